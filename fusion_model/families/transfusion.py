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
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from fusion_model.config import FusionConfig
from fusion_model.diffusion import CosineSchedule
from fusion_model.families.base import Family, LossSettings, LossTerm, Objective, ObjectiveContext
from fusion_model.families.chameleon import next_token_objective
from fusion_model.families.transfusion_unet import UNetPatches
from fusion_model.layers import attention_backends as attn_lib
from fusion_model.layers.loss import target_counts
from fusion_model.model import FusionModel
from tokenizer.layout import patchify, unpatchify

TIMESTEP_FREQUENCIES = 256  # width of the sinusoidal step features (DiT's)


@dataclass(frozen=True)
class TransfusionOptions:
    """`--model.family_options` of the transfusion family.

    latent_channels, patch_size: C and k of the latent patches (a patch vector holds C*k*k values);
    image_placeholder_id: the vocabulary's `<image>` id (fit takes these three from the shards / vocabulary);
    diffusion_weight: lambda, the diffusion term's weight against the text term;
    diffusion_steps: N of the cosine schedule; caption_dropout: the probability that an image is trained
    unconditionally; image_bidirectional: full attention inside each image (false: causal, the ablation);
    max_t_image_first: the largest step drawn for an image that opens its document and is followed by text
    (paper, Table 8: captioning sees less noisy images), None for no limit;
    patch_encoder: "linear" (a linear layer in and out, `LatentPatches`) or "unet" (U-Net down and up blocks with
    skip connections, `fusion_model.families.transfusion_unet`; paper, Table 7); latent_grid: [h, w] of every
    image's latents (the U-Net's grid; fit takes it from the shards when patch_encoder is "unet");
    unet_channels, unet_blocks: the U-Net's width at the latent resolution (doubling per downsampling) and ResNet
    blocks per resolution and path; x0_clip: sampling clamps each DDIM step's clean estimate to [-x0_clip, x0_clip]
    (the continuous tokenizer scales latents to unit std; null: no clamp), see `CosineSchedule.ddim_step`.
    """

    latent_channels: int | None = None
    patch_size: int = 2
    image_placeholder_id: int | None = None
    diffusion_weight: float = 5.0
    diffusion_steps: int = 1000
    caption_dropout: float = 0.1
    image_bidirectional: bool = True
    max_t_image_first: int | None = 500
    patch_encoder: str = "linear"
    latent_grid: tuple[int, int] | None = None
    unet_channels: int = 64
    unet_blocks: int = 2
    x0_clip: float | None = 4.0

    def __post_init__(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"model.family_options.{name}={getattr(self, name)!r} is invalid for the transfusion "
                             f"family: {rule}")

        def is_int(value: Any) -> bool:
            return isinstance(value, numbers.Integral) and not isinstance(value, bool)

        def is_real(value: Any) -> bool:
            return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

        if self.latent_channels is not None and (not is_int(self.latent_channels) or self.latent_channels <= 0):
            fail("latent_channels", "it must be a positive integer")
        for name in ("patch_size", "diffusion_steps"):
            if not is_int(getattr(self, name)) or getattr(self, name) <= 0:
                fail(name, "it must be a positive integer")
        for name in ("image_placeholder_id", "max_t_image_first"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                fail(name, "it must be an integer >= 0 or null")
        if not is_real(self.diffusion_weight) or self.diffusion_weight < 0:
            fail("diffusion_weight", "it must be a finite number >= 0")
        if not is_real(self.caption_dropout) or not 0 <= self.caption_dropout < 1:
            fail("caption_dropout", "it must be a number with 0 <= caption_dropout < 1")
        if not isinstance(self.image_bidirectional, bool):
            fail("image_bidirectional", "it must be true or false")
        if self.x0_clip is not None and (not is_real(self.x0_clip) or self.x0_clip <= 0):
            fail("x0_clip", "it must be a finite number > 0 or null")
        if self.patch_encoder not in ("linear", "unet"):
            fail("patch_encoder", 'it must be "linear" or "unet"')
        for name in ("unet_channels", "unet_blocks"):
            if not is_int(getattr(self, name)) or getattr(self, name) <= 0:
                fail(name, "it must be a positive integer")
        if self.latent_grid is not None:
            grid = self.latent_grid
            if isinstance(grid, str) or not hasattr(grid, "__len__") or len(grid) != 2 or not all(
                    is_int(side) and side > 0 for side in grid):
                fail("latent_grid", "it must be [height, width], two positive integers")
            object.__setattr__(self, "latent_grid", (int(grid[0]), int(grid[1])))
            if is_int(self.patch_size) and (grid[0] % self.patch_size or grid[1] % self.patch_size):
                fail("latent_grid", f"patch_size {self.patch_size} must divide its height and width")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TransfusionOptions:
        """From `--model.family_options`; an unknown key is an error naming the known ones."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"the transfusion family has no model.family_options {unknown}; its options: {known}")
        return cls(**values)

    @property
    def latent_dim(self) -> int:
        """Values per patch vector: C * k * k."""
        return self.latent_channels * self.patch_size ** 2


class TimestepEmbedding(nn.Module):
    """The diffusion step as a vector: sinusoidal features (DiT's) through a two-layer MLP."""

    def __init__(self, dim: int, frequencies: int = TIMESTEP_FREQUENCIES) -> None:
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, dim), nn.SiLU(), nn.Linear(dim, dim))

    def features(self, t: torch.Tensor) -> torch.Tensor:
        """(N,) steps -> (N, frequencies): cos and sin of t at geometrically spaced frequencies 1 ... 1/10,000."""
        half = self.frequencies // 2
        scale = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        angles = t.float()[:, None] * scale
        return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """(N,) steps -> (N, dim)."""
        first = self.mlp[0]
        return self.mlp(self.features(t).to(first.weight.dtype))


