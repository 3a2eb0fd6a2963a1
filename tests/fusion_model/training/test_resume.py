"""Exact resume: a run killed with SIGKILL and resumed from its last checkpoint continues bit for bit."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from fusion_model.cli.fit import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_worker as fw  # noqa: E402


def test_resume_after_sigkill_matches_an_uninterrupted_run_bit_for_bit(tmp_path):
    resume_after_sigkill_matches_an_uninterrupted_run(tmp_path)


def resume_after_sigkill_matches_an_uninterrupted_run(tmp_path: Path, extra: tuple[str, ...] = (),
                                                      tokens: Path | None = None) -> None:
    """Kill a `fit` child (SIGKILL) after step 4 of 9, resume it from last.ckpt, and assert that its batches,
    losses and final weights equal an uninterrupted run's bit for bit; `extra`: more fit options for every run
    (e.g. another decoder block or family); `tokens`: the shards (default: random text)."""
    tokens = fw.make_token_dir(tmp_path / "tokens") if tokens is None else tokens
    # dropout on (so the RNG states matter) and a loader worker (so the loader position matters);
    # 9 steps of an 8-batch epoch: the kill is mid-epoch and the resumed run crosses into the next epoch
    common = ["--model.config.dropout=0.1", "--data.num_workers=1", *extra]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the killed child uses 1 thread too: same float summation order everywhere
    try:
        reference = tmp_path / "reference"
        assert main(fw.tiny_args(tokens, reference, 9, extra=[*common, fw.recorder_arg(reference / "rec")])) == 0

        run = tmp_path / "run"
        child_args = fw.tiny_args(tokens, run, 9, extra=[*common, fw.recorder_arg(run / "rec", hang_after_step=4)])
        child = subprocess.Popen([sys.executable, str(fw.HERE / "fit_worker.py"), *child_args], cwd=fw.REPO,
                                 env={**os.environ, "FIT_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300
        while not (run / "rec.hanging").exists():
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the training child never reached step 4"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stderr.close()
        last = run / "ckpt" / "last.ckpt"
        assert torch.load(last, weights_only=True)["global_step"] == 4

        assert main(fw.tiny_args(tokens, run, 9, extra=[*common, fw.recorder_arg(run / "resumed"), f"--ckpt_path={last}"])) == 0
    finally:
        torch.set_num_threads(threads)

    expected = torch.load(reference / "rec.rank0.pt", weights_only=True)
    resumed = torch.load(run / "resumed.rank0.pt", weights_only=True)
    assert resumed["steps"] == [5, 6, 7, 8, 9]
    for got, want in zip(resumed["batches"], expected["batches"][4:], strict=True):
        assert torch.equal(got, want)  # the loader continued at the next batch, across the epoch boundary
    assert resumed["losses"] == expected["losses"][4:]  # bit for bit
    for name, value in expected["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name


def test_checkpoint_holds_model_optimizer_scheduler_step_rng_and_loader_position(tmp_path):
    tokens = fw.make_token_dir(tmp_path / "tokens")
    assert main(fw.tiny_args(tokens, tmp_path, 3)) == 0
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 3
    assert "model.head.weight" in checkpoint["state_dict"]
    assert checkpoint["optimizer_states"][0]["state"][0]["step"] == 3
    assert checkpoint["lr_schedulers"][0]["last_epoch"] == 3
    assert set(checkpoint["rng_states"]) >= {"torch", "python", "numpy"}
    loader = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert (loader["epoch"], loader["batches_consumed"]) == (0, 3)
    assert checkpoint["hyper_parameters"]["config"]["dim"] == fw.TINY["dim"]


def test_resume_from_the_last_step_of_an_epoch_is_bit_exact_with_dropout(tmp_path):
    """The kill comes after step 4 of a 4-batch epoch: between that checkpoint and the next step the uninterrupted run
    starts a new pass of the loader, which must draw nothing from the RNG that dropout continues from."""
    tokens = fw.make_token_dir(tmp_path / "tokens", n_docs=16)
    from data_shards.packed_stream import PackedTokenStream

    assert len(PackedTokenStream(tokens, 32, 4, rank=0, world_size=1)) == 4  # the premise: step 4 ends the epoch
    resume_after_sigkill_matches_an_uninterrupted_run(tmp_path, tokens=tokens)
