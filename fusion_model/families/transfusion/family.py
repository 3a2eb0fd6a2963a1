"""The Transfusion family (Zhou et al. 2024, arXiv 2408.11039): one decoder trained on text with next-token
cross-entropy and on continuous image latents with a diffusion (noise-prediction MSE) loss.

Batch contract (beyond ids, documents and positions): each image is `<boi>`, then P placeholder positions holding
the vocabulary's `<image>` id (`image_placeholder_id`), then `<eoi>`; P = (h/k)(w/k) latent patches in row-major
order. `image_latents` (B, T, C*k*k) holds each placeholder position's clean patch vector (`patchify`'s order:
channel-major inside the patch), zeros elsewhere; `token_keys` (B, T) each token's identity in the dataset.
An image is a run of placeholder positions inside one document (a document cut inside an image makes two).

Training: per image a step t and a caption-dropout decision, keyed by its first patch's token key and the step;
per patch a noise vector keyed by that patch's own token key (the same numbers on any rank, in any row and
micro-batch, and after a resume). The decoder reads x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps at the placeholder
positions (patch projection + timestep embedding instead of the `<image>` embedding) and predicts eps there.
Attention is bidirectional inside each image (`image_bidirectional`), causal elsewhere, never across documents.
Terms: `text` (CE + z-loss over text targets, the placeholders excluded as targets: the `<boi>` position predicts
nothing, `<boi>` and `<eoi>` themselves are scored) and `diffusion` (weight `diffusion_weight`: per image, the
mean squared error over its patch values, summed over images and divided by the number of images).

Caption dropout (classifier-free guidance): a dropped image, its `<boi>` included, attends only to itself, not to
the document's text before it (`FusionModel.forward_hidden(visible_from=...)`); everything after it still sees it.
`denoise(..., unconditional=True)` runs that branch; by RoPE's relative positions it equals a row of the image's
`<boi>` and patches alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fusion_model.config import FusionConfig
from fusion_model.families.base import (
    Family,
    LossSettings,
    LossTerm,
    Objective,
    ObjectiveContext,
    next_token_objective,
)
from fusion_model.families.transfusion.diffusion import CosineSchedule
from fusion_model.families.transfusion.layout import DiffusionDraws, ImageLayout, image_layout, visible_from
from fusion_model.families.transfusion.options import TransfusionOptions
from fusion_model.families.transfusion.patches import TIMESTEP_FREQUENCIES, LatentPatches, TimestepEmbedding
from fusion_model.families.transfusion.sampling import DiffusionSamplingConfig
from fusion_model.families.transfusion.unet import UNetPatches
from fusion_model.layers.loss import target_counts
from fusion_model.model import FusionModel


class TransfusionFamily(Family):
    """Transfusion: the decoder (`model`) and its latent-patch projections and timestep MLP (`patches`); terms
    `text` and `diffusion`. See the module docstring for the batch contract, the draws and caption dropout."""

    name = "transfusion"
    Options = TransfusionOptions
    batch_keys = ("token_keys", "image_latents")
    scores_image_positions = False
    sampling_config = DiffusionSamplingConfig  # adds --denoising-steps to `train.py generate`

    def __init__(self, config: FusionConfig, options: Any = None, losses: LossSettings | None = None) -> None:
        super().__init__(config, options, losses)
        # the decoder's attention reads the placeholder id as an image position (bidirectional runs, the block's
        # modality): one image-position rule for codes and patches
        self.config = dataclasses.replace(config, image_placeholder_id=self.options.image_placeholder_id,
                                          image_bidirectional=self.options.image_bidirectional)
        self.schedule = CosineSchedule(self.options.diffusion_steps)

    # ---- configuration --------------------------------------------------------------------------------------
    def check(self) -> None:
        """Refuse missing ids/sizes and a decoder config that contradicts the options."""
        super().check()
        options, config = self.options, self.config
        missing = [name for name in ("latent_channels", "image_placeholder_id") if getattr(options, name) is None]
        if missing:
            raise ValueError(f"the transfusion family needs model.family_options {missing} (train.py fit takes them "
                             "from the token shards' manifest, the placeholder id also from the vocabulary)")
        if options.patch_encoder == "unet" and options.latent_grid is None:
            raise ValueError("the transfusion family's U-Net patch encoder needs model.family_options latent_grid "
                             "[height, width] (train.py fit takes it from the token shards' manifest)")
        if config.image_placeholder_id not in (None, options.image_placeholder_id):
            raise ValueError(f"model.config.image_placeholder_id {config.image_placeholder_id} and "
                             f"model.family_options.image_placeholder_id {options.image_placeholder_id} disagree: "
                             "give one")
        if config.image_bidirectional and not options.image_bidirectional:
            raise ValueError("model.config.image_bidirectional is true but model.family_options.image_bidirectional "
                             "is false: the family option decides (leave the config's out)")

    @classmethod
    def derive_options(cls, options: dict, manifest: Mapping[str, Any], vocab: Any | None) -> None:
        """latent_channels and patch_size from the token shards' manifest (`latent: {channels, grid, patch_size}`,
        written for a continuous image tokenizer), image_placeholder_id from it or the vocabulary's `<image>`;
        latent_grid from it too when patch_encoder is "unet" (the linear encoder does not need it)."""
        latent = manifest.get("latent") or {}
        known = {"latent_channels": latent.get("channels"), "patch_size": latent.get("patch_size"),
                 "image_placeholder_id": manifest.get("image_placeholder_id")}
        if vocab is not None and known["image_placeholder_id"] is None:
            known["image_placeholder_id"] = vocab.image_placeholder_id
        for name, value in known.items():
            if value is not None:
                options.setdefault(name, int(value))
        # the shards fix the patches' layout: an option that disagrees would meet rows of another width at step 1
        for name in ("latent_channels", "patch_size"):
            if known[name] is not None and options[name] != int(known[name]):
                raise ValueError(f"model.family_options {name}={options[name]} but the token shards hold latent "
                                 f"patches of {name} {known[name]} (their manifest's `latent`): drop the option, or "
                                 "re-tokenize the images with `shards tokenize --patch-size K` into a fresh directory")
        if options.get("patch_encoder") == "unet" and latent.get("grid") is not None:
            options.setdefault("latent_grid", [int(side) for side in latent["grid"]])

    def flops_per_token(self, seq_len: int) -> float:
        """The decoder's FLOPs plus the patch projections and the timestep MLP (6 x their weights), counted at
        every position: an upper bound, since text positions skip them. With the U-Net, 6 x its weights times
        their uses per patch position (`UNetPatches.matmul_parameters`, counted on a meta-device copy)."""
        o, d = self.options, self.config.dim
        if o.patch_encoder == "unet":
            with torch.device("meta"):
                unet = self.latent_patches()
            return self.config.flops_per_token(seq_len) + 6.0 * unet.matmul_parameters()
        added = 2 * o.latent_dim * d + TIMESTEP_FREQUENCIES * d + d * d
        return self.config.flops_per_token(seq_len) + 6.0 * added

    # ---- parts --------------------------------------------------------------------------------------------------
    def build(self) -> dict[str, nn.Module]:
        """`model` (the decoder, its config carrying the placeholder id) and `patches` (LatentPatches, or
        UNetPatches with patch_encoder "unet")."""
        return {"model": FusionModel(self.config), "patches": self.latent_patches()}

    def latent_patches(self) -> nn.Module:
        """The `patches` part: the linear projections or the U-Net (patch_encoder)."""
        o, config = self.options, self.config
        if o.patch_encoder == "unet":
            return UNetPatches(o.latent_channels, o.patch_size, o.latent_grid, config.dim, config.init_std,
                               time=TimestepEmbedding(config.dim), time_dim=config.dim, channels=o.unet_channels,
                               blocks=o.unet_blocks)
        return LatentPatches(o.latent_dim, config.dim, config.init_std)

    def parallelize(self, parts: Mapping[str, nn.Module], mesh: Any) -> None:
        """FSDP2 as `Family.parallelize` shards (each block, then each part's root), with the two other calls the
        training forward makes registered as FSDP forwards: the decoder's `hidden_and_loss` (the embedding, final
        norm and head are used only inside it) and `patches.embed` (patch_in and the timestep MLP; `patches`' own
        forward is patch_out). `patches` is then used twice an iteration: each use's gradients are reduce-scattered
        when its backward ends, and the shards add up. Sampling (`predict`) is not sharded."""
        from torch.distributed.fsdp import register_fsdp_forward_method

        super().parallelize(parts, mesh)
        register_fsdp_forward_method(parts["model"], "hidden_and_loss")
        register_fsdp_forward_method(parts["patches"], "embed")

    # ---- training -------------------------------------------------------------------------------------------
    def layout(self, batch: Mapping[str, torch.Tensor]) -> ImageLayout:
        """The batch's images (runs of the placeholder id inside a document)."""
        return image_layout(batch["input_ids"], batch["document_ids"], self.options.image_placeholder_id)

    def denominators(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weighted text targets (placeholders are no target) and the number of images."""
        counts = target_counts(batch["input_ids"], batch["document_ids"], self.config.image_offset,
                               self.config.image_codes, self.options.image_placeholder_id)
        images = float(self.layout(batch).count)
        return {"text": self.losses.weighted_count(*counts), "diffusion": torch.tensor(images)}

    def _check_batch(self, batch: Mapping[str, torch.Tensor]) -> None:
        for key in self.batch_keys:
            if key not in batch:
                raise ValueError(f"the transfusion family needs batches with {key} (FusionDataModule adds them when "
                                 "the family asks; the shards must hold image latents)")
        latents, ids = batch["image_latents"], batch["input_ids"]
        if latents.shape != (*ids.shape, self.options.latent_dim):
            raise ValueError(f"image_latents has shape {tuple(latents.shape)}, the transfusion family expects "
                             f"{(*ids.shape, self.options.latent_dim)} (input_ids' shape by latent_channels x "
                             f"patch_size^2 = {self.options.latent_channels} x {self.options.patch_size}^2)")

    def draws(self, batch: Mapping[str, torch.Tensor], context: ObjectiveContext) -> DiffusionDraws:
        """The batch's keyed steps, caption-dropout decisions and noise, and the noisy latents (no model)."""
        self._check_batch(batch)
        options = self.options
        layout = self.layout(batch)
        keys = batch["token_keys"].reshape(-1)
        image_keys = keys[layout.start]
        last = options.diffusion_steps - 1
        limit = torch.full_like(image_keys, last)
        if options.max_t_image_first is not None:
            limit = torch.where(layout.image_first, min(options.max_t_image_first, last), limit)
        uniform = context.uniform(image_keys, "transfusion_timestep")[:, 0]
        timesteps = torch.minimum((uniform.double() * (limit + 1)).floor().long(), limit)
        if context.training and options.caption_dropout > 0:
            dropped = context.uniform(image_keys, "transfusion_caption_dropout")[:, 0] < options.caption_dropout
        else:
            dropped = torch.zeros_like(image_keys, dtype=torch.bool)
        clean = batch["image_latents"][layout.is_patch].float()
        noise = context.normal(keys[layout.is_patch.reshape(-1)], "transfusion_noise", draws=options.latent_dim)
        noisy = self.schedule.q_sample(clean, timesteps[layout.patch_image()], noise)
        return DiffusionDraws(layout=layout, timesteps=timesteps, dropped=dropped, clean=clean, noise=noise,
                              noisy=noisy)

    def predict(self, parts: Mapping[str, nn.Module], input_ids: torch.Tensor, layout: ImageLayout,
                noisy: torch.Tensor, patch_steps: torch.Tensor, *, document_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, visible: torch.Tensor | None = None,
                kv_cache: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder over ids with noisy patches (P, C*k*k) at steps (P,) in the placeholder positions: (final
        hidden states (B, T, dim), predicted noise (P, C*k*k)). Training and `denoise` both run this."""
        model, patches = parts["model"], parts["patches"]
        embeds = model.embed(input_ids)
        # the latent patch replaces the <image> embedding at its position (late fusion's inputs_embeds path)
        embeds = embeds.masked_scatter(layout.is_patch[..., None], patches.embed(noisy, patch_steps).to(embeds.dtype))
        hidden = model.forward_hidden(input_ids, position_ids, document_ids, kv_cache, inputs_embeds=embeds,
                                      visible_from=visible)
        return hidden, patches(hidden[layout.is_patch]).float()

    def training_forward(self, parts: Mapping[str, nn.Module], batch: Mapping[str, torch.Tensor],
                         context: ObjectiveContext) -> tuple[DiffusionDraws, torch.Tensor, torch.Tensor]:
        """(the draws, final hidden states, predicted noise per patch) of one training micro-batch."""
        return self.training_outputs(parts, batch, context)[:3]

    def training_outputs(self, parts: Mapping[str, nn.Module], batch: Mapping[str, torch.Tensor],
                         context: ObjectiveContext) -> tuple[DiffusionDraws, torch.Tensor, torch.Tensor, dict]:
        """`training_forward` and the text loss (fusion_loss_from_hidden's dict): `predict`'s computation, with the
        decoder's embedding, final norm and head used inside one call, `FusionModel.hidden_and_loss` (FSDP2
        gathers them around it; `parallelize`)."""
        draws = self.draws(batch, context)
        layout, ids = draws.layout, batch["input_ids"]
        visible = None
        if context.training and self.options.caption_dropout > 0:
            visible = visible_from(layout, draws.dropped, ids.shape)
        model, patches = parts["model"], parts["patches"]
        embedded = patches.embed(draws.noisy, draws.timesteps[layout.patch_image()])
        hidden, out = model.hidden_and_loss(
            ids, batch["document_ids"], batch.get("position_ids"), replace=layout.is_patch, replacement=embedded,
            visible_from=visible, ignore_id=self.options.image_placeholder_id, text_weight=self.losses.text_weight,
            image_weight=self.losses.image_weight, chunk_size=self.losses.chunk_size,
        )
        return draws, hidden, patches(hidden[layout.is_patch]).float(), out

    def per_image_mse(self, predicted: torch.Tensor, draws: DiffusionDraws) -> torch.Tensor:
        """(N,) each image's mean squared noise error over its patch values."""
        layout = draws.layout
        squared = (predicted.float() - draws.noise).pow(2).sum(-1)
        sums = squared.new_zeros(layout.count).index_add(0, layout.patch_image(), squared)
        return sums / (layout.patches * self.options.latent_dim).clamp_min(1)

    def objective(self, parts: Mapping[str, nn.Module], batch: Mapping[str, torch.Tensor],
                  context: ObjectiveContext) -> Objective:
        """`text`: CE + z-loss over the text targets; `diffusion` (weight lambda): per-image noise MSE, one unit per
        image."""
        draws, _, predicted, out = self.training_outputs(parts, batch, context)
        documents = batch["document_ids"]
        text = next_token_objective(out, self.losses, (documents >= 0).sum())
        mse = self.per_image_mse(predicted, draws)
        images = torch.tensor(float(draws.layout.count), device=mse.device)
        metrics = {name: value for name, value in text.metrics.items() if name != "image_loss"}  # no image targets
        metrics["diffusion_mse"] = (mse.detach().sum() / images.clamp_min(1), images)
        return Objective(terms={"text": text.terms["loss"],
                                "diffusion": LossTerm(mse.sum(), images, weight=self.options.diffusion_weight)},
                         metrics=metrics, positions=text.positions)

    # ---- sampling ---------------------------------------------------------------------------------------------
    def denoise(self, parts: Mapping[str, nn.Module], input_ids: torch.Tensor, noisy_latents: torch.Tensor,
                timesteps: torch.Tensor | int, *, document_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, unconditional: torch.Tensor | bool = False,
                kv_cache: Any = None) -> torch.Tensor:
        """Predicted noise (B, T, C*k*k) at the placeholder positions of `input_ids` (zeros elsewhere).

        noisy_latents (B, T, C*k*k): x_t at the placeholder positions; timesteps: one step, one per row (B,), or one
        per position (B, T); unconditional: True or per row (B,): those rows' images see only their `<boi>` and
        themselves (the classifier-free-guidance branch caption dropout trains). With kv_cache the ids follow what
        the cache holds (a text prefix prefilled by the decoder), as a prefill; truncate the cache to reuse it.
        The same computation as the training forward at the same step (tested).
        """
        batch, length = input_ids.shape
        documents = torch.zeros_like(input_ids) if document_ids is None else document_ids
        layout = image_layout(input_ids, documents, self.options.image_placeholder_id)
        steps = torch.as_tensor(timesteps, dtype=torch.long, device=input_ids.device)
        if steps.dim() == 0:
            patch_steps = steps.expand(int(layout.is_patch.sum()))
        elif steps.dim() == 1:
            patch_steps = steps[layout.is_patch.nonzero()[:, 0]]
        else:
            patch_steps = steps[layout.is_patch]
        rows = torch.as_tensor(unconditional, dtype=torch.bool, device=input_ids.device).expand(batch)
        visible = None
        if bool(rows.any()):
            offset = 0 if kv_cache is None else kv_cache.length
            visible = visible_from(layout, rows[layout.start // length], input_ids.shape, offset)
        _, predicted = self.predict(parts, input_ids, layout, noisy_latents[layout.is_patch], patch_steps,
                                    document_ids=document_ids, position_ids=position_ids, visible=visible,
                                    kv_cache=kv_cache)
        out = noisy_latents.new_zeros(batch, length, self.options.latent_dim, dtype=torch.float32)
        out[layout.is_patch] = predicted
        return out

    def generate(self, parts: Mapping[str, nn.Module], vocab: Any, image_tokenizer: Any, prompts: list[list[Any]],
                 config: Any) -> tuple[list[list[Any]], list[list[int]]]:
        """Text token by token, images by guided DDIM over `denoise` (fusion_model.families.transfusion.sampling)."""
        from fusion_model.families.transfusion.sampling import generate

        return generate(self, parts, vocab, image_tokenizer, prompts, config)
