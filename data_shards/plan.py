"""The dataset index and its row plans: what a rank reads at start instead of the manifest, written once per dataset
under `plans/`: `index.json` (the manifest's fields but its shard list, and its sha256), `names.npy` (the shard names,
mapped, not parsed) and `rows-<seq_len>-<sha256 prefix>.npy` (every shard's row count at that seq_len, counted by
`plan_shard`). How one shard's documents are cut and packed into rows is `data_shards.row_packing`.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.files import atomic_open, atomic_write_json
from data_shards.raw import ShardError

# re-exported: the row packing moved to row_packing; its names stay importable from here (`X as X`: not used here)
from data_shards.row_packing import ShardRows as ShardRows
from data_shards.row_packing import pack_rows as pack_rows
from data_shards.row_packing import plan_shard
from data_shards.row_packing import shard_rows as shard_rows
from data_shards.row_packing import video_markers as video_markers
from data_shards.row_packing import whole_images as whole_images
from data_shards.token_shards import MANIFEST, TokenShard, read_manifest

INDEX_FORMAT = "early-fusion-dataset-index/1"
PLAN_DIR = "plans"
NAMES_FILE = "names.npy"
# From this many shards on, making the index or the row counts at start is worth a line on stderr (it reads every
# shard's entry or offsets: seconds and more); below it, it is milliseconds, and a refused `fit` keeps its one line.
NOTICE_SHARDS = 1_000


def manifest_digest(token_dir: str | Path) -> str:
    """sha256 of the manifest file's bytes: it lists every shard with its counts and file checksums, so other shards
    give another digest. Hashing the bytes (milliseconds) instead of serialising the parsed shard list (a tenth of a
    second per 6,400 shards here) keeps it cheap at any shard count."""
    return hashlib.sha256((Path(token_dir) / MANIFEST).read_bytes()).hexdigest()


def _encode_names(manifest: dict) -> np.ndarray:
    """The manifest's shard names as fixed-width UTF-8 bytes (what `names.npy` holds)."""
    encoded = [entry["name"].encode("utf-8") for entry in manifest["shards"]]
    names = np.array(encoded, dtype=f"S{max(1, max(map(len, encoded)))}")
    damaged = [e for n, e in zip(names.tolist(), encoded) if n != e]  # fixed width drops trailing NUL bytes
    if damaged:
        raise ShardError(f"shard names ending in a NUL byte cannot be indexed: {damaged[:3]}")
    return names


class ShardNames:
    """A dataset's shard names in manifest order, read one at a time: a read-only memmap of `names.npy`, so a rank
    decodes only the names of the shards it opens (pickled as its path: a worker maps the file again)."""

    def __init__(self, path: Path | None, names: np.ndarray | None = None) -> None:
        self.path = path
        self._names = np.load(path, mmap_mode="r", allow_pickle=False) if names is None else names
        if self._names.ndim != 1 or self._names.dtype.kind != "S":
            raise ValueError(f"{path}: not an array of names")

    def __len__(self) -> int:
        return len(self._names)

    def __getitem__(self, index: int) -> str:
        return bytes(self._names[index]).decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))

    def __getstate__(self) -> dict:
        return {"path": self.path} if self.path is not None else {"path": None, "names": np.asarray(self._names)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state.get("names"))


@dataclass
class DatasetIndex:
    """What a rank needs from a token directory's manifest, without parsing it: every field but the shard list
    (`header`), the shard names (`names`) and the manifest's sha256 (`digest`: the data's identity)."""

    token_dir: Path
    header: dict
    names: ShardNames
    digest: str

    @property
    def num_shards(self) -> int:
        """Shards the manifest lists."""
        return len(self.names)


def index_path(token_dir: str | Path) -> Path:
    """Where the index of `token_dir` lives (its names beside it, in `names.npy`)."""
    return Path(token_dir) / PLAN_DIR / "index.json"


def plan_path(token_dir: str | Path, seq_len: int, digest: str | None = None) -> Path:
    """Where the row counts of `token_dir` at `seq_len` live: named by the manifest's sha256 (`digest`, hashed when
    not given), so counts made from other shards are never read."""
    digest = manifest_digest(token_dir) if digest is None else digest
    return Path(token_dir) / PLAN_DIR / f"rows-{seq_len}-{digest[:16]}.npy"


def _manifest_stat(token_dir: Path) -> list[int]:
    """What one stat of the manifest tells about its bytes. The inode and ctime too, not only size and mtime: a manifest
    rewritten in place of the old one (a new file) or given back its old mtime (`cp -p`, `touch -r`) changes them."""
    stat = (token_dir / MANIFEST).stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def _index_checksum(stored: dict) -> str:
    """sha256 of what the index asserts about the manifest (its digest, shard count and header): an index edited by
    hand no longer matches it, and is made again from the manifest instead of being trusted."""
    asserted = {key: stored.get(key) for key in ("manifest_sha256", "shards", "header")}
    return hashlib.sha256(json.dumps(asserted, sort_keys=True).encode("utf-8")).hexdigest()


