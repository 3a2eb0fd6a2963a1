"""A damaged shard met during `train.py fit` stops training at one step, naming the file: in one process, and on
two ranks where only one of them reads the shard (the other learns it through the step's collective, not left
waiting in it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from data_shards.stream import PackedTokenStream
from fusion_model.cli.fit import main

TRAINING = Path(__file__).resolve().parents[1] / "fusion_model" / "training"
sys.path.insert(0, str(TRAINING))
import fit_worker as fw  # noqa: E402

WINDOW = 4


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-2] ^= 1  # an id still inside the vocabulary: only the checksum tells
    path.write_bytes(bytes(data))


def _stream(tokens: Path, rank: int, world: int, batch_size: int) -> PackedTokenStream:
    # the settings FusionDataModule gives fit's train loader (data.seed 0, shuffled)
    return PackedTokenStream(tokens, 32, batch_size, seed=0, rank=rank, world_size=world, shuffle_window=WINDOW)


def test_one_process_stops_at_the_step_that_meets_a_damaged_shard(tmp_path):
    tokens = fw.make_token_dir(tmp_path / "tokens", n_docs=60, shards=6)
    probe = _stream(tokens, 0, 1, 4)
    first = {s for pieces in probe.batch_pieces(0, 0) for s, _, _ in pieces}
    later = [s for s in probe.shard_order(0)[0].tolist() if s not in first]
    bad = tokens / f"{probe.shard_names[later[-1]]}.ids.npy"
    _damage(bad)
    with pytest.raises(ValueError, match=r"damaged training data at optimizer step \d+.*" + str(bad)):
        main(fw.tiny_args(tokens, tmp_path / "run", 50, extra=[f"--data.shuffle_window={WINDOW}"]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_both_stop_when_one_meets_a_damaged_shard(tmp_path):
    tokens = fw.make_token_dir(tmp_path / "tokens", n_docs=60, shards=6)
    mine = [_stream(tokens, rank, 2, 2).rank_shards(0) for rank in (0, 1)]
    only_rank_1 = sorted(mine[1] - mine[0])
    assert only_rank_1, "the test needs a shard that rank 0 never reads"
    bad = tokens / f"{_stream(tokens, 1, 2, 2).shard_names[only_rank_1[0]]}.ids.npy"
    _damage(bad)
    port = str(_free_port())
    children = []
    for node in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node), "FIT_THREADS": "1"}
        for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_JOB_ID"):
            env.pop(key, None)
        args = fw.tiny_args(tokens, tmp_path / f"node{node}", 50, batch_size=2, extra=[
            f"--data.shuffle_window={WINDOW}", "--trainer.strategy=ddp", "--trainer.num_nodes=2",
            "--trainer.devices=1"])
        children.append(subprocess.Popen([sys.executable, str(fw.HERE / "fit_worker.py"), *args], cwd=fw.REPO, env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        errors = [child.communicate(timeout=300)[1] for child in children]
    finally:
        for child in children:
            child.kill()
    for child, err in zip(children, errors):
        assert child.returncode != 0, err[-2000:]
        assert "damaged training data at optimizer step" in err and str(bad) in err, err[-3000:]
