"""Speculative Jacobi decoding (SJD, Teng et al. 2024, arXiv 2410.01699) of image codes: several codes per forward
pass, the same distribution as the plain sampler.

Inside an image a prompt keeps up to `speculative_window` drafted codes after its last committed token. One
forward feeds, for every row of every stream, that token and the drafts; draft i (drawn earlier from q_i) is
accepted with probability min(1, p_i(x)/q_i(x)) against the target p_i (guidance, image mask, temperature,
top-k, top-p exactly as the plain sampler), left to right; the first rejected one is replaced by a draw from
normalize(max(0, p_i − q_i)), and when all are accepted one more code is drawn from the p after the last draft,
so each committed code is an exact draw from p given the committed prefix. At temperature 0 a draft is accepted
iff it is p's argmax and the replacement is the argmax: greedy decoding, token for token.

Rows commit different numbers of tokens per forward; the KV cache keeps one length for all rows, so a row that
committed fewer leaves holes (document id -1: no query attends to them, as with the prompts' left padding)
where the others kept accepted drafts. Holes are squeezed out when the cache fills (`_ChunkDecoder._compact`).
Prompts outside images (text, `<boi>`, `<eoi>`) take one token per forward in the same forwards, through the
plain sampler's own rules.
"""

from __future__ import annotations

from typing import Any

import torch

from fusion_model.sampling import (
    ModalityRules,
    SamplingConfig,
    Streams,
    _Decoder,
    _guided,
    _next_tokens,
    _SeenText,
    truncate_logits,
)

# cache slots for holes beyond the drafts, as a fraction of the tokens to generate: a compaction copies the
# whole cache once, so leave room for many forwards between two
HOLE_ROOM = 0.25


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of non-negative, not necessarily normalised weights (..., C): the exponential race."""
    race = torch.empty_like(weights).exponential_(generator=generator).clamp_min_(1e-20)
    return (weights / race).argmax(dim=-1)


class _ChunkDecoder(_Decoder):
    """A _Decoder that feeds several tokens per row and forward, then keeps a per-row prefix of them."""

    def __init__(self, model: torch.nn.Module, rows: list[list[int]], pad_id: int, steps: int, use_cache: bool,
                 device: torch.device, window: int):
        # a forward adds at most window + 1 tokens; after a compaction a row holds at most prompt + steps - 1
        super().__init__(model, rows, pad_id, steps, use_cache, device,
                         extra_cache=window + 1 + int(HOLE_ROOM * steps))
        self.chunk_start = 0  # cache length (or column count without a cache) before the last chunk

    def _length(self) -> int:
        return self.cache.length if self.use_cache else self.ids.shape[1]

    def feed(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Append tokens (rows, T), each row's valid ones a prefix, the rest padding; logits (rows, T, V)."""
        width = tokens.shape[1]
        if self.use_cache and self.cache.length + width > self.cache.max_len:
            self._compact()
        tokens = torch.where(valid, tokens, torch.full_like(tokens, self.pad_id))
        offsets = torch.arange(width, device=tokens.device)
        pos = (self.next_pos[:, None] + offsets).clamp(max=self.max_pos)
        docs = torch.where(valid, 0, -1)
        self.chunk_start = self._length()
        if self.use_cache:
            return self._chunk_logits(tokens, pos, docs, width)
        self.ids, self.pos, self.docs = (torch.cat(pair, dim=1) for pair in
                                         zip((self.ids, self.pos, self.docs), (tokens, pos, docs)))
        return self._chunk_logits(self.ids, self.pos, self.docs, width)

    def keep(self, counts: torch.Tensor) -> None:
        """Keep the first counts[r] tokens of row r's last chunk (0 for a padding row); forget the rest.

        The kept keys saw only committed tokens (attention is causal), so they stay valid; a row's dropped
        slots before the longest kept prefix become holes (document -1).
        """
        kept = int(counts.max())
        end = self.chunk_start + kept
        if self.use_cache:
            self.cache.truncate(end)
            docs = self.cache.document_ids
        else:
            self.ids, self.pos, self.docs = self.ids[:, :end], self.pos[:, :end], self.docs[:, :end]
            docs = self.docs
        hole = torch.arange(kept, device=counts.device)[None, :] >= counts[:, None]
        docs[:, self.chunk_start : end].masked_fill_(hole, -1)
        self.next_pos = self.next_pos + counts

    def _compact(self) -> None:
        """Squeeze the holes out of the cache: each row's cached tokens move right, in order, padding before.

        Attention depends only on which keys a query may see (document ids, order) and on the positions stored
        with them, so moving them changes no logit beyond float summation order.
        """
        cache = self.cache
        length = cache.length
        real = cache.document_ids[:, :length] >= 0
        new_length = int(real.sum(dim=1).max())
        # a stable sort puts each row's holes first and its real keys after them, in their order
        order = torch.argsort(real.long(), dim=1, stable=True)[:, length - new_length :]
        for buffers in (cache.keys, cache.values):
            for buffer in buffers:
                index = order[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[3])
                buffer[:, :, :new_length] = buffer[:, :, :length].gather(2, index)
        cache.document_ids[:, :new_length] = cache.document_ids[:, :length].gather(1, order)
        cache.positions[:, :new_length] = cache.positions[:, :length].gather(1, order)
        cache.truncate(new_length)

    def _chunk_logits(self, ids: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor, width: int) -> torch.Tensor:
        head = getattr(self.model, "head", None)
        if head is None or not hasattr(self.model, "forward_hidden"):
            return self.model(ids, position_ids=pos, document_ids=docs, kv_cache=self.cache)[:, -width:].float()
        hidden = self.model.forward_hidden(ids, position_ids=pos, document_ids=docs, kv_cache=self.cache)
        return head(hidden[:, -width:]).float()


