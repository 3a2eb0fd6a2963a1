"""Sampling mixed text-and-image sequences: a KV-cached decode loop with Chameleon's modality rules,
per-modality temperature / top-k / top-p, a text repetition penalty, and classifier-free guidance."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # only for type hints; the sampler works with any object that has the attributes used
    from PIL import Image

MODES = ("text", "image", "interleaved")


@dataclass
class SamplingConfig:
    """How to sample. Temperature 0 means greedy; top_k 0 and top_p 1.0 mean no truncation.

    Guidance (image tokens only): two-stream `u + cfg_scale·(c − u)` when cfg_scale != 1 (or when
    unconditional prompts are passed explicitly); three-stream
    `u + cfg_image_scale·(img − u) + cfg_text_scale·(full − img)` when both of those are set.
    """

    mode: str = "interleaved"  # "text" | "image" (text-to-image: one image, <boi> forced) | "interleaved"
    max_new_tokens: int | None = None  # None: text until eos or the context is full; image: h·w + 2
    text_temperature: float = 1.0
    text_top_k: int = 0
    text_top_p: float = 1.0
    image_temperature: float = 1.0
    image_top_k: int = 0
    image_top_p: float = 1.0
    repetition_penalty: float = 1.0  # text tokens only (HF convention: > 1 discourages repeats)
    cfg_scale: float = 1.0
    cfg_image_scale: float | None = None
    cfg_text_scale: float | None = None
    seed: int | None = None
    image_grid: tuple[int, int] | None = None  # (h, w) codes per image; generate() takes the tokenizer's
    stop_at_eos: bool = True
    use_kv_cache: bool = True  # False recomputes the whole sequence every step (the reference path)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"SamplingConfig.mode={self.mode!r}; choose one of {MODES}")
        for name in ("text_temperature", "image_temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"SamplingConfig.{name}={getattr(self, name)} must be >= 0 (0 = greedy)")
        for name in ("text_top_p", "image_top_p"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"SamplingConfig.{name}={getattr(self, name)} must be in (0, 1]")
        for name in ("text_top_k", "image_top_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"SamplingConfig.{name}={getattr(self, name)} must be >= 0 (0 = off)")
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingConfig.repetition_penalty={self.repetition_penalty} must be > 0")
        if (self.cfg_image_scale is None) != (self.cfg_text_scale is None):
            raise ValueError("three-stream guidance needs both cfg_image_scale and cfg_text_scale (or neither)")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens={self.max_new_tokens} must be >= 1 or None")
        if self.image_grid is not None:
            self.image_grid = (int(self.image_grid[0]), int(self.image_grid[1]))
            if min(self.image_grid) < 1:
                raise ValueError(f"SamplingConfig.image_grid={self.image_grid} must be positive")

    @classmethod
    def chameleon(cls, **overrides: Any) -> SamplingConfig:
        """The settings of Chameleon's release: temperature 0.7, top-p 0.9, text penalty 1.2, CFG 1.2/3.0."""
        values: dict[str, Any] = dict(
            text_temperature=0.7, text_top_p=0.9, image_temperature=0.7, image_top_p=0.9,
            repetition_penalty=1.2, cfg_image_scale=1.2, cfg_text_scale=3.0,
        )
        values.update(overrides)
        return cls(**values)

    @property
    def three_stream(self) -> bool:
        """Whether Chameleon's three-stream guidance is on."""
        return self.cfg_image_scale is not None


# ---------------------------------------------------------------- logits processing (pure functions)


