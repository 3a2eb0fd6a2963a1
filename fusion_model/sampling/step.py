"""The plain decode step: one token per prompt per forward, fixed shapes changed in place (it compiles)."""

from __future__ import annotations

import torch

from fusion_model.sampling.config import SamplingConfig
from fusion_model.sampling.feeder import CacheFeeder
from fusion_model.sampling.logits import apply_repetition_penalty, guided_logits, sample_by_modality
from fusion_model.sampling.modality import ModalityRules, SeenTextTokens
from fusion_model.sampling.streams import Streams


def choose_next_tokens(
    logits: torch.Tensor,
    n_prompts: int,
    rules: ModalityRules,
    seen_text: SeenTextTokens | None,
    config: SamplingConfig,
    noise: torch.Tensor | None,
    pad_id: int,
) -> torch.Tensor:
    """One id per prompt from the rows' logits (rows, V): guidance, repetition penalty, modality rules, sampling.

    noise: this step's exponential_noise (prompts, V), None when both modalities are greedy."""
    scores = guided_logits(logits.float(), n_prompts, rules.in_image, config)
    if seen_text is not None:  # text tokens only
        text_seen = seen_text.mask & ~rules.in_image[:, None]
        scores = apply_repetition_penalty(scores, text_seen, config.repetition_penalty)
    scores = scores.masked_fill(~rules.allowed(), float("-inf"))
    token = sample_by_modality(scores, rules.in_image, config, noise)
    return torch.where(rules.done, torch.full_like(token, pad_id), token)


def _record(out: torch.Tensor, rules: ModalityRules, token: torch.Tensor, take: torch.Tensor) -> None:
    """Write each taking prompt's token at its next output column (call before rules.advance); the others write
    into the spare last column, so the shapes stay fixed."""
    column = torch.where(take & ~rules.done, rules.n_new, out.shape[1] - 1)
    out.scatter_(1, column[:, None], token[:, None])


class PlainStep:
    """One step of the plain decode loop on fixed-shape tensors that change in place: feed each prompt's last token
    to its streams, choose the next one, write it out, advance the rules.

    Nothing is read back to the host, so the step compiles to one graph (decode.compiled_step); the loop around it
    only draws the noise and counts. A prompt that is done keeps getting padding tokens that attend to nothing real.
    """

    def __init__(self, feeder: CacheFeeder, streams: Streams, rules: ModalityRules,
                 seen_text: SeenTextTokens | None, config: SamplingConfig, noise: torch.Tensor | None, pad_id: int,
                 out: torch.Tensor):
        self.feeder, self.rules, self.seen_text, self.config = feeder, rules, seen_text, config
        self.pad_id, self.out = pad_id, out
        self.n_prompts, self.n_streams = streams.n_prompts, streams.n_streams
        self.token = torch.full((self.n_prompts,), pad_id, dtype=torch.long, device=out.device)  # the last taken
        self.noise = noise

    def state(self) -> list[torch.Tensor]:
        """Every tensor the step changes in place (a CUDA graph must keep them at fixed addresses)."""
        rules, cache = self.rules, self.feeder.cache
        tensors = [self.token, self.out, self.feeder.next_pos, rules.n_new, rules.codes_done,
                   rules.in_image, rules.in_video, rules.done]
        if self.seen_text is not None:
            tensors.append(self.seen_text.mask)
        if self.noise is not None:
            tensors.append(self.noise)
        if cache is not None:
            tensors += [self.feeder.slot, cache.document_ids, cache.positions, *cache.keys, *cache.values]
        return tensors

    def take(self, token: torch.Tensor, take: torch.Tensor) -> None:
        """Commit one token for each prompt in `take`: write it out, remember its text, advance the rules."""
        _record(self.out, self.rules, token, take)
        if self.seen_text is not None:
            self.seen_text.add(token, take & ~self.rules.done)
        self.rules.advance(token, take)

    def force(self, token_id: int) -> None:
        """Take `token_id` for every prompt without a choice (image mode's `<boi>` before a whole image)."""
        token = torch.full_like(self.token, token_id)
        self.take(token, ~self.rules.done)
        self.token.copy_(token)

    def choose(self, logits: torch.Tensor, noise: torch.Tensor | None) -> None:
        """Choose each prompt's next token from the rows' logits, record it and advance the rules."""
        token = choose_next_tokens(logits, self.n_prompts, self.rules, self.seen_text, self.config, noise,
                                   self.pad_id)
        self.take(token, torch.ones_like(self.rules.done))
        self.token.copy_(token)

    def __call__(self, noise: torch.Tensor | None) -> None:
        """Feed the last tokens, then choose the next ones."""
        live = ~self.rules.done
        logits = self.feeder.step(self.token.repeat(self.n_streams), live.repeat(self.n_streams))
        self.choose(logits, noise)
