"""Chameleon's modality rules as a per-prompt state machine; the text ids the repetition penalty saw."""

from __future__ import annotations

from typing import Any

import torch

from fusion_model.sampling.config import SamplingConfig
from tokenizer.vocab import text_mode_mask


def _open_image_codes(prompt: list[int], vocab: Any) -> int:
    """How many codes of an unfinished image end the prompt (-1 when the prompt is in text mode)."""
    spans = vocab.spans(prompt)
    if not spans or not spans[-1].is_image or spans[-1].closed:
        return -1
    return len(prompt[spans[-1].body])


class ModalityRules:
    """Chameleon's modality rules as a state machine per prompt: which ids may come next, and when it is done.

    Outside an image: text, `</s>`, `<sep>`, and `<boi>` only while a whole image (`<boi>`, h·w codes,
    `<eoi>`) still fits in every stream's context and in max_new_tokens; mode "text" never opens an image and
    mode "image" opens exactly one (and stops at its `<eoi>`). Inside an image: h·w image codes, then `<eoi>`.
    A prompt may end inside an image: its codes count, and the sampler finishes it first.
    """

    def __init__(
        self, vocab: Any, config: SamplingConfig, prompts: list[list[int]], room: torch.Tensor, context: int
    ):
        """room: the tokens each prompt may add (Streams.room); context: the model's, for messages."""
        device = room.device
        self.mode, self.stop_at_eos = config.mode, config.stop_at_eos
        self.boi_id, self.eoi_id, self.eos_id = vocab.boi_id, vocab.eoi_id, vocab.eos_id
        open_codes = torch.tensor([_open_image_codes(p, vocab) for p in prompts], device=device)
        self.room = room
        self.n_codes, self.budget = self._budget(config, open_codes, room, context)

        # vocabulary masks
        all_ids = torch.arange(int(vocab.vocab_size), device=device)
        self.is_image = vocab.is_image(all_ids).to(device)
        self.text_ok = text_mode_mask(vocab).to(device)
        self.boi_only, self.eoi_only = all_ids == vocab.boi_id, all_ids == vocab.eoi_id

        # the state of each prompt
        self.in_image = open_codes >= 0
        self.codes_done = open_codes.clamp_min(0)
        self.n_new = torch.zeros(len(prompts), dtype=torch.long, device=device)
        self.done = self.budget <= 0

    @staticmethod
    def _budget(
        config: SamplingConfig, open_codes: torch.Tensor, room: torch.Tensor, context: int
    ) -> tuple[int, torch.Tensor]:
        """(h·w, new tokens each prompt may take); refuses a request that cannot end in whole images."""
        opened = open_codes >= 0
        if (config.mode != "text" or bool(opened.any())) and config.image_grid is None:
            raise ValueError(
                "SamplingConfig.image_grid (h, w) is needed to generate images; "
                "use the image tokenizer's grid_shape"
            )
        n_codes = config.image_grid[0] * config.image_grid[1] if config.image_grid else 0
        if config.mode == "text" and bool(opened.any()):
            raise ValueError(
                "a prompt ends inside an image (<boi> without <eoi>) but mode is 'text'; "
                "use 'interleaved' or 'image'"
            )
        if bool((open_codes > n_codes).any()):
            raise ValueError(
                f"a prompt's open image already has more than h·w = {n_codes} codes; check image_grid"
            )
        # tokens a prompt must still get: the rest of an image it opened, and in image mode otherwise a whole
        # image (<boi>, codes, <eoi>)
        finish_open = torch.where(opened, n_codes - open_codes + 1, torch.zeros_like(open_codes))
        needed = finish_open
        if config.mode == "image":
            needed = torch.where(opened, finish_open, torch.full_like(open_codes, n_codes + 2))
        for b in range(len(open_codes)):
            if needed[b] > room[b]:
                raise ValueError(
                    f"prompt {b}: the image needs {int(needed[b])} more tokens "
                    f"(h·w = {n_codes} codes + <boi>/<eoi>) but only {int(room[b])} fit in the context of "
                    f"{context}: shorten the prompt or use a smaller image grid"
                )
            if config.max_new_tokens is not None and needed[b] > config.max_new_tokens:
                raise ValueError(
                    f"prompt {b}: the image needs {int(needed[b])} new tokens but "
                    f"max_new_tokens={config.max_new_tokens}: raise it or leave it None"
                )
        if config.mode == "image":
            return n_codes, needed
        if config.max_new_tokens is None:
            return n_codes, room
        return n_codes, torch.clamp(room, max=config.max_new_tokens)

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
        # a whole image (<boi>, codes, <eoi>) must fit in every stream's row and in max_new_tokens
        fits = (self.room - self.n_new >= self.n_codes + 2) & (self.budget - self.n_new >= self.n_codes + 2)
        if self.mode == "text":
            outside = self.text_ok.expand(len(fits), -1)
        elif self.mode == "image":
            outside = self.boi_only.expand(len(fits), -1)  # the row stops at the image's <eoi>
        else:
            outside = self.text_ok | (self.boi_only & fits[:, None])
        inside = torch.where((self.codes_done < self.n_codes)[:, None], self.is_image, self.eoi_only)
        return torch.where(self.in_image[:, None], inside, outside)

    def advance(self, token: torch.Tensor, take: torch.Tensor | None = None) -> None:
        """Take one token per prompt (prompts already done ignore theirs) and move each state on.

        take: which prompts take their token (default all); speculative decoding commits a different number
        of tokens per prompt in one forward.
        """
        # the state tensors change in place: the compiled decode step keeps them at fixed addresses
        live = ~self.done if take is None else ~self.done & take
        self.n_new += live.long()
        closes = live & self.in_image & (token == self.eoi_id)
        opens = live & ~self.in_image & (token == self.boi_id)
        counted = torch.where(live & self.in_image & ~closes, self.codes_done + 1, self.codes_done)
        self.codes_done.copy_(torch.where(opens | closes, torch.zeros_like(counted), counted))
        self.in_image.copy_((self.in_image & ~closes) | opens)
        finished = self.n_new >= self.budget
        if self.stop_at_eos:
            finished |= token == self.eos_id
        if self.mode == "image":
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
