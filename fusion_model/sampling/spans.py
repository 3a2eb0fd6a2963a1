"""Images a family makes whole instead of code by code (Transfusion's denoised latents): what the decode loop asks of
such a family when a prompt opens an image, and the feeder the loop then samples through.

The loop (`decode.generate_ids`) stays the one loop: it chooses every token under the modality rules, with the
repetition penalty, the noise and the stopping rules of any other family. Only when a prompt takes `<boi>` does it hand
the image to the family (`WholeImages.make`), take the ids of the span it returns as that prompt's tokens and feed the
span to the model in the same forward as the other prompts' next tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch

# One row's chunk for a ChunkFeeder: its ids and, per id, what the family's model reads with it (a latent patch at each
# image position, zeros elsewhere), or None for ids alone.
Chunk = tuple[list[int], "torch.Tensor | None"]


class ChunkFeeder(Protocol):
    """Feeds the prompts, one token per row and whole chunks to a family's model; each returns the logits after every
    row's last token, (rows, V). `forwards` counts the model's forwards, the family's own (denoising) included."""

    forwards: int

    def prefill(self) -> torch.Tensor:
        """Run the prompts."""
        ...

    def step(self, token: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Feed token[b] to each row b where live[b] (rows, the loop's plain step)."""
        ...

    def feed(self, chunks: list[Chunk | None]) -> torch.Tensor:
        """Feed each row its chunk (None: nothing) in one forward."""
        ...


class WholeImages(Protocol):
    """A family's images made in one piece: the feeder the loop samples through, and each opened image's span."""

    def feeder(self, rows: list[list[int]], steps: int, device: torch.device) -> ChunkFeeder:
        """The feeder of these prompt rows (ids), for at most `steps` new tokens each."""
        ...

    def make(self, feeder: ChunkFeeder, opened: list[int], generator: torch.Generator | None) -> list[Chunk]:
        """For each prompt in `opened` (each just took `<boi>`), the chunk it feeds next: `<boi>`, its image's
        positions and `<eoi>`, with what the model reads at each; all of one length. Random draws come from
        `generator` (the loop's), after the token choices that came before."""
        ...
