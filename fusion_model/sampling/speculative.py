"""Speculative Jacobi decoding of image codes: several codes per forward, the plain sampler's distribution."""

from __future__ import annotations

import torch

from fusion_model.sampling.config import SamplingConfig
from fusion_model.sampling.logits import exponential_noise, guided_logits, truncate_logits
from fusion_model.sampling.step import PlainStep, choose_next_tokens

# Speculative Jacobi decoding (SJD, Teng et al. 2024, arXiv 2410.01699) of image codes: several codes per forward
# pass, the same distribution as the plain sampler.
#
# Inside an image a prompt keeps up to `speculative_window` drafted codes after its last committed token. One
# forward feeds, for every row of every stream, that token and the drafts; draft i (drawn earlier from q_i) is
# accepted with probability min(1, p_i(x)/q_i(x)) against the target p_i (guidance, image mask, temperature,
# top-k, top-p exactly as the plain sampler), left to right; the first rejected one is replaced by a draw from
# normalize(max(0, p_i − q_i)), and when all are accepted one more code is drawn from the p after the last draft,
# so each committed code is an exact draw from p given the committed prefix. At temperature 0 a draft is accepted
# iff it is p's argmax and the replacement is the argmax: greedy decoding, token for token.
#
# The drafts for the next forward are draws from this forward's p at their positions (the Jacobi update). A draft
# that was already there is kept with probability min(1, q_new(x)/q_old(x)) and otherwise replaced by a draw from
# normalize(max(0, q_new − q_old)): the maximal coupling of the old and new proposals (MC-SJD, arXiv 2510.24211).
# The new draft is still an exact draw from q_new, so acceptance stays exact, but the drafts change only where the
# proposals disagree; the context of later positions then settles, and more of them are accepted.
#
# Every shape is fixed: a forward feeds window + 1 tokens per row (the unused ones are padding), all noise is drawn
# outside the step, and rows that commit different numbers of tokens move their own cache index on
# (`CacheFeeder.advance`), so the step compiles to one graph as the plain one does. Prompts outside images (text,
# `<boi>`, `<eoi>`) take one token per forward in the same forwards, through the plain sampler's own rules.


