"""The family seam: a family defined outside the project trains through `train.py fit` with no project file
changed; several loss terms accumulate exactly, each over its own count; an objective's randomness is keyed by
the sample and the step; the older `late_fusion` spelling and unknown names resolve as documented."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusion_model.families import family_class, family_names, resolve_family
from fusion_model.layers.keyed_random import keyed_generator, keyed_normal, keyed_uniform

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "tests/fusion_model/training"))
import fit_worker as fw  # noqa: E402

TOY = "toy_family:ToyFamily"  # importable with this folder on the path; no project file names it

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    return fw.make_token_dir(tmp_path_factory.mktemp("seam") / "tokens")


def test_a_family_from_outside_the_project_trains_through_train_py_fit(tokens, tmp_path):
    root = tmp_path / "run"
    argv = [sys.executable, "train.py", "fit", *fw.tiny_args(tokens, root, 3), f"--model.family={TOY}",
            '--model.family_options={"noise_weight": 0.25}', "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = torch.load(root / "ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    assert checkpoint["hyper_parameters"]["family"] == TOY
    assert checkpoint["hyper_parameters"]["family_options"] == {"noise_weight": 0.25}
    assert sorted(checkpoint["state_dict"]) == ["model.embed.weight", "model.head.bias", "model.head.weight"]
    assert checkpoint["hyper_parameters"]["tokenizers"] == {"vocab": "vocab-test", "image_tokenizer": "image-test"}
    logged = (root / "lightning_logs").rglob("metrics.csv")
    header = next(iter(logged)).read_text().splitlines()[0]
    assert {"train/next_token", "train/noise", "train/documents"} <= set(header.split(","))


def test_two_loss_terms_accumulate_exactly_each_over_its_own_count(tokens, tmp_path):
    from fusion_model.cli.fit import main

    sys.path.insert(0, str(HERE))
    try:
        one, accumulated = tmp_path / "one", tmp_path / "accumulated"
        assert main(fw.tiny_args(tokens, one, 4, batch_size=4, extra=[f"--model.family={TOY}"])) == 0
        assert main(fw.tiny_args(tokens, accumulated, 4, batch_size=2, extra=[
            f"--model.family={TOY}", "--trainer.accumulate_grad_batches=2"])) == 0
    finally:
        sys.path.remove(str(HERE))
    expected = torch.load(one / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    got = torch.load(accumulated / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    # summation order differs, and Adam turns that into ~1e-6 differences; one shared count for both terms, or a
    # per-micro-batch mean, moves the weights by far more
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, rtol=0, atol=1e-5, msg=name)


def test_keyed_randomness_follows_the_key_not_the_batch():
    keys = torch.tensor([7, 123_456_789_012, -3, 0, 42, 99])
    draws = keyed_normal(keys, seed=0, step=5, stream="noise", draws=4)
    assert draws.shape == (6, 4)
    order = torch.tensor([3, 0, 5, 1, 4, 2])  # another batch order, another rank's share: the same numbers per key
    torch.testing.assert_close(keyed_normal(keys[order], seed=0, step=5, stream="noise", draws=4), draws[order],
                               rtol=0, atol=0)
    torch.testing.assert_close(keyed_normal(keys[:2], seed=0, step=5, stream="noise", draws=4), draws[:2],
                               rtol=0, atol=0)
    assert not torch.equal(keyed_normal(keys, seed=0, step=6, stream="noise", draws=4), draws)  # a new step
    assert not torch.equal(keyed_normal(keys, seed=1, step=5, stream="noise", draws=4), draws)  # a new seed
    assert not torch.equal(keyed_normal(keys, seed=0, step=5, stream="timestep", draws=4), draws)  # another use
    many = keyed_uniform(torch.arange(20_000), seed=0, step=0, stream="u")
    assert 0 < float(many.min()) and float(many.max()) < 1 and abs(float(many.mean()) - 0.5) < 0.01
    normal = keyed_normal(torch.arange(20_000), seed=0, step=0, stream="n", draws=2)
    assert abs(float(normal.mean())) < 0.02 and abs(float(normal.std()) - 1) < 0.02
    first = torch.rand(3, generator=keyed_generator(keys, seed=0, step=1, stream="g"))
    again = torch.rand(3, generator=keyed_generator(keys[order], seed=0, step=1, stream="g"))
    assert torch.equal(first, again)


def test_the_late_fusion_spelling_names_a_family_and_family_options_win_key_by_key():
    assert resolve_family(None, None, None) == ("chameleon", {})
    assert resolve_family("chameleon", None, {"kind": "llava", "stage": 2}) == ("llava", {"kind": "llava", "stage": 2})
    assert resolve_family("chameleon", {"depth": 1}, {"kind": "qformer", "stage": 1, "depth": 3})[0] == "blip2-stage1"
    assert resolve_family(None, {"depth": 1}, {"kind": "qformer", "stage": 2, "depth": 3})[1]["depth"] == 1
    with pytest.raises(ValueError, match="disagree"):
        resolve_family("flamingo", None, {"kind": "llava", "stage": 1})
    with pytest.raises(ValueError, match="names no family"):
        resolve_family(None, None, {"kind": "flamingo", "stage": 2})
    assert {"chameleon", "llava", "qformer", "blip2-stage1", "flamingo"} <= set(family_names())
    for name in family_names():
        assert family_class(name).name == name


def test_an_unknown_family_is_one_line_and_exit_2(tokens, tmp_path, capsys):
    from fusion_model.cli import main

    code = main(["fit", *fw.tiny_args(tokens, tmp_path, 1), "--model.family=no_such_family"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "no_such_family" in err and "chameleon" in err and "my_package.my_module:MyFamily" in err
    assert not (tmp_path / "ckpt").exists()


def test_family_options_are_checked_by_the_family(tokens, tmp_path, capsys):
    from fusion_model.cli import main

    code = main(["fit", *fw.tiny_args(tokens, tmp_path, 1), '--model.family_options={"depth": 2}'])
    err = capsys.readouterr().err
    assert code == 2 and "takes no model.family_options" in err and "depth" in err
    json.dumps(err)  # one printable line


@pytest.mark.parametrize("option, value", [("lr", float("nan")), ("lr", 0.0), ("eps", float("inf")),
                                           ("weight_decay", float("nan")), ("betas", (0.9, float("nan"))),
                                           ("min_lr_ratio", 2.0), ("warmup_steps", -1), ("text_weight", float("nan")),
                                           ("image_weight", -1.0), ("loss_chunk_size", 0)])
def test_every_recipe_setting_is_checked_up_front_non_finite_values_included(option, value):
    from fusion_model.config import FusionConfig
    from fusion_model.training.lightning_module import FusionLightningModule

    with pytest.raises(ValueError, match=rf"--model\.{option}="):
        FusionLightningModule(FusionConfig.from_preset("tiny"), **{option: value})


@pytest.mark.parametrize("option, value", [("num_queries", 0), ("depth", -1), ("heads", 2.5), ("text_len", True),
                                           ("connector_dim", 0), ("feature_dim", -8), ("image_token_id", -1)])
def test_every_late_fusion_setting_is_checked_up_front(option, value):
    from fusion_model.families.late.model import LateFusionConfig

    with pytest.raises(ValueError, match=rf"late_fusion\.{option}="):
        LateFusionConfig(kind="qformer", stage=2, **{option: value})