class LatentPatches(nn.Module):
    """What Transfusion adds around the decoder: a patch's noisy latent into the decoder's width (plus its step's
    embedding) at the input, and the decoder's hidden state back to a predicted noise at the output."""

    def __init__(self, latent_dim: int, dim: int, init_std: float) -> None:
        super().__init__()
        self.init_std = init_std
        self.patch_in = nn.Linear(latent_dim, dim)
        self.time = TimestepEmbedding(dim)
        self.patch_out = nn.Linear(dim, latent_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) matrices (the decoder's init), zero biases."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.init_std)
                nn.init.zeros_(module.bias)

    def embed(self, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """(P, C*k*k) noisy patches at steps (P,) -> (P, dim) decoder inputs."""
        return self.patch_in(noisy.to(self.patch_in.weight.dtype)) + self.time(t)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(P, dim) final hidden states at patch positions -> (P, C*k*k) predicted noise."""
        return self.patch_out(hidden)

    def matmul_parameters(self) -> int:
        """Weights a patch runs through in matrix products (FLOPs counting)."""
        return sum(p.numel() for p in self.parameters() if p.dim() >= 2)


@dataclass
class ImageLayout:
    """Where a batch's continuous images are. Flat indices are row * T + column; images are numbered in that
    order."""

    is_patch: torch.Tensor  # (B, T) bool: placeholder positions inside a document
    image_of: torch.Tensor  # (B, T) long: each patch position's image, -1 elsewhere
    start: torch.Tensor  # (N,) flat index of each image's first patch
    opener: torch.Tensor  # (N,) flat index of the position before it in its document (<boi>), or its start
    patches: torch.Tensor  # (N,) patches per image
    image_first: torch.Tensor  # (N,) whether it opens its document (only <s> before its <boi>) and text follows

    @property
    def count(self) -> int:
        """Number of images."""
        return int(self.start.numel())

    def patch_image(self) -> torch.Tensor:
        """(P,) the image of each patch position, in row-major order."""
        return self.image_of[self.is_patch]


def image_layout(input_ids: torch.Tensor, document_ids: torch.Tensor, placeholder_id: int) -> ImageLayout:
    """The images of a packed batch: runs of `placeholder_id` inside one document each."""
    batch, length = input_ids.shape
    is_patch = (input_ids == placeholder_id) & (document_ids >= 0)
    same_document = torch.zeros_like(is_patch)
    same_document[:, 1:] = document_ids[:, 1:] == document_ids[:, :-1]
    continues = torch.zeros_like(is_patch)
    continues[:, 1:] = is_patch[:, :-1] & same_document[:, 1:]
    starts = (is_patch & ~continues).reshape(-1)
    start = starts.nonzero().squeeze(1)
    number = starts.long().cumsum(0) - 1
    image_of = torch.where(is_patch.reshape(-1), number, -1).view(batch, length)
    patches = torch.bincount(image_of[is_patch], minlength=start.numel())
    opener = torch.where(same_document.reshape(-1)[start], start - 1, start)
    before = attn_lib.positions_from_documents(document_ids).reshape(-1)  # tokens before each in its document
    after = attn_lib.positions_from_documents(document_ids.flip(1)).flip(1).reshape(-1)  # and after it
    end = start + patches - 1
    # <s> <boi> patches <eoi> and at least two more tokens (a caption and </s>, not just </s>)
    image_first = (opener != start) & (before[opener] <= 1) & (after[end] >= 3)
    return ImageLayout(is_patch=is_patch, image_of=image_of, start=start, opener=opener, patches=patches,
                       image_first=image_first)


@dataclass
class DiffusionDraws:
    """One batch's keyed diffusion inputs: per image its step and caption-dropout decision, per patch (row-major
    order) its clean latent, its noise and the noisy latent the decoder reads."""

    layout: ImageLayout
    timesteps: torch.Tensor  # (N,) long
    dropped: torch.Tensor  # (N,) bool: trained without its caption
    clean: torch.Tensor  # (P, C*k*k)
    noise: torch.Tensor  # (P, C*k*k)
    noisy: torch.Tensor  # (P, C*k*k)


def visible_from(layout: ImageLayout, unconditional: torch.Tensor, shape: torch.Size, offset: int = 0) -> torch.Tensor:
    """(B, T) key index each query may attend from (`FusionModel.forward_hidden(visible_from=)`): an unconditional
    image's `<boi>` and patches from its `<boi>` on (offset + column: cache indices under a KV cache), every
    other position from 0 (its document limits it)."""
    batch, length = shape
    result = torch.zeros(batch * length, dtype=torch.long, device=layout.is_patch.device)
    column = layout.opener % length + offset
    patch_positions = layout.is_patch.reshape(-1).nonzero().squeeze(1)
    image = layout.patch_image()
    result[patch_positions] = torch.where(unconditional[image], column[image], 0)
    result[layout.opener] = torch.where(unconditional, column, result[layout.opener])
    return result.view(batch, length)


class TransfusionFamily(Family):
    """Transfusion: the decoder (`model`) and its latent-patch projections and timestep MLP (`patches`); terms
    `text` and `diffusion`. See the module docstring for the batch contract, the draws and caption dropout."""

    name = "transfusion"
    Options = TransfusionOptions
    batch_keys = ("token_keys", "image_latents")
    scores_image_positions = False

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
        """Text token by token, images by guided DDIM over `denoise` (fusion_model.families.transfusion_sampling)."""
        from fusion_model.families.transfusion_sampling import generate

        return generate(self, parts, vocab, image_tokenizer, prompts, config)


__all__ = ["ImageLayout", "LatentPatches", "TimestepEmbedding", "TransfusionFamily", "TransfusionOptions",
           "image_layout", "patchify", "unpatchify", "visible_from"]