def _atomic_save(path: Path, array: np.ndarray) -> None:
    """np.save, atomically (readers see the old file or the new one) and with a plain open()'s permissions."""
    with atomic_open(path, "wb") as handle:
        np.save(handle, array, allow_pickle=False)


def write_index(token_dir: str | Path, manifest: dict | None = None) -> DatasetIndex:
    """Write (atomically) the index of `token_dir` from its full manifest (checked by `read_manifest`: every listed
    file present, ids within the vocabulary)."""
    token_dir = Path(token_dir)
    manifest = read_manifest(token_dir) if manifest is None else manifest
    names = _encode_names(manifest)
    _atomic_save(token_dir / PLAN_DIR / NAMES_FILE, names)
    # as JSON will give it back, so that the checksum is that of what a reader loads
    header = json.loads(json.dumps({key: value for key, value in manifest.items() if key != "shards"}, default=str))
    _write_index_file(token_dir, {"format": INDEX_FORMAT, "manifest_sha256": manifest_digest(token_dir),
                                  "manifest_stat": _manifest_stat(token_dir), "shards": len(names), "header": header})
    index, why, _ = _load_index(token_dir)
    if index is None:  # the manifest changed while the index was written
        raise ShardError(f"{token_dir}: {why}; is another process writing the dataset?")
    return index


def _write_index_file(token_dir: Path, stored: dict) -> None:
    """Write `index.json` (atomically) with the checksum of what it asserts."""
    atomic_write_json(index_path(token_dir), {**stored, "index_sha256": _index_checksum(stored)}, indent=None)


def _load_index(token_dir: Path) -> tuple[DatasetIndex | None, str, bool]:
    """(index, "", False) when the stored index describes the manifest as it is now, else (None, why not, whether
    that is worth a line at any shard count: an index edited or damaged since it was written)."""
    path = index_path(token_dir)
    if not path.is_file():
        return None, f"{path} is missing", path.exists()
    try:
        stored = json.loads(path.read_text())
        names = ShardNames(path.parent / NAMES_FILE)
    except (OSError, ValueError) as err:
        return None, f"{path} is unreadable ({type(err).__name__}: {err})", True
    if (not isinstance(stored, dict) or stored.get("format") != INDEX_FORMAT
            or not isinstance(stored.get("header"), dict) or not isinstance(stored.get("manifest_sha256"), str)):
        return None, f"{path} is not a {INDEX_FORMAT} index", True
    if "index_sha256" not in stored:  # written before indexes carried a checksum: made again, once
        return None, f"{path} has no checksum (an older index)", False
    if stored["index_sha256"] != _index_checksum(stored):
        return None, f"{path} does not match its checksum (edited since `shards plan` or `fit` wrote it)", True
    if stored.get("shards") != len(names):
        return None, f"{path} disagrees with the {NAMES_FILE} beside it", True
    # the manifest's stat unchanged: the index holds (a stat, not a read of an O(shards) file); changed, its bytes
    # decide (a copy or a rewrite with equal content keeps the index, and its stat is brought up to date)
    stat = _manifest_stat(token_dir)
    if stored.get("manifest_stat") != stat:
        if stored["manifest_sha256"] != manifest_digest(token_dir):
            return None, f"{path} was made from another {MANIFEST}", False
        try:  # so that the next start needs the stat alone again
            _write_index_file(token_dir, {**{k: v for k, v in stored.items() if k != "index_sha256"},
                                          "manifest_stat": stat})
        except OSError:  # a read-only dataset: every start hashes the manifest (milliseconds to seconds)
            pass
    return DatasetIndex(token_dir, stored["header"], names, stored["manifest_sha256"]), "", False


def read_index(token_dir: str | Path) -> DatasetIndex:
    """The index of `token_dir`, in O(1) plus a map of its names when it is fresh; when it is missing or stale, made
    from the full manifest (one line on stderr says so from NOTICE_SHARDS shards on, and at any count when the
    index was edited or damaged) and written back, or kept in memory when the directory is read-only."""
    token_dir = Path(token_dir)
    if not (token_dir / MANIFEST).is_file():
        read_manifest(token_dir)  # raises its message: not a token shard directory, and what to run
    index, why, damaged = _load_index(token_dir)
    if index is not None:
        return index
    manifest = read_manifest(token_dir)
    shards = len(manifest["shards"])
    try:
        index = write_index(token_dir, manifest)
        kept = "written back"
    except OSError as err:  # a read-only dataset: the index lives in memory, made again at every start
        index = DatasetIndex(token_dir, {k: v for k, v in manifest.items() if k != "shards"},
                             ShardNames(None, _encode_names(manifest)), manifest_digest(token_dir))
        kept = (f"kept in memory: cannot write {token_dir / PLAN_DIR} ({err}), so every start will read the whole "
                f"manifest (run `train.py shards plan {token_dir} --seq-len N` where it can be written)")
    if damaged or shards >= NOTICE_SHARDS:
        print(f"dataset index: {why}; made again from the {shards} shards of {token_dir / MANIFEST}, {kept}",
              file=sys.stderr, flush=True)
    return index


