"""The BLIP-2 stage-1 family: the Q-Former learns against the frozen image encoder alone (ITC, ITM, ITG)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fusion_model.config import FusionConfig
from fusion_model.families.base import LossSettings, LossTerm, Objective, ObjectiveContext
from fusion_model.families.late.family import LateFusionFamily
from fusion_model.families.late.qformer_pretraining import QFormerPretrainer, caption_pairs


class Blip2Stage1Family(LateFusionFamily):
    """BLIP-2's representation stage on the shards' one-image documents (image-text pairs): image-text
    contrastive, matching with hard negatives and image-grounded generation through the Q-Former's own layers. The
    decoder is built (and checkpointed, frozen) but never run; stage 2 (`qformer`) starts from this connector.
    The hard negatives are drawn from a generator keyed by the step and the batch's samples (their token keys)."""

    name = "blip2-stage1"
    kind = "qformer"
    batch_keys = ("image_features", "token_keys")

    def __init__(self, config: FusionConfig, options: Any = None, losses: LossSettings | None = None) -> None:
        values = dict(options or {}) if isinstance(options, Mapping) or options is None else options
        if isinstance(values, dict):
            values.setdefault("stage", 1)
        super().__init__(config, values, losses)
        if self.options.stage != 1:
            raise ValueError("the blip2-stage1 family is BLIP-2's stage 1; stage 2 is --model.family qformer")

    def build(self) -> dict[str, nn.Module]:
        """`model` (frozen, unused), `connector` (the Q-Former) and `stage1_heads` (the ITC/ITM/ITG heads)."""
        parts = super().build()
        heads = QFormerPretrainer(parts["connector"], self.config.vocab_size, self.options.text_len)
        # the Q-Former is the `connector` part already: the heads part holds only its own weights, so checkpoints
        # name each weight once, and reaches the Q-Former through this family
        del heads._modules["qformer"]
        heads.__dict__["qformer"] = parts["connector"]
        # the projection to the decoder's width is stage 2's: unused here (DDP refuses unused trainable weights)
        parts["connector"].to_language_model.requires_grad_(False)
        return {**parts, "stage1_heads": heads}

    def _pairs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        if "image_features" not in batch:
            raise ValueError("the blip2-stage1 family needs batches with image_features: tokenize the shards with "
                             "--features")
        return caption_pairs(batch["input_ids"], batch["document_ids"], batch["image_features"],
                             image_offset=self.config.image_offset, image_codes=self.config.image_codes,
                             special_ids=list(self.options.special_ids), pad_id=0,  # padding is masked: never read
                             max_text_len=self.options.text_len)

    def denominators(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The number of image-text pairs (each loss is a mean over the batch's pairs)."""
        pairs = self._pairs(batch)
        return {"loss": torch.tensor(0.0 if pairs is None else float(len(pairs["pair_ids"])))}

    def objective(self, parts: Mapping[str, nn.Module], batch: Mapping[str, torch.Tensor],
                  context: ObjectiveContext) -> Objective:
        """ITC + ITM + ITG of the batch's pairs, one term counted in pairs; the hard negatives are drawn from a
        generator keyed by the step and the batch's samples, not from the rank's random state."""
        pairs = self._pairs(batch)
        zero = batch["image_features"].new_zeros(())
        if pairs is None:  # nothing to contrast: a zero loss that still reaches every trainable weight
            loss = sum(p.sum() for part in parts.values() for p in part.parameters() if p.requires_grad) * 0.0
            return Objective(terms={"loss": LossTerm(loss, zero)},
                             metrics={name: (zero, 0) for name in ("itc", "itm", "itg", "itc_accuracy")})
        if "token_keys" not in batch:
            raise ValueError("the blip2-stage1 family keys its hard negatives by the batch's samples: its batches "
                             "need token_keys (FusionDataModule adds them when the family asks)")
        generator = context.generator(batch["token_keys"][batch["document_ids"] >= 0], "itm_negatives",
                                      device=pairs["text_ids"].device)
        out = parts["stage1_heads"](pairs["features"], pairs["text_ids"], pairs["text_mask"], pairs["feature_mask"],
                                    pair_ids=pairs["pair_ids"], generator=generator)
        count = torch.tensor(float(len(pairs["pair_ids"])), device=zero.device)
        return Objective(terms={"loss": LossTerm(out["loss"] * count, count)},
                         metrics={name: (out[name].detach(), count) for name in ("itc", "itm", "itg", "itc_accuracy")})

    def generate(self, parts: Mapping[str, nn.Module], vocab: Any, image_tokenizer: Any, prompts: list[list[Any]],
                 config: Any) -> tuple[list[list[Any]], list[list[int]]]:
        """Refused: stage 1 never connects the Q-Former to the decoder."""
        raise ValueError("a blip2-stage1 checkpoint cannot caption: its Q-Former is not yet connected to the decoder; "
                         "train stage 2 from it (configs/fusion/late/qformer-stage2.yaml) and sample that checkpoint")
