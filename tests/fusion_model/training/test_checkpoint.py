"""Checkpoint files: atomic under SIGKILL mid-write, loadable with weights_only=True, RNG states as tensors."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common.files import atomic_torch_save, load_checkpoint_file
from fusion_model.training.checkpointing import AtomicCheckpointIO, rng_state, set_rng_state

REPO = Path(__file__).resolve().parents[3]

# The child saves checkpoint 1 normally, then starts checkpoint 2 with a torch.save that stops halfway
# through writing its bytes (and says so), so the SIGKILL lands in the middle of the write for certain.
CHILD = r"""
import sys, time, torch
from pathlib import Path
from fusion_model.training.checkpointing import AtomicCheckpointIO
path, marker = sys.argv[1], Path(sys.argv[2])
io = AtomicCheckpointIO()
io.save_checkpoint({"version": 1, "w": torch.full((250_000,), 1.0)}, path)
real_save = torch.save
def half_save(obj, f, *args, **kwargs):
    import io as _io
    buffer = _io.BytesIO()
    real_save(obj, buffer)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    marker.write_text("mid-write")
    time.sleep(600)
torch.save = half_save
io.save_checkpoint({"version": 2, "w": torch.full((250_000,), 2.0)}, path)
"""


def test_sigkill_during_a_checkpoint_write_leaves_the_previous_checkpoint(tmp_path):
    path, marker = tmp_path / "last.ckpt", tmp_path / "marker"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(marker)], cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, "the writer exited before reaching the middle of the write"
            assert time.monotonic() < deadline, "the writer never reached the middle of the write"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    leftovers = [p.name for p in tmp_path.iterdir() if p.name not in {"last.ckpt", "marker"}]
    assert leftovers and all(name.startswith(".last.ckpt.tmp") for name in leftovers)  # the torn file is a tmp
    checkpoint = AtomicCheckpointIO().load_checkpoint(path)
    assert checkpoint["version"] == 1 and torch.equal(checkpoint["w"], torch.full((250_000,), 1.0))


def test_an_error_during_the_write_keeps_the_old_file_and_removes_the_tmp(tmp_path, monkeypatch):
    path = tmp_path / "c.ckpt"
    atomic_torch_save({"step": 1}, path)

    def failing_save(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        atomic_torch_save({"step": 2}, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]
    assert load_checkpoint_file(path) == {"step": 1}


def test_loading_refuses_pickled_objects_and_names_the_file(tmp_path):
    path = tmp_path / "unsafe.ckpt"
    torch.save({"obj": Path("x")}, path)  # a pickled Python object, not a tensor or plain value
    with pytest.raises(ValueError, match="unsafe.ckpt.*weights_only=True"):
        AtomicCheckpointIO().load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        load_checkpoint_file(tmp_path / "missing.ckpt")


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state
    atomic_torch_save({"rng": rng_state()}, tmp_path / "rng.ckpt")
    expected = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(2))
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    set_rng_state(load_checkpoint_file(tmp_path / "rng.ckpt")["rng"])
    again = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(2))
    assert torch.equal(expected[0], again[0]) and expected[1:3] == again[1:3]
    np.testing.assert_array_equal(expected[3], again[3])


def test_the_next_save_removes_the_torn_file_of_a_killed_save_but_not_a_live_one(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    torn = tmp_path / f".last.ckpt.tmp-{dead.pid}"  # what a save killed mid-write leaves behind
    torn.write_bytes(b"half a checkpoint")
    odd = tmp_path / f".last.ckpt.tmp-{os.getpid()}-other"  # not a bare pid: never touched
    odd.write_bytes(b"?")
    live = tmp_path / f".last.ckpt.tmp-{os.getppid()}"  # a writer still running
    live.write_bytes(b"being written")
    AtomicCheckpointIO().save_checkpoint({"step": 2}, tmp_path / "last.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.ckpt", odd.name, live.name])
    assert load_checkpoint_file(tmp_path / "last.ckpt") == {"step": 2}


def test_loading_a_truncated_checkpoint_names_an_earlier_complete_one(tmp_path):
    atomic_torch_save({"step": 1}, tmp_path / "epoch=0-step=1.ckpt")
    whole = (tmp_path / "epoch=0-step=1.ckpt").read_bytes()
    (tmp_path / "last.ckpt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError) as info:
        AtomicCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    message = str(info.value)
    assert "\n" not in message and f"checkpoint {tmp_path / 'last.ckpt'} could not be loaded" in message
    assert f"--ckpt_path {tmp_path / 'epoch=0-step=1.ckpt'}" in message
