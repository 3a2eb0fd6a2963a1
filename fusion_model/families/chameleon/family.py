"""The Chameleon family: early fusion, one decoder over text and image codes, next-token CE + z-loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fusion_model.families.base import Family, Objective, ObjectiveContext, next_token_objective
from fusion_model.layers.loss import target_counts
from fusion_model.model import FusionModel


class ChameleonFamily(Family):
    """Chameleon (arXiv 2405.09818): image codes are tokens; every position predicts the next token, text and
    image alike, each target weighted by its modality's weight (`--model.text_weight`, `--model.image_weight`)."""

    name = "chameleon"
    # target_mask: answer-only SFT on conversation shards (absent from a batch: every token is a target)
    batch_keys = ("target_mask",)
    scores_image_positions = True
    exportable = True

    def build(self) -> dict[str, nn.Module]:
        """The decoder, registered as `model` (checkpoints hold `model.*`)."""
        return {"model": FusionModel(self.config)}

    def denominators(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The modality-weighted number of next-token targets (what `objective` divides the loss sum by)."""
        counts = target_counts(batch["input_ids"], batch["document_ids"], self.config.image_offset,
                               self.config.image_codes, target_mask=batch.get("target_mask"))
        return {"loss": self.losses.weighted_count(*counts)}

    def objective(self, parts: Mapping[str, nn.Module], batch: Mapping[str, torch.Tensor],
                  context: ObjectiveContext) -> Objective:
        """CE + z-loss over every next-token target (answer tokens only where the batch has a `target_mask`),
        as one term (its count: the weighted targets)."""
        out = parts["model"].loss(batch["input_ids"], batch["document_ids"], batch.get("position_ids"),
                                  text_weight=self.losses.text_weight, image_weight=self.losses.image_weight,
                                  chunk_size=self.losses.chunk_size, target_mask=batch.get("target_mask"))
        positions = (batch["document_ids"] >= 0).sum()
        return next_token_objective(out, self.losses, positions)

    def generate(self, parts: Mapping[str, nn.Module], vocab: Any, image_tokenizer: Any, prompts: list[list[Any]],
                 config: Any) -> tuple[list[list[Any]], list[list[int]]]:
        """Mixed text-and-image sampling (fusion_model.sampling.generate.generate)."""
        from fusion_model.sampling.generate import generate

        return generate(parts["model"], vocab, image_tokenizer, prompts, config, return_ids=True)
