"""Sampling a Transfusion checkpoint through the shared decode loop (`fusion_model.sampling.generate_ids`): text token
by token under the sampler's rules until `<boi>`, then the image this module makes whole, by DDIM over the family's
`denoise` with classifier-free guidance, its clean keys and values written once with `<eoi>`, and text again; images
decoded by the continuous image tokenizer.

What the loop does for every family applies to text here (ModalityRules, the repetition penalty, text temperature /
top-k / top-p, max_new_tokens, the seed): `<boi>` is allowed only while `<boi>`, the image's P placeholders and
`<eoi>` still fit, mode "image" forces one image after the prompt and stops at its `<eoi>`, mode "text" never opens
one. This module is the loop's `WholeImages` (`DenoisedImages`) and its feeders (`CachedRows`, `FullRows`). An image
is P = (h/k)(w/k) placeholder positions fed x_t and t at each of `denoising_steps` DDIM steps (eta 0, from pure noise
at the schedule's last step); with `cfg_scale` != 1 each step runs the conditional rows and the unconditional ones
(the image seeing only its `<boi>`: the branch caption dropout trains) in one forward and mixes them as u + s (c - u).
With the KV cache the text before the image is computed once: each step feeds `<boi>` and the placeholders after a
copy of the prefix's keys and values and truncates back; after the last step one forward writes `<boi>`, the clean
x_0 at t = 0 and `<eoi>` into the cache (Transfusion's inference), and its `<eoi>` position gives the next text token.
Without the cache (`use_kv_cache=False`, the reference) every forward recomputes the whole sequence. DDIM is
deterministic given its starting noise, so the image temperature / top-k / top-p settings have no meaning here and
are not read.

This module reads the family only through its methods (`layout`, `predict`, `denoise`, `options`, `schedule`), so the
family module can import it without an import cycle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn

from fusion_model.families.transfusion.diffusion import guided_noise
from fusion_model.sampling.config import SamplingConfig
from fusion_model.sampling.decode import generate_ids
from fusion_model.sampling.spans import Chunk
from tokenizer.chat import encode_segments, is_ids
from tokenizer.layout import patchify, unpatchify
from tokenizer.vocab import LatentImage

DEFAULT_DENOISING_STEPS = 50
# predict(x_t (n, P, D), t) -> (conditional noise, unconditional noise or None): one DDIM step's denoiser
Predictor = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class DiffusionSamplingConfig(SamplingConfig):
    """SamplingConfig with `denoising_steps`: the DDIM steps per image (at most the schedule's training steps, which
    the family checks); `cfg_scale` is the images' guidance. The transfusion family's `sampling_config`, so
    `train.py generate` offers `--denoising-steps` for its checkpoints."""

    denoising_steps: int = field(default=DEFAULT_DENOISING_STEPS, metadata={
        "help": "DDIM steps per image of a checkpoint whose images come from a diffusion model (at most its "
                "training steps; guidance: --cfg-scale)"})
    # which checkpoints these settings are for, in a sentence refusing them elsewhere (`train.py generate`)
    applies_to: ClassVar[str] = "a checkpoint whose images come from a diffusion model (the transfusion family)"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.denoising_steps < 1:
            raise ValueError(f"SamplingConfig.denoising_steps={self.denoising_steps} must be >= 1 "
                             "(--denoising-steps)")


def denoising_steps(config: SamplingConfig) -> int:
    """The DDIM steps per image `config` asks for (the default for a plain SamplingConfig)."""
    return int(getattr(config, "denoising_steps", DEFAULT_DENOISING_STEPS))


@dataclass
class TransfusionSamples:
    """What `sample` returns: per prompt its new ids and the latents (C, h, w) of each image it made, in order;
    `stats` counts decoder forwards (`forwards`, all of them: with the cache a guided DDIM step is one forward over
    both branches, without it two), `denoising_steps` (DDIM steps, all images together) and `image_writes` (forwards
    that write clean images: into the cache, or into the recomputed sequence)."""

    ids: list[list[int]]
    latents: list[list[torch.Tensor]]
    stats: dict[str, int] = field(default_factory=dict)


class _Decoder:
    """The family's decoder over chunks of ids with clean latents at their placeholders (t = 0): the loop's feeder
    (`fusion_model.sampling.spans.ChunkFeeder`)."""

    def __init__(self, family: Any, parts: Mapping[str, nn.Module], pad_id: int, boi_id: int) -> None:
        self.family, self.parts, self.pad_id, self.boi_id = family, parts, pad_id, boi_id
        self.model = parts["model"]
        self.device = next(self.model.parameters()).device
        self.latent_dim = family.options.latent_dim
        self.forwards = 0  # decoder forwards run, denoising ones included
        self.image_writes = 0  # forwards that fed clean images (into the cache, or into the recomputed sequence)

    def step(self, token: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Feed token[b] to each live row b (the loop's plain step); (B, V) logits after each row's last token."""
        return self.feed([([t], None) if alive else None for t, alive in zip(token.tolist(), live.tolist())])

    def count_image_writes(self, chunks: list[Chunk | None]) -> None:
        """Count a forward whose chunks write an image."""
        placeholder = self.family.options.image_placeholder_id
        self.image_writes += int(any(chunk is not None and placeholder in chunk[0] for chunk in chunks))

    def batch(self, rows: list[Chunk | None], starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows right-padded to one length: (ids, documents (-1 = padding), positions from `starts`, latents,
        lengths)."""
        lengths = torch.tensor([0 if row is None else len(row[0]) for row in rows])
        width = max(int(lengths.max()), 1)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        latents = torch.zeros(len(rows), width, self.latent_dim)
        for b, row in enumerate(rows):
            if row is not None:
                ids[b, : len(row[0])] = torch.tensor(row[0])
                if row[1] is not None:  # None: ids alone, no image positions
                    latents[b, : len(row[0])] = row[1]
        real = torch.arange(width)[None, :] < lengths[:, None]
        documents = torch.where(real, 0, -1)
        positions = torch.where(real, starts.cpu()[:, None] + torch.arange(width), 0)
        move = [t.to(self.device) for t in (ids, documents, positions, latents)]
        return (*move, lengths.to(self.device))

    def hidden(self, ids: torch.Tensor, documents: torch.Tensor, positions: torch.Tensor, latents: torch.Tensor,
               kv_cache: Any = None) -> torch.Tensor:
        """Final hidden states (B, T, dim), each placeholder fed its clean patch at step 0."""
        layout = self.family.layout({"input_ids": ids, "document_ids": documents})
        patches = latents[layout.is_patch]
        steps = torch.zeros(patches.shape[0], dtype=torch.long, device=ids.device)
        hidden, _ = self.family.predict(self.parts, ids, layout, patches, steps, document_ids=documents,
                                        position_ids=positions, kv_cache=kv_cache)
        self.forwards += 1
        return hidden

    def denoise(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The family's `denoise` (predicted noise at the placeholders), counted as a forward."""
        self.forwards += 1
        return self.family.denoise(self.parts, *args, **kwargs)

    def last_logits(self, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """(B, V) fp32 logits at each row's last real position (position 0 for a row fed nothing)."""
        last = (lengths - 1).clamp_min(0)
        return self.model.head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last]).float()

    def image_chunk(self, patches: int) -> list[int]:
        """`<boi>` and the image's placeholders: what each denoising step feeds."""
        options = self.family.options
        return [self.boi_id, *[options.image_placeholder_id] * patches]


