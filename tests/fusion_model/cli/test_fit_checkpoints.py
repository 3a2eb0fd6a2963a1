"""`train.py fit` and checkpoints: unwritable checkpoint folders stop the start, a broken checkpoint to resume from
names a good one, and a config with impossible sizes is refused before anything is built."""

import os
import sys
from pathlib import Path

import pytest
import torch

from fusion_model import cli
from fusion_model.training.checkpointing import AtomicCheckpointIO, previous_good_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import fit_worker as fw  # noqa: E402


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return fw.make_token_dir(tmp_path_factory.mktemp("tokens") / "train")


@pytest.fixture(scope="module")
def trained(tokens, tmp_path_factory):
    """A finished 2-step run: epoch=0-step=1.ckpt, epoch=0-step=2.ckpt and last.ckpt."""
    root = tmp_path_factory.mktemp("run")
    assert cli.main(["fit", *fw.tiny_args(tokens, root, 2)]) == 0
    return root / "ckpt"


def _fit_error(args, capsys) -> str:
    assert cli.main(["fit", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1]


def _broken_copy(trained, tmp_path, data: bytes) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for name in ("epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"):
        (folder / name).write_bytes((trained / name).read_bytes())
    os.utime(folder / "epoch=0-step=1.ckpt", ns=(1_000_000_000, 1_000_000_000))  # the older one
    (folder / "last.ckpt").write_bytes(data)
    return folder


@pytest.mark.parametrize("kind", ["truncated", "empty"])
def test_resuming_from_a_broken_last_ckpt_names_the_previous_good_checkpoint(trained, tokens, tmp_path, capsys, kind):
    whole = (trained / "last.ckpt").read_bytes()
    folder = _broken_copy(trained, tmp_path, whole[: len(whole) // 2] if kind == "truncated" else b"")
    line = _fit_error([*fw.tiny_args(tokens, tmp_path, 4), f"--ckpt_path={folder / 'last.ckpt'}"], capsys)
    assert line.startswith(f"train.py fit: checkpoint {folder / 'last.ckpt'} ")
    assert ("is empty" in line) if kind == "empty" else ("truncated" in line)
    assert f"resume from the previous good checkpoint in the same folder instead: --ckpt_path {folder / 'epoch=0-step=2.ckpt'}" in line


def test_resuming_with_ckpt_path_last_from_an_empty_last_ckpt_is_one_line_too(trained, tokens, tmp_path, capsys):
    _broken_copy(trained, tmp_path, b"")
    line = _fit_error([*fw.tiny_args(tokens, tmp_path, 4), "--ckpt_path=last"], capsys)
    assert "last.ckpt is empty" in line and "epoch=0-step=2.ckpt" in line


def test_a_broken_checkpoint_alone_in_its_folder_says_there_is_no_other(tmp_path):
    (tmp_path / "last.ckpt").write_bytes(b"PK\x03\x04 torn")
    with pytest.raises(ValueError, match=r"last.ckpt could not be loaded.*no other complete checkpoint is in its folder"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert previous_good_checkpoint(tmp_path / "last.ckpt") is None
    torch.save({"step": 1}, tmp_path / "older.ckpt")
    assert previous_good_checkpoint(tmp_path / "last.ckpt") == tmp_path / "older.ckpt"


def test_a_checkpoint_directory_that_cannot_be_written_stops_the_start(tokens, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    args = fw.tiny_args(tokens, tmp_path, 2)
    args = [a.replace(str(tmp_path / "ckpt"), str(blocker / "ckpt")) for a in args]
    line = _fit_error(args, capsys)
    assert f"checkpoint directory {blocker / 'ckpt'} cannot be written" in line and "a-file is not a directory" in line
    assert "ModelCheckpoint dirpath" in line
    assert not list(tmp_path.rglob("*.ckpt"))


def test_an_unwritable_default_root_dir_stops_the_start(tokens, tmp_path, capsys):
    if os.geteuid() == 0:
        readonly = Path("/proc/self")  # read-only even for root
    else:
        readonly = tmp_path / "readonly"
        readonly.mkdir()
        readonly.chmod(0o500)
    args = [*fw.tiny_args(tokens, tmp_path, 2), f"--trainer.default_root_dir={readonly / 'run'}"]
    line = _fit_error(args, capsys)
    assert f"checkpoint directory {readonly / 'run'} cannot be written" in line


@pytest.mark.parametrize(("field", "value"), [("dim", "0"), ("vocab_size", "-5"), ("dropout", "1.5")])
def test_impossible_model_sizes_are_refused_naming_the_field(tokens, tmp_path, capsys, field, value):
    line = _fit_error([*fw.tiny_args(tokens, tmp_path, 2), f"--model.config.{field}={value}"], capsys)
    assert f"FusionConfig: {field}=" in line and f"--model.config.{field}" in line
    assert not (tmp_path / "ckpt").exists()
