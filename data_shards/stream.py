"""Packed, split and exactly resumable streaming of token shards into (B, T) batches, planned at shard granularity.

Rows: every document longer than `seq_len` is cut into pieces of at most `seq_len` tokens (each piece is its own
document: positions restart at 0, it attends only to itself), and each shard's pieces are packed into rows of that
shard alone (best-fit decreasing, `data_shards.plan`), from its stored lengths only. The row count of every shard
is read from the dataset's plan file (`train.py shards plan`), so laying out an epoch costs O(shards), never an
open of every shard; a shard's piece and row tables are built when this rank first reads one of its rows and
dropped once it moves past the shard's shuffle window.

An epoch's positions: the shards in a permutation seeded by (seed, epoch), their rows concatenated in that order,
then shuffled within consecutive windows of `shuffle_window` positions (each window by (seed, epoch, window)). With
S = world_size x batch_size x accumulate (the rows of one optimizer step's global batch), the positions form S
contiguous streams of ceil(rows / S) positions (positions past the last row are padding rows); optimizer step t reads
position t of every stream. Rank r owns streams r P .. r P + P - 1 (P = batch_size x accumulate): a contiguous range
of 1/world of the epoch, hence only its own shards (plus its windows' edges). Its rows, in order, take one position
from each of its streams per step, and its batch j is its rows [j B, (j + 1) B), so `len()` = ceil(rows / S) x
accumulate. What a step reads depends only on S: 2 ranks x 2 rows read the step of 1 rank x 4, and 2 micro-batches
of 2 accumulated read the rows of one batch of 4, in order. A rank's batches go round-robin to DataLoader workers
starting at the resume position.

Integrity: a shard's files are size + sha256 checked (TokenShard's verify) the first time this process opens it,
before any of its rows are used; making a batch also starts checking the new shards of the next batch this process
will make in a background thread, so the hashing is mostly off the step's path. A failure raises ShardError naming the file; under the
loader the failing rank hands the error to the training step as a flagged batch (`DATA_ERROR`), which shares it in
the step's collective so every rank stops at the same step (`FusionLightningModule`).

Resume: the state holds the set of consumed positions of the epoch (intervals). Loading it under any world size,
batch size or accumulation deals the positions not yet consumed, in position order, into the new S contiguous streams;
`len()` keeps its value for the new S and the position becomes batch `len() - remaining batches` of the epoch, so
every rank gets the same number of batches and every row is read exactly once across the old and new runs. When
nothing changed (and the state is at a step boundary) this is the uninterrupted layout (bit-exact). The loader reports the renumbering as `resume_shift` (new position -
saved position) so a trainer that restored its own count of the epoch's batches can move it too.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_shards.plan import ShardRows, load_row_counts, pack_rows, plan_shard, read_index
from data_shards.raw import ShardError
from data_shards.token_shards import LATENT_KIND, TokenShard, latent_placeholder
from tokenizer.layout import image_position_mask

__all__ = ["DATA_ERROR", "PackedTokenStream", "ResumableDataLoader", "document_causal_mask", "make_dataloader",
           "pack_rows", "with_window_denominators"]

# Version of the row layout (how rows are formed and ordered in an epoch); a loader state of another version
# cannot continue mid-epoch. 1: one global packing and permutation of rows; 2: per-shard packing, shard-level plan.
LAYOUT_VERSION = 2
DEFAULT_SHUFFLE_WINDOW = 1 << 16  # positions (rows) shuffled together: 256M tokens at seq_len 4096
# Key of a batch that carries a data error instead of data (the message, naming the file): the training step
# shares it with every rank before raising.
DATA_ERROR = "data_error"
_EXTRA_TABLES = 2  # shard tables kept beyond those of the windows in use (a stream crossing a window edge)


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask (B, T, T): query i may attend key j iff same document (>= 0) and j <= i.

    A padding query (-1) attends only to itself, so no softmax row is empty (no NaN); nothing attends to it.
    """
    same = document_ids[:, :, None] == document_ids[:, None, :]
    real = (document_ids >= 0)[:, :, None]
    t = document_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=document_ids.device)
    return (same & real & causal) | eye


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


# -- sets of positions as sorted, disjoint [start, stop) intervals ------------------------------------------------
Intervals = list[tuple[int, int]]


