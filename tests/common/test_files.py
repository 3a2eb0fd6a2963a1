"""common.files: atomic writes keep the old file on failure and leave no temporary files; checkpoint loading
refuses pickled objects, URLs and missing files."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import torch

from common import files
from common.files import (
    atomic_open,
    atomic_path,
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    load_checkpoint_file,
    remove_stale_temporaries,
    replace_directory,
)


class Boom(RuntimeError):
    """Raised inside a write block to stand for a crash mid-write."""


def _names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_atomic_path_writes_the_file_on_success(tmp_path):
    target = tmp_path / "sub" / "weights.bin"  # the parent is created
    with atomic_path(target) as tmp:
        assert tmp != target and tmp.parent == target.parent
        tmp.write_bytes(b"new")
        assert not target.exists(), "nothing is visible before the block ends"
    assert target.read_bytes() == b"new"
    assert _names(target.parent) == ["weights.bin"]


def test_atomic_path_keeps_the_old_file_when_the_block_raises(tmp_path):
    target = tmp_path / "weights.bin"
    target.write_bytes(b"old")
    with pytest.raises(Boom), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise Boom
    assert target.read_bytes() == b"old"
    assert _names(tmp_path) == ["weights.bin"]


def test_atomic_open_streams_and_rolls_back(tmp_path):
    target = tmp_path / "ids.npy"
    with atomic_open(target, "wb") as handle:
        np.save(handle, np.arange(5), allow_pickle=False)
    np.testing.assert_array_equal(np.load(target, allow_pickle=False), np.arange(5))
    with pytest.raises(Boom), atomic_open(target, "wb") as handle:
        np.save(handle, np.arange(99), allow_pickle=False)
        raise Boom
    np.testing.assert_array_equal(np.load(target, allow_pickle=False), np.arange(5))
    assert _names(tmp_path) == ["ids.npy"]


def test_atomic_open_text_mode_passes_its_arguments(tmp_path):
    target = tmp_path / "note.txt"
    with atomic_open(target, "w", encoding="utf-8") as handle:
        handle.write("grüße")
    assert target.read_text(encoding="utf-8") == "grüße"


@pytest.mark.parametrize("mode", ["r", "rb", "a", "ab", "r+", "x"])
def test_atomic_open_refuses_modes_that_do_not_write_a_whole_file(tmp_path, mode):
    target = tmp_path / "file"
    target.write_bytes(b"old")
    with pytest.raises(ValueError, match="must start with 'w'"), atomic_open(target, mode):
        pass
    assert target.read_bytes() == b"old"
    assert _names(tmp_path) == ["file"]


def test_write_helpers_write_their_content(tmp_path):
    assert atomic_write_bytes(tmp_path / "a.bin", b"\x00\x01") == tmp_path / "a.bin"
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    atomic_write_text(tmp_path / "b.txt", "line\n")
    assert (tmp_path / "b.txt").read_bytes() == b"line\n"
    atomic_write_json(tmp_path / "c.json", {"n": 1, "path": tmp_path})  # str() for what JSON cannot hold
    assert json.loads((tmp_path / "c.json").read_text()) == {"n": 1, "path": str(tmp_path)}
    assert (tmp_path / "c.json").read_text().endswith("}\n")
    assert _names(tmp_path) == ["a.bin", "b.txt", "c.json"]


def test_atomic_write_json_keeps_the_old_file_when_the_object_cannot_be_written(tmp_path):
    target = tmp_path / "manifest.json"
    atomic_write_json(target, {"ok": True})
    circular: list = []
    circular.append(circular)
    with pytest.raises(ValueError, match="Circular"):
        atomic_write_json(target, circular)
    assert json.loads(target.read_text()) == {"ok": True}
    assert _names(tmp_path) == ["manifest.json"]


def test_atomic_torch_save_round_trips_through_load_checkpoint_file(tmp_path):
    target = tmp_path / "model.ckpt"
    atomic_torch_save({"step": 3, "weight": torch.arange(4.0)}, target)
    loaded = load_checkpoint_file(target)
    assert loaded["step"] == 3 and torch.equal(loaded["weight"], torch.arange(4.0))
    assert _names(tmp_path) == ["model.ckpt"]


def test_replace_directory_swaps_in_the_new_one(tmp_path):
    old, new = tmp_path / "bundle", tmp_path / "bundle.new"
    old.mkdir()
    (old / "stale.txt").write_text("old")
    new.mkdir()
    (new / "fresh.txt").write_text("new")
    replace_directory(new, old)
    assert _names(old) == ["fresh.txt"]
    assert _names(tmp_path) == ["bundle"]


class Payload:
    """A class a pickle can only rebuild by running code: weights_only loading must refuse it."""

    def __init__(self) -> None:
        self.value = 1


def test_load_checkpoint_file_refuses_a_pickled_object(tmp_path):
    target = tmp_path / "evil.ckpt"
    torch.save({"state": OrderedDict(), "payload": Payload()}, target)
    with pytest.raises(ValueError, match="evil.ckpt.*weights_only=True"):
        load_checkpoint_file(target)
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps(Payload(), protocol=2))
    with pytest.raises(ValueError, match="plain.pkl"):
        load_checkpoint_file(plain)


@pytest.mark.parametrize("url", ["https://example.com/model.ckpt", "s3://bucket/model.ckpt"])
def test_load_checkpoint_file_refuses_a_url(url):
    with pytest.raises(ValueError, match="is a URL"):
        load_checkpoint_file(url)


def test_load_checkpoint_file_names_a_missing_file(tmp_path):
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(FileNotFoundError, match="nope.ckpt does not exist"):
        load_checkpoint_file(missing)
    (tmp_path / "folder.ckpt").mkdir()
    with pytest.raises(FileNotFoundError, match="folder.ckpt"):
        load_checkpoint_file(tmp_path / "folder.ckpt")


def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped), so os.kill(pid, 0) fails."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_atomic_path_removes_temporaries_of_killed_writers_but_keeps_live_ones(tmp_path):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"old")
    stale = tmp_path / f".last.ckpt.tmp-{_dead_pid()}"
    stale.write_bytes(b"half of a checkpoint")
    live = tmp_path / f".last.ckpt.tmp-{os.getppid()}"  # a writer that is still running
    live.write_bytes(b"being written")
    other = tmp_path / f".other.ckpt.tmp-{_dead_pid()}"  # another file's temporary: not ours to judge
    other.write_bytes(b"x")
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert not stale.exists(), "the killed writer's temporary file is removed"
    assert live.exists() and other.exists()
    assert _names(tmp_path) == sorted([other.name, live.name, "last.ckpt"])


def test_remove_stale_temporaries_keeps_this_process_file(tmp_path):
    target = tmp_path / "weights.bin"
    mine = tmp_path / f".weights.bin.tmp-{os.getpid()}"
    mine.write_bytes(b"mine")
    stale = tmp_path / f".weights.bin.tmp-{_dead_pid()}"
    stale.write_bytes(b"old")
    (tmp_path / ".weights.bin.tmp-notapid").write_bytes(b"?")
    assert remove_stale_temporaries(target) == [stale]
    assert mine.exists() and (tmp_path / ".weights.bin.tmp-notapid").exists()


@pytest.mark.skipif(os.name != "posix", reason="permission bits and umask are POSIX")
@pytest.mark.parametrize(("umask", "expected"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_get_the_mode_a_plain_open_gives(tmp_path, monkeypatch, umask, expected):
    from safetensors.torch import save_file

    monkeypatch.setattr(files, "_cached_new_file_mode", None)  # the mode is read once per process
    previous = os.umask(umask)
    try:
        with atomic_path(tmp_path / "model.safetensors") as tmp:
            save_file({"weight": torch.zeros(2)}, str(tmp))  # safetensors creates its file 0600
        atomic_write_json(tmp_path / "config.json", {"a": 1})
    finally:
        os.umask(previous)
    assert oct((tmp_path / "model.safetensors").stat().st_mode & 0o777) == oct(expected)
    assert oct((tmp_path / "config.json").stat().st_mode & 0o777) == oct(expected)
    assert _names(tmp_path) == ["config.json", "model.safetensors"]  # no probe or temporary left
