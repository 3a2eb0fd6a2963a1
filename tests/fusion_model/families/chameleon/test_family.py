"""The Chameleon family: the decoder as `model`, one next-token term, and no attention that sees the answer:
`image_bidirectional` is refused where image positions carry a next-token loss."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fusion_model.config import FusionConfig
from fusion_model.families.base import LossSettings, ObjectiveContext
from fusion_model.families.chameleon.family import ChameleonFamily
from fusion_model.model import FusionModel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "training"))
import fit_worker as fw  # noqa: E402

IMAGE = dict(image_offset=128, image_codes=64)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


def image_row() -> torch.Tensor:
    """<s> text <boi> 8 codes <eoi> text, in the tiny vocabulary (image block 128..191)."""
    codes = torch.arange(128, 136)
    return torch.cat([torch.tensor([1, 20, 21, 3]), codes, torch.tensor([4, 22, 2])])[None]


def change_of_logits_when_the_target_changes(model: FusionModel, position: int) -> float:
    """How much the logits at `position` move when the token after it (its next-token target) changes."""
    ids = image_row()
    changed = ids.clone()
    changed[0, position + 1] = 180  # another image code
    with torch.no_grad():
        return float((model(ids)[0, position] - model(changed)[0, position]).abs().max())


def test_image_bidirectional_lets_an_image_position_see_its_own_target():
    torch.manual_seed(0)
    leaky = FusionModel(FusionConfig.from_preset("tiny", image_bidirectional=True, **IMAGE))
    assert change_of_logits_when_the_target_changes(leaky, position=6) > 1e-3  # what the refusal prevents


def test_the_chameleon_family_refuses_image_bidirectional_and_its_scored_positions_never_see_their_targets():
    with pytest.raises(ValueError, match="image_bidirectional is true.*next-token loss on image positions"):
        ChameleonFamily(FusionConfig.from_preset("tiny", image_bidirectional=True, **IMAGE))
    torch.manual_seed(0)
    family = ChameleonFamily(FusionConfig.from_preset("tiny", **IMAGE))
    model = family.build()["model"]
    for position in range(image_row().shape[1] - 1):  # every scored position, text and image
        assert change_of_logits_when_the_target_changes(model, position) == 0.0, position


def test_fit_refuses_image_bidirectional_for_the_chameleon_family_before_writing_anything(tmp_path, capsys):
    from fusion_model.cli import main

    tokens = fw.make_token_dir(tmp_path / "tokens")
    args = fw.tiny_args(tokens, tmp_path / "run", 1, extra=[
        "--model.config.image_bidirectional=true", "--model.config.image_offset=128",
        "--model.config.image_codes=64"])
    assert main(["fit", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "image_bidirectional" in err and "predict" in err
    assert not (tmp_path / "run" / "ckpt").exists()


def test_the_objective_is_the_decoder_loss_as_one_term_counted_in_weighted_targets():
    torch.manual_seed(0)
    config = FusionConfig.from_preset("tiny", **IMAGE)
    family = ChameleonFamily(config, losses=LossSettings(text_weight=1.0, image_weight=0.5))
    parts = family.build()
    ids = image_row().repeat(2, 1)
    documents = torch.zeros_like(ids)
    documents[1, 10:] = -1  # padding: fewer targets in row 1
    batch = {"input_ids": ids, "document_ids": documents}
    objective = family.objective(parts, batch, ObjectiveContext(step=0))
    out = parts["model"].loss(ids, documents, text_weight=1.0, image_weight=0.5)
    torch.testing.assert_close(objective.mean("loss"), out["loss"].detach())
    assert float(objective.terms["loss"].count) == float(family.denominators(batch)["loss"])
    n_text, n_image = int(out["n_text_targets"]), int(out["n_image_targets"])
    assert float(objective.terms["loss"].count) == n_text + 0.5 * n_image