class CachedRows(_Decoder):
    """The rows over one KV cache: a prefix is computed once; rows that feed nothing in a forward get padding slots
    (document -1, never attended to), and positions are counted per row."""

    def __init__(self, family: Any, parts: Mapping[str, nn.Module], pad_id: int, boi_id: int,
                 prompts: list[Chunk], room: int) -> None:
        super().__init__(family, parts, pad_id, boi_id)
        self.prompts = prompts
        self.next_pos = torch.zeros(len(prompts), dtype=torch.long)
        width = max(len(ids) for ids, _ in prompts)
        self.cache = self.model.new_kv_cache(len(prompts), width + room)

    def _make_room(self, tokens: int) -> None:
        """Grow the cache when `tokens` more do not fit: padding slots can take it past the context."""
        cache = self.cache
        needed = cache.length + tokens
        if needed <= cache.max_len:
            return
        size = max(needed, 2 * cache.max_len)

        def grown(tensor: torch.Tensor, dim: int, fill: int) -> torch.Tensor:
            shape = list(tensor.shape)
            shape[dim] = size
            out = tensor.new_full(shape, fill)
            out.narrow(dim, 0, cache.length).copy_(tensor.narrow(dim, 0, cache.length))
            return out

        cache.keys = [grown(k, 2, 0) for k in cache.keys]
        cache.values = [grown(v, 2, 0) for v in cache.values]
        cache.document_ids = grown(cache.document_ids, 1, -1)
        cache.positions = grown(cache.positions, 1, 0)
        cache.max_len = size

    def prefill(self) -> torch.Tensor:
        """The prompts into the cache; (B, V) logits of what follows each."""
        return self.feed(list(self.prompts))

    def feed(self, chunks: list[Chunk | None]) -> torch.Tensor:
        """Append each row's chunk (None: padding) in one forward; (B, V) logits after each row's last token."""
        self.count_image_writes(chunks)
        ids, documents, positions, latents, lengths = self.batch(chunks, self.next_pos)
        self._make_room(ids.shape[1])
        hidden = self.hidden(ids, documents, positions, latents, kv_cache=self.cache)
        self.next_pos += lengths.cpu()
        return self.last_logits(hidden, lengths)

    def denoiser(self, rows: list[int], guided: bool, patches: int) -> Predictor:
        """predict(x_t (n, P, D), t) -> (conditional, unconditional or None) noise of the images the rows open.

        The rows' cached keys and values are copied once into a cache of their own (the unconditional copies get
        none: their `<boi>` sees nothing before it), which each step appends to and truncates back.
        """
        cache, n = self.cache, len(rows)
        streams = 2 if guided else 1
        prefix = cache.length
        own = self.model.new_kv_cache(streams * n, prefix + patches + 1)
        index = torch.tensor(rows, device=cache.document_ids.device)
        for layer in range(len(cache.keys)):
            own.keys[layer][:n, :, :prefix] = cache.keys[layer][index, :, :prefix]
            own.values[layer][:n, :, :prefix] = cache.values[layer][index, :, :prefix]
        own.document_ids[:n, :prefix] = cache.document_ids[index, :prefix]
        own.positions[:n, :prefix] = cache.positions[index, :prefix]
        own.length = prefix
        starts = self.next_pos[rows].repeat(streams)
        chunk = (self.image_chunk(patches), torch.zeros(patches + 1, self.latent_dim))
        ids, documents, positions, _, _ = self.batch([chunk] * (streams * n), starts)
        unconditional = torch.arange(streams * n, device=ids.device) >= n

        def predict(x: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            noisy = torch.zeros(streams * n, patches + 1, self.latent_dim, device=x.device)
            noisy[:, 1:] = x.repeat(streams, 1, 1)
            noise = self.denoise(ids, noisy, t, document_ids=documents, position_ids=positions,
                                 unconditional=unconditional, kv_cache=own)[:, 1:]
            own.truncate(prefix)
            return noise[:n], (noise[n:] if guided else None)

        return predict


class FullRows(_Decoder):
    """The reference: every forward recomputes each row's whole sequence (the prompt, what was sampled, its images
    at t = 0)."""

    def __init__(self, family: Any, parts: Mapping[str, nn.Module], pad_id: int, boi_id: int,
                 prompts: list[Chunk], room: int) -> None:
        super().__init__(family, parts, pad_id, boi_id)
        self.rows = [(list(ids), latents.clone()) for ids, latents in prompts]
        self.zeros = torch.zeros(len(prompts), dtype=torch.long)

    def _logits(self) -> torch.Tensor:
        ids, documents, positions, latents, lengths = self.batch(self.rows, self.zeros)
        return self.last_logits(self.hidden(ids, documents, positions, latents), lengths)

    def prefill(self) -> torch.Tensor:
        """(B, V) logits of what follows each prompt."""
        return self._logits()

    def feed(self, chunks: list[Chunk | None]) -> torch.Tensor:
        """Append the chunks and recompute every row; (B, V) logits after each row's last token."""
        self.count_image_writes(chunks)
        for b, chunk in enumerate(chunks):
            if chunk is not None:
                ids, latents = self.rows[b]
                extra = chunk[1] if chunk[1] is not None else torch.zeros(len(chunk[0]), self.latent_dim)
                self.rows[b] = (ids + chunk[0], torch.cat([latents, extra]))
        return self._logits()

    def denoiser(self, rows: list[int], guided: bool, patches: int) -> Predictor:
        """predict(x_t, t) -> (conditional, unconditional or None) noise: the conditional rows are the whole
        sequence with the image at its end, the unconditional ones `<boi>` and the image alone at the same
        positions."""
        tail = self.image_chunk(patches)
        sequences = [(self.rows[b][0] + tail, torch.cat([self.rows[b][1], torch.zeros(patches + 1,
                                                                                       self.latent_dim)]))
                     for b in rows]
        ids, documents, positions, clean, lengths = self.batch(sequences, torch.zeros(len(rows), dtype=torch.long))
        image = torch.arange(ids.shape[1], device=ids.device)[None, :] >= (lengths - patches)[:, None]
        image &= documents >= 0
        starts = torch.tensor([len(self.rows[b][0]) for b in rows])
        alone = self.batch([(tail, torch.zeros(patches + 1, self.latent_dim))] * len(rows), starts)

        def predict(x: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            noisy = clean.clone()
            noisy[image] = x.reshape(-1, self.latent_dim)
            steps = torch.where(image, t, 0)
            noise = self.denoise(ids, noisy, steps, document_ids=documents, position_ids=positions)
            conditional = noise[image].view(len(rows), patches, self.latent_dim)
            if not guided:
                return conditional, None
            a_ids, a_documents, a_positions, _, _ = alone
            a_noisy = torch.zeros(len(rows), patches + 1, self.latent_dim, device=x.device)
            a_noisy[:, 1:] = x
            unconditional = self.denoise(a_ids, a_noisy, t, document_ids=a_documents, position_ids=a_positions,
                                         unconditional=True)[:, 1:]
            return conditional, unconditional

        return predict


def check_settings(family: Any, config: SamplingConfig) -> int:
    """Refuse settings this sampler cannot honour (one sentence each); returns the DDIM steps per image."""
    if config.compile:
        raise ValueError("--compile is not available for a transfusion checkpoint: its images are a few dozen "
                         "forwards over whole images, not a one-token decode step a compiled graph would replay; "
                         "leave out --compile")
    if config.speculative_window:
        raise ValueError("--speculative-window drafts image codes; a transfusion checkpoint's images are denoised, "
                         "not drafted: leave it out")
    if config.three_stream:
        raise ValueError("three-stream guidance (--cfg-image-scale / --cfg-text-scale, --chameleon-defaults) needs "
                         "an image-conditional branch a transfusion checkpoint is not trained with: use --cfg-scale "
                         "(the caption-dropped branch)")
    steps = denoising_steps(config)
    limit = family.options.diffusion_steps
    if not 1 <= steps <= limit:
        raise ValueError(f"--denoising-steps {steps} must be between 1 and the checkpoint's diffusion_steps {limit}")
    return steps


class DenoisedImages:
    """The shared loop's whole images (`fusion_model.sampling.spans.WholeImages`) for a transfusion checkpoint: its
    feeder over the prompts' ids and latents, and DDIM from pure noise for each image a prompt opens."""

    def __init__(self, family: Any, parts: Mapping[str, nn.Module], vocab: Any, prompts: list[Chunk],
                 config: SamplingConfig, steps: int, patch_grid: tuple[int, int] | None) -> None:
        self.family, self.parts, self.vocab, self.prompts, self.config = family, parts, vocab, prompts, config
        self.patches = 0 if patch_grid is None else patch_grid[0] * patch_grid[1]
        self.latent_grid = None if patch_grid is None else (patch_grid[0] * family.options.patch_size,
                                                            patch_grid[1] * family.options.patch_size)
        self.timesteps = family.schedule.ddim_timesteps(steps).tolist() + [-1]
        self.images: list[list[torch.Tensor]] = [[] for _ in prompts]
        self.denoising_steps = 0
        self.rows: CachedRows | FullRows | None = None

    def feeder(self, rows: list[list[int]], steps: int, device: torch.device) -> CachedRows | FullRows:
        """The prompts' feeder: one KV cache (config.use_kv_cache), or the full recompute."""
        if rows != [list(ids) for ids, _ in self.prompts]:
            raise ValueError("DenoisedImages: the loop's rows are not the prompts it was built for")
        rows_class = CachedRows if self.config.use_kv_cache else FullRows
        self.rows = rows_class(self.family, self.parts, self.vocab.pad_id, self.vocab.boi_id, self.prompts,
                               max(steps, 1) + 1)
        return self.rows

    def make(self, feeder: CachedRows | FullRows, opened: list[int],
             generator: torch.Generator | None) -> list[Chunk]:
        """Each opened prompt's image by guided DDIM, as the chunk that writes it: `<boi>`, the clean patches at the
        placeholders, `<eoi>`."""
        clean = self.denoise(feeder, opened, generator).float().cpu()
        chunks = []
        for i, b in enumerate(opened):
            self.images[b].append(unpatchify(clean[i : i + 1], self.family.options.patch_size, *self.latent_grid)[0])
            latents = torch.zeros(self.patches + 2, feeder.latent_dim)
            latents[1:-1] = clean[i]
            chunks.append((feeder.image_chunk(self.patches) + [self.vocab.eoi_id], latents))
        return chunks

    def denoise(self, rows: CachedRows | FullRows, opened: list[int], generator: torch.Generator | None) -> torch.Tensor:
        """DDIM from pure noise for the images the `opened` rows start: their clean latent patches (n, P, D)."""
        schedule, scale = self.family.schedule, float(self.config.cfg_scale)
        guided = scale != 1.0  # scale 1 is the conditional branch alone: its forward is not run
        predict = rows.denoiser(opened, guided, self.patches)
        x = torch.randn(len(opened), self.patches, rows.latent_dim, generator=generator, device=rows.device)
        for t, t_prev in zip(self.timesteps[:-1], self.timesteps[1:]):
            conditional, unconditional = predict(x, t)
            noise = conditional if unconditional is None else guided_noise(conditional, unconditional, scale)
            now, before = torch.tensor(t, device=rows.device), torch.tensor(t_prev, device=rows.device)
            x = schedule.ddim_step(x, noise.to(x.dtype), now, before, self.family.options.x0_clip)
            self.denoising_steps += 1
        return x


@torch.inference_mode()
def sample(family: Any, parts: Mapping[str, nn.Module], vocab: Any, prompts: list[Chunk], config: SamplingConfig,
           latent_grid: tuple[int, int] | None) -> TransfusionSamples:
    """Continue each prompt (ids starting `<s>`, with the clean latent patch (D,) at each placeholder position):
    text and images as the module docstring says, through the shared decode loop. latent_grid (h, w): the latent
    size of a generated image (None: text only)."""
    steps = check_settings(family, config)
    options, model = family.options, parts["model"]
    k = options.patch_size
    patch_grid = None
    if latent_grid is not None:
        if latent_grid[0] % k or latent_grid[1] % k:
            raise ValueError(f"the image tokenizer's latent grid {latent_grid} is not a multiple of the checkpoint's "
                             f"patch_size {k}")
        if getattr(options, "latent_grid", None) not in (None, tuple(latent_grid)):
            raise ValueError(f"the image tokenizer's latent grid {tuple(latent_grid)} is not the {options.latent_grid} "
                             "the checkpoint's U-Net patch encoder was built for: use the tokenizer it was trained with")
        patch_grid = (latent_grid[0] // k, latent_grid[1] // k)
    images = DenoisedImages(family, parts, vocab, prompts, config, steps, patch_grid)
    training = {name: part.training for name, part in parts.items()}
    family.set_mode(parts, False)
    try:
        # the rules count an image's patches as its codes: the patch grid is the image grid
        ids = generate_ids(model, vocab, [list(ids) for ids, _ in prompts], replace(config, image_grid=patch_grid),
                           whole_images=images)
    finally:
        for name, part in parts.items():
            part.train(training[name])
    rows = images.rows  # None when there was no prompt
    stats = {"forwards": rows.forwards if rows else 0, "denoising_steps": images.denoising_steps,
             "image_writes": rows.image_writes if rows else 0}
    return TransfusionSamples(ids=ids, latents=images.images, stats=stats)


def encode_prompt(segments: list[Any], vocab: Any, image_tokenizer: Any, patch_size: int,
                  latent_dim: int) -> Chunk:
    """`<s>` + the segments (text as BPE, images as `<boi>`, placeholders, `<eoi>`), without `</s>`; and the clean
    latent patch at each position (zeros off images)."""
    from fusion_model.sampling.generate import load_prompt_image

    parts: list[Any] = []
    patches: list[torch.Tensor] = []
    for item in segments:
        if isinstance(item, str) or is_ids(item):  # text, or a chat's verbatim ids
            parts.append(item)
            continue
        if not (isinstance(item, (os.PathLike, bytes)) or hasattr(item, "convert")):
            raise TypeError(f"prompt segment of type {type(item).__name__}: use str (text), a PIL image, or a "
                            "pathlib.Path")
        if image_tokenizer is None:
            raise ValueError("the prompt contains an image but no image tokenizer was given (--image-tokenizer)")
        image = patchify(image_tokenizer.encode([load_prompt_image(item)]).float().cpu(), patch_size)[0]
        parts.append(LatentImage(image.shape[0]))
        patches.append(image)
    ids = encode_segments(vocab, parts)
    latents = torch.zeros(len(ids), latent_dim)
    if patches:
        latents[torch.tensor(ids) == vocab.image_placeholder_id] = torch.cat(patches)
    return ids, latents


def split_outputs(ids: list[int], images: list[torch.Tensor], vocab: Any) -> list[str | torch.Tensor]:
    """New ids -> text strings and the images' latents in order (`</s>`, padding and unfinished images dropped)."""
    segments: list[str | torch.Tensor] = []
    made = iter(images)
    for span in vocab.spans(ids):
        if span.is_image:
            if span.closed:
                segments.append(next(made))
            continue
        text = [token for token in ids[span.body] if token not in (vocab.eos_id, vocab.pad_id, vocab.bos_id)]
        if text:
            segments.append(vocab.decode_text(text))
    return segments


def check_image_tokenizer(family: Any, image_tokenizer: Any) -> tuple[int, int]:
    """The latent grid (h, w) of a continuous image tokenizer that matches the checkpoint; a sentence otherwise."""
    kind = getattr(image_tokenizer, "kind", None)
    if kind != "continuous":
        raise ValueError(f"a transfusion checkpoint reads and writes continuous latents, but --image-tokenizer is a "
                         f"{kind or type(image_tokenizer).__name__} image tokenizer: pass the continuous (KL) bundle "
                         "its token shards were made with")
    channels = int(image_tokenizer.latent_channels)
    if channels != family.options.latent_channels:
        raise ValueError(f"the image tokenizer makes {channels}-channel latents but the checkpoint was trained on "
                         f"{family.options.latent_channels}: pass the bundle its token shards were made with")
    return tuple(int(v) for v in image_tokenizer.grid_shape)


def generate(family: Any, parts: Mapping[str, nn.Module], vocab: Any, image_tokenizer: Any, prompts: list[list[Any]],
             config: SamplingConfig) -> tuple[list[list[Any]], list[list[int]]]:
    """Text and PIL images after each prompt (str / PIL image / path segments), and the new ids of each."""
    from tokenizer.image import to_pil

    check_settings(family, config)
    grid = None
    if image_tokenizer is not None:
        grid = check_image_tokenizer(family, image_tokenizer)
    elif config.mode != "text":
        raise ValueError(f"mode {config.mode!r} can produce images: give the continuous image tokenizer "
                         "(--image-tokenizer) to decode them, or use mode 'text'")
    options = family.options
    encoded = [encode_prompt(p, vocab, image_tokenizer, options.patch_size, options.latent_dim) for p in prompts]
    result = sample(family, parts, vocab, encoded, config, grid)
    split = [split_outputs(ids, images, vocab) for ids, images in zip(result.ids, result.latents)]
    latents = [segment for segments in split for segment in segments if not isinstance(segment, str)]
    pixels = image_tokenizer.decode(torch.stack(latents)) if latents else None
    samples, k = [], 0
    for segments in split:
        out: list[Any] = []
        for segment in segments:
            if isinstance(segment, str):
                out.append(segment)
            else:
                out.append(to_pil(pixels[k]))
                k += 1
        samples.append(out)
    return samples, result.ids
