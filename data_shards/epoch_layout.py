"""An epoch's order of rows, which rows each of a rank's batches reads, and the resumable position over them.

An epoch's positions: the shards in a permutation seeded by (seed, epoch), their rows concatenated in that order,
then shuffled within consecutive windows of `shuffle_window` positions (each window by (seed, epoch, window)). With
S = world_size x batch_size x accumulate (the rows of one optimizer step's global batch), the positions form S
contiguous streams of ceil(rows / S) positions (positions past the last row are padding rows); optimizer step t reads
position t of every stream. Rank r owns streams r P .. r P + P - 1 (P = batch_size x accumulate): a contiguous range
of 1/world of the epoch, hence only its own shards (plus its windows' edges). Its rows, in order, take one position
from each of its streams per step, and its batch j is its rows [j B, (j + 1) B), so `len()` = ceil(rows / S) x
accumulate. What a step reads depends only on S: 2 ranks x 2 rows read the step of 1 rank x 4, and 2 micro-batches
of 2 accumulated read the rows of one batch of 4, in order.

Resume: the state holds the set of consumed positions of the epoch (intervals). Loading it under any world size,
batch size or accumulation deals the positions not yet consumed, in position order, into the new S contiguous streams;
`len()` keeps its value for the new S and the position becomes batch `len() - remaining batches` of the epoch, so
every rank gets the same number of batches and every row is read exactly once across the old and new runs. When
nothing changed (and the state is at a step boundary) this is the uninterrupted layout (bit-exact).

All of it is arithmetic on every shard's row count: `EpochLayout` opens no file (`PackedTokenStream` is the
EpochLayout that reads the rows).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections import OrderedDict

import numpy as np
import torch

from data_shards.intervals import Intervals, PositionSequence, complement, normalize

__all__ = ["DEFAULT_SHUFFLE_WINDOW", "LAYOUT_VERSION", "EpochLayout"]

# Version of the row layout (how rows are formed and ordered in an epoch); a loader state of another version
# cannot continue mid-epoch. 1: one global packing and permutation of rows; 2: per-shard packing, shard-level plan.
LAYOUT_VERSION = 2
DEFAULT_SHUFFLE_WINDOW = 1 << 16  # positions (rows) shuffled together: 256M tokens at seq_len 4096


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _stream_consumption(sequence: PositionSequence, first: int, num_batches: int, batch_size: int, accumulate: int,
                        counts: dict[int, tuple[int, int]]) -> Intervals:
    """Positions read by ranks {rank: (from batch, to batch)} in a layout dealing `sequence` from batch `first`.

    A rank owns P = batch_size x accumulate streams of span = (num_batches - first) / accumulate indices each;
    its rows, in order, take one index from each of its streams per optimizer step, and batch j is its rows
    [(j - first) B, (j - first + 1) B): stream i of rank r has read ceil((k B - i) / P) indices after k batches.
    """
    per_rank = batch_size * accumulate
    span = (num_batches - first) // accumulate
    out: Intervals = []
    for rank, (low, high) in counts.items():
        low, high = max(low - first, 0), max(high - first, 0)
        for i in range(per_rank):
            start = min(max(0, -(-(low * batch_size - i) // per_rank)), span)
            stop = min(max(0, -(-(high * batch_size - i) // per_rank)), span)
            if stop > start:
                s = rank * per_rank + i
                out += sequence.spans(s * span + start, s * span + stop)
    return out


class EpochLayout:
    """The epoch plan of one rank over shards of known row counts: each epoch's order of rows, the positions each
    of this rank's `len(self)` batches reads, and its position in the epoch as a state that resumes exactly, also
    under another world size, batch size or accumulation.

    One epoch is `len(self)` batches for this rank; `set_epoch(e)` chooses the shuffle.
    """

    def __init__(
        self,
        shard_rows: np.ndarray,
        seq_len: int,
        batch_size: int,
        *,
        data_key: str,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
        accumulate: int = 1,
    ) -> None:
        """shard_rows: every shard's row count at seq_len, in manifest order (shard i is index i); data_key: the
        data's identity (with seq_len, what fixes the rows: both enter `order_signature`); the rest as in
        PackedTokenStream."""
        super().__init__()
        self.check_sizes(seq_len, batch_size, shuffle_window, accumulate)
        self.accumulate = int(accumulate)
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.shuffle_window = int(shuffle_window)
        self.rank, self.world_size = rank, world_size
        self._data_key = data_key
        # rows per shard (manifest order): all the epoch plan needs, O(shards) int64s
        self.shard_rows = shard_rows
        self.num_rows = int(self.shard_rows.sum())
        self.epoch = 0
        self._start_batch = 0
        self._consumed = 0
        # After a resume that re-deals the rest of an epoch: (epoch, first batch, positions not consumed then).
        self._resume: tuple[int, int, Intervals] | None = None
        self._reset_layout_caches()

    @staticmethod
    def check_sizes(seq_len: int, batch_size: int, shuffle_window: int, accumulate: int) -> None:
        """Refuse sizes that are not positive (a stream checks them before it reads any file)."""
        if seq_len < 1 or batch_size < 1 or shuffle_window < 1 or accumulate < 1:
            raise ValueError(f"seq_len, batch_size, shuffle_window and accumulate must be positive, got {seq_len}, "
                             f"{batch_size}, {shuffle_window}, {accumulate}")

    def _reset_layout_caches(self) -> None:
        """The epochs' shard orders and window permutations, recomputed on demand (a worker makes its own)."""
        self._orders: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # epoch -> (order, cum rows)
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()  # (epoch, window) -> permutation

    # -- the epoch's order and this rank's positions ---------------------------------------------------
    def world(self) -> tuple[int, int]:
        """(rank, world_size): given ones, else torch.distributed's, else RANK / WORLD_SIZE, else (0, 1)."""
        rank, world = _resolve_rank(self.rank, self.world_size)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside world_size {world}")
        return rank, world

    def __len__(self) -> int:
        """Batches per epoch for this rank (the same on every rank and in every epoch; a multiple of accumulate)."""
        return -(-self.num_rows // self._streams()) * self.accumulate

    def _streams(self) -> int:
        """Streams of the epoch's positions: one per row of an optimizer step's global batch."""
        _, world = self.world()
        return world * self.batch_size * self.accumulate

    def _layout(self, epoch: int) -> tuple[int, PositionSequence]:
        """(first batch, the positions it deals from that batch on) for `epoch`."""
        if self._resume is not None and self._resume[0] == epoch:
            return self._resume[1], PositionSequence(self._resume[2])
        return 0, PositionSequence([(0, self.num_rows)] if self.num_rows else [])

    def shard_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard indices in the epoch's order, cumulative rows along that order): position p before the window
        shuffle is row p - cum[q] of shard order[q], where cum[q] <= p < cum[q + 1]."""
        if epoch not in self._orders:
            order = np.arange(len(self.shard_rows))
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shard_rows))
            self._orders[epoch] = (order, np.concatenate([[0], np.cumsum(self.shard_rows[order])]).astype(np.int64))
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
        return self._orders[epoch]

    def _window(self, epoch: int, window: int) -> np.ndarray:
        key = (epoch, window)
        if key not in self._windows:
            size = min(self.shuffle_window, self.num_rows - window * self.shuffle_window)
            self._windows[key] = np.random.default_rng([self.seed, epoch, window]).permutation(size)
            while len(self._windows) > 2 * self.batch_size * self.accumulate + 2:
                self._windows.popitem(last=False)
        self._windows.move_to_end(key)
        return self._windows[key]

    def locate(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, row within the shard) of each of the epoch's positions (each in [0, num_rows))."""
        positions = np.asarray(positions, dtype=np.int64)
        unshuffled = positions.copy()
        if self.shuffle:
            for i, p in enumerate(positions.tolist()):
                window, at = divmod(p, self.shuffle_window)
                unshuffled[i] = window * self.shuffle_window + self._window(epoch, window)[at]
        order, cum = self.shard_order(epoch)
        q = np.searchsorted(cum, unshuffled, side="right") - 1
        return order[q], unshuffled - cum[q]

    def _window_shards(self, epoch: int, positions: np.ndarray) -> set[int]:
        """The shards the windows of `positions` draw from (the tables a rank may need while in them)."""
        order, cum = self.shard_order(epoch)
        shards: set[int] = set()
        step = self.shuffle_window if self.shuffle else 1
        for window in {int(p) // step for p in positions.tolist()}:
            low, high = window * step, min((window + 1) * step, self.num_rows)
            q0, q1 = np.searchsorted(cum, [low, high - 1], side="right") - 1
            shards.update(order[q0 : q1 + 1].tolist())
        return shards

    def batch_positions(self, epoch: int, batch: int) -> np.ndarray:
        """The epoch's positions this rank's batch number `batch` reads, one per row (-1 = padding row)."""
        return self._rank_positions(epoch, (batch - self._layout(epoch)[0]) * self.batch_size + np.arange(self.batch_size))

    def _rank_positions(self, epoch: int, rows: np.ndarray) -> np.ndarray:
        """Positions of this rank's rows number `rows` (counted from the layout's first batch; -1 = padding)."""
        rank, _ = self.world()
        first, sequence = self._layout(epoch)
        per_rank = self.batch_size * self.accumulate
        span = (len(self) - first) // self.accumulate
        step, stream = np.divmod(rows, per_rank)
        index = (rank * per_rank + stream) * span + step
        valid = (index < sequence.size) & (rows >= 0) & (step < span)
        positions = np.full(len(rows), -1, dtype=np.int64)
        if valid.any():
            positions[valid] = sequence.at(index[valid])
        return positions

    def _step_positions(self, epoch: int, batch: int) -> np.ndarray:
        """Positions every stream of this rank reads at the optimizer step(s) of batch `batch` (real ones)."""
        per_rank = self.batch_size * self.accumulate
        first, _ = self._layout(epoch)
        low, high = (batch - first) * self.batch_size // per_rank, ((batch - first + 1) * self.batch_size - 1) // per_rank
        rows = (np.arange(low, high + 1)[:, None] * per_rank + np.arange(per_rank)).ravel()
        positions = self._rank_positions(epoch, rows)
        return positions[positions >= 0]

    def rank_shards(self, epoch: int) -> set[int]:
        """The shards this rank may read in `epoch` from its current position: those of the windows its positions
        fall in (what it opens and checks)."""
        shards: set[int] = set()
        for batch in range(self._start_batch if epoch == self.epoch else 0, len(self)):
            shards |= self._window_shards(epoch, self._step_positions(epoch, batch))
        return shards

    # -- position ------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start the next pass at the beginning of `epoch`."""
        self._resume = None
        self.set_position(epoch, 0)

    def set_position(self, epoch: int, batches_consumed: int) -> None:
        """Start the next pass at batch `batches_consumed` of `epoch` (and fix rank/world for workers)."""
        self.rank, self.world_size = self.world()
        if self._resume is not None and (self._resume[0] != epoch or batches_consumed < self._resume[1]):
            self._resume = None  # a resume layout holds for the rest of its own epoch only
        self.epoch, self._start_batch, self._consumed = int(epoch), int(batches_consumed), int(batches_consumed)

    def signature(self) -> str:
        """A hash of what fixes the batch layout (rows and their order, batch size, world size)."""
        _, world = self.world()
        return hashlib.sha256(repr((self.order_signature(), self.batch_size, world, self.accumulate)).encode()
                              ).hexdigest()[:16]

    def order_signature(self) -> str:
        """A hash of what fixes the rows and their order in each epoch (data, seq_len, seed, shuffle, its window,
        the layout version)."""
        text = repr((self._data_key, self.seq_len, self.seed, self.shuffle, self.shuffle_window if self.shuffle else None,
                     LAYOUT_VERSION))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def state_dict(self) -> dict:
        """Position after the batches this process has yielded (use make_dataloader's with workers)."""
        return self.position_state(self.epoch, self._consumed)

    def position_state(self, epoch: int, batches_consumed: int) -> dict:
        """The resumable state for a position: (epoch, batches consumed), what fixes the layout, and the positions
        of the epoch the whole job has consumed once every rank consumed `batches_consumed` batches (`consumed`,
        intervals; `rows_consumed` counts them); `first`/`remaining` describe a re-dealt layout (after a resume)."""
        rank, world = self.world()
        first, sequence = self._layout(epoch)
        consumed = complement(sequence.intervals, self.num_rows) + _stream_consumption(
            sequence, first, len(self), self.batch_size, self.accumulate,
            {r: (first, batches_consumed) for r in range(world)})
        consumed = normalize(consumed)
        state = {"epoch": int(epoch), "batches_consumed": int(batches_consumed), "num_batches": len(self),
                 "signature": self.signature(), "order_signature": self.order_signature(), "layout": LAYOUT_VERSION,
                 "rank": rank, "world_size": world, "batch_size": self.batch_size, "accumulate": self.accumulate,
                 "num_rows": self.num_rows,
                 "rows_consumed": sum(b - a for a, b in consumed), "rows_taken": [],
                 "consumed": [list(iv) for iv in consumed]}
        if self._resume is not None and self._resume[0] == epoch:
            state["first"], state["remaining"] = first, [list(iv) for iv in sequence.intervals]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly at a state from `state_dict()` (or `merge_states`), also under another world size.

        With the same rows (data, seq_len, seed, shuffle, layout version) the next batches deal the positions not
        yet consumed into this world size x batch size's streams, and the position becomes batch `len(self) -
        remaining batches`: bit-exact when nothing changed. A state saved with other data or settings (or by a
        loader with another row layout) is accepted only at an epoch boundary (the next epoch starts); mid-epoch it
        is refused.
        """
        epoch, consumed = int(state["epoch"]), int(state["batches_consumed"])
        if "consumed" in state and state.get("order_signature") == self.order_signature():
            self._resume_at(epoch, normalize(state["consumed"]))
            return
        if state.get("signature") != self.signature():
            if consumed >= state.get("num_batches", float("inf")):
                epoch, consumed = epoch + 1, 0
            elif consumed != 0:
                if state.get("layout") != LAYOUT_VERSION:
                    raise ValueError(
                        f"loader state (epoch {epoch}, batch {consumed}) was saved by a loader with row layout "
                        f"{state.get('layout', 1)}, and this one packs rows per shard and orders them by a shard plan "
                        f"(layout {LAYOUT_VERSION}): exact resume mid-epoch is impossible: resume from an "
                        "end-of-epoch checkpoint or start a new epoch with set_epoch"
                    )
                raise ValueError(
                    f"loader state (epoch {epoch}, batch {consumed}) was saved for other data or settings "
                    "(shards, seq_len, seed, shuffle or shuffle_window differ); exact resume mid-epoch "
                    "is impossible: resume from an end-of-epoch checkpoint or start a new epoch with set_epoch"
                )
            warnings.warn(f"loader state was saved with other data or settings; starting epoch {epoch} afresh",
                          stacklevel=2)
        self._resume = None
        self.set_position(epoch, consumed)

    def _plain_consumed(self, batches: int) -> Intervals:
        """What the uninterrupted layout has consumed after `batches` batches of every rank."""
        _, world = self.world()
        sequence = PositionSequence([(0, self.num_rows)] if self.num_rows else [])
        return normalize(_stream_consumption(sequence, 0, len(self), self.batch_size, self.accumulate,
                                              {r: (0, batches) for r in range(world)}))

    def _resume_at(self, epoch: int, consumed: Intervals) -> None:
        remaining = complement(consumed, self.num_rows)
        left = sum(b - a for a, b in remaining)
        first = len(self) - -(-left // self._streams()) * self.accumulate
        # The plain layout reaches this position by itself (always so when the layout did not change):
        # keep it, so a resume under the same settings is the uninterrupted run bit for bit.
        plain = consumed == self._plain_consumed(first)
        self._resume = None if plain else (epoch, first, remaining)
        self.set_position(epoch, first)

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """One state from the `state_dict()` of every rank of a job, also when they consumed unequal counts.

        Its `consumed` is the union of what every rank read; `batches_consumed` is the lowest count and
        `rows_taken` lists the positions the ranks ahead read past it. `load_state_dict` deals only the rest.
        """
        if not states or any("consumed" not in s for s in states):
            raise ValueError("merge_states needs the state_dict() of every rank (states with consumed positions)")
        base = min(states, key=lambda s: s["batches_consumed"])
        for key in ("epoch", "order_signature", "world_size", "batch_size", "accumulate", "num_rows", "num_batches"):
            if len({s.get(key, 1) for s in states}) != 1:
                raise ValueError(f"states of one job must agree on {key}; got {sorted({s.get(key, 1) for s in states})}")
        world, batch, num_rows = base["world_size"], base["batch_size"], base["num_rows"]
        if sorted(s["rank"] for s in states) != list(range(world)):
            raise ValueError(f"need the state of each of ranks 0..{world - 1} once, got ranks "
                             f"{sorted(s['rank'] for s in states)}")
        first = int(base.get("first", 0))
        remaining = normalize(base["remaining"]) if "remaining" in base else [(0, num_rows)] if num_rows else []
        low = base["batches_consumed"]
        taken = _stream_consumption(PositionSequence(remaining), first, base["num_batches"], batch,
                                    base.get("accumulate", 1), {s["rank"]: (low, s["batches_consumed"]) for s in states})
        consumed = normalize([*map(tuple, base["consumed"]), *taken])
        rows_taken = sorted(p for a, b in taken for p in range(a, b))
        return {**base, "rank": None, "consumed": [list(iv) for iv in consumed],
                "rows_consumed": sum(b - a for a, b in consumed), "rows_taken": rows_taken}
