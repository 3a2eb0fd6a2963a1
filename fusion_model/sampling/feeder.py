"""The cache feeder: feeds tokens to the model for every row, with or without a KV cache; returns logits."""

from __future__ import annotations

import torch

from fusion_model.sampling.protocol import DecodableModel


def round_up(count: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= count."""
    return -(-count // multiple) * multiple


class CacheFeeder:
    """Feeds tokens to the model for all rows, with or without a KV cache; returns their logits (the choice of the
    next tokens is the steps': step.PlainStep, speculative.SpeculativeStep).

    With a cache, every row has its own write index (`slot`): a forward writes T tokens per row from there on and
    `advance` moves each row on by the tokens it keeps, so the next forward overwrites the rest. Every shape is
    fixed. Without a cache (the reference path) the whole sequence is recomputed every forward, and tokens a row
    does not keep become padding (document -1) when another row keeps more.
    """

    def __init__(
        self,
        model: DecodableModel,
        rows: list[list[int]],
        pad_id: int,
        steps: int,
        use_cache: bool,
        device,
        chunk: int = 1,
        cache_multiple: int = 1,
    ):
        """chunk: the most tokens a row is fed in one forward after the prefill (speculative decoding's window + 1);
        cache_multiple: round the cache length up to a multiple of it (a compiled step's shapes then repeat).

        The model must support the cache when use_cache (generate_ids checks `supports_kv_cache` first)."""
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
        # a row keeps at most `steps` tokens after its prompt, and a forward writes up to `chunk` past its last one
        length = round_up(width + steps + chunk, cache_multiple)
        self.cache = model.new_kv_cache(n, length, device=device) if use_cache else None
        self.slot = torch.full((n,), width, dtype=torch.long, device=device)  # each row's next cache index

    def prefill(self) -> torch.Tensor:
        """Run the prompts; the logits at every row's last token, (rows, V)."""
        return self._logits(self.ids, self.pos, self.docs, 1)[:, 0]

    def step(self, token: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Feed one token per row and keep it (finished rows get a padding token that attends to nothing real);
        the logits after it, (rows, V)."""
        logits = self.feed(token[:, None], live[:, None])[:, 0]
        self.advance(live.long())
        return logits

    def feed(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Feed tokens (rows, T) after each row's kept ones, each row's valid ones a prefix and the rest padding;
        the logits after each, (rows, T, V). Nothing is kept until `advance`."""
        tokens = torch.where(valid, tokens, torch.full_like(tokens, self.pad_id))
        pos = (self.next_pos[:, None] + torch.arange(tokens.shape[1], device=tokens.device)).clamp(max=self.max_pos)
        docs = torch.where(valid, 0, -1)
        if self.use_cache:
            return self.model.head(self.model.decode_hidden(tokens, pos, docs, self.slot, self.cache)).float()
        self.ids, self.pos, self.docs = (torch.cat(pair, dim=1) for pair in
                                         zip((self.ids, self.pos, self.docs), (tokens, pos, docs)))
        self.fed = tokens.shape[1]
        return self._logits(self.ids, self.pos, self.docs, self.fed)

    def advance(self, counts: torch.Tensor) -> None:
        """Keep the first counts[r] tokens row r was just fed (0 for a finished row); forget the rest.

        The kept keys saw only kept tokens (attention is causal), so they stay valid."""
        self.next_pos += counts
        if self.use_cache:
            self.slot += counts
            return
        # no cache: drop the columns no row keeps; a row's dropped tokens before the longest kept prefix become
        # padding (document -1)
        kept = int(counts.max())
        start = self.ids.shape[1] - self.fed
        self.ids, self.pos, self.docs = (a[:, : start + kept] for a in (self.ids, self.pos, self.docs))
        dropped = torch.arange(kept, device=counts.device)[None, :] >= counts[:, None]
        self.docs[:, start:].masked_fill_(dropped, -1)

    def _logits(self, ids: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor, last: int) -> torch.Tensor:
        """The logits (rows, last, V) at the last `last` columns of a forward over ids (appended to the cache)."""
        # the head on the last columns only: a long prompt never materialises (rows, T, V) logits
        hidden = self.model.forward_hidden(ids, position_ids=pos, document_ids=docs, kv_cache=self.cache)
        return self.model.head(hidden[:, -last:]).float()
