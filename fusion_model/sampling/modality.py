"""Chameleon's modality rules as a per-prompt state machine; the text ids the repetition penalty saw."""

from __future__ import annotations

from typing import Any

import torch

from fusion_model.sampling.config import SamplingConfig
from tokenizer.vocab import NO_VIDEO_MARKERS, text_mode_mask


def _open_span(prompt: list[int], vocab: Any) -> tuple[int, bool]:
    """(codes of the unfinished image or clip that ends the prompt, whether it is a clip); (-1, False) when the
    prompt is in text mode."""
    spans = vocab.spans(prompt)
    last = spans[-1] if spans else None
    if last is None or last.kind == "text" or last.closed:
        return -1, False
    return len(prompt[last.body]), last.is_video


class ModalityRules:
    """Chameleon's modality rules as a state machine per prompt: which ids may come next, and when it is done.

    Outside an image: text, `</s>`, `<sep>`, and `<boi>` only while a whole image (`<boi>`, h·w codes,
    `<eoi>`) still fits in every stream's context and in max_new_tokens; mode "text" never opens an image and
    mode "image" opens exactly one (and stops at its `<eoi>`). Inside an image: h·w image codes, then `<eoi>`.
    A prompt may end inside an image: its codes count, and the sampler finishes it first.

    Video clips (config.video_grid (t, h, w) set and a vocabulary with `<bov>` / `<eov>`): outside any image or
    clip, `<bov>` too, only while a whole clip (`<bov>`, t·h·w codes, `<eov>`) fits; inside a clip, t·h·w image
    codes then `<eov>`; mode "video" opens exactly one clip and stops at its `<eov>`. `in_image` is True inside
    an image or a clip (clip codes are image-block codes: guidance and the image temperature apply), `in_video`
    inside a clip; `n_codes` is each prompt's codes for the span it is in (or would open).
    """

    def __init__(
        self, vocab: Any, config: SamplingConfig, prompts: list[list[int]], room: torch.Tensor, context: int
    ):
        """room: the tokens each prompt may add (Streams.room); context: the model's, for messages."""
        device = room.device
        self.mode, self.stop_at_eos = config.mode, config.stop_at_eos
        self.boi_id, self.eoi_id, self.eos_id = vocab.boi_id, vocab.eoi_id, vocab.eos_id
        self.bov_id, self.eov_id = getattr(vocab, "bov_id", None), getattr(vocab, "eov_id", None)
        opened = [_open_span(p, vocab) for p in prompts]
        open_codes = torch.tensor([codes for codes, _ in opened], device=device)
        open_clip = torch.tensor([clip for _, clip in opened], dtype=torch.bool, device=device)
        self.room = room
        self.image_codes, self.clip_codes, self.budget = self._budget(
            config, vocab, open_codes, open_clip, room, context)
        # clips may be opened (interleaved, video): a grid, and markers in the vocabulary
        self.clips_on = config.video_grid is not None and self.bov_id is not None

        # vocabulary masks
        all_ids = torch.arange(int(vocab.vocab_size), device=device)
        self.is_image = vocab.is_image(all_ids).to(device)
        self.text_ok = text_mode_mask(vocab).to(device)
        self.boi_only, self.eoi_only = all_ids == vocab.boi_id, all_ids == vocab.eoi_id
        self.bov_only = all_ids == (self.bov_id if self.bov_id is not None else -1)
        self.eov_only = all_ids == (self.eov_id if self.eov_id is not None else -1)

        # the state of each prompt
        self.in_image = open_codes >= 0
        self.in_video = open_clip & self.in_image
        self.codes_done = open_codes.clamp_min(0)
        self.n_new = torch.zeros(len(prompts), dtype=torch.long, device=device)
        self.done = self.budget <= 0

    @staticmethod
    def _budget(
        config: SamplingConfig, vocab: Any, open_codes: torch.Tensor, open_clip: torch.Tensor, room: torch.Tensor,
        context: int,
    ) -> tuple[int, int, torch.Tensor]:
        """(h·w, t·h·w, new tokens each prompt may take); refuses a request that cannot end in whole images and
        clips."""
        opened = open_codes >= 0
        open_image, open_video = opened & ~open_clip, opened & open_clip
        if (config.mode in ("image", "interleaved") or bool(open_image.any())) and config.image_grid is None:
            raise ValueError(
                "SamplingConfig.image_grid (h, w) is needed to generate images; "
                "use the image tokenizer's grid_shape"
            )
        if config.mode == "video" or bool(open_video.any()):
            if getattr(vocab, "bov_id", None) is None:
                raise ValueError(f"mode 'video' needs video markers, but {NO_VIDEO_MARKERS}")
            if config.video_grid is None:
                raise ValueError(
                    "SamplingConfig.video_grid (t, h, w) is needed to generate video clips; "
                    "use the video tokenizer's grid of a clip"
                )
        n_codes = config.image_grid[0] * config.image_grid[1] if config.image_grid else 0
        t, h, w = config.video_grid if config.video_grid else (0, 0, 0)
        clip_codes = t * h * w
        if config.mode == "text" and bool(opened.any()):
            what = "a clip (<bov> without <eov>)" if bool(open_video.any()) else "an image (<boi> without <eoi>)"
            raise ValueError(f"a prompt ends inside {what} but mode is 'text'; use 'interleaved' or "
                             f"'{'video' if bool(open_video.any()) else 'image'}'")
        if config.mode == "image" and bool(open_video.any()):
            raise ValueError("a prompt ends inside a clip (<bov> without <eov>) but mode is 'image'; use "
                             "'interleaved' or 'video'")
        if config.mode == "video" and bool(open_image.any()):
            raise ValueError("a prompt ends inside an image (<boi> without <eoi>) but mode is 'video'; use "
                             "'interleaved' or 'image'")
        if bool((open_image & (open_codes > n_codes)).any()):
            raise ValueError(
                f"a prompt's open image already has more than h·w = {n_codes} codes; check image_grid"
            )
        if bool((open_video & (open_codes > clip_codes)).any()):
            raise ValueError(
                f"a prompt's open clip already has more than t·h·w = {clip_codes} codes; check video_grid"
            )
        # tokens a prompt must still get: the rest of an image (clip) it opened, and in image (video) mode otherwise
        # a whole image (<boi>, codes, <eoi>) or clip (<bov>, codes, <eov>)
        span_codes = torch.where(open_clip, clip_codes, n_codes)
        finish_open = torch.where(opened, span_codes - open_codes + 1, torch.zeros_like(open_codes))
        needed = finish_open
        whole = {"image": n_codes + 2, "video": clip_codes + 2}.get(config.mode)
        if whole is not None:
            needed = torch.where(opened, finish_open, torch.full_like(open_codes, whole))
        for b in range(len(open_codes)):
            kind, grid = (("clip", f"t·h·w = {clip_codes} codes + <bov>/<eov>")
                          if bool(open_clip[b]) or (config.mode == "video" and not bool(opened[b]))
                          else ("image", f"h·w = {n_codes} codes + <boi>/<eoi>"))
            if needed[b] > room[b]:
                raise ValueError(
                    f"prompt {b}: the {kind} needs {int(needed[b])} more tokens "
                    f"({grid}) but only {int(room[b])} fit in the context of "
                    f"{context}: shorten the prompt or use a smaller {kind} grid"
                )
            if config.max_new_tokens is not None and needed[b] > config.max_new_tokens:
                raise ValueError(
                    f"prompt {b}: the {kind} needs {int(needed[b])} new tokens but "
                    f"max_new_tokens={config.max_new_tokens}: raise it or leave it None"
                )
        if whole is not None:
            return n_codes, clip_codes, needed
        if config.max_new_tokens is None:
            return n_codes, clip_codes, room
        return n_codes, clip_codes, torch.clamp(room, max=config.max_new_tokens)

    @property
    def n_codes(self) -> torch.Tensor:
        """(prompts,) the codes of the span each prompt is in: t·h·w inside a clip, h·w otherwise (in mode
        "video", before its `<bov>`, t·h·w)."""
        clip = self.in_video | (~self.in_image & (self.mode == "video"))
        return torch.where(clip, self.clip_codes, self.image_codes)

    @property
    def steps(self) -> int:
        """The most new tokens any prompt may take."""
        return int(self.budget.max())

    @property
    def all_done(self) -> bool:
        """Whether every prompt has finished."""
        return bool(self.done.all())

    def allowed(self) -> torch.Tensor:
        """(prompts, V) mask of the ids each prompt may take next."""
        # a whole image (<boi>, codes, <eoi>) must fit in every stream's row and in max_new_tokens; a clip too
        left = torch.minimum(self.room - self.n_new, self.budget - self.n_new)
        fits = left >= self.image_codes + 2
        if self.mode == "text":
            outside = self.text_ok.expand(len(fits), -1)
        elif self.mode == "image":
            outside = self.boi_only.expand(len(fits), -1)  # the row stops at the image's <eoi>
        elif self.mode == "video":
            outside = self.bov_only.expand(len(fits), -1)  # the row stops at the clip's <eov>
        else:
            outside = self.text_ok | (self.boi_only & fits[:, None])
            if self.clips_on:
                outside = outside | (self.bov_only & (left >= self.clip_codes + 2)[:, None])
        closer = torch.where(self.in_video[:, None], self.eov_only, self.eoi_only)
        inside = torch.where((self.codes_done < self.n_codes)[:, None], self.is_image, closer)
        return torch.where(self.in_image[:, None], inside, outside)

    def advance(self, token: torch.Tensor, take: torch.Tensor | None = None) -> None:
        """Take one token per prompt (prompts already done ignore theirs) and move each state on.

        take: which prompts take their token (default all); speculative decoding commits a different number
        of tokens per prompt in one forward.
        """
        # the state tensors change in place: the compiled decode step keeps them at fixed addresses
        live = ~self.done if take is None else ~self.done & take
        self.n_new += live.long()
        closer = torch.where(self.in_video, self.eov_id if self.eov_id is not None else -1, self.eoi_id)
        closes = live & self.in_image & (token == closer)
        opens = live & ~self.in_image & (token == self.boi_id)
        opens_clip = live & ~self.in_image & (token == (self.bov_id if self.bov_id is not None else -1))
        counted = torch.where(live & self.in_image & ~closes, self.codes_done + 1, self.codes_done)
        self.codes_done.copy_(torch.where(opens | opens_clip | closes, torch.zeros_like(counted), counted))
        self.in_video.copy_((self.in_video & ~closes) | opens_clip)
        self.in_image.copy_((self.in_image & ~closes) | opens | opens_clip)
        finished = self.n_new >= self.budget
        if self.stop_at_eos:
            finished |= token == self.eos_id
        if self.mode in ("image", "video"):
            finished |= closes
        self.done |= live & finished


class SeenTextTokens:
    """The repetition penalty's memory: the text ids of each prompt and of what was sampled for it so far.

    `mask` (prompts, V) is True at every text id a prompt has seen (changed in place: the compiled step keeps it).
    """

    def __init__(self, prompts: list[list[int]], text_ok: torch.Tensor):
        device = text_ok.device
        self.text_ok = text_ok
        self.mask = torch.zeros(len(prompts), text_ok.numel(), dtype=torch.bool, device=device)
        for b, p in enumerate(prompts):
            self.mask[b, torch.tensor(p, device=device)] = True
        self.mask &= text_ok

    def add(self, token: torch.Tensor, live: torch.Tensor) -> None:
        """Remember the new token of each live prompt when it is text."""
        self.mask[torch.arange(len(token), device=token.device), token] |= live & self.text_ok[token]