def _count_rows(token_dir: str, names: list[str], header: dict, seq_len: int) -> list[int]:
    """Row counts of some shards (one task of a plan's process pool)."""
    counts = []
    for name in names:
        shard = TokenShard(token_dir, name, int(header["vocab_size"]), verify=False)
        counts.append(plan_shard(shard, header, seq_len).num_rows)
    return counts


def compute_row_counts(token_dir: str | Path, index: DatasetIndex, seq_len: int, workers: int = 1) -> list[int]:
    """Every shard's row count at seq_len, from its offsets (structure checked, files not hashed); `workers`
    processes share the shards (packing is pure Python: about 0.8 s of CPU per million documents)."""
    names = list(index.names)
    if workers <= 1 or len(names) < 2:
        return _count_rows(str(token_dir), names, index.header, seq_len)
    # forkserver/spawn, never fork: the caller may have started threads (torch, a stream's checker)
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    step = max(1, -(-len(names) // (workers * 8)))  # a few tasks per worker: uneven shards even out
    chunks = [names[i : i + step] for i in range(0, len(names), step)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
        parts = pool.map(_count_rows, [str(token_dir)] * len(chunks), chunks, [index.header] * len(chunks),
                         [seq_len] * len(chunks))
        return [count for part in parts for count in part]


def write_plan(token_dir: str | Path, seq_len: int, counts: list[int] | None = None, workers: int = 1) -> Path:
    """Write (atomically) the index of `token_dir` and its row counts at `seq_len`, computing the counts (on
    `workers` processes) unless given; returns the counts' path."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    manifest = read_manifest(token_dir)  # before any write: a directory that is not a dataset gets its own message
    plans = Path(token_dir) / PLAN_DIR
    made_plans = not plans.exists()
    try:
        index = write_index(token_dir, manifest)
    except OSError as err:
        if made_plans and plans.is_dir() and not any(plans.iterdir()):
            plans.rmdir()  # nothing half made is left behind
        raise ShardError(_cannot_write(Path(token_dir), err)) from err
    counts = compute_row_counts(token_dir, index, seq_len, workers) if counts is None else counts
    if len(counts) != index.num_shards:
        raise ValueError(f"{len(counts)} row counts for {index.num_shards} shards")
    path = plan_path(token_dir, seq_len, index.digest)
    try:
        _atomic_save(path, np.asarray(counts, dtype=np.int64))
    except OSError as err:
        raise ShardError(_cannot_write(Path(token_dir), err)) from err
    return path


def _cannot_write(token_dir: Path, err: OSError) -> str:
    """The message of a `shards plan` that cannot write `plans/`: why, and what to do (training does not need it)."""
    plans = token_dir / PLAN_DIR
    if plans.exists() and not plans.is_dir():
        return (f"cannot write the dataset index: {plans} is a file, not a directory; move it away (the index is "
                "written there) and run `shards plan` again")
    return (f"cannot write the dataset index in {plans} ({err.strerror or err}: {err.filename or plans}). "
            "`train.py fit` does not need it: on a dataset it cannot write, it builds the index in memory at each "
            f"start (reading the whole manifest); to keep one, run `shards plan` where {token_dir} can be written")


def read_plan(index: DatasetIndex, seq_len: int) -> tuple[np.ndarray | None, str]:
    """(row counts, "") from the plan file, or (None, why it cannot be used: missing or unreadable)."""
    path = plan_path(index.token_dir, seq_len, index.digest)
    if not path.is_file():
        return None, f"{path} is missing"
    try:
        rows = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        return None, f"{path} is unreadable ({type(err).__name__}: {err})"
    if rows.ndim != 1 or rows.dtype != np.int64 or len(rows) != index.num_shards or (rows < 0).any():
        return None, f"{path} does not hold {index.num_shards} row counts"
    return rows, ""


def load_row_counts(index: DatasetIndex, seq_len: int) -> np.ndarray:
    """Every shard's row count at seq_len: from the plan file (O(shards) int64s); when it is missing or damaged,
    computed from every shard's offsets (one line on stderr says so from NOTICE_SHARDS shards on) and written back
    when the directory allows."""
    counts, why = read_plan(index, seq_len)
    if counts is None:
        token_dir = index.token_dir
        if index.num_shards >= NOTICE_SHARDS:
            print(f"row plan: {why}; computing it from the offsets of all {index.num_shards} shards "
                  f"(run `train.py shards plan {token_dir} --seq-len {seq_len}` once to skip this)",
                  file=sys.stderr, flush=True)
        counts = np.asarray(compute_row_counts(token_dir, index, seq_len), dtype=np.int64)
        try:
            _atomic_save(plan_path(token_dir, seq_len, index.digest), counts)
        except OSError:  # a read-only dataset: the counts are still right, only not kept
            pass
    if not counts.sum():
        raise ShardError(f"{index.token_dir}: no rows at seq_len {seq_len}")
    return counts
