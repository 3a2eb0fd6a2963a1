"""PackedTokenStream: the IterableDataset that reads this rank's rows of token shards into (B, T) batches.

Rows: every document longer than `seq_len` is cut into pieces of at most `seq_len` tokens (each piece is its own
document: positions restart at 0, it attends only to itself), and each shard's pieces are packed into rows of that
shard alone (best-fit decreasing, `data_shards.plan`), from its stored lengths only. The row count of every shard
is read from the dataset's plan file (`train.py shards plan`), so laying out an epoch (`EpochLayout`, which this
stream is) costs O(shards), never an open of every shard; a shard's piece and row tables are built when this rank
first reads one of its rows and dropped once it moves past the shard's shuffle window. A rank's batches go
round-robin to DataLoader workers starting at the resume position.

Integrity: a shard's files are size + sha256 checked (TokenShard's verify) the first time this process opens it,
before any of its rows are used; making a batch also starts checking the new shards of the next batch this process
will make in a background thread, so the hashing is mostly off the step's path; `close()` (the data module's
teardown), or dropping the stream, cancels the checks still queued. The features or latents of every piece fed are
checked finite (the rule of `shards verify`). A failure raises ShardError naming the file; under the
loader the failing rank hands the error to the training step as a flagged batch (`DATA_ERROR`), which shares it in
the step's collective so every rank stops at the same step (`FusionLightningModule`).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from data_shards.epoch_layout import DEFAULT_SHUFFLE_WINDOW, EpochLayout
from data_shards.plan import ShardRows, load_row_counts, plan_shard, read_index
from data_shards.raw import ShardError
from data_shards.token_shards import LATENT_KIND, TARGET, TokenShard, latent_placeholder
from tokenizer.layout import image_position_mask

__all__ = ["DATA_ERROR", "PackedTokenStream", "document_causal_mask"]

# Key of a batch that carries a data error instead of data (the message, naming the file): the training step
# shares it with every rank before raising.
DATA_ERROR = "data_error"
_EXTRA_TABLES = 2  # shard tables kept beyond those of the windows in use (a stream crossing a window edge)
# Shards whose dropped conversations (longer than seq_len) get a line each on stderr; the rest are summed up once.
DROPPED_LINES = 5


def _stop_checks(checker: ThreadPoolExecutor, pid: int) -> None:
    """Cancel a stream's queued shard checks, so its verifier thread ends after the one running; never waits (it runs
    when the garbage collector drops a stream, possibly in that very thread). A forked child has not the thread."""
    if os.getpid() == pid:
        checker.shutdown(wait=False, cancel_futures=True)


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


class PackedTokenStream(EpochLayout, IterableDataset):
    """Batches {input_ids, document_ids, position_ids} (LongTensors (B, T)) from a token shard directory.

    With `image_features`, batches also hold `image_features` (B, T, C) float32: each image-code position's
    pre-quantisation feature (zeros elsewhere), from shards tokenized with `--features`. With `image_latents`, they
    hold `image_latents` (B, T, C*k*k) float32: each `<image>` placeholder position's latent patch (zeros elsewhere),
    from shards tokenized with a continuous image tokenizer (Transfusion). With `token_keys`, they hold
    `token_keys` (B, T) int64: each token's identity in the dataset, shard index x 2^40 + its offset in the shard's
    ids (-1 for padding), the same whatever the rank, row or epoch: what an objective keys its randomness by.
    With `target_mask`, they hold `target_mask` (B, T) bool: True where the token is a training target (bit 0 of
    the shard's stored target mask: a conversation's trained turns, every token of a plain document; every real
    token of a shard without conversations), False at padding; with `answer_only` False, every real token (the
    "loss on every token" ablation; conversations are still never cut). A loss scores position t's prediction of
    token t + 1 where both share a document and target_mask[:, t + 1] holds.

    Conversations are never cut: one longer than seq_len is left out of the rows (`plan_shard`), counted in
    `dropped_conversations` and named on stderr (a line per shard for the first few shards, then a summary).

    One pass is one epoch of `len(self)` batches for this rank; `set_epoch(e)` chooses the shuffle. Which rows a
    batch reads, and the resumable position, are the `EpochLayout` this stream is over the shards' row counts.
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
        target_mask: bool = False,
        answer_only: bool = True,
    ) -> None:
        """shuffle_window: rows shuffled together after the shard permutation (more mixes more shards per window and
        holds more shard tables at once); verify_ahead: check the shards of the next batch in a background thread;
        accumulate: micro-batches per optimizer step (the trainer's accumulate_grad_batches): a step then reads the
        rows of one batch of batch_size x accumulate, split in order."""
        self.check_sizes(seq_len, batch_size, shuffle_window, accumulate)  # before any file is read
        self.token_dir = Path(token_dir)
        # the manifest's fields and shard names from the dataset index: O(1) reads and a map, never a parse of
        # the O(shards) manifest (made and written back once when missing)
        self.index = read_index(token_dir)
        self.manifest = self.index.header  # every manifest field but the shard list
        self.image_features, self.image_latents = image_features, image_latents
        self.token_keys = token_keys
        self.target_mask, self.answer_only = target_mask, answer_only
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
        self.verify_ahead = verify_ahead
        self.check_ids = check_ids
        # a damaged shard ends the pass with a flagged padding batch instead of raising (set by the loader)
        self.share_errors = False
        self.vocab_size, self.pad_id = self.manifest["vocab_size"], self.manifest["pad_id"]
        self.shard_names = self.index.names
        # the data's identity (signatures are taken at every save): the manifest's sha256 names every shard with its
        # checksums and the vocabulary's fingerprint
        super().__init__(load_row_counts(self.index, seq_len), seq_len, batch_size, data_key=self.index.digest,
                         seed=seed, rank=rank, world_size=world_size, shuffle=shuffle, shuffle_window=shuffle_window,
                         accumulate=accumulate)
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        """Per-process caches (tables, open shards, background checks): never shared with a worker or a copy."""
        self._pid = os.getpid()
        self._reset_layout_caches()
        self._tables: OrderedDict[int, tuple[TokenShard, ShardRows]] = OrderedDict()  # shard -> its rows
        self._checks: dict[int, Future] = {}  # shard -> background verification (returns the opened TokenShard)
        self._checker: ThreadPoolExecutor | None = None
        # cancels the queued checks when this stream is dropped: a dropped executor's thread would run them all first
        self._stop_checker: weakref.finalize | None = None
        self._verified: set[int] = set()  # shards whose files this process has checked
        self.shards_opened: list[int] = []  # shard indices this process verified and opened, in order
        # conversations longer than seq_len left out, per shard this process has planned (a shard reopened after
        # its table was dropped is not counted again)
        self._dropped: dict[int, int] = {}
        self._dropped_summarised = 0

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        # the layout's caches too (_orders, _windows): a worker recomputes them
        for key in ("_orders", "_windows", "_tables", "_checks", "_checker", "_stop_checker", "_verified",
                    "shards_opened", "_dropped", "_dropped_summarised"):
            state.pop(key, None)  # memmaps, threads and locks are made again in the worker, never copied
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    # -- shard tables and integrity -------------------------------------------------------------------
    def _check(self, shard: int) -> Future:
        """The (started) verification of a shard's files; its result is the opened TokenShard."""
        if shard not in self._checks:
            if self._checker is None:
                self._checker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-verify")
                self._stop_checker = weakref.finalize(self, _stop_checks, self._checker, self._pid)
            # hashed once per process: a shard reopened after its table was dropped is not hashed again
            verify = shard not in self._verified
            future = self._checker.submit(TokenShard, self.token_dir, self.shard_names[shard], self.vocab_size, verify)
            if not self.verify_ahead:
                future.result()
            self._checks[shard] = future
        return self._checks[shard]

    def close(self) -> None:
        """End the background checks (the queued ones are cancelled, the running one is waited for: at most one
        shard's hash) and drop the open shards' tables; iterating again starts afresh, without hashing again."""
        if self._pid != os.getpid():  # a forked worker's copy: its parent's thread is not its own
            self._reset_process_state()
            return
        checker, stop = self._checker, self._stop_checker
        if checker is not None and stop is not None:
            stop()  # cancels the queued checks (once; a later drop of this stream does nothing more)
            checker.shutdown(wait=True)
        self._checker = self._stop_checker = None
        self._checks.clear()
        self._tables.clear()

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
            if len(rows.dropped) and shard not in self._dropped:
                self._note_dropped(shard, opened, rows.dropped)
        self._tables.move_to_end(shard)
        return self._tables[shard]

    @property
    def dropped_conversations(self) -> int:
        """Conversations longer than seq_len this process has left out (each counted once, in the shards it read)."""
        return sum(self._dropped.values())

    def _note_dropped(self, shard: int, opened: TokenShard, dropped: np.ndarray) -> None:
        """Count a shard's conversations too long for seq_len; name them on stderr for the first few shards."""
        self._dropped[shard] = len(dropped)
        if len(self._dropped) > DROPPED_LINES:
            return
        lengths = opened.lengths[dropped]
        try:
            keys = [opened.keys[int(d)] for d in dropped[:3]]
        except ShardError:  # a damaged keys file: the document indices still name them
            keys = [f"document {int(d)}" for d in dropped[:3]]
        more = f" and {len(dropped) - 3} more" if len(dropped) > 3 else ""
        print(f"stream: shard {opened.name}: left out {len(dropped)} conversation(s) longer than seq_len "
              f"{self.seq_len} (never cut): {', '.join(map(repr, keys))}{more} ({int(lengths.max())} tokens at most); "
              "train with a longer --data.seq_len to keep them", file=sys.stderr, flush=True)

    def _summarise_dropped(self) -> None:
        """One line for the shards past the first few whose too-long conversations were left out."""
        quiet = list(self._dropped.values())[DROPPED_LINES:]
        if len(quiet) > self._dropped_summarised:
            print(f"stream: and {sum(quiet)} more conversation(s) longer than seq_len {self.seq_len} left out in "
                  f"{len(quiet)} more shard(s) ({self.dropped_conversations} in all)", file=sys.stderr, flush=True)
            self._dropped_summarised = len(quiet)

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

    # -- batches -------------------------------------------------------------------------------------
    def make_batch(self, pieces: list[list[tuple[int, int, int]]]) -> dict[str, torch.Tensor]:
        """Materialise rows given as pieces (see `batch_pieces`) as the batch dict."""
        b, t = len(pieces), self.seq_len
        input_ids = np.full((b, t), self.pad_id, dtype=np.int64)
        document_ids = np.full((b, t), -1, dtype=np.int64)
        position_ids = np.zeros((b, t), dtype=np.int64)
        keys = np.full((b, t), -1, dtype=np.int64) if self.token_keys else None
        targets = np.zeros((b, t), dtype=bool) if self.target_mask else None
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
                if targets is not None:
                    marks = shard.targets if self.answer_only else None
                    targets[i, cursor : cursor + length] = (
                        True if marks is None else (marks[start : start + length] & TARGET) != 0)
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
        if targets is not None:
            batch["target_mask"] = torch.from_numpy(targets)
        return batch

    def __iter__(self) -> Iterator[dict]:
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
        self._summarise_dropped()
