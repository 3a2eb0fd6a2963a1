"""Per-shard row plans and the dataset index: each token shard's documents cut at seq_len and packed into rows, built
one shard at a time; and what a rank reads at start instead of the manifest, written once per dataset under `plans/`:
`index.json` (the manifest's fields but its shard list, and its sha256), `names.npy` (the shard names, mapped, not
parsed) and `rows-<seq_len>-<sha256 prefix>.npy` (every shard's row count at that seq_len).

A row holds pieces of documents of one shard only, packed by best-fit decreasing (`pack_rows`) from the stored
lengths alone, so a shard's rows depend on nothing but that shard and seq_len: the stream needs only the counts of
all shards (O(shards), read from the plan file) to lay out an epoch, and builds the tables of a shard when a rank
is about to read it.

Some spans are never cut (`whole_images`): a continuous image of a latent shard (Transfusion), and a video clip of a
shard whose manifest declares video. A manifest declares video with the clip markers' ids `bov_id` and `eov_id`
(ints; absent or null: no clips) beside `video_grid`, the [t, h, w] shape of every clip's codes (Emu3's meta; the
ids hold only `<bov>`, t*h*w codes, `<eov>`). A clip is then `<bov>` ... the next `<eov>` of its document, and a
document is cut before a clip's `<bov>` rather than inside it; a clip longer than seq_len is refused, naming its
shard, document and key.

A conversation (a document whose target mask has the `CONVERSATION` bit, `token_shards`) is never cut either: it is
one piece when it fits seq_len and is dropped otherwise (not an error: `ShardRows.dropped` lists it, so the stream
counts and names it), so the plan's row counts and the stream's rows agree.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import multiprocessing
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.files import atomic_open, atomic_write_json
from data_shards.raw import ShardError
from data_shards.token_shards import MANIFEST, TokenShard, latent_placeholder, read_manifest

INDEX_FORMAT = "early-fusion-dataset-index/1"
PLAN_DIR = "plans"
NAMES_FILE = "names.npy"
# From this many shards on, making the index or the row counts at start is worth a line on stderr (it reads every
# shard's entry or offsets: seconds and more); below it, it is milliseconds, and a refused `fit` keeps its one line.
NOTICE_SHARDS = 1_000


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
    # documents (indices in the shard) left out: conversations longer than seq_len, which are never cut
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_rows(self) -> int:
        """Rows of the shard."""
        return len(self.row_ptr) - 1


def shard_rows(offsets: np.ndarray, seq_len: int, no_cut: np.ndarray | None = None, *, shard: TokenShard | None = None,
               clips: bool = False, whole: np.ndarray | None = None) -> ShardRows:
    """Cut a shard's documents (its offsets) into pieces of at most seq_len tokens and pack them into rows.

    `no_cut` (bool per id of the shard, from `whole_images`): positions a piece may not start at, so that a
    continuous image (a clip) stays in one row; a document is then cut at the start of the span that would be
    split. shard, clips: for the message when a span is longer than seq_len (the shard's name and the document's
    key; whether the spans are clips). `whole` (bool per document): documents never cut (conversations): one piece
    when they fit seq_len, else dropped and listed in `dropped`.
    """
    starts, lengths = offsets[:-1], np.diff(offsets)
    keep = lengths > 0
    dropped = np.zeros(0, dtype=np.int64)
    if whole is not None:
        too_long = np.asarray(whole, dtype=bool) & (lengths > seq_len)
        dropped = np.flatnonzero(too_long).astype(np.int64)
        keep &= ~too_long
    documents = np.flatnonzero(keep)
    starts, lengths = starts[keep], lengths[keep]
    if no_cut is None or not (lengths > seq_len).any():
        pieces = -(-lengths // seq_len)
        piece_doc = np.repeat(np.arange(len(lengths)), pieces)
        first = np.cumsum(pieces) - pieces
        within = np.arange(len(piece_doc)) - np.repeat(first, pieces)
        piece_start = (starts[piece_doc] + within * seq_len).astype(np.int64)
        piece_len = np.minimum(seq_len, lengths[piece_doc] - within * seq_len).astype(np.int64)
    else:
        try:
            piece_start, piece_len = _cut_around(starts, lengths, seq_len, no_cut)
        except _SpanTooLong as err:
            raise ShardError(_too_long(err, int(documents[err.document]), seq_len, no_cut, shard, clips)) from None
    row_ptr, row_pieces = pack_rows(piece_len, seq_len)
    return ShardRows(piece_start, piece_len, row_ptr, row_pieces, dropped)


class _SpanTooLong(Exception):
    """A span that may not be cut is longer than seq_len: the document (index among the non-empty ones), where the
    span starts and where its document ends (ids of the shard)."""

    def __init__(self, document: int, start: int, end: int) -> None:
        super().__init__(document, start, end)
        self.document, self.start, self.end = document, start, end


def _too_long(err: _SpanTooLong, document: int, seq_len: int, no_cut: np.ndarray, shard: TokenShard | None,
              clips: bool) -> str:
    """The message for a span longer than seq_len, naming the shard, the document and its key when known."""
    inside = np.flatnonzero(~np.asarray(no_cut[err.start + 1 : err.end]))
    length = int(inside[0]) + 1 if len(inside) else err.end - err.start
    where = "its shard"
    if shard is not None:
        try:
            key = f" (key {shard.keys[document]!r})"
        except ShardError:  # the keys file is damaged: the document's index still names it
            key = ""
        where = f"document {document}{key} of shard {shard.name}"
    if clips:
        return (f"a video clip of {length} ids (<bov>, its codes, <eov>) at id {err.start} of {where} is longer than "
                f"seq_len {seq_len}: a row never cuts a clip; train with --data.seq_len >= {length}, or tokenize "
                "shorter or smaller clips (fewer frames, a coarser video grid)")
    return (f"a continuous image at id {err.start} of {where} is longer than seq_len {seq_len} with its markers: "
            "train with a longer --data.seq_len, or tokenize with a larger --patch-size (fewer positions per image)")


def _cut_around(starts: np.ndarray, lengths: np.ndarray, seq_len: int, no_cut: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """Pieces of at most seq_len tokens, each cut moved back to the nearest position not in `no_cut`."""
    piece_start: list[int] = []
    piece_len: list[int] = []
    for document, (start, length) in enumerate(zip(starts.tolist(), lengths.tolist())):
        end = start + length
        while end - start > seq_len:
            cut = start + seq_len
            while no_cut[cut] and cut > start:
                cut -= 1
            if cut == start:
                raise _SpanTooLong(document, start, end)
            piece_start.append(start)
            piece_len.append(cut - start)
            start = cut
        piece_start.append(start)
        piece_len.append(end - start)
    return np.asarray(piece_start, dtype=np.int64), np.asarray(piece_len, dtype=np.int64)


def video_markers(header: dict) -> tuple[int, int] | None:
    """(bov_id, eov_id) when the manifest declares video clips (both ids set), else None."""
    bov, eov = header.get("bov_id"), header.get("eov_id")
    if bov is None or eov is None:
        return None
    return int(bov), int(eov)


def _inside_clips(ids: np.ndarray, bov: int, eov: int, offsets: np.ndarray | None) -> np.ndarray:
    """Per id: whether it follows a `<bov>` of its document with no `<eov>` in between (a clip's codes and its
    `<eov>`; never its `<bov>`)."""
    index = np.arange(len(ids), dtype=np.int64)
    before = np.full(len(ids), -1, dtype=np.int64)  # the last <bov> (<eov>, document start) strictly before each id
    last_bov = np.maximum.accumulate(np.where(ids == bov, index, -1)) if len(ids) else before
    last_eov = np.maximum.accumulate(np.where(ids == eov, index, -1)) if len(ids) else before
    prev_bov, prev_eov = before.copy(), before.copy()
    prev_bov[1:], prev_eov[1:] = last_bov[:-1], last_eov[:-1]
    inside = prev_bov > prev_eov
    if offsets is not None and len(ids):  # a clip left open at a document's end ends there
        starts = np.full(len(ids), -1, dtype=np.int64)
        firsts = np.asarray(offsets[:-1], dtype=np.int64)
        firsts = firsts[firsts < len(ids)]
        starts[firsts] = firsts
        inside &= prev_bov >= np.maximum.accumulate(starts)
    return inside


def whole_images(ids: np.ndarray, header: dict, offsets: np.ndarray | None = None) -> np.ndarray | None:
    """The positions no row may start at, or None when any may (cuts every seq_len ids: codes of a VQ image may
    sit in two rows).

    Shards of continuous images (`feature_kind` "latent"): each `<image>` placeholder, and an `<eoi>` right after
    one, so `<boi>`, the patches and `<eoi>` share a row. Shards whose manifest declares video (`video_markers`):
    every id after a clip's `<bov>` up to its `<eov>`, so a clip is never cut (offsets: the shard's, so that a
    clip left open ends with its document)."""
    placeholder = latent_placeholder(header)
    markers = video_markers(header)
    if placeholder is None and markers is None:
        return None
    ids = np.asarray(ids)
    no_cut = np.zeros(len(ids), dtype=bool)
    if placeholder is not None:
        is_patch = ids == placeholder
        no_cut |= is_patch
        no_cut[1:] |= (ids[1:] == int(header["eoi_id"])) & is_patch[:-1]
    if markers is not None:
        no_cut |= _inside_clips(ids, *markers, offsets)
    return no_cut


def plan_shard(shard: TokenShard, header: dict, seq_len: int) -> ShardRows:
    """A shard's pieces and rows at seq_len under the dataset's rules (`whole_images`; conversations whole, or
    dropped when longer than seq_len); a span too long to keep whole is refused naming the shard, the document and
    its key."""
    no_cut = whole_images(shard.ids, header, shard.offsets)
    whole = shard.conversation_documents() if shard.has_targets else None
    return shard_rows(shard.offsets, seq_len, no_cut, shard=shard, clips=video_markers(header) is not None,
                      whole=whole)


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
