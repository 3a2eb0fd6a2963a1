"""Hostile starts of `train.py fit` from weights and from its own checkpoints: a run started from
--model.init_weights resumes bit for bit once that file is gone (never opening it, never saying it upcycled again);
a resume that asks for another architecture is refused; refused starts leave the run's root as it was; the
init_weights refusals name only real differences with advice that works, refuse another family's checkpoint, and
refuse a pickled checkpoint in one line without torch's weights_only=False advice."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import pytest
import torch

from common.files import load_checkpoint_file
from fusion_model import cli
from fusion_model.checkpoint import save_model
from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fusion_model" / "training"))
import fit_worker as fw  # noqa: E402
import test_mot_training as mot  # noqa: E402  (module attributes only: its tests stay collected in their own file)

MOT, tiny = mot.MOT, mot.tiny
info_lines = mot.info_lines  # the fixture catching the module's rank_zero_info lines

LAYOUT = list(MOT[1:])  # the image block of MOT, without the block itself: a dense decoder of the same layout
STEPS, STOP = 4, 2  # the uninterrupted run's steps, and where the interrupted one stops


def tree(root: Path) -> list[str] | None:
    """Every path under `root` (None when it does not exist): what a refused start must leave unchanged."""
    return sorted(str(path.relative_to(root)) for path in root.rglob("*")) if root.exists() else None


def default_logger_args(tokens: Path, root: Path, steps: int, extra: list[str]) -> list[str]:
    """fit_worker's tiny run with `fit`'s default loggers (tb/ and csv/ under the root) instead of its CSV one."""
    return [arg for arg in fw.tiny_args(tokens, root, steps, extra=extra) if not arg.startswith("--trainer.logger")]


def refusal(argv: list[str], capsys) -> str:
    """The one line `train.py fit` refuses `argv` with (exit 2)."""
    capsys.readouterr()
    assert cli.main(["fit", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("train.py fit: "), lines[-5:]
    return lines[-1]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    return fw.make_token_dir(tmp_path_factory.mktemp("tokens") / "train")


@pytest.fixture(scope="module")
def dense(tokens, tmp_path_factory) -> Path:
    """last.ckpt of a 2-step dense run with MOT's image block."""
    root = tmp_path_factory.mktemp("dense")
    assert cli.main(["fit", *fw.tiny_args(tokens, root, 2, extra=LAYOUT)]) == 0
    return root / "ckpt" / "last.ckpt"


@pytest.fixture(scope="module")
def upcycled(tokens, dense, tmp_path_factory) -> dict[str, Path]:
    """A MoT run upcycled from a copy of `dense` that is deleted after it stopped at step STOP (`run`), and the same
    run uninterrupted to STEPS (`reference`, with a recorder)."""
    base = tmp_path_factory.mktemp("upcycled")
    source = base / "source.ckpt"
    shutil.copy(dense, source)
    common = [*MOT, f"--model.init_weights={source}", f"--model.decay_steps={STEPS}"]  # one schedule for all
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float summation order in every run
    try:
        reference = base / "reference"
        assert cli.main(["fit", *fw.tiny_args(tokens, reference, STEPS,
                                              extra=[*common, fw.recorder_arg(reference / "rec")])]) == 0
        assert cli.main(["fit", *fw.tiny_args(tokens, base / "run", STOP, extra=common)]) == 0
    finally:
        torch.set_num_threads(threads)
    source.unlink()  # the file the run started from is gone
    return {"run": base / "run", "reference": reference, "source": source, "common": common}


