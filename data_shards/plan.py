"""Per-shard row plans: each token shard's documents cut at seq_len and packed into rows, built one shard at a time,
and the row count of every shard at one seq_len, written once per dataset (`plans/rows-<seq_len>.json`, naming the
manifest it was made from by its sha256).

A row holds pieces of documents of one shard only, packed by best-fit decreasing (`pack_rows`) from the stored
lengths alone, so a shard's rows depend on nothing but that shard and seq_len: the stream needs only the counts of
all shards (O(shards), read from the plan file) to lay out an epoch, and builds the tables of a shard when a rank
is about to read it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_shards.raw import ShardError
from data_shards.token_shards import MANIFEST, TokenShard, read_manifest
from tokenizer.files import atomic_write_json

PLAN_FORMAT = "early-fusion-row-plan/1"
PLAN_DIR = "plans"


def pack_rows(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack pieces (each <= seq_len) into rows by best-fit decreasing; returns (row_ptr, piece_ids) in CSR form.

    Deterministic from `lengths` alone. Each piece, longest first, goes to the open row with the least
    room that still fits it (found by bisection over the distinct room sizes), else to a new row.
    About 2.5 s per million pieces here; 0.2% padding on short documents, vs 6% for a greedy packer.
    """
    order = np.argsort(-lengths, kind="stable")
    rooms: list[int] = []  # sorted distinct room sizes of open rows
    rows_with_room: dict[int, list[int]] = {}
    row_of = np.empty(len(lengths), dtype=np.int64)
    num_rows = 0
    for piece, size in zip(order.tolist(), lengths[order].tolist()):
        i = bisect.bisect_left(rooms, size)
        if i < len(rooms):
            room = rooms[i]
            row = rows_with_room[room].pop()
            if not rows_with_room[room]:
                rooms.pop(i)
        else:
            row, room, num_rows = num_rows, seq_len, num_rows + 1
        row_of[piece] = row
        left = room - size
        if left > 0:
            bucket = rows_with_room.setdefault(left, [])
            if not bucket:
                bisect.insort(rooms, left)
            bucket.append(row)
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=num_rows))]).astype(np.int64)
    return row_ptr, np.argsort(row_of, kind="stable").astype(np.int64)


@dataclass
class ShardRows:
    """One shard's packing at a seq_len: piece i is ids [piece_start[i], piece_start[i] + piece_len[i]) of the
    shard; row r holds pieces row_pieces[row_ptr[r]:row_ptr[r + 1]]."""

    piece_start: np.ndarray
    piece_len: np.ndarray
    row_ptr: np.ndarray
    row_pieces: np.ndarray

    @property
    def num_rows(self) -> int:
        """Rows of the shard."""
        return len(self.row_ptr) - 1