def draw_from_weights(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One index per row of non-negative, not necessarily normalised weights (..., C), a draw from
    weights / weights.sum(), given Exponential(1) noise of the same shape (logits.exponential_noise): the argmax of
    weights / noise. The same noise gives the same index, so the caller owns the randomness."""
    return (weights / noise).argmax(dim=-1)


def _image_targets(
    logits: torch.Tensor, code_ids: torch.Tensor, n_prompts: int, config: SamplingConfig
) -> torch.Tensor:
    """The plain sampler's image-code distribution after each chunk position, (prompts, T, codes).

    At temperature 0, the argmax code instead, (prompts, T). Same steps as the plain sampler for an image
    token: guidance mix, image ids only, top-k / top-p, then temperature; the ids outside the image block
    are -inf there, so working on the block alone changes nothing.
    """
    rows, width, _ = logits.shape
    # rows are stream-major (stream, prompt), so (stream, prompt, position) flattens into guided_logits' row layout
    codes = logits.index_select(-1, code_ids).float().reshape(rows * width, -1)
    everywhere = torch.ones(n_prompts * width, dtype=torch.bool, device=logits.device)
    mixed = guided_logits(codes, n_prompts * width, everywhere, config)
    top_k = torch.full((len(mixed),), config.image_top_k, device=logits.device)
    top_p = torch.full((len(mixed),), config.image_top_p, device=logits.device)
    kept = truncate_logits(mixed, top_k, top_p, largest_k=config.image_top_k, use_p=config.image_top_p < 1.0)
    if config.image_temperature == 0:
        return kept.argmax(dim=-1).view(n_prompts, width)
    return (kept / config.image_temperature).softmax(dim=-1).view(n_prompts, width, -1)


def _verify(
    target: torch.Tensor,
    drafts: torch.Tensor,
    draft_q: torch.Tensor | None,
    window: torch.Tensor,
    uniform: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts per prompt, the code after them): speculative sampling's accept / replace rule.

    target: _image_targets of this chunk, (prompts, window_cap + 1[, codes]); drafts (prompts, window_cap) code
    indices drawn from draft_q (prompts, window_cap, codes), None at temperature 0 (greedy); window: the drafts
    each prompt fed; uniform (prompts, window_cap) and noise (prompts, codes, exponential): this forward's noise.
    """
    n_prompts, width = target.shape[:2]
    checked = width - 1
    rows = torch.arange(n_prompts, device=target.device)
    in_window = torch.arange(checked, device=target.device)[None, :] < window[:, None]
    if draft_q is None:  # greedy: a draft stands iff it is the argmax
        ok = drafts == target[:, :checked]
    else:
        p_draft = target[:, :checked].gather(-1, drafts[..., None]).squeeze(-1)
        q_draft = draft_q.gather(-1, drafts[..., None]).squeeze(-1)
        ok = uniform * q_draft < p_draft  # u < p/q: accepted with probability min(1, p/q)
    accepted = (ok & in_window).long().cumprod(dim=1).sum(dim=1)
    if draft_q is None:
        return accepted, target[rows, accepted]
    p_next = target[rows, accepted]
    rejected = accepted < window
    residual = (p_next - draft_q[rows, accepted.clamp(max=checked - 1)]).clamp_min(0)
    # p ≤ q everywhere can only come from rounding (a rejection needs p(x) < q(x), so mass elsewhere)
    usable = rejected[:, None] & (residual.sum(dim=-1, keepdim=True) > 0)
    return accepted, draw_from_weights(torch.where(usable, residual, p_next), noise)


def coupled_drafts(
    new_q: torch.Tensor, old_drafts: torch.Tensor, old_q: torch.Tensor, has_old: torch.Tensor,
    uniform: torch.Tensor, noise: torch.Tensor,
) -> torch.Tensor:
    """Draws from new_q (prompts, W, codes) maximally coupled with the old drafts where has_old: an old draft x
    stays with probability min(1, q_new(x)/q_old(x)), else the draw is from normalize(max(0, q_new − q_old)).

    old_drafts (prompts, W): code indices drawn from old_q (prompts, W, codes); uniform (prompts, W) and noise
    (prompts, W, codes, exponential): the randomness. SpeculativeStep calls it through this module's global, so a
    benchmark may swap in another drafting rule of the same signature (bench/bench_speculative.py redraws every
    draft independently, as SJD was published)."""
    new_at_old = new_q.gather(-1, old_drafts[..., None]).squeeze(-1)
    old_at_old = old_q.gather(-1, old_drafts[..., None]).squeeze(-1)
    stays = has_old & (uniform * old_at_old < new_at_old)
    residual = (new_q - old_q).clamp_min(0)
    # only proposals that differ leave a residual; equal ones (up to rounding) keep the old draft
    usable = has_old[..., None] & (residual.sum(dim=-1, keepdim=True) > 0)
    fresh = draw_from_weights(torch.where(usable, residual, new_q), noise)
    return torch.where(stays, old_drafts, fresh)


class SpeculativeStep:
    """One forward of speculative Jacobi decoding on fixed shapes that change in place: feed each prompt's last
    committed token and its drafts, commit the accepted drafts and one more code (or, outside an image, one token
    by the plain rules), then draw the next drafts. Shares the plain step's state, so the loop can alternate.
    """

    def __init__(self, plain: PlainStep, window: int):
        rules, device = plain.rules, plain.out.device
        self.plain, self.window_cap = plain, window
        self.code_ids = torch.nonzero(rules.is_image).flatten()
        prompts, codes = plain.n_prompts, len(self.code_ids)
        self.window = torch.zeros(prompts, dtype=torch.long, device=device)  # the drafts each prompt feeds next
        self.drafts = torch.zeros(prompts, window, dtype=torch.long, device=device)  # code indices
        self.greedy = plain.config.image_temperature == 0
        self.draft_q = None if self.greedy else torch.zeros(prompts, window, codes, device=device)
        # noise, drawn outside the step by the seeded generator (draw_noise)
        self.noise_buffers: list[torch.Tensor] = []
        if not self.greedy:
            self.uniforms = torch.zeros(2, prompts, window, device=device)  # acceptance, coupling
            # exponential noise: the replacement code, then the drafts
            self.exponentials = torch.zeros(prompts, window + 1, codes, device=device)
            self.noise_buffers = [self.uniforms, self.exponentials]

    def state(self) -> list[torch.Tensor]:
        """Every tensor the step changes in place (a CUDA graph must keep them at fixed addresses)."""
        own = [self.window, self.drafts, *self.noise_buffers] + ([] if self.draft_q is None else [self.draft_q])
        return self.plain.state() + own

    def draw_noise(self, generator: torch.Generator | None) -> None:
        """This forward's acceptance, coupling and draw noise, in place."""
        if not self.greedy:
            self.uniforms.uniform_(generator=generator)
            exponential_noise(self.exponentials, generator)

    def __call__(self, noise: torch.Tensor | None) -> None:
        """Feed, verify, commit, draft; noise: the plain step's (for prompts outside an image)."""
        plain, rules, config = self.plain, self.plain.rules, self.plain.config
        n_prompts, width = plain.n_prompts, self.window_cap + 1
        device = plain.out.device
        live, was_in_image = ~rules.done, rules.in_image.clone()
        fed_window = self.window.clone()
        drafting = fed_window > 0
        chunk = torch.cat([plain.token[:, None], self.code_ids[self.drafts]], dim=1)
        offsets = torch.arange(width, device=device)
        valid = (offsets[None, :] <= fed_window[:, None]) & live[:, None]
        logits = plain.feeder.feed(chunk.repeat(plain.n_streams, 1), valid.repeat(plain.n_streams, 1))

        # what each prompt commits: its accepted drafts and one more code, or one token by the plain rules
        target = _image_targets(logits, self.code_ids, n_prompts, config)
        uniform = None if self.greedy else self.uniforms[0]
        accepted, code_after = _verify(target, self.drafts, self.draft_q, fed_window, uniform,
                                       None if self.greedy else self.exponentials[:, 0])
        by_rules = choose_next_tokens(logits[:, 0], n_prompts, rules, plain.seen_text, config, noise,
                                      plain.pad_id)
        commit = torch.cat([chunk[:, 1:], chunk[:, :1]], dim=1)
        commit.scatter_(1, accepted[:, None], self.code_ids[code_after][:, None])
        commit[:, 0] = torch.where(drafting, commit[:, 0], by_rules)
        counts = torch.where(drafting, accepted + 1, live.long())
        for column in range(width):
            plain.take(commit[:, column], counts > column)
        # the fed token and the accepted drafts stay in the cache; the last committed token is fed next
        plain.feeder.advance(counts.repeat(plain.n_streams))
        plain.token.copy_(commit.gather(1, (counts - 1).clamp(min=0)[:, None])[:, 0])

        self._draft(target, counts, fed_window, was_in_image)

    def start(self, logits: torch.Tensor, was_in_image: torch.Tensor) -> None:
        """The first drafts, from the prefill's logits (rows, V), for prompts that were inside an image before it."""
        target = _image_targets(logits[:, None], self.code_ids, self.plain.n_prompts, self.plain.config)
        self._draft(target, torch.ones_like(self.window), torch.zeros_like(self.window), was_in_image)

    def _draft(self, target: torch.Tensor, counts: torch.Tensor, fed_window: torch.Tensor,
               was_in_image: torch.Tensor) -> None:
        """The next window and drafts, for the codes after each prompt's last committed one.

        target: the chunk's _image_targets; counts: the tokens each prompt kept of it; fed_window: the drafts it
        fed; was_in_image: which prompts were inside an image before the chunk (the others have no image p yet).
        Where the chunk reached a draft's code, the draft is a draw from the chunk's p there (its context held older
        drafts, which only makes it a worse proposal, never a wrong one: q is whatever the draft was drawn from).
        Codes past the chunk's end are drawn from its last p rather than uniformly: neighbouring codes of an image
        are alike. A prompt that just opened an image takes its first code by the plain rules.
        """
        rules = self.plain.rules
        remaining = rules.n_codes - rules.codes_done
        self.window.copy_(torch.where(rules.in_image & ~rules.done & was_in_image & (remaining >= 2),
                                      (remaining - 1).clamp(max=self.window_cap), 0))
        offsets = torch.arange(self.window_cap, device=counts.device)
        position = counts[:, None] + offsets[None, :]  # in the chunk, where each next draft's code sits
        source = torch.minimum(position, fed_window[:, None])
        if self.greedy:
            self.drafts.copy_(target.gather(1, source))
            return
        new_q = target.gather(1, source[..., None].expand(-1, -1, target.shape[-1]))
        has_old = position < fed_window[:, None]  # a draft was fed there: couple the new one with it
        old = position.clamp(max=self.window_cap - 1)
        old_q = self.draft_q.gather(1, old[..., None].expand(-1, -1, target.shape[-1]))
        drafts = coupled_drafts(new_q, self.drafts.gather(1, old), old_q, has_old, self.uniforms[1],
                                self.exponentials[:, 1:])
        self.drafts.copy_(drafts)
        self.draft_q.copy_(new_q)
