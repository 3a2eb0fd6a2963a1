"""The KV cache the sampler decodes into: keys and values per layer, with each cached token's document and
position."""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys/values per layer (B, n_kv_heads, max_len, head_dim), with each cached key's
    document id and position; `length` keys are filled. Rows share one length (left-pad prompts
    with document id -1)."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        dtype = dtype or torch.get_default_dtype()
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.document_ids = torch.full((batch_size, max_len), -1, dtype=torch.long, device=device)
        self.positions = torch.zeros((batch_size, max_len), dtype=torch.long, device=device)
        self.length = 0
        self.max_len = max_len
        self.batch_size = batch_size

    def reset(self) -> None:
        """Forget every cached token (the buffers are reused)."""
        self.length = 0
        self.document_ids.fill_(-1)

    def truncate(self, length: int) -> None:
        """Forget every cached token from `length` on (a rollback, e.g. of rejected drafts appended by a forward).

        The keys before `length` stay valid: causal attention never let them see the tokens after (unless
        image_bidirectional let image tokens fed in one forward see each other).
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"KVCache.truncate: length {length} is outside [0, {self.length}] (the cached tokens)")
        self.document_ids[:, length : self.length] = -1
        self.length = length

    def reserve(self, document_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Record the metadata of the next T tokens (called once per forward, before the layers)."""
        batch, length = document_ids.shape
        if batch != self.batch_size:
            raise ValueError(f"KVCache: batch {batch} does not match the cache's batch size {self.batch_size}")
        if self.length + length > self.max_len:
            raise ValueError(
                f"KVCache: {self.length} cached + {length} new tokens exceed max_len {self.max_len}; "
                "create the cache with a larger max_len"
            )
        self.document_ids[:, self.length : self.length + length] = document_ids
        self.positions[:, self.length : self.length + length] = position_ids

    def record_at(self, slot: torch.Tensor, document_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Record T tokens per row (B, T) from each row's cache index slot[b] on: the static decode step's reserve."""
        index = slot[:, None] + torch.arange(document_ids.shape[1], device=slot.device)
        self.document_ids.scatter_(1, index, document_ids)
        self.positions.scatter_(1, index, position_ids)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               slot: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this layer's new keys/values at `length` and return all keys/values up to the new end; with `slot`
        ((B,): each row's cache index) write row b's T new ones from slot[b] on and return the whole buffers
        (fixed shapes, no host sync)."""
        if slot is not None:
            batch, heads, length, dim = k.shape
            index = (slot[:, None] + torch.arange(length, device=slot.device))[:, None, :, None]
            index = index.expand(batch, heads, length, dim)
            self.keys[layer].scatter_(2, index, k)
            self.values[layer].scatter_(2, index, v)
            return self.keys[layer], self.values[layer]
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
