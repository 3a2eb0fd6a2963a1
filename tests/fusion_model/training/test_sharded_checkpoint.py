"""Sharded (torch.distributed.checkpoint) checkpoints of AtomicModelParallelStrategy: written to a temporary
directory and renamed into place, so a failed save never leaves a half-written checkpoint; they resume exactly."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from fusion_model.training.checkpointing import AtomicModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_worker as fw  # noqa: E402


class OneRank(AtomicModelParallelStrategy):
    """The strategy's own save logic in a world of one process (no process group needed)."""

    global_rank = 0

    def broadcast(self, obj, src=0):
        return obj

    def barrier(self, name=None):
        pass


def _fake_shard_writer(fail_after: int | None = None):
    """Stands in for Lightning's sharded save: writes two shard files into the directory it is given."""

    def save(self, checkpoint, filepath, storage_options=None):
        path = Path(filepath)
        path.mkdir(parents=True, exist_ok=True)
        for i in range(2):
            if fail_after is not None and i == fail_after:
                raise OSError("disk full (simulated)")
            (path / f"__{i}_0.distcp").write_text(checkpoint["version"])

    return save


def _contents(path: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(path.iterdir())}


def test_a_failed_sharded_save_keeps_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    strategy = OneRank(save_distributed_checkpoint=True)
    target = tmp_path / "last.ckpt"
    monkeypatch.setattr(ModelParallelStrategy, "save_checkpoint", _fake_shard_writer())
    strategy.save_checkpoint({"version": "v1"}, target)
    assert _contents(target) == {"__0_0.distcp": "v1", "__1_0.distcp": "v1"}

    monkeypatch.setattr(ModelParallelStrategy, "save_checkpoint", _fake_shard_writer(fail_after=1))
    with pytest.raises(OSError, match="disk full"):
        strategy.save_checkpoint({"version": "v2"}, target)
    assert _contents(target) == {"__0_0.distcp": "v1", "__1_0.distcp": "v1"}  # untouched
    assert (tmp_path / ".last.ckpt.partial").is_dir()  # the half-written shards sit aside

    monkeypatch.setattr(ModelParallelStrategy, "save_checkpoint", _fake_shard_writer())
    strategy.save_checkpoint({"version": "v3"}, target)
    assert _contents(target) == {"__0_0.distcp": "v3", "__1_0.distcp": "v3"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no .partial, no .old left


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fit(tokens: Path, root: Path, steps: int, extra: list[str]) -> None:
    strategy = {"class_path": "fusion_model.training.checkpointing.AtomicModelParallelStrategy",
                "init_args": {"save_distributed_checkpoint": True}}
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "FIT_THREADS": "1"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "SLURM_JOB_ID"):
        env.pop(key, None)
    # accumulation too: its gradient rescaling must work on FSDP2's DTensor gradients
    args = fw.tiny_args(tokens, root, steps, batch_size=2, extra=[
        f"--trainer.strategy={json.dumps(strategy)}", "--trainer.devices=1", "--trainer.accumulate_grad_batches=2", *extra])
    result = subprocess.run([sys.executable, str(fw.HERE / "fit_worker.py"), *args], cwd=fw.REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("family", ["chameleon", "transfusion"])
def test_fsdp2_sharded_checkpoints_are_directories_that_resume_to_the_same_weights(tmp_path, family):
    # transfusion: continuous-image shards, its patches part and its two loss terms sharded and resumed too
    make = fw.make_latent_token_dir if family == "transfusion" else fw.make_token_dir
    tokens = make(tmp_path / "tokens")
    extra = [f"--model.family={family}"]
    whole = tmp_path / "whole"
    _fit(tokens, whole, 4, [fw.recorder_arg(whole / "rec"), *extra])
    step2 = whole / "ckpt" / "epoch=0-step=2.ckpt"
    assert {".metadata", "meta.pt"} <= {p.name for p in step2.iterdir()}  # a torch.distributed.checkpoint
    assert not [p for p in (whole / "ckpt").iterdir() if p.name.startswith(".")]  # every save was renamed in place

    resumed = tmp_path / "resumed"
    _fit(tokens, resumed, 4, [fw.recorder_arg(resumed / "rec"), f"--ckpt_path={step2}", *extra])
    expected = torch.load(whole / "rec.rank0.pt", weights_only=True)
    got = torch.load(resumed / "rec.rank0.pt", weights_only=True)
    # the recorder logs each micro-batch with the optimizer step count after it
    assert got["steps"] == [2, 3, 3, 4] and expected["steps"] == [0, 1, 1, 2, 2, 3, 3, 4]
    assert got["losses"] == expected["losses"][4:]
    assert family == "chameleon" or any(name.startswith("patches.") for name in expected["weights"])
    for name, weight in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], weight, rtol=0, atol=0, msg=name)