def _normalize(intervals: Iterable) -> Intervals:
    """Sorted, merged, non-empty intervals."""
    out: Intervals = []
    for a, b in sorted((int(a), int(b)) for a, b in intervals if int(b) > int(a)):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _complement(intervals: Intervals, n: int) -> Intervals:
    """[0, n) minus normalized `intervals`."""
    out, at = [], 0
    for a, b in intervals:
        if a > at:
            out.append((at, min(a, n)))
        at = max(at, b)
    if at < n:
        out.append((at, n))
    return [(a, b) for a, b in out if b > a]


class _Sequence:
    """The positions of normalized intervals as one sequence: index i -> its i-th position."""

    def __init__(self, intervals: Intervals) -> None:
        self.intervals = intervals
        self.starts = np.array([a for a, _ in intervals], dtype=np.int64)
        lengths = np.array([b - a for a, b in intervals], dtype=np.int64)
        self.cum = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.size = int(self.cum[-1])

    def at(self, index: np.ndarray) -> np.ndarray:
        """Positions of indices (each in [0, size))."""
        k = np.searchsorted(self.cum, index, side="right") - 1
        return self.starts[k] + index - self.cum[k]

    def spans(self, a: int, b: int) -> Intervals:
        """The positions of indices [a, b) as intervals."""
        a, b = max(int(a), 0), min(int(b), self.size)
        out: Intervals = []
        k = int(np.searchsorted(self.cum, a, side="right") - 1) if a < b else 0
        while a < b:
            take = min(b, int(self.cum[k + 1]))
            out.append((int(self.starts[k] + a - self.cum[k]), int(self.starts[k] + take - self.cum[k])))
            a, k = take, k + 1
        return out


