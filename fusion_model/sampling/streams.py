"""The guidance streams: each prompt's conditional, unconditional and image-conditional rows, checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fusion_model.sampling.config import SamplingConfig


def image_only_prompt(prompt: list[int], vocab: Any) -> list[int]:
    """The 'img' stream of three-stream guidance: `<s>` plus only the complete images and clips of the prompt.

    An image (clip) the prompt ends inside is kept too: the conditional stream is about to finish it.
    """
    spans = vocab.spans(prompt)
    out = [vocab.bos_id]
    for span in spans:
        if span.is_visual and (span.closed or span is spans[-1]):
            out += prompt[span.start : span.end]
    return out


@dataclass
class Streams:
    """The rows of one sampling batch, stream by stream: [cond_0..cond_B-1, uncond_0.., image_cond_0..]."""

    rows: list[list[int]]
    n_prompts: int

    @property
    def n_streams(self) -> int:
        """1 (conditional only), 2 (plus unconditional) or 3 (plus image-conditional)."""
        return len(self.rows) // self.n_prompts

    @property
    def prompts(self) -> list[list[int]]:
        """The conditional rows: the prompts themselves."""
        return self.rows[: self.n_prompts]

    def room(self, context: int, device: torch.device) -> torch.Tensor:
        """Tokens each prompt may still add, (n_prompts,): a new token goes to every stream of its prompt."""
        lengths = torch.tensor([len(row) for row in self.rows], device=device)
        return (context - lengths).view(self.n_streams, self.n_prompts).min(dim=0).values


def build_streams(
    vocab: Any,
    prompts: list[list[int]],
    config: SamplingConfig,
    context: int,
    uncond_prompts: list[list[int]] | None = None,
    image_cond_prompts: list[list[int]] | None = None,
    conditional_only: bool = False,
) -> Streams:
    """The rows guidance needs, checked against the vocabulary and the context.

    Default streams: u = `<s>`; img = `<s>` + the prompt's images. conditional_only: the prompts' own rows alone (a
    family that makes its images whole guides them itself; text is never guided).
    """
    n_prompts = len(prompts)
    rows = [list(map(int, p)) for p in prompts]
    guided = config.three_stream or config.cfg_scale != 1.0 or uncond_prompts is not None
    if guided and not conditional_only:
        uncond = uncond_prompts if uncond_prompts is not None else [[vocab.bos_id] for _ in prompts]
        if len(uncond) != n_prompts:
            raise ValueError(
                f"got {len(uncond)} unconditional prompts for {n_prompts} prompts; give one each"
            )
        rows += [list(map(int, p)) for p in uncond]
    if config.three_stream and not conditional_only:
        if image_cond_prompts is not None:
            img = image_cond_prompts
        else:
            img = [image_only_prompt(p, vocab) for p in rows[:n_prompts]]
        if len(img) != n_prompts:
            raise ValueError(
                f"got {len(img)} image-conditional prompts for {n_prompts} prompts; give one each"
            )
        rows += [list(map(int, p)) for p in img]
    vocab_size = int(vocab.vocab_size)
    for r, ids in enumerate(rows):
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
    return Streams(rows, n_prompts)