# ---- case 1: resuming a run that started from init_weights -------------------------------------------------------
def test_a_run_started_from_init_weights_resumes_bit_exact_after_the_source_is_gone(upcycled, tokens, tmp_path,
                                                                                    info_lines, one_thread):
    run = tmp_path / "run"
    shutil.copytree(upcycled["run"], run)
    last = run / "ckpt" / "last.ckpt"
    argv = fw.tiny_args(tokens, run, STEPS, extra=[*upcycled["common"], fw.recorder_arg(run / "resumed"),
                                                   "--checkpoint", str(last)])
    assert cli.main(["fit", *argv]) == 0  # the same command again, --model.init_weights and all
    assert not upcycled["source"].exists()  # so it was never opened
    assert not [line for line in info_lines if "upcycled" in line]
    expected = torch.load(upcycled["reference"] / "rec.rank0.pt", weights_only=True)
    resumed = torch.load(run / "resumed.rank0.pt", weights_only=True)
    assert resumed["steps"] == list(range(STOP + 1, STEPS + 1))
    assert resumed["losses"] == expected["losses"][STOP:]  # bit for bit
    for name, value in expected["weights"].items():
        assert torch.equal(resumed["weights"][name], value), name


@pytest.mark.parametrize("named", ["path", "last"])
def test_resuming_a_mot_checkpoint_as_a_dense_decoder_is_refused_naming_the_checkpoints_block(named, upcycled, tokens,
                                                                                             tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(upcycled["run"], run)
    before = tree(run)
    last = run / "ckpt" / "last.ckpt"
    resume = f"--ckpt_path={last if named == 'path' else 'last'}"
    line = refusal(fw.tiny_args(tokens, run, STEPS, extra=[*MOT, "--model.config.block=dense", resume]), capsys)
    assert line == (
        f"train.py fit: --ckpt_path {last} holds another decoder than model.config asks for (block: mot vs dense; "
        "checkpoint vs model.config): a resumed run keeps its checkpoint's architecture, so drop those "
        "--model.config options to resume it, or start a new run (without --ckpt_path) for the other one")
    assert tree(run) == before


# ---- case 2: refused starts write nothing ------------------------------------------------------------------------
def _mismatched(tmp_path: Path) -> list[str]:
    save_model(FusionModel(tiny(dim=64)), tmp_path / "wide.ckpt")
    return [f"--model.init_weights={tmp_path / 'wide.ckpt'}"]


def _missing(tmp_path: Path) -> list[str]:
    return [f"--model.init_weights={tmp_path / 'gone.ckpt'}"]


def _truncated(tmp_path: Path) -> list[str]:
    save_model(FusionModel(tiny()), tmp_path / "whole.ckpt")
    whole = (tmp_path / "whole.ckpt").read_bytes()
    (tmp_path / "torn.ckpt").write_bytes(whole[: len(whole) // 2])
    return [f"--model.init_weights={tmp_path / 'torn.ckpt'}"]


REFUSED_STARTS = {"a size-mismatched init_weights": (_mismatched, "holds another architecture"),
                  "a missing init_weights": (_missing, "gone.ckpt does not exist"),
                  "a truncated init_weights": (_truncated, "torn.ckpt could not be loaded")}


@pytest.mark.parametrize("make", REFUSED_STARTS, ids=list(REFUSED_STARTS))
@pytest.mark.parametrize("existing", [False, True], ids=["new root", "existing run"])
def test_a_refused_start_leaves_the_runs_root_as_it_was(make, existing, tokens, tmp_path, capsys):
    root = tmp_path / "run"
    if existing:  # an earlier run's logs and checkpoints: never touched, and no new version folder beside them
        assert cli.main(["fit", *default_logger_args(tokens, root, 1, LAYOUT)]) == 0
        assert (root / "tb" / "version_0").is_dir() and (root / "csv" / "version_0").is_dir()
    before = tree(root)
    extra, expected = REFUSED_STARTS[make]
    line = refusal(default_logger_args(tokens, root, 2, [*LAYOUT, *extra(tmp_path)]), capsys)
    assert expected in line
    assert tree(root) == before


def test_a_truncated_last_ckpt_refused_on_resume_leaves_the_run_as_it_was(tokens, tmp_path, capsys):
    root = tmp_path / "run"
    assert cli.main(["fit", *default_logger_args(tokens, root, 2, [])]) == 0
    last = root / "ckpt" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    before = tree(root)
    line = refusal(default_logger_args(tokens, root, 4, ["--ckpt_path=last"]), capsys)
    assert f"checkpoint {last} could not be loaded" in line and "epoch=0-step=2.ckpt" in line
    assert tree(root) == before


def test_damaged_training_data_found_before_the_first_step_leaves_no_log_folders(tokens, tmp_path, capsys):
    damaged = tmp_path / "tokens"
    shutil.copytree(tokens, damaged)
    ids = damaged / "shard-000.ids.npy"
    data = bytearray(ids.read_bytes())
    data[-4] ^= 0xFF  # under the manifest's checksum: found when the stream reads the shard
    ids.write_bytes(bytes(data))
    root = tmp_path / "run"
    line = refusal(default_logger_args(damaged, root, 2, []), capsys)
    assert "shard-000.ids.npy" in line
    assert tree(root) is None


# ---- case 3: the size-mismatch refusal of a dense checkpoint into MoT ----------------------------------------------
def test_a_dense_checkpoint_of_other_sizes_into_mot_names_only_the_sizes_and_advice_that_keeps_mot(tokens, tmp_path,
                                                                                                   capsys, info_lines):
    wide = tmp_path / "wide.ckpt"
    save_model(FusionModel(tiny(dim=64, n_kv_heads=4)), wide)
    line = refusal(fw.tiny_args(tokens, tmp_path / "refused", 1, extra=[*MOT, f"--model.init_weights={wide}"]), capsys)
    assert line == (
        f"train.py fit: model.init_weights {wide} holds another architecture (dim: 64 vs 32; kv_heads: 4 vs 2; "
        "checkpoint vs model.config): pass the checkpoint's values (--model.config.dim=64 "
        "--model.config.n_kv_heads=4) to upcycle it into the mot block, or --model.config null to train the "
        "checkpoint's dense decoder as it is")
    # the advice works as printed: the run upcycles and keeps the mot block
    advised = ["--model.config.dim=64", "--model.config.n_kv_heads=4"]
    assert cli.main(["fit", *fw.tiny_args(tokens, tmp_path / "advised", 1,
                                          extra=[*MOT, f"--model.init_weights={wide}", *advised])]) == 0
    assert any("upcycled the dense weights into the mot block" in line for line in info_lines)
    trained = torch.load(tmp_path / "advised" / "ckpt" / "last.ckpt", weights_only=True)["hyper_parameters"]["config"]
    assert (trained["block"], trained["dim"], trained["n_kv_heads"]) == ("mot", 64, 4)


# ---- case 4: another family's checkpoint as init_weights -----------------------------------------------------------
def test_a_transfusion_checkpoint_as_init_weights_of_a_chameleon_run_is_refused_naming_both_families(tokens, tmp_path,
                                                                                                    capsys):
    latent = fw.make_latent_token_dir(tmp_path / "latent")
    assert cli.main(["fit", *fw.tiny_args(latent, tmp_path / "transfusion", 1,
                                          extra=["--model.family=transfusion"])]) == 0
    source = tmp_path / "transfusion" / "ckpt" / "last.ckpt"
    for name, block in {"dense": [], "mot": list(MOT)}.items():  # as it is, and as an upcycling source
        root = tmp_path / f"chameleon-{name}"
        line = refusal(default_logger_args(tokens, root, 1, [*block, f"--model.init_weights={source}"]), capsys)
        assert line == (
            f"train.py fit: model.init_weights {source} was trained by the transfusion family, but this run trains "
            "the chameleon family: start it from a chameleon checkpoint (a decoder alone, e.g. from `train.py "
            "convert import`) or one of the chameleon family, or train --model.family transfusion")
        assert tree(root) is None


# ---- case 5: a pickled checkpoint ------------------------------------------------------------------------------------
def _pickled(path: Path) -> Path:
    """A fusion checkpoint whose hparams hold a pickled object (a weights-only load refuses it)."""
    torch.save({"state_dict": {}, "hyper_parameters": {"config": tiny().to_dict(), "args": argparse.Namespace(a=1)}},
               path)
    return path


def test_a_pickled_checkpoint_is_refused_in_one_line_without_torchs_weights_only_false_advice(tmp_path):
    path = _pickled(tmp_path / "pickled.ckpt")
    with pytest.raises(ValueError) as refused:
        load_checkpoint_file(path)
    assert str(refused.value) == (
        f"checkpoint {path} holds pickled Python objects, which torch.load(weights_only=True) refuses and this "
        "project never unpickles (that can run code): save its weights again as plain tensors with the project's "
        "tools (fusion_model.checkpoint.save_model, or `train.py convert import` for a transformers folder) and "
        "pass that file")


@pytest.mark.parametrize("flag", ["--model.init_weights", "--checkpoint"])
def test_fit_refuses_a_pickled_checkpoint_in_one_line(flag, tokens, tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    path = _pickled(tmp_path / "ckpt" / "pickled.ckpt")
    root = tmp_path / "run"
    capsys.readouterr()
    assert cli.main(["fit", *default_logger_args(tokens, root, 1, [flag, str(path)])]) == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert f"checkpoint {path} holds pickled Python objects" in line
    assert "weights_only=False" not in err and "Weights only load failed" not in err
    assert tree(root) is None


def test_the_upcycled_fixture_checkpoints_are_mot_and_hold_the_init_weights_they_started_from(upcycled):
    """The resume tests' premise: the interrupted run is MoT and its hparams name the (now deleted) source."""
    hparams = torch.load(upcycled["run"] / "ckpt" / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert FusionConfig.from_dict(hparams["config"]).block == "mot"
    assert hparams["init_weights"] == str(upcycled["source"]) and not upcycled["source"].exists()


# ---- case 6: `--ckpt_path last` reads the checkpoint as a path does; options it overrides are said ------------------
def test_resuming_last_of_a_run_whose_config_came_from_init_weights_works_after_the_source_is_gone(dense, tokens,
                                                                                                   tmp_path):
    source = tmp_path / "source.ckpt"
    shutil.copy(dense, source)
    from_weights = [f"--model.init_weights={source}", "--model.config=null", "--model.decay_steps=3"]
    root = tmp_path / "run"
    assert cli.main(["fit", *fw.tiny_args(tokens, root, 2, extra=from_weights)]) == 0
    source.unlink()
    # the same command again, resuming its newest last.ckpt: the decoder comes from that file, not init_weights
    assert cli.main(["fit", *fw.tiny_args(tokens, root, 3, extra=[*from_weights, "--ckpt_path=last"])]) == 0
    resumed = torch.load(root / "ckpt" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 3


def test_model_options_a_resumed_checkpoint_overrides_are_named_in_one_line(tokens, tmp_path, capsys):
    root = tmp_path / "run"
    assert cli.main(["fit", *fw.tiny_args(tokens, root, 1)]) == 0
    last = root / "ckpt" / "last.ckpt"
    capsys.readouterr()
    for resume in (str(last), "last"):  # a path and Lightning's special value say the same
        assert cli.main(["fit", *fw.tiny_args(tokens, root, 2, extra=["--model.lr=0.005", "--ckpt_path", resume])]) == 0
        notes = [line for line in capsys.readouterr().err.splitlines() if "with its own model options" in line]
        assert len(notes) == 1 and "lr=0.01 (this command: 0.005)" in notes[0], notes
        assert torch.load(last, weights_only=True)["hyper_parameters"]["lr"] == 0.01  # the checkpoint's recipe won
    # the same options as the checkpoint's: nothing to say
    assert cli.main(["fit", *fw.tiny_args(tokens, root, 3, extra=["--ckpt_path", str(last)])]) == 0
    assert "with its own model options" not in capsys.readouterr().err
