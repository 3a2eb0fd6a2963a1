"""`fit --model.train_only image_head_rows` (Anole's recipe): only the output head's rows of the image codes train."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fusion_model import cli
from fusion_model.checkpoint import save_model
from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel
from fusion_model.training.lightning_module import FusionLightningModule

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_worker as fw  # noqa: E402
from test_resume import resume_after_sigkill_matches_an_uninterrupted_run  # noqa: E402

IMAGE = {"image_offset": 128, "image_codes": 128}  # ids 128..255 are image codes; the random shards hold both kinds


def options(base: Path) -> list[str]:
    """The fit options of a head-only run from `base` (weight decay on: it may not reach what does not train)."""
    return [*(f"--model.config.{k}={v}" for k, v in IMAGE.items()), f"--model.init_weights={base}",
            "--model.train_only=image_head_rows", "--model.weight_decay=0.1"]


@pytest.fixture(scope="module")
def head_run(tmp_path_factory):
    """A 3-step head-only run: (root, base path, its recording)."""
    root = tmp_path_factory.mktemp("head")
    tokens = fw.make_token_dir(root / "tokens")
    torch.manual_seed(0)
    base = save_model(FusionModel(FusionConfig(**fw.TINY, **IMAGE)), root / "base.ckpt")
    args = fw.tiny_args(tokens, root / "run", 3, extra=[*options(base), "--model.config.dropout=0.1",
                                                          fw.recorder_arg(root / "rec")])
    assert cli.main(["fit", *args]) == 0
    return root, base, torch.load(root / "rec.rank0.pt", weights_only=True)


def test_only_the_image_rows_of_the_head_change_in_a_few_steps(head_run):
    tmp_path, base, recording = head_run
    start = torch.load(base, weights_only=True)["state_dict"]
    weights = recording["weights"]
    for name, value in weights.items():
        if name != "head.weight":
            assert torch.equal(value, start[f"model.{name}"]), name
    head, before = weights["head.weight"], start["model.head.weight"]
    assert torch.equal(head[:128], before[:128])  # text rows (and specials): bit-identical
    changed = (head[128:] != before[128:]).any(dim=1)
    assert changed.all()  # every image-code row moved
    checkpoint = torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["train_only"] == "image_head_rows"
    assert torch.equal(checkpoint["state_dict"]["model.head.weight"], head)  # a full checkpoint: it loads anywhere
    # the optimizer holds the head alone, in a group without weight decay
    groups = checkpoint["optimizer_states"][0]["param_groups"]
    assert [len(g["params"]) for g in groups] == [0, 1] and groups[1]["weight_decay"] == 0.0


def test_train_only_is_refused_without_an_image_block_or_with_peft():
    with pytest.raises(ValueError, match="train_only='everything' is invalid"):
        FusionLightningModule(FusionConfig(**fw.TINY), train_only="everything")
    with pytest.raises(ValueError, match="needs the vocabulary's image block"):
        FusionLightningModule(FusionConfig(**fw.TINY), train_only="image_head_rows")
    with pytest.raises(ValueError, match="give one of them"):
        FusionLightningModule(FusionConfig(**fw.TINY, **IMAGE), train_only="image_head_rows", peft={"rank": 2})


def test_a_head_only_run_resumes_bit_for_bit(head_run, tmp_path):
    resume_after_sigkill_matches_an_uninterrupted_run(tmp_path, extra=tuple(options(head_run[1])))


def test_two_ranks_train_the_image_rows_of_one_process(head_run, tmp_path):
    from test_distributed import _two_nodes

    root, base, _ = head_run
    single = tmp_path / "single"
    assert cli.main(["fit", *fw.tiny_args(root / "tokens", single, 3, extra=[*options(base),
                                                                          fw.recorder_arg(single / "rec")])]) == 0
    reference = torch.load(single / "rec.rank0.pt", weights_only=True)["weights"]
    ranks = _two_nodes(root / "tokens", tmp_path / "ddp", 3, "ddp", extra=options(base))
    for name, value in reference.items():
        torch.testing.assert_close(ranks[0]["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    assert torch.equal(ranks[0]["weights"]["head.weight"][:128], reference["head.weight"][:128])