def _stream_consumption(sequence: _Sequence, first: int, num_batches: int, batch_size: int, accumulate: int,
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


class PackedTokenStream(IterableDataset):
    """Batches {input_ids, document_ids, position_ids} (LongTensors (B, T)) from a token shard directory.

    With `image_features`, batches also hold `image_features` (B, T, C) float32: each image-code position's
    pre-quantisation feature (zeros elsewhere), from shards tokenized with `--features`. With `image_latents`, they
    hold `image_latents` (B, T, C*k*k) float32: each `<image>` placeholder position's latent patch (zeros elsewhere),
    from shards tokenized with a continuous image tokenizer (Transfusion). With `token_keys`, they hold
    `token_keys` (B, T) int64: each token's identity in the dataset, shard index x 2^40 + its offset in the shard's
    ids (-1 for padding), the same whatever the rank, row or epoch: what an objective keys its randomness by.

    One pass is one epoch of `len(self)` batches for this rank; `set_epoch(e)` chooses the shuffle.
    Use `make_dataloader` for exact resume with workers (and under Lightning).
    """

    def __init__(
        self,
        token_dir: str | Path,
        seq_len: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        check_ids: bool = True,
        image_features: bool = False,
        image_latents: bool = False,
        token_keys: bool = False,
        shuffle_window: int = DEFAULT_SHUFFLE_WINDOW,
        verify_ahead: bool = True,
        accumulate: int = 1,
    ) -> None:
        """shuffle_window: rows shuffled together after the shard permutation (more mixes more shards per window and
        holds more shard tables at once); verify_ahead: check the shards of the next batch in a background thread;
        accumulate: micro-batches per optimizer step (the trainer's accumulate_grad_batches): a step then reads the
        rows of one batch of batch_size x accumulate, split in order."""
        super().__init__()
        if seq_len < 1 or batch_size < 1 or shuffle_window < 1 or accumulate < 1:
            raise ValueError(f"seq_len, batch_size, shuffle_window and accumulate must be positive, got {seq_len}, "
                             f"{batch_size}, {shuffle_window}, {accumulate}")
        self.accumulate = int(accumulate)
        self.token_dir = Path(token_dir)
        # the manifest's fields and shard names from the dataset index: O(1) reads and a map, never a parse of
        # the O(shards) manifest (made and written back once when missing)
        self.index = read_index(token_dir)
        self.manifest = self.index.header  # every manifest field but the shard list
        self.image_features, self.image_latents = image_features, image_latents
        self.token_keys = token_keys
        latent = self.manifest.get("feature_kind") == LATENT_KIND
        if image_features and (latent or not self.manifest.get("feature_dim")):
            held = "continuous images' latents, not codes" if latent else "no image features"
            raise ShardError(f"{self.token_dir} holds {held} (late-fusion models read the features of image codes): "
                             "re-run `train.py shards tokenize --features` with a VQ image tokenizer into a fresh "
                             "directory")
        if image_latents and not latent:
            raise ShardError(f"{self.token_dir} holds no continuous image latents (Transfusion models read them): "
                             "re-run `train.py shards tokenize` with a continuous image tokenizer (e.g. one trained "
                             "with configs/tokenizer/kl-demo-64.yaml) into a fresh directory")
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, seed, shuffle
        self.shuffle_window, self.verify_ahead = int(shuffle_window), verify_ahead
        self.rank, self.world_size = rank, world_size
        self.check_ids = check_ids
        # a damaged shard ends the pass with a flagged padding batch instead of raising (set by the loader)
        self.share_errors = False
        self.vocab_size, self.pad_id = self.manifest["vocab_size"], self.manifest["pad_id"]
        self.shard_names = self.index.names
        # the data's identity (signatures are taken at every save): the manifest's sha256 names every shard with its
        # checksums and the vocabulary's fingerprint
        self._data_key = self.index.digest
        # rows per shard (manifest order): all the epoch plan needs, O(shards) int64s
        self.shard_rows = load_row_counts(self.index, seq_len)
        self.num_rows = int(self.shard_rows.sum())
        self.epoch = 0
        self._start_batch = 0
        self._consumed = 0
        # After a resume that re-deals the rest of an epoch: (epoch, first batch, positions not consumed then).
        self._resume: tuple[int, int, Intervals] | None = None
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        """Per-process caches (tables, open shards, background checks): never shared with a worker or a copy."""
        self._pid = os.getpid()
        self._orders: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # epoch -> (order, cum rows)
        self._windows: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()  # (epoch, window) -> permutation
        self._tables: OrderedDict[int, tuple[TokenShard, ShardRows]] = OrderedDict()  # shard -> its rows
        self._checks: dict[int, Future] = {}  # shard -> background verification (returns the opened TokenShard)
        self._checker: ThreadPoolExecutor | None = None
        self._verified: set[int] = set()  # shards whose files this process has checked
        self.shards_opened: list[int] = []  # shard indices this process verified and opened, in order

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("_orders", "_windows", "_tables", "_checks", "_checker", "_verified", "shards_opened"):
            state.pop(key, None)  # memmaps, threads and locks are made again in the worker, never copied
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    # -- epoch layout --------------------------------------------------------------------------------
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

    def _layout(self, epoch: int) -> tuple[int, _Sequence]:
        """(first batch, the positions it deals from that batch on) for `epoch`."""
        if self._resume is not None and self._resume[0] == epoch:
            return self._resume[1], _Sequence(self._resume[2])
        return 0, _Sequence([(0, self.num_rows)] if self.num_rows else [])

    def shard_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard indices in the epoch's order, cumulative rows along that order): position p before the window
        shuffle is row p - cum[q] of shard order[q], where cum[q] <= p < cum[q + 1]."""
        if epoch not in self._orders:
            order = np.arange(len(self.shard_names))
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shard_names))
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

    # -- shard tables and integrity -------------------------------------------------------------------
    def _check(self, shard: int) -> Future:
        """The (started) verification of a shard's files; its result is the opened TokenShard."""
        if shard not in self._checks:
            if self._checker is None:
                self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-verify")
            # hashed once per process: a shard reopened after its table was dropped is not hashed again
            verify = shard not in self._verified
            future = self._checker.submit(TokenShard, self.token_dir, self.shard_names[shard], self.vocab_size, verify)
            if not self.verify_ahead:
                future.result()
            self._checks[shard] = future
        return self._checks[shard]

    def _table(self, shard: int) -> tuple[TokenShard, ShardRows]:
        """A shard's open files and rows, its files verified before first use."""
        if shard not in self._tables:
            opened: TokenShard = self._check(shard).result()  # raises ShardError naming the file; before any row is used
            self._verified.add(shard)
            rows = plan_shard(opened, self.manifest, self.seq_len)  # never cuts a clip (or a continuous image)
            if rows.num_rows != int(self.shard_rows[shard]):
                raise ShardError(f"shard {opened.name} ({opened.path('.offsets.npy')}) packs into {rows.num_rows} rows "
                                 f"at seq_len {self.seq_len}, but the row plan says {int(self.shard_rows[shard])}: "
                                 f"the plan is stale; run `train.py shards plan {self.token_dir} --seq-len "
                                 f"{self.seq_len}`")
            self._tables[shard] = (opened, rows)
            self.shards_opened.append(shard)
        self._tables.move_to_end(shard)
        return self._tables[shard]

    def _release(self, keep: set[int]) -> None:
        """Drop shard tables outside `keep` beyond a few recent ones (and their finished checks)."""
        spare = [s for s in self._tables if s not in keep]
        for shard in spare[: max(0, len(spare) - _EXTRA_TABLES)]:
            del self._tables[shard]
            self._checks.pop(shard, None)

    def batch_pieces(self, epoch: int, batch: int, ahead: int | None = None) -> list[list[tuple[int, int, int]]]:
        """This rank's batch `batch` of `epoch` as pieces: per row, [(shard index, start in the shard's ids, length),
        ...] in row order ([] for a padding row). `ahead`: the batch this process makes next, whose new shards start
        being checked in the background now (with verify_ahead)."""
        if self._pid != os.getpid():  # a forked worker: its parent's threads and open files are not its own
            self._reset_process_state()
        positions = self.batch_positions(epoch, batch)
        real = positions >= 0
        out: list[list[tuple[int, int, int]]] = [[] for _ in positions]
        if not real.any():
            return out
        shards, rows = self.locate(epoch, positions[real])
        # keep the tables of the windows every stream of this rank is in at this step: the next batches read them
        self._release(self._window_shards(epoch, self._step_positions(epoch, batch)) | set(shards.tolist()))
        for shard in dict.fromkeys(shards.tolist()):
            if shard not in self._tables:
                self._check(shard)  # queued first: this batch waits for no check of a later one
        if self.verify_ahead and ahead is not None and ahead < len(self):
            upcoming = self.batch_positions(epoch, ahead)
            if (upcoming >= 0).any():
                for shard in dict.fromkeys(self.locate(epoch, upcoming[upcoming >= 0])[0].tolist()):
                    if shard not in self._tables:
                        self._check(shard)
        for i, shard, row in zip(np.flatnonzero(real).tolist(), shards.tolist(), rows.tolist()):
            _, table = self._table(shard)
            pieces = table.row_pieces[table.row_ptr[row] : table.row_ptr[row + 1]].tolist()
            out[i] = [(shard, int(table.piece_start[p]), int(table.piece_len[p])) for p in pieces]
        return out

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
        consumed = _complement(sequence.intervals, self.num_rows) + _stream_consumption(
            sequence, first, len(self), self.batch_size, self.accumulate,
            {r: (first, batches_consumed) for r in range(world)})
        consumed = _normalize(consumed)
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
            self._resume_at(epoch, _normalize(state["consumed"]))
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
        sequence = _Sequence([(0, self.num_rows)] if self.num_rows else [])
        return _normalize(_stream_consumption(sequence, 0, len(self), self.batch_size, self.accumulate,
                                              {r: (0, batches) for r in range(world)}))

    def _resume_at(self, epoch: int, consumed: Intervals) -> None:
        remaining = _complement(consumed, self.num_rows)
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
        remaining = _normalize(base["remaining"]) if "remaining" in base else [(0, num_rows)] if num_rows else []
        low = base["batches_consumed"]
        taken = _stream_consumption(_Sequence(remaining), first, base["num_batches"], batch, base.get("accumulate", 1),
                                    {s["rank"]: (low, s["batches_consumed"]) for s in states})
        consumed = _normalize([*map(tuple, base["consumed"]), *taken])
        rows_taken = sorted(p for a, b in taken for p in range(a, b))
        return {**base, "rank": None, "consumed": [list(iv) for iv in consumed],
                "rows_consumed": sum(b - a for a, b in consumed), "rows_taken": rows_taken}

    # -- batches -------------------------------------------------------------------------------------
    def make_batch(self, pieces: list[list[tuple[int, int, int]]]) -> dict[str, torch.Tensor]:
        """Materialise rows given as pieces (see `batch_pieces`) as the batch dict."""
        b, t = len(pieces), self.seq_len
        input_ids = np.full((b, t), self.pad_id, dtype=np.int64)
        document_ids = np.full((b, t), -1, dtype=np.int64)
        position_ids = np.zeros((b, t), dtype=np.int64)
        keys = np.full((b, t), -1, dtype=np.int64) if self.token_keys else None
        features = None
        if self.image_features or self.image_latents:
            features = np.zeros((b, t, int(self.manifest["feature_dim"])), dtype=np.float32)
            image_offset, image_codes = self.manifest.get("image_offset"), self.manifest.get("image_codes")
            placeholder = latent_placeholder(self.manifest)
        for i, row in enumerate(pieces):
            cursor = 0
            for doc, (index, start, length) in enumerate(row):
                shard = self._tables[index][0] if index in self._tables else self._check(index).result()
                chunk = shard.ids[start : start + length]
                if self.check_ids and int(chunk.max()) >= self.vocab_size:
                    shard.check_ids(start, start + length)
                input_ids[i, cursor : cursor + length] = chunk
                document_ids[i, cursor : cursor + length] = doc
                position_ids[i, cursor : cursor + length] = np.arange(length)
                if keys is not None:
                    keys[i, cursor : cursor + length] = (index << 40) + start + np.arange(length)
                if features is not None:
                    at = np.flatnonzero(image_position_mask(chunk, image_offset, image_codes, placeholder))
                    features[i, cursor + at] = shard.image_features(start, start + length, image_offset, image_codes,
                                                                    placeholder)
                cursor += length
        batch = {
            "input_ids": torch.from_numpy(input_ids),
            "document_ids": torch.from_numpy(document_ids),
            "position_ids": torch.from_numpy(position_ids),
        }
        if features is not None:
            batch["image_latents" if self.image_latents else "image_features"] = torch.from_numpy(features)
        if keys is not None:
            batch["token_keys"] = torch.from_numpy(keys)
        return batch

    def __iter__(self):
        worker = get_worker_info()
        worker_id, workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        epoch, start = self.epoch, self._start_batch
        # Batch j (j >= start) goes to worker (j - start) % workers: DataLoader pulls workers round-robin,
        # so the batches come out in order j = start, start + 1, ... whatever the worker count.
        for batch in range(start + worker_id, len(self), workers):
            try:
                out = self.make_batch(self.batch_pieces(epoch, batch, ahead=batch + workers))
            except ShardError as err:
                if not self.share_errors:
                    raise
                # Raising here would stop this rank alone while the others wait in the step's collective: hand the
                # step a batch without data that carries the message, for it to share with every rank and raise.
                rank, _ = self.world()
                yield {**self.make_batch([[] for _ in range(self.batch_size)]),
                       DATA_ERROR: f"rank {rank}, batch {batch} of epoch {epoch}: {err}"}
                return
            if worker is None:
                self._consumed = batch + 1
            yield out


class ResumableDataLoader(DataLoader):
    """A DataLoader over a PackedTokenStream whose `state_dict()` is exact, with or without workers.

    It counts the batches handed to the consumer in the main process, so worker prefetching never
    shifts the state. Each new `iter()` starts the next epoch, except the first one and the first one
    after `load_state_dict` / `set_epoch`, which start at the stored position.

    Lightning 2.6 (read in loops/fit_loop.py, utilities/combined_loader.py, loops/fetchers.py): the fit
    loop saves `state_dict()` of every train DataLoader that has state_dict/load_state_dict into the
    checkpoint ("combined_loader") and calls `load_state_dict` in `FitLoop.setup_data` before creating the
    iterator. Because this loader has a `len`, Lightning does not prefetch a batch ahead (it prefetches
    only when the length is unknown), so the saved count equals the batches trained on. Lightning does not
    call `set_epoch` on an IterableDataset; the epoch advances here on each new `iter()`. Only rank 0's
    state is saved; every rank loads it, which is right because all ranks have the same `len` and consume
    in lock step. Under another world size x batch size the position is renumbered (`resume_shift`), and
Lightning's restored count of the epoch's batches must move with it or the epoch ends early (growing job)
or late (shrinking job): `align_batch_progress` in the training layer does that. Caveat (Lightning issue 20550, reproduced here with 2.6): if `configure_optimizers` calls
    `trainer.estimated_stepping_batches`, the train loader is set up before the checkpoint is restored,
    its state is silently dropped and the resumed run trains on the wrong batches; take the schedule
    horizon from `max_steps` (or `len(loader)`) instead.
    """

    def __init__(self, stream: PackedTokenStream, num_workers: int = 0, *, window: int = 1,
                 count: Callable[[dict], dict[str, torch.Tensor] | None] | None = None, share_errors: bool = False,
                 **kwargs) -> None:
        """window, count: read each optimizer step's `window` micro-batches (batch indices [k window, (k+1) window)
        of the epoch) ahead, and give each of them `window_denominators` = the sum of `count(batch)` over its
        step, so a loss can be divided by its count over the whole step (exact gradient accumulation).
        share_errors: a damaged shard yields a padding batch holding the message under DATA_ERROR (then the pass
        ends) instead of raising in this rank alone; the training step shares it with every rank."""
        if kwargs.get("persistent_workers"):
            raise ValueError("persistent_workers would keep stale positions in the workers; leave it off")
        stream.share_errors = share_errors
        super().__init__(stream, batch_size=None, num_workers=num_workers, **kwargs)
        self._epoch, self._consumed, self._fresh = stream.epoch, 0, True
        self.window, self.count = max(int(window), 1), count
        # batches the position moved when a state saved under another world size x batch size was loaded
        self.resume_shift = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next `iter()` start at the beginning of `epoch`."""
        self.dataset.set_epoch(epoch)  # drops a resume layout of that epoch
        self._epoch, self._consumed, self._fresh = int(epoch), 0, True

    def __iter__(self):
        if not self._fresh:
            self._epoch, self._consumed = self._epoch + 1, 0
        self._fresh = False
        if self._consumed >= len(self.dataset):  # resumed from the end of an epoch
            self._epoch, self._consumed = self._epoch + 1, 0
        self.dataset.set_position(self._epoch, self._consumed)
        batches = super().__iter__()
        if self.window > 1 and self.count is not None:
            batches = with_window_denominators(batches, self.window, self.count, self._consumed, len(self.dataset))
        for batch in batches:
            self._consumed += 1  # counted as handed over: read-ahead batches are not yet consumed
            yield batch

    def state_dict(self) -> dict:
        """(epoch, batches consumed) plus a signature of the batch layout."""
        return self.dataset.position_state(self._epoch, self._consumed)

    def load_state_dict(self, state: dict) -> None:
        """Make the next `iter()` yield exactly the batches that followed `state`; sets `resume_shift`."""
        self.dataset.load_state_dict(state)
        self._epoch, self._consumed, self._fresh = self.dataset.epoch, self.dataset._start_batch, True
        same_epoch = self._epoch == int(state["epoch"])
        self.resume_shift = self._consumed - int(state["batches_consumed"]) if same_epoch else 0


def with_window_denominators(batches: Iterable[dict], window: int,
                             count: Callable[[dict], dict[str, torch.Tensor] | None], first_index: int = 0,
                             epoch_length: int | None = None) -> Iterator[dict]:
    """The batches in order, each optimizer step's `window` micro-batches read before the first of them is handed
    on, each given `window_denominators`: the sum over its step of `count(batch)` (a dict of tensors; None: no
    counts, the batches pass unchanged). Steps are aligned to the epoch's batch index, as Lightning's accumulation
    is (batch `first_index` is the first handed on; the epoch's last step may be shorter), so a resume at any step
    boundary reads the same steps."""

    def attach(pending: list[dict]) -> list[dict]:
        counts = [count(batch) for batch in pending]
        if not pending or any(c is None for c in counts):
            return pending
        totals = {name: sum(c[name].float() for c in counts) for name in counts[0]}
        return [{**batch, "window_denominators": dict(totals)} for batch in pending]

    pending: list[dict] = []
    for batch in batches:
        pending.append(batch)
        index = first_index + len(pending)  # the epoch's batch count once this one is handed on
        if index % window == 0 or (epoch_length is not None and index >= epoch_length):
            yield from attach(pending)
            first_index, pending = index, []
    yield from attach(pending)


def make_dataloader(stream: PackedTokenStream, num_workers: int = 0, **kwargs) -> ResumableDataLoader:
    """A DataLoader with exact `state_dict()` / `load_state_dict()` resume (batches are built by the stream);
    `window` and `count` as in ResumableDataLoader."""
    return ResumableDataLoader(stream, num_workers=num_workers, **kwargs)