def _image_targets(
    logits: torch.Tensor, code_ids: torch.Tensor, n_prompts: int, config: SamplingConfig
) -> torch.Tensor:
    """The plain sampler's image-code distribution after each chunk position, (prompts, T, codes).

    At temperature 0, the argmax code instead, (prompts, T). Same steps as the plain sampler for an image
    token: guidance mix, image ids only, top-k / top-p, then temperature; the ids outside the image block
    are -inf there, so working on the block alone changes nothing.
    """
    rows, width, _ = logits.shape
    # rows are stream-major (stream, prompt), so (stream, prompt, position) flattens into _guided's row layout
    codes = logits.index_select(-1, code_ids).float().reshape(rows * width, -1)
    everywhere = torch.ones(n_prompts * width, dtype=torch.bool, device=logits.device)
    mixed = _guided(codes, n_prompts * width, everywhere, config)
    top_k = torch.full((len(mixed),), config.image_top_k, device=logits.device)
    top_p = torch.full((len(mixed),), config.image_top_p, device=logits.device)
    kept = truncate_logits(mixed, top_k, top_p)
    if config.image_temperature == 0:
        return kept.argmax(dim=-1).view(n_prompts, width)
    temperature = torch.full((len(kept), 1), config.image_temperature, device=logits.device)
    return (kept / temperature.clamp_min(1e-6)).softmax(dim=-1).view(n_prompts, width, -1)


