"""The late-fusion families: a connector over the frozen image tokenizer's features in front of the decoder (LLaVA's
projector, BLIP-2's Q-Former, Flamingo's gated cross-attention), trained on the early-fusion shards re-laid out for
it (`model.late_layout`), and captioning through the sampler."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fusion_model.checkpoint import connector_weights
from fusion_model.config import FusionConfig
from fusion_model.families.base import Family, LossSettings, Objective, ObjectiveContext, next_token_objective
from fusion_model.families.late.model import LateFusionConfig, LateFusionModel, late_layout, set_stage
from fusion_model.layers.loss import fusion_loss_from_hidden, target_counts
from fusion_model.model import FusionModel
from tokenizer.chat import encode_segments, is_ids
from tokenizer.layout import image_code_mask

IDS_FROM_SHARDS = ("feature_dim", "image_token_id", "boi_id", "eoi_id")


class LateFusionFamily(Family):
    """A connector (`kind`) reads the shards' pre-quantisation image features; image placeholders carry no loss;
    the stage decides whether the decoder trains. Subclasses name the kind (and the stages they train)."""

    kind = ""
    batch_keys = ("image_features",)
    writes_images = False  # a connector reads images; the decoder writes text only
    Options = LateFusionConfig

    def __init__(self, config: FusionConfig, options: Any = None, losses: LossSettings | None = None) -> None:
        values = dict(options or {}) if not isinstance(options, LateFusionConfig) else dataclasses.asdict(options)
        if values.setdefault("kind", self.kind) != self.kind:
            raise ValueError(f"the {self.name} family trains a {self.kind} connector, not late_fusion.kind "
                             f"{values['kind']!r}: use --model.family {values['kind']}")
        super().__init__(config, LateFusionConfig.from_dict(values), losses)
        self.late: LateFusionModel | None = None  # the decoder and connector together, once built

    @classmethod
    def derive_options(cls, options: dict, manifest: Mapping[str, Any], vocab: Any | None) -> None:
        """The ids (<image>, <boi>, <eoi>) and feature_dim from the token shards' manifest (ids also from the
        vocabulary); shards without features are refused before anything starts."""
        if manifest and not manifest.get("feature_dim"):
            raise ValueError(f"the token shards hold no image features, which the {cls.name} family reads: re-run "
                             "`train.py shards tokenize --features` into a fresh directory")
        known = {"feature_dim": manifest.get("feature_dim"), "image_token_id": manifest.get("image_placeholder_id"),
                 "boi_id": manifest.get("boi_id"), "eoi_id": manifest.get("eoi_id")}
        if vocab is not None:
            known = {**known, "image_token_id": known["image_token_id"] or vocab.image_placeholder_id,
                     "boi_id": known["boi_id"] or vocab.boi_id, "eoi_id": known["eoi_id"] or vocab.eoi_id}
        for key, value in known.items():
            if value is not None:
                options.setdefault(key, int(value))
        specials = [manifest.get(k) for k in ("pad_id", "bos_id", "eos_id")] + [known["boi_id"], known["eoi_id"]]
        options.setdefault("special_ids", [int(i) for i in specials if i is not None])

    # ---- training ---------------------------------------------------------------------------------------------
    def build(self) -> dict[str, nn.Module]:
        """`model` (the decoder) and `connector`; frozen as the stage says."""
        late = self.options
        missing = [name for name in IDS_FROM_SHARDS if getattr(late, name) is None]
        if missing:
            raise ValueError(f"the {self.name} family needs {missing} (train.py fit takes them from the token "
                             "shards' manifest)")
        self.late = LateFusionModel(FusionModel(self.config), late.kind, late.image_token_id,
                                    feature_dim=late.feature_dim, connector_dim=late.connector_dim,
                                    num_latents=late.num_latents, num_queries=late.num_queries, depth=late.depth,
                                    heads=late.heads)
        set_stage(self.late, late.stage)
        return {"model": self.late.decoder, "connector": self.late.connector}

    def set_mode(self, parts: Mapping[str, nn.Module], training: bool) -> None:
        """A frozen decoder runs in eval mode (no dropout)."""
        self.late.train(training)

    def start_new_run(self, parts: Mapping[str, nn.Module]) -> None:
        """Start the connector from an earlier stage's checkpoint (`init_connector`)."""
        if self.options.init_connector:
            parts["connector"].load_state_dict(connector_weights(self.options.init_connector))

    def parallelize(self, parts: Mapping[str, nn.Module], mesh: Any) -> None:
        """Refused: the connector path calls the decoder's embed, forward_hidden and head outside any FSDP forward,
        so the root's parameters would stay sharded (and an unsharded connector's gradients unsynchronised)."""
        raise ValueError(f"the {self.name} family does not run under ModelParallelStrategy (FSDP2) yet: train it "
                         "with --trainer.strategy=ddp (or auto on one device)")

    def layout(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch as the connector reads it (fusion_model.families.late.model.late_layout)."""
        if "image_features" not in batch:
            raise ValueError(f"the {self.name} family needs batches with image_features: set data.image_features "
                             "true (or leave it null) and tokenize the shards with --features")
        return late_layout(batch["input_ids"], batch["document_ids"], batch["image_features"], config=self.options,
                           image_offset=self.config.image_offset, image_codes=self.config.image_codes)

    def denominators(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weighted next-token targets of the re-laid-out batch (placeholders carry none)."""
        layout = self.layout(batch)
        counts = target_counts(layout["input_ids"], layout["document_ids"], self.config.image_offset,
                               self.config.image_codes, self.options.image_token_id)
        return {"loss": self.losses.weighted_count(*counts)}

    def objective(self, parts: Mapping[str, nn.Module], batch: Mapping[str, torch.Tensor],
                  context: ObjectiveContext) -> Objective:
        """Codes replaced by the connector's view of the features, image placeholders ignored (label -100), the
        rest as in pretraining (CE + z-loss)."""
        config, layout = self.config, self.layout(batch)
        if layout["input_ids"].shape[1] > config.max_seq_len:
            raise ValueError(f"late fusion made rows of {layout['input_ids'].shape[1]} positions (each image costs "
                             f"{self.options.per_image}), more than model.config.max_seq_len {config.max_seq_len}: "
                             "raise max_seq_len or lower data.seq_len")
        hidden = self.late.hidden(layout["input_ids"], features=layout["features"],
                                  feature_mask=layout["feature_mask"], document_ids=layout["document_ids"],
                                  position_ids=layout["position_ids"])
        out = fusion_loss_from_hidden(
            hidden, parts["model"].head.weight, layout["input_ids"], layout["document_ids"],
            image_offset=config.image_offset, image_codes=config.image_codes, z_loss_coef=config.z_loss_coef,
            text_weight=self.losses.text_weight, image_weight=self.losses.image_weight,
            chunk_size=self.losses.chunk_size, ignore_id=self.options.image_token_id,
        )
        positions = (layout["document_ids"] >= 0).sum()
        return next_token_objective(out, self.losses, positions)

    # ---- sampling: captions of prompt images ------------------------------------------------------------------
    def generate(self, parts: Mapping[str, nn.Module], vocab: Any, image_tokenizer: Any, prompts: list[list[Any]],
                 config: Any) -> tuple[list[list[Any]], list[list[int]]]:
        """Text after each prompt, its images read through the frozen image tokenizer and the connector (text only:
        a late-fusion decoder writes no images, so interleaved is text; guidance has no unconditional stream here)."""
        from fusion_model.sampling import generate_ids
        from fusion_model.sampling.generate import decode_outputs, load_prompt_image

        if config.mode == "image":
            raise ValueError(f"a {self.name} checkpoint writes text only: use --mode text or interleaved, not image")
        config = dataclasses.replace(config, mode="text")  # interleaved, for a model that writes no images
        if config.cfg_scale != 1.0 or config.cfg_image_scale is not None:
            raise ValueError(f"classifier-free guidance needs image-code streams; a {self.name} checkpoint samples "
                             "without it: leave out --cfg-scale / --cfg-image-scale / --chameleon-defaults")
        if image_tokenizer is None and any(not (isinstance(s, str) or is_ids(s)) for p in prompts for s in p):
            raise ValueError(f"--image needs --image-tokenizer: the {self.name} connector reads its features")
        rows, features, masks = [], [], []
        for prompt in prompts:
            ids, feats, mask = self.prompt_layout(prompt, vocab, image_tokenizer, load_prompt_image)
            rows.append(ids)
            features.append(feats)
            masks.append(mask)
        # a prompt without images adds none (its empty slice may be shaped unlike the others': leave it out)
        kept = [(f, m) for f, m in zip(features, masks) if len(f)] or [(features[0], masks[0])]
        bound = BoundImages(self.late, torch.cat([f for f, _ in kept]), torch.cat([m for _, m in kept]))
        if not bound.supports_kv_cache:
            if config.compile:
                raise ValueError(f"--compile needs the KV cache, which a {self.name} checkpoint cannot use (its text "
                                 "attends to the images inside every block): leave out --compile")
            config = dataclasses.replace(config, use_kv_cache=False)
        new_ids = generate_ids(bound, vocab, rows, config)
        return decode_outputs(new_ids, vocab, None, None), new_ids

    def prompt_layout(self, segments: list[Any], vocab: Any, image_tokenizer: Any,
                      load_image) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """One prompt as the connector reads it: its ids (images as placeholders / markers) and the images'
        features (N, P, C) with their mask."""
        parts, per_image = [], []
        for segment in segments:
            if isinstance(segment, str) or is_ids(segment):  # text, or a chat's verbatim ids
                parts.append(segment)
                continue
            codes, feats = image_tokenizer.encode_with_features([load_image(segment)])
            parts.append(codes[0])
            per_image.append(feats[0].float())
        ids = torch.tensor([encode_segments(vocab, parts)])
        feature_dim = self.options.feature_dim
        per_position = torch.zeros(*ids.shape, feature_dim)
        if per_image:
            per_position[image_code_mask(ids, vocab.image_offset, vocab.image_codes)] = torch.cat(per_image)
        layout = late_layout(ids, torch.zeros_like(ids), per_position, config=self.options,
                             image_offset=vocab.image_offset, image_codes=vocab.image_codes, pad_id=vocab.pad_id)
        return layout["input_ids"][0].tolist(), layout["features"][: len(per_image)], \
            layout["feature_mask"][: len(per_image)]


# ---- the three connectors, one family each ---------------------------------------------------------------------
class LlavaFamily(LateFusionFamily):
    """LLaVA-1.5: stage 1 trains the projector alone on captions, stage 2 the projector and the decoder."""

    name = "llava"
    kind = "llava"


class QFormerFamily(LateFusionFamily):
    """BLIP-2's generative stage: the Q-Former (from stage 1: `blip2-stage1`) and its projection learn, the decoder
    stays frozen."""

    name = "qformer"
    kind = "qformer"

    def check(self) -> None:
        """Stage 1 trains without the decoder: it is its own family."""
        super().check()
        if self.options.stage == 1:
            raise ValueError("the qformer family trains BLIP-2's stage 2; stage 1 is --model.family blip2-stage1 "
                             "(or late_fusion {kind: qformer, stage: 1})")


class FlamingoFamily(LateFusionFamily):
    """Flamingo: one `<image>` marker per image in the text; the text after it attends to that image's resampled
    latents before every decoder block, through gates that start closed."""

    name = "flamingo"
    kind = "flamingo"


class BoundImages(nn.Module):
    """A late-fusion model with one batch's prompt images bound to it: the sampler's view of it (the decode
    interface of fusion_model.sampling). Images enter where their placeholders (LLaVA, Q-Former) or markers
    (Flamingo) are, in row-major order; new tokens are text, fed to the decoder as usual."""

    def __init__(self, late: LateFusionModel, features: torch.Tensor, feature_mask: torch.Tensor) -> None:
        super().__init__()
        self.late = late
        self.config = late.decoder.config
        self.head = late.decoder.head
        self.features, self.feature_mask = features, feature_mask
        # Flamingo's text cross-attends to the images in every block, which the cached decode step does not do
        self.supports_kv_cache = late.kind != "flamingo"

    def forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                       document_ids: torch.Tensor | None = None, kv_cache: Any = None) -> torch.Tensor:
        """Hidden states of rows holding every bound image's placeholders (prefill, or the whole sequence)."""
        device = input_ids.device
        return self.late.hidden(input_ids, features=self.features.to(device),
                                feature_mask=self.feature_mask.to(device), document_ids=document_ids,
                                position_ids=position_ids, kv_cache=kv_cache)

    def decode_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor,
                      slot: torch.Tensor, kv_cache: Any) -> torch.Tensor:
        """New text tokens after the prompt: the decoder's own cached step."""
        return self.late.decoder.decode_hidden(tokens, positions, documents, slot, kv_cache)

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, device: Any = None, dtype: Any = None):
        """The decoder's cache."""
        return self.late.decoder.new_kv_cache(batch_size, max_len, device, dtype)