def mix_guidance(
    cond: torch.Tensor,
    uncond: torch.Tensor,
    scale: float,
    image_cond: torch.Tensor | None = None,
    text_scale: float | None = None,
) -> torch.Tensor:
    """Two-stream `u + s·(c − u)`, or with `image_cond` three-stream `u + s·(img − u) + text_scale·(c − img)`."""
    if image_cond is None:
        # written as c + (s−1)(c − u) so that s = 1 returns c bit for bit
        return cond + (scale - 1.0) * (cond - uncond)
    if text_scale is None:
        raise ValueError("three-stream guidance needs text_scale")
    return uncond + scale * (image_cond - uncond) + text_scale * (cond - image_cond)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """HF/CTRL penalty on ids already seen: positive logits divided by it, negative ones multiplied."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def truncate_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row top-k (0 = off) then top-p (1 = off) on (N, V) logits; removed entries become -inf."""
    neg_inf = torch.finfo(logits.dtype).min if logits.dtype != torch.float32 else float("-inf")
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1.0).any())
    if not use_k and not use_p:
        return logits
    if not use_p:  # top-k alone: a partial top-k is much cheaper than sorting the whole vocabulary
        k = top_k.clamp(min=1, max=logits.shape[-1])
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
        return logits.masked_fill((top_k[:, None] > 0) & (logits < kth), neg_inf)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        remove |= (top_k[:, None] > 0) & (ranks[None, :] >= top_k[:, None])
    if use_p:
        probs = sorted_logits.masked_fill(remove, neg_inf).softmax(dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does
        remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    remove[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(remove, neg_inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def choose_tokens(logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Sample one id per row at the row's temperature (0 = greedy argmax)."""
    greedy = logits.argmax(dim=-1)
    if bool((temperature == 0).all()):
        return greedy
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    probs = scaled.softmax(dim=-1)
    # argmax of p / Exponential(1) is a draw from p (the exponential race); cheaper than torch.multinomial
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-20)  # never 0/0
    sampled = (probs / race).argmax(dim=-1)
    return torch.where(temperature == 0, greedy, sampled)


# ---------------------------------------------------------------- the decode loop


def _check_compatible(model: torch.nn.Module, vocab: Any) -> None:
    """A checkpoint and a vocabulary must agree on the id space, or every id means something else."""
    config = getattr(model, "config", None)
    model_vocab = getattr(config, "vocab_size", None)
    if model_vocab is not None and model_vocab != vocab.vocab_size:
        raise ValueError(
            f"the model has vocab_size {model_vocab} but the vocabulary has {vocab.vocab_size}: "
            "pass the tokenizer.json the checkpoint was trained with"
        )
    for name in ("image_offset", "image_codes"):
        value = getattr(config, name, None)
        if value is not None and value != getattr(vocab, name):
            raise ValueError(
                f"the model's {name} is {value} but the vocabulary's is {getattr(vocab, name)}: "
                "pass the tokenizer.json the checkpoint was trained with"
            )


def image_only_prompt(prompt: list[int], vocab: Any) -> list[int]:
    """The 'img' stream of three-stream guidance: `<s>` plus only the complete images of the prompt."""
    out = [vocab.bos_id]
    start = None
    for i, token in enumerate(prompt):
        if token == vocab.boi_id:
            start = i
        elif token == vocab.eoi_id and start is not None:
            out += prompt[start : i + 1]
            start = None
    if start is not None:  # the prompt ends inside an image: keep the open image too
        out += prompt[start:]
    return out


def _open_image_codes(prompt: list[int], vocab: Any) -> int:
    """How many codes of an unfinished image end the prompt (-1 when the prompt is in text mode)."""
    last_boi = max((i for i, t in enumerate(prompt) if t == vocab.boi_id), default=-1)
    last_eoi = max((i for i, t in enumerate(prompt) if t == vocab.eoi_id), default=-1)
    return len(prompt) - 1 - last_boi if last_boi > last_eoi else -1


@torch.inference_mode()
def generate_ids(
    model: torch.nn.Module,
    vocab: Any,
    prompts: list[list[int]],
    config: SamplingConfig,
    *,
    uncond_prompts: list[list[int]] | None = None,
    image_cond_prompts: list[list[int]] | None = None,
) -> list[list[int]]:
    """Continue each prompt (ids, usually starting `<s>`); returns the new ids of each.

    All streams (conditional, unconditional, image-conditional) of all prompts are rows of one batch,
    so a step is one forward pass over a preallocated KV cache; every stream of a prompt receives the
    token chosen for that prompt. Default streams: u = `<s>`; img = `<s>` + the prompt's images.
    """
    _check_compatible(model, vocab)
    if not prompts:
        return []
    n_prompts = len(prompts)
    context = int(model.config.max_seq_len)
    vocab_size = int(vocab.vocab_size)
    device = next(model.parameters()).device

    # ---- the streams: rows [cond_0..cond_B-1, uncond_0.., image_cond_0..]
    streams = [list(map(int, p)) for p in prompts]
    guided = config.three_stream or config.cfg_scale != 1.0 or uncond_prompts is not None
    if guided:
        uncond = uncond_prompts if uncond_prompts is not None else [[vocab.bos_id] for _ in prompts]
        if len(uncond) != n_prompts:
            raise ValueError(f"got {len(uncond)} unconditional prompts for {n_prompts} prompts; give one each")
        streams += [list(map(int, p)) for p in uncond]
    if config.three_stream:
        img = image_cond_prompts if image_cond_prompts is not None else [image_only_prompt(p, vocab) for p in streams[:n_prompts]]
        if len(img) != n_prompts:
            raise ValueError(f"got {len(img)} image-conditional prompts for {n_prompts} prompts; give one each")
        streams += [list(map(int, p)) for p in img]
    n_streams = len(streams) // n_prompts
    for r, ids in enumerate(streams):
        which = ("prompt", "unconditional prompt", "image-conditional prompt")[r // n_prompts]
        if not ids:
            raise ValueError(f"{which} {r % n_prompts} is empty; start it with <s> (id {vocab.bos_id})")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{which} {r % n_prompts} has ids outside [0, {vocab_size}): {bad[:5]}")
        if len(ids) >= context:
            raise ValueError(
                f"{which} {r % n_prompts} has {len(ids)} tokens but the model's context is {context}: "
                "shorten the prompt (or use a model with a longer max_seq_len)"
            )

    # ---- per-prompt budgets and the image rules
    lengths = torch.tensor([len(s) for s in streams], device=device)
    room = (context - lengths).view(n_streams, n_prompts).min(dim=0).values  # tokens each prompt may add
    open_codes = torch.tensor([_open_image_codes(p, vocab) for p in streams[:n_prompts]], device=device)
    need_grid = config.mode != "text" or bool((open_codes >= 0).any())
    if need_grid and config.image_grid is None:
        raise ValueError("SamplingConfig.image_grid (h, w) is needed to generate images; use the image tokenizer's grid_shape")
    n_codes = config.image_grid[0] * config.image_grid[1] if config.image_grid else 0
    if config.mode == "text" and bool((open_codes >= 0).any()):
        raise ValueError("a prompt ends inside an image (<boi> without <eoi>) but mode is 'text'; use 'interleaved' or 'image'")
    if bool((open_codes > n_codes).any()):
        raise ValueError(f"a prompt's open image already has more than h·w = {n_codes} codes; check image_grid")
    # tokens a prompt must still get: in image mode a whole image (<boi>, codes, <eoi>); in any mode the
    # rest of an image the prompt opened
    finish_open = torch.where(open_codes >= 0, n_codes - open_codes + 1, torch.zeros_like(open_codes))
    needed = torch.where(open_codes >= 0, finish_open, torch.full_like(open_codes, n_codes + 2)) if config.mode == "image" else finish_open
    for b in range(n_prompts):
        if needed[b] > room[b]:
            raise ValueError(
                f"prompt {b}: the image needs {int(needed[b])} more tokens (h·w = {n_codes} codes + <boi>/<eoi>) "
                f"but only {int(room[b])} fit in the context of {context}: shorten the prompt or use a smaller image grid"
            )
        if config.max_new_tokens is not None and needed[b] > config.max_new_tokens:
            raise ValueError(
                f"prompt {b}: the image needs {int(needed[b])} new tokens but max_new_tokens={config.max_new_tokens}: "
                "raise it or leave it None"
            )
    if config.mode == "image":
        budget = needed
    else:
        budget = room if config.max_new_tokens is None else torch.clamp(room, max=config.max_new_tokens)
    steps = int(budget.max())

    # ---- vocabulary masks
    all_ids = torch.arange(vocab_size, device=device)
    is_image = vocab.is_image(all_ids).to(device)
    text_ok = vocab.is_text(all_ids).to(device) & ~is_image
    text_ok[vocab.eos_id] = True
    sep = getattr(vocab, "sep_id", None)
    if sep is not None:  # the separator / end-of-turn is text-mode punctuation for chat-style documents
        text_ok[sep] = True
    boi_only, eoi_only = all_ids == vocab.boi_id, all_ids == vocab.eoi_id
    seen = torch.zeros(n_prompts, vocab_size, dtype=torch.bool, device=device)
    if config.repetition_penalty != 1.0:
        for b, p in enumerate(streams[:n_prompts]):
            seen[b, torch.tensor(p, device=device)] = True
        seen &= text_ok

    # ---- state per prompt
    in_image = open_codes >= 0
    codes_done = open_codes.clamp_min(0)
    n_new = torch.zeros(n_prompts, dtype=torch.long, device=device)
    done = budget <= 0
    generator = None
    if config.seed is not None:
        generator = torch.Generator(device=device).manual_seed(int(config.seed))
    out = torch.full((n_prompts, max(steps, 1)), vocab.pad_id, dtype=torch.long, device=device)

    was_training = model.training
    model.eval()
    try:
        step_logits = _Decoder(model, streams, vocab.pad_id, steps, config.use_kv_cache, device)
        logits = step_logits.prefill()
        for step in range(steps):
            logits = logits.float()
            # guidance only for image tokens: text uses the conditional stream alone
            cond = logits[:n_prompts]
            if n_streams > 1:
                uncond = logits[n_prompts : 2 * n_prompts]
                if config.three_stream:
                    mixed = mix_guidance(cond, uncond, config.cfg_image_scale, logits[2 * n_prompts :], config.cfg_text_scale)
                else:
                    mixed = mix_guidance(cond, uncond, config.cfg_scale)
                cond = torch.where(in_image[:, None], mixed, cond)
            if config.repetition_penalty != 1.0:
                cond = apply_repetition_penalty(cond, seen & ~in_image[:, None], config.repetition_penalty)

            # modality rules (Chameleon's release)
            # a whole image (<boi>, codes, <eoi>) must fit in every stream's row and in max_new_tokens
            fits = (room - n_new >= n_codes + 2) & (budget - n_new >= n_codes + 2)
            if config.mode == "text":
                allowed = text_ok.expand(n_prompts, -1)
            elif config.mode == "image":
                allowed = boi_only.expand(n_prompts, -1)  # the row stops at the image's <eoi>
            else:
                allowed = text_ok | (boi_only & fits[:, None])
            image_allowed = torch.where((codes_done < n_codes)[:, None], is_image, eoi_only)
            allowed = torch.where(in_image[:, None], image_allowed, allowed)
            cond = cond.masked_fill(~allowed, float("-inf"))

            temperature = torch.where(in_image, config.image_temperature, config.text_temperature)
            top_k = torch.where(in_image, config.image_top_k, config.text_top_k)
            top_p = torch.where(in_image, config.image_top_p, config.text_top_p)
            token = choose_tokens(truncate_logits(cond, top_k, top_p), temperature.float(), generator)
            token = torch.where(done, torch.full_like(token, vocab.pad_id), token)
            out[:, step] = token

            # advance the state machine
            live = ~done
            n_new += live.long()
            closes = live & in_image & (token == vocab.eoi_id)
            codes_done = torch.where(live & in_image & ~closes, codes_done + 1, codes_done)
            opens = live & ~in_image & (token == vocab.boi_id)
            in_image = (in_image & ~closes) | opens
            codes_done = torch.where(opens | closes, torch.zeros_like(codes_done), codes_done)
            if config.repetition_penalty != 1.0:
                seen[torch.arange(n_prompts, device=device), token] |= live & text_ok[token]
            finished = n_new >= budget
            if config.stop_at_eos:
                finished |= token == vocab.eos_id
            if config.mode == "image":
                finished |= closes
            done = done | (live & finished)
            if bool(done.all()) or step == steps - 1:
                break
            logits = step_logits.step(token.repeat(n_streams), ~done.repeat(n_streams))
    finally:
        model.train(was_training)
    counts = n_new.tolist()
    rows = out.tolist()
    return [rows[b][: counts[b]] for b in range(n_prompts)]


class _Decoder:
    """Feeds tokens to the model for all rows in lockstep, with or without a KV cache; returns last logits."""

    def __init__(self, model: torch.nn.Module, rows: list[list[int]], pad_id: int, steps: int, use_cache: bool, device):
        self.model, self.pad_id, self.use_cache = model, pad_id, use_cache
        width = max(len(r) for r in rows)
        n = len(rows)
        # left padding (document -1) so every row's newest token sits in the last column
        self.ids = torch.full((n, width), pad_id, dtype=torch.long, device=device)
        self.docs = torch.full((n, width), -1, dtype=torch.long, device=device)
        self.pos = torch.zeros((n, width), dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            self.ids[i, width - len(r) :] = torch.tensor(r, device=device)
            self.docs[i, width - len(r) :] = 0
            self.pos[i, width - len(r) :] = torch.arange(len(r), device=device)
        self.next_pos = torch.tensor([len(r) for r in rows], device=device)
        self.max_pos = int(model.config.max_seq_len) - 1
        self.cache = model.new_kv_cache(n, width + steps, device=device) if use_cache else None

    def prefill(self) -> torch.Tensor:
        """Run the prompts; the logits at every row's last token, (rows, V)."""
        return self._last_logits(self.ids, self.pos, self.docs)

    def step(self, token: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Append one token per row (finished rows get a padding token that attends to nothing real)."""
        token = torch.where(live, token, torch.full_like(token, self.pad_id))
        pos = self.next_pos.clamp(max=self.max_pos)
        doc = torch.where(live, 0, -1)
        self.next_pos = self.next_pos + live.long()
        new = (token[:, None], pos[:, None], doc[:, None])
        if self.use_cache:
            return self._last_logits(*new)
        self.ids, self.pos, self.docs = (torch.cat([a, b], dim=1) for a, b in zip((self.ids, self.pos, self.docs), new))
        return self._last_logits(self.ids, self.pos, self.docs)

    def _last_logits(self, ids: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        head = getattr(self.model, "head", None)
        if head is None or not hasattr(self.model, "forward_hidden"):
            return self.model(ids, position_ids=pos, document_ids=docs, kv_cache=self.cache)[:, -1]
        # the head on the last column only: a long prompt never materialises (rows, T, V) logits
        hidden = self.model.forward_hidden(ids, position_ids=pos, document_ids=docs, kv_cache=self.cache)
        return head(hidden[:, -1]).float()


# ---------------------------------------------------------------- text + images in, segments out


def load_prompt_image(item: Any) -> Image.Image:
    """Open a prompt image (PIL image or path) fully now, so a bad file fails here with its name."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        return item
    path = Path(item)
    if not path.is_file():
        raise FileNotFoundError(f"prompt image {str(path)!r} does not exist: check the path")
    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"prompt image {str(path)!r} cannot be read as an image ({error}); pass a PNG/JPEG file") from error


def encode_prompt(segments: list[Any], vocab: Any, image_tokenizer: Any) -> list[int]:
    """`<s>` + the segments in order (text as BPE, images as `<boi>` codes `<eoi>`), without `</s>`."""
    parts: list[Any] = []
    for item in segments:
        if isinstance(item, str):
            parts.append(item)
        elif isinstance(item, (os.PathLike, bytes)) or hasattr(item, "convert"):
            if image_tokenizer is None:
                raise ValueError("the prompt contains an image but no image tokenizer was given")
            codes = image_tokenizer.encode([load_prompt_image(item)])[0]
            parts.append(codes.cpu())
        else:
            raise TypeError(f"prompt segment of type {type(item).__name__}: use str (text), a PIL image, or a pathlib.Path")
    return list(vocab.encode_document(parts, bos=True, eos=False))


def split_segments(ids: list[int], vocab: Any, grid: tuple[int, int] | None) -> list[str | torch.Tensor]:
    """Generated ids → text strings and (h, w) code grids in order; `</s>` and unfinished images dropped."""
    segments: list[str | torch.Tensor] = []
    text: list[int] = []
    image: list[int] | None = None
    for token in ids:
        if image is not None:
            if token == vocab.eoi_id:
                if grid is not None and len(image) == grid[0] * grid[1]:
                    segments.append(torch.tensor(image).view(*grid) - vocab.image_offset)
                image = None
            else:
                image.append(token)
        elif token == vocab.boi_id:
            if text:
                segments.append(vocab.decode_text(text))
                text = []
            image = []
        elif token not in (vocab.eos_id, vocab.pad_id, vocab.bos_id):
            text.append(token)
    if text:
        segments.append(vocab.decode_text(text))
    return segments


def decode_outputs(rows: list[list[int]], vocab: Any, image_tokenizer: Any, grid: tuple[int, int] | None) -> list[list[Any]]:
    """Generated ids of each prompt → segments, image grids decoded to PIL images (all images in one batch)."""
    from tokenizer.image import to_pil

    split = [split_segments(row, vocab, grid) for row in rows]
    grids = [seg for segments in split for seg in segments if not isinstance(seg, str)]
    if grids and image_tokenizer is None:
        raise ValueError("the output contains images but no image tokenizer was given to decode them")
    pixels = image_tokenizer.decode(torch.stack(grids)) if grids else None
    results, k = [], 0
    for segments in split:
        out: list[Any] = []
        for seg in segments:
            if isinstance(seg, str):
                out.append(seg)
            else:
                out.append(to_pil(pixels[k]))
                k += 1
        results.append(out)
    return results


def generate(
    model: torch.nn.Module,
    vocab: Any,
    image_tokenizer: Any,
    prompts: list[list[str | Image.Image | os.PathLike]],
    config: SamplingConfig,
    *,
    return_ids: bool = False,
) -> list[list[str | Image.Image]] | tuple[list[list[str | Image.Image]], list[list[int]]]:
    """Sample a continuation of each prompt (text, PIL images or pathlib.Path images) as text and PIL images.

    With return_ids, also returns the generated ids of each prompt.
    """
    if image_tokenizer is not None:
        grid = tuple(image_tokenizer.grid_shape)
        if config.image_grid is not None and tuple(config.image_grid) != grid:
            raise ValueError(f"SamplingConfig.image_grid={config.image_grid} but the image tokenizer makes {grid} grids")
        codebook = getattr(getattr(image_tokenizer, "config", None), "codebook_size", None)
        if codebook is not None and codebook != vocab.image_codes:
            raise ValueError(
                f"the image tokenizer has {codebook} codes but the vocabulary has {vocab.image_codes} image ids: "
                "pass the image tokenizer the vocabulary was built for"
            )
        config = replace(config, image_grid=grid)
    elif config.mode != "text":
        raise ValueError(f"mode {config.mode!r} can produce images: give an image tokenizer to decode them (or use mode 'text')")
    ids = [encode_prompt(p, vocab, image_tokenizer) for p in prompts]
    new_ids = generate_ids(model, vocab, ids, config)
    samples = decode_outputs(new_ids, vocab, image_tokenizer, config.image_grid)
    return (samples, new_ids) if return_ids else samples
