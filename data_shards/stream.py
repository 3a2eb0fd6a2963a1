"""Packed, split and exactly resumable streaming of token shards into (B, T) batches: the stream's public API.

Import the stream from here; each part lives in the module of its job, lowest first:

- `data_shards.intervals`: sets of an epoch's positions as intervals (what a loader state records as consumed);
- `data_shards.epoch_layout`: `EpochLayout`, the epoch's order of rows, which positions each rank's batch reads,
  and the resumable position over them (`state_dict`, `load_state_dict`, `merge_states`), also under another
  world size, batch size or accumulation; `DEFAULT_SHUFFLE_WINDOW`;
- `data_shards.packed_stream`: `PackedTokenStream`, the IterableDataset (an EpochLayout) that opens and checks the
  shards and makes the batches; `DATA_ERROR`, the key of a batch that carries a data error; `document_causal_mask`;
- `data_shards.loader`: `ResumableDataLoader` / `make_dataloader`, exact resume with workers and under Lightning,
  and `with_window_denominators`, each optimizer step's loss denominators;
- `data_shards.plan`: the per-shard row plans (`pack_rows`).
"""

from __future__ import annotations

from data_shards.epoch_layout import DEFAULT_SHUFFLE_WINDOW
from data_shards.loader import ResumableDataLoader, make_dataloader, with_window_denominators
from data_shards.packed_stream import DATA_ERROR, PackedTokenStream, document_causal_mask
from data_shards.plan import pack_rows

__all__ = ["DATA_ERROR", "DEFAULT_SHUFFLE_WINDOW", "PackedTokenStream", "ResumableDataLoader", "document_causal_mask",
           "make_dataloader", "pack_rows", "with_window_denominators"]