def _verify(
    target: torch.Tensor,
    drafts: torch.Tensor,
    draft_q: torch.Tensor | None,
    window: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts per prompt, the code after them): speculative sampling's accept / replace rule.

    target: _image_targets of this chunk; drafts (prompts, window) code indices drawn from draft_q
    (prompts, window, codes), None at temperature 0 (greedy); window: the drafts each prompt fed.
    """
    n_prompts, width = target.shape[:2]
    checked = width - 1
    rows = torch.arange(n_prompts, device=target.device)
    in_window = torch.arange(checked, device=target.device)[None, :] < window[:, None]
    drafted = drafts[:, :checked]
    if draft_q is None:  # greedy: a draft stands iff it is the argmax
        ok = drafted == target[:, :checked]
    else:
        p_draft = target[:, :checked].gather(-1, drafted[..., None]).squeeze(-1)
        q_draft = draft_q[:, :checked].gather(-1, drafted[..., None]).squeeze(-1)
        uniform = torch.rand(drafted.shape, generator=generator, device=target.device)
        ok = uniform * q_draft < p_draft  # u < p/q: accepted with probability min(1, p/q)
    accepted = (ok & in_window).long().cumprod(dim=1).sum(dim=1)
    if draft_q is None:
        return accepted, target[rows, accepted]
    p_next = target[rows, accepted]
    rejected = accepted < window
    residual = (p_next - draft_q[rows, accepted.clamp(max=draft_q.shape[1] - 1)]).clamp_min(0)
    # p ≤ q everywhere can only come from rounding (a rejection needs p(x) < q(x), so mass elsewhere)
    usable = rejected[:, None] & (residual.sum(dim=-1, keepdim=True) > 0)
    return accepted, _draw(torch.where(usable, residual, p_next), generator)


def speculative_decode(
    model: torch.nn.Module,
    vocab: Any,
    streams: Streams,
    rules: ModalityRules,
    seen: _SeenText | None,
    config: SamplingConfig,
    generator: torch.Generator | None,
    out: torch.Tensor,
) -> int:
    """The decode loop with speculative Jacobi decoding inside images; fills `out`, returns the forwards made.

    Same contract as sampling._plain_decode: `rules` and `seen` move on as tokens are committed.
    """
    if getattr(model.config, "image_bidirectional", False):
        raise ValueError(
            "speculative_window needs causal attention inside images, but the model has image_bidirectional=True: "
            "drafts fed in one forward would see each other; use speculative_window=0"
        )
    device = out.device
    window_cap = int(config.speculative_window)
    n_prompts, n_streams = streams.n_prompts, streams.n_streams
    code_ids = torch.nonzero(rules.is_image).flatten()
    greedy = config.image_temperature == 0
    decoder = _ChunkDecoder(model, streams.rows, vocab.pad_id, rules.steps, config.use_kv_cache, device, window_cap)
    prompt_index = torch.arange(n_prompts, device=device)
    draft_offsets = torch.arange(window_cap, device=device)

    logits = decoder.prefill()[:, None]  # a chunk of one position, no drafts
    forwards, fed = 1, False
    window = torch.zeros(n_prompts, dtype=torch.long, device=device)
    drafts = torch.zeros(n_prompts, window_cap, dtype=torch.long, device=device)
    draft_q: torch.Tensor | None = None  # what the drafts were drawn from (None when greedy)
    while True:
        live = ~rules.done
        was_in_image = rules.in_image.clone()
        fed_window, drafting = window, window > 0
        # (no prompt in an image: nothing to draft or check, and no random draw spent, so text decoding
        # gives the plain sampler's tokens for a seed)
        target = _image_targets(logits, code_ids, n_prompts, config) if bool((live & was_in_image).any()) else None

        # what each prompt commits: its accepted drafts and one more code, or one token by the plain rules
        width = logits.shape[1]
        commit = torch.full((n_prompts, width), vocab.pad_id, dtype=torch.long, device=device)
        accepted = torch.zeros_like(window)
        if bool(drafting.any()):
            accepted, code_after = _verify(target, drafts, draft_q, window, generator)
            commit[:, : width - 1] = code_ids[drafts[:, : width - 1]]
            commit[prompt_index, accepted] = code_ids[code_after]
        if bool((live & ~drafting).any()):
            plain = _next_tokens(logits[:, 0], n_prompts, rules, seen, config, generator, vocab.pad_id)
            commit[:, 0] = torch.where(drafting, commit[:, 0], plain)
        counts = torch.where(drafting, accepted + 1, live.long())
        for column in range(int(counts.max())):
            take = counts > column
            token = commit[:, column]
            out[prompt_index[take], rules.n_new[take]] = token[take]
            if seen is not None:
                seen.add(token, take & ~rules.done)
            rules.advance(token, take)
        if fed:  # the fed token and the accepted drafts stay in the cache; the code after them is fed next
            decoder.keep(torch.where(drafting, accepted + 1, live.long()).repeat(n_streams))
        if rules.all_done:
            return forwards

        # Next drafts, for the codes after the last committed one. Where this chunk reached that code, the draft
        # is a draw from this forward's p there (the Jacobi update; its context held older drafts, which only
        # makes it a worse proposal, never a wrong one: q is whatever the draft was drawn from). Codes past the
        # chunk's end are drawn from the chunk's last p rather than uniformly: neighbouring codes of an image are
        # alike, so repeating the last prediction is the better guess (greedy, it fills a flat region exactly).
        # A prompt without an image p yet (it just opened an image) takes its first code by the plain rules.
        remaining = rules.n_codes - rules.codes_done
        window = torch.where(
            rules.in_image & ~rules.done & was_in_image & (remaining >= 2),
            (remaining - 1).clamp(max=window_cap), 0,
        )
        if bool((window > 0).any()):
            source = torch.minimum(counts[:, None] + draft_offsets, fed_window[:, None])
            if greedy:
                drafts = target.gather(1, source)
            else:
                draft_q = target.gather(1, source[..., None].expand(-1, -1, target.shape[-1]))
                drafts = _draw(draft_q, generator)

        chunk_width = 1 + int(window.max())
        last_committed = commit.gather(1, (counts - 1).clamp(min=0)[:, None])
        chunk = torch.cat([last_committed, code_ids[drafts[:, : chunk_width - 1]]], dim=1)
        valid = (torch.arange(chunk_width, device=device)[None, :] <= window[:, None]) & ~rules.done[:, None]
        logits = decoder.feed(chunk.repeat(n_streams, 1), valid.repeat(n_streams, 1))
        forwards, fed = forwards + 1, True