def shard_rows(offsets: np.ndarray, seq_len: int) -> ShardRows:
    """Cut a shard's documents (its offsets) into pieces of at most seq_len tokens and pack them into rows."""
    starts, lengths = offsets[:-1], np.diff(offsets)
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    pieces = -(-lengths // seq_len)
    piece_doc = np.repeat(np.arange(len(lengths)), pieces)
    first = np.cumsum(pieces) - pieces
    within = np.arange(len(piece_doc)) - np.repeat(first, pieces)
    piece_start = (starts[piece_doc] + within * seq_len).astype(np.int64)
    piece_len = np.minimum(seq_len, lengths[piece_doc] - within * seq_len).astype(np.int64)
    row_ptr, row_pieces = pack_rows(piece_len, seq_len)
    return ShardRows(piece_start, piece_len, row_ptr, row_pieces)


def manifest_digest(token_dir: str | Path) -> str:
    """sha256 of the manifest file's bytes: it lists every shard with its counts and file checksums, so other shards
    give another digest. Hashing the bytes (milliseconds) instead of serialising the parsed shard list (a tenth of a
    second per 6,400 shards here) keeps it cheap at any shard count."""
    return hashlib.sha256((Path(token_dir) / MANIFEST).read_bytes()).hexdigest()


def plan_path(token_dir: str | Path, seq_len: int) -> Path:
    """Where the row plan of `token_dir` at `seq_len` lives."""
    return Path(token_dir) / PLAN_DIR / f"rows-{seq_len}.json"


def _count_rows(token_dir: str, names: list[str], vocab_size: int, seq_len: int) -> list[int]:
    """Row counts of some shards (one task of a plan's process pool)."""
    return [shard_rows(TokenShard(token_dir, name, vocab_size, verify=False).offsets, seq_len).num_rows
            for name in names]


def compute_row_counts(token_dir: str | Path, manifest: dict, seq_len: int, workers: int = 1) -> list[int]:
    """Every shard's row count at seq_len, from its offsets (structure checked, files not hashed); `workers`
    processes share the shards (packing is pure Python: about 0.8 s of CPU per million documents)."""
    names = [entry["name"] for entry in manifest["shards"]]
    if workers <= 1 or len(names) < 2:
        return _count_rows(str(token_dir), names, manifest["vocab_size"], seq_len)
    # forkserver/spawn, never fork: the caller may have started threads (torch, a stream's checker)
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    step = max(1, -(-len(names) // (workers * 8)))  # a few tasks per worker: uneven shards even out
    chunks = [names[i : i + step] for i in range(0, len(names), step)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
        parts = pool.map(_count_rows, [str(token_dir)] * len(chunks), chunks, [manifest["vocab_size"]] * len(chunks),
                         [seq_len] * len(chunks))
        return [count for part in parts for count in part]


def write_plan(token_dir: str | Path, seq_len: int, manifest: dict | None = None,
               counts: list[int] | None = None, workers: int = 1) -> Path:
    """Write (atomically) the row plan of `token_dir` at `seq_len`, computing the counts (on `workers` processes)
    unless given."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    manifest = read_manifest(token_dir) if manifest is None else manifest
    counts = compute_row_counts(token_dir, manifest, seq_len, workers) if counts is None else counts
    path = plan_path(token_dir, seq_len)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"format": PLAN_FORMAT, "seq_len": seq_len, "manifest_sha256": manifest_digest(token_dir),
                             "shards": [s["name"] for s in manifest["shards"]], "rows": [int(c) for c in counts]},
                      indent=None)
    return path


def read_plan(token_dir: str | Path, manifest: dict, seq_len: int) -> tuple[list[int] | None, str]:
    """(row counts, "") from the plan file, or (None, why it cannot be used: missing, unreadable, other shards)."""
    path = plan_path(token_dir, seq_len)
    if not path.is_file():
        return None, f"{path} is missing"
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return None, f"{path} is unreadable ({err})"
    names = [s["name"] for s in manifest["shards"]]
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT or plan.get("seq_len") != seq_len:
        return None, f"{path} is not a {PLAN_FORMAT} plan for seq_len {seq_len}"
    rows = plan.get("rows")
    if (plan.get("shards") != names or plan.get("manifest_sha256") != manifest_digest(token_dir)
            or not isinstance(rows, list) or len(rows) != len(names)
            or not all(isinstance(r, int) and r >= 0 for r in rows)):
        return None, f"{path} was made from other shards than the manifest lists"
    return rows, ""


def load_row_counts(token_dir: str | Path, manifest: dict, seq_len: int) -> np.ndarray:
    """Every shard's row count at seq_len: from the plan file (O(shards)); when it is missing or stale, computed
    from every shard's offsets (one line on stderr says so) and written back when the directory allows."""
    counts, why = read_plan(token_dir, manifest, seq_len)
    if counts is None:
        print(f"row plan: {why}; computing it from the offsets of all {len(manifest['shards'])} shards "
              f"(run `train.py shards plan {token_dir} --seq-len {seq_len}` once to skip this)",
              file=sys.stderr, flush=True)
        counts = compute_row_counts(token_dir, manifest, seq_len)
        try:
            write_plan(token_dir, seq_len, manifest, counts)
        except OSError:  # a read-only dataset: the counts are still right, only not kept
            pass
    if not counts:
        raise ShardError(f"{token_dir}: no rows at seq_len {seq_len}")
    return np.asarray(counts, dtype=np.int64)
