"""Token shards: flat uint16 ids + per-document offsets (.npy, never pickled) + keys, and a checked manifest.

Layout of a token directory: `manifest.json` and, per shard NAME, `NAME.ids.npy` (all ids concatenated),
`NAME.offsets.npy` (int64, documents + 1 entries), `NAME.keys.json` (sample keys, read only to name a
document in an error) and `NAME.meta.json` (counts, settings, the sha256 of the raw shard it came from and
the size + sha256 of each of the three files above; written last, so its presence means the shard is complete).
Opening a shard checks those checksums (once per process and file); `verify_token_dir` checks everything.

A shard holding at least one conversation (chat SFT data) also has `NAME.targets.npy`: uint8, one entry per id,
bit 0 (`TARGET`) = the token is a training target, bit 1 (`CONVERSATION`) = it belongs to a conversation, which
packing never cuts. Plain documents there are all 1; a conversation's prompt and context tokens (`<s>`, system and
user turns with their `<sep>`) are 2, its trained roles' turns (with the `</s>` ending each answer) 3. Shards
without conversations have no such file (every token is a target). The mask is stored, not derived from the ids,
because the markers alone cannot tell a system turn from a user turn (`<sep>` ends both), so a run training one of
them could not be told from the ids, and because a shard mixing documents and conversations needs a per-document
"never cut" flag. It is checksummed in the meta's `files` like the others, and `verify_shard` checks it against
the markers and the recorded `target_roles`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from common.files import atomic_path, atomic_write_bytes, atomic_write_json
from data_shards.ranks import rank_subset
from data_shards.raw import RAW_FORMAT, ShardError
from tokenizer.layout import image_position_mask

TOKEN_FORMAT = "early-fusion-tokens/1"
MANIFEST = "manifest.json"
MANIFEST_FIELDS = {
    "format": str,
    "vocab_fingerprint": str,
    "image_tokenizer_fingerprint": str,
    "vocab_size": int,
    "pad_id": int,
    "dtype": str,
    "documents": int,
    "tokens": int,
    "shards": list,
}
# The vocabulary layout recorded since checksums were added; older manifests lack these (checks then skip them).
LAYOUT_FIELDS = ("vocab_size", "image_offset", "image_codes", "pad_id", "bos_id", "eos_id")
SHARD_FILES = (".ids.npy", ".offsets.npy", ".keys.json")
FEATURES_FILE = ".features.npy"  # optional: pre-quantisation image features, one row per image-code position
TARGETS_FILE = ".targets.npy"  # shards with conversations: uint8 per id, the bits below
TARGET = 1  # bit 0 of a targets entry: the token is a training target
CONVERSATION = 2  # bit 1: the token belongs to a conversation (packing never cuts it)
# A manifest's `feature_kind` when its features are continuous images' latent patches (one row per `<image>`
# placeholder position, written by a continuous image tokenizer); pre-quantisation features have "pre-quantisation".
LATENT_KIND = "latent"
_REMEDY = "the shard is corrupt or stale: re-run `train.py shards tokenize` into a fresh directory"
_HASH_CHUNK = 8 << 20
# (path, size, mtime_ns) -> sha256 of files already checked in this process (inherited by forked workers).
_VERIFIED: dict[tuple[str, int, int], str] = {}


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id (uint16 for Chameleon's 65,536)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def sha256_file(path: str | Path) -> str:
    """sha256 (hex) of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_checked(path: Path, data: bytes) -> dict:
    atomic_write_bytes(path, data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def check_file(path: Path, expected: dict) -> None:
    """Raise ShardError naming `path` unless its size and sha256 equal `expected` ({"bytes", "sha256"}).

    The hash is computed once per process and file (keyed by size and mtime), so a stream's workers and
    repeated opens do not re-read the file.
    """
    try:
        stat = path.stat()
    except OSError as err:
        raise ShardError(f"{path}: cannot read ({err}); {_REMEDY}") from err
    if stat.st_size != expected["bytes"]:
        raise ShardError(f"{path}: {stat.st_size} bytes, but {expected['bytes']} were written (truncated or "
                         f"overwritten); {_REMEDY}")
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    actual = _VERIFIED.get(key) or sha256_file(path)
    if actual != expected["sha256"]:
        raise ShardError(f"{path}: sha256 {actual[:16]}... differs from the {expected['sha256'][:16]}... recorded "
                         f"when it was written (bytes changed on disk); {_REMEDY}")
    _VERIFIED[key] = actual


class FeatureWriter:
    """Writes a shard's `NAME.features.npy` in chunks, never holding the whole array: the bytes equal `np.save` of
    the concatenated float16 (rows, dim) array. A context manager: the file appears (atomically) only through
    `finish()`, called by `write_token_shard` before the meta; leaving the block without it removes the temporary."""

    def __init__(self, out_dir: str | Path, name: str, dim: int) -> None:
        self.path = Path(out_dir) / f"{name}{FEATURES_FILE}"
        self.dim, self.rows = int(dim), 0
        # np.save pads its header to 64 bytes; the row count is known only at the end, so its slot is reserved now
        # and must not change length with the count (it does not below 10**40 rows at any dim below 10**12)
        self._header_size = len(self._header(0))
        if len(self._header(2**63 - 1)) != self._header_size:
            raise ValueError(f"feature dim {dim}: the .npy header length would depend on the row count")
        self._stack = ExitStack()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self._stack.enter_context(atomic_path(self.path))
        self._handle = self._stack.enter_context(open(self._tmp, "wb"))
        self._handle.write(b"\0" * self._header_size)

    def _header(self, rows: int) -> bytes:
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            buffer, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float16)), "fortran_order": False,
                     "shape": (rows, self.dim)})
        return buffer.getvalue()

    def write(self, rows: np.ndarray) -> None:
        """Append feature rows (n, dim), stored as float16."""
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] != self.dim:
            raise ValueError(f"{self.path.name}: feature rows must be (n, {self.dim}), got shape {rows.shape}")
        self._handle.write(np.ascontiguousarray(rows, dtype=np.float16).tobytes())
        self.rows += rows.shape[0]

    def finish(self) -> dict:
        """Write the header, move the file into place; returns its {"bytes", "sha256"} for the meta."""
        self._handle.seek(0)
        self._handle.write(self._header(self.rows))
        self._handle.close()
        checked = {"bytes": os.path.getsize(self._tmp), "sha256": sha256_file(self._tmp)}  # one read back
        self._stack.close()  # fsync, rename into place
        return checked

    def __enter__(self) -> FeatureWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stack.__exit__(exc_type, exc, tb)  # after finish(): nothing left; otherwise removes the temporary


def write_token_shard(out_dir: str | Path, name: str, keys: list[str], documents: list[list[int] | np.ndarray],
                      info: dict,
                      features: np.ndarray | FeatureWriter | None = None,
                      targets: list[np.ndarray] | None = None) -> dict:
    """Write one token shard atomically (ids, offsets, then meta last); returns its meta.

    `features` (rows, C) float16: one row per image-code position of the ids, in order (late fusion reads them);
    or a `FeatureWriter` that already holds them on disk (finished here, before the meta). `targets`: per document
    its uint8 target mask (`TARGET` / `CONVERSATION` bits), written as `NAME.targets.npy` (shards with
    conversations).
    """
    out_dir = Path(out_dir)
    vocab_size = info["vocab_size"]
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = (np.concatenate([np.asarray(d, dtype=np.int64) for d in documents]) if documents
            else np.zeros(0, dtype=np.int64))
    if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
        bad = int(np.flatnonzero((flat < 0) | (flat >= vocab_size))[0])
        doc = int(np.searchsorted(offsets, bad, side="right") - 1)
        raise ShardError(f"shard {name}, key {keys[doc]!r}: token id {int(flat[bad])} outside the vocabulary "
                         f"(size {vocab_size}); the vocabulary and image tokenizer do not match")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {
        f"{name}.ids.npy": _write_checked(out_dir / f"{name}.ids.npy", _npy_bytes(flat.astype(id_dtype(vocab_size)))),
        f"{name}.offsets.npy": _write_checked(out_dir / f"{name}.offsets.npy", _npy_bytes(offsets)),
        f"{name}.keys.json": _write_checked(out_dir / f"{name}.keys.json",
                                            (json.dumps(keys, indent=2) + "\n").encode()),
    }
    if targets is not None:
        marks = np.concatenate([np.asarray(t, dtype=np.uint8) for t in targets]) if targets else np.zeros(0, np.uint8)
        if len(targets) != len(documents) or len(marks) != len(flat):
            raise ValueError(f"shard {name}: {len(marks)} target entries for {len(flat)} ids")
        files[f"{name}{TARGETS_FILE}"] = _write_checked(out_dir / f"{name}{TARGETS_FILE}", _npy_bytes(marks))
    if isinstance(features, FeatureWriter):
        files[f"{name}{FEATURES_FILE}"] = features.finish()
    elif features is not None:
        if features.ndim != 2:
            raise ValueError(f"shard {name}: features must be (rows, dim), got shape {features.shape}")
        files[f"{name}{FEATURES_FILE}"] = _write_checked(out_dir / f"{name}{FEATURES_FILE}",
                                                         _npy_bytes(features.astype(np.float16)))
    meta = {
        "name": name,
        "documents": len(documents),
        "tokens": int(offsets[-1]),
        "max_id": int(flat.max()) if flat.size else -1,
        **info,
        "files": files,
    }
    atomic_write_json(out_dir / f"{name}.meta.json", meta)
    return meta


def manifest_entry(meta: dict) -> dict:
    """What the manifest lists of one shard's meta."""
    return {k: v for k, v in meta.items()
            if k in ("name", "source", "raw_sha256", "documents", "tokens", "images", "clips", "conversations",
                     "max_id", "files")}


def write_manifest(token_dir: str | Path, header: dict, shard_metas: list[dict]) -> dict:
    """Write `manifest.json` for finished shards: `header` (fingerprints, vocab_size, pad_id, ...) + totals."""
    shards = [manifest_entry(meta) for meta in shard_metas]
    manifest = {
        "format": TOKEN_FORMAT,
        "dtype": id_dtype(header["vocab_size"]).name,
        **header,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "images": sum(s.get("images", 0) for s in shards),
        # only shards with clips add the field: image-only manifests stay as they were
        **({"clips": sum(s.get("clips", 0) for s in shards)} if any("clips" in s for s in shards) else {}),
        **({"conversations": sum(s.get("conversations", 0) for s in shards)}
           if any(s.get("conversations") for s in shards) else {}),
        "shards": shards,
    }
    atomic_write_json(Path(token_dir) / MANIFEST, manifest)
    return manifest


def read_shard_meta(token_dir: str | Path, name: str) -> dict | None:
    """The meta of a finished shard, or None when the shard is absent or incomplete."""
    token_dir = Path(token_dir)
    path = token_dir / f"{name}.meta.json"
    if not path.is_file() or not (token_dir / f"{name}.ids.npy").is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ShardError(f"{path}: unreadable shard meta ({err}); {_REMEDY}") from err
    if not isinstance(meta, dict):
        raise ShardError(f"{path}: shard meta is not a JSON object; {_REMEDY}")
    return meta


def read_manifest(token_dir: str | Path) -> dict:
    """Load a token directory's manifest and check its fields and that every listed shard file exists."""
    token_dir = Path(token_dir)
    path = token_dir / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {token_dir} is not a token shard directory (run `shards tokenize`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ShardError(f"{path}: invalid JSON ({err})") from err
    kind_of_dir = manifest.get("format") if isinstance(manifest, dict) else None
    if kind_of_dir == RAW_FORMAT:  # the step before: name it rather than its first missing field
        raise ShardError(f"{token_dir} is a raw shard directory (from `shards write`), not a token shard directory: "
                         f"run `train.py shards tokenize {token_dir} --out TOKENS_DIR --vocab tokenizer.json` first "
                         "and give TOKENS_DIR here")
    if kind_of_dir != TOKEN_FORMAT:
        raise ShardError(f"{path}: not a token shard manifest (format {kind_of_dir!r}, expected {TOKEN_FORMAT!r}): "
                         "a token shard directory is the --out of `train.py shards tokenize` (manifest.json and, "
                         "per shard, NAME.ids.npy, NAME.offsets.npy, NAME.keys.json, NAME.meta.json)")
    for field, kind in MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(field), kind):
            raise ShardError(f"{path}: field {field!r} missing or not {kind.__name__}")
    if not manifest["shards"]:
        raise ShardError(f"{path}: lists no shards")
    for field in LAYOUT_FIELDS:
        if field in manifest and manifest[field] is not None and not isinstance(manifest[field], int):
            raise ShardError(f"{path}: field {field!r} is not an int")
    # one listing of the directory, not a stat per file: 4 per shard cost 56 ms per thousand shards (a minute at
    # a million), paid by every rank at every start
    present = {entry.name for entry in os.scandir(token_dir) if entry.is_file()}
    for shard in manifest["shards"]:
        for suffix in (".ids.npy", ".offsets.npy", ".keys.json", ".meta.json"):
            if f"{shard['name']}{suffix}" not in present:
                raise ShardError(f"{path}: shard {shard['name']} lists a missing file {shard['name']}{suffix}")
        if shard.get("max_id", -1) >= manifest["vocab_size"]:
            raise ShardError(f"{path}: shard {shard['name']} holds id {shard['max_id']} >= vocab_size "
                             f"{manifest['vocab_size']}")
    return manifest


class TokenShard:
    """Read access to one token shard: ids as a read-only memmap, offsets in memory, keys loaded on demand.

    Opening checks the structure (offsets against the meta's counts) and, when the meta records them
    (shards written since checksums were added), each file's size and sha256 (once per process and file).
    """

    def __init__(self, token_dir: str | Path, name: str, vocab_size: int, verify: bool = True) -> None:
        self.token_dir = Path(token_dir)
        self.name = name
        self.vocab_size = vocab_size
        self._keys: list[str] | None = None
        self._features: np.ndarray | None = None
        self._feature_start: np.ndarray | None = None
        self._targets: np.ndarray | None = None
        ids_path, offsets_path = self.path(".ids.npy"), self.path(".offsets.npy")
        self.meta = read_shard_meta(self.token_dir, name)
        if self.meta is None:
            missing = ids_path if not ids_path.is_file() else self.path(".meta.json")  # name the one that is gone
            raise ShardError(f"{missing}: missing; {_REMEDY}")
        loading = ids_path
        try:
            self.ids = np.load(ids_path, mmap_mode="r", allow_pickle=False)
            loading = offsets_path
            self.offsets = np.load(offsets_path, allow_pickle=False)
            documents = int(self.meta["documents"])
        # a damaged .npy header surfaces as almost anything (ValueError, SyntaxError, tokenize.TokenError, ...)
        except Exception as err:  # noqa: BLE001
            raise ShardError(f"shard {name}: unreadable token shard {loading} ({type(err).__name__}: {err}); "
                             f"{_REMEDY}") from err
        where = f"shard {name} ({ids_path})"
        if self.ids.ndim != 1 or self.offsets.ndim != 1 or self.offsets.dtype != np.int64:
            raise ShardError(f"{where}: ids must be 1-D and offsets 1-D int64; {_REMEDY}")
        if len(self.offsets) != documents + 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.ids):
            raise ShardError(f"shard {name}: offsets ({len(self.offsets)} in {offsets_path}) do not match its "
                             f"{documents} documents and {len(self.ids)} ids; {_REMEDY}")
        if np.any(np.diff(self.offsets) < 0):
            raise ShardError(f"shard {name}: offsets in {offsets_path} are not increasing; {_REMEDY}")
        if documents == 0:
            raise ShardError(f"{where}: empty shard (no documents); {_REMEDY}")
        if "tokens" in self.meta and self.meta["tokens"] != len(self.ids):
            raise ShardError(f"{where}: {len(self.ids)} ids but its meta says {self.meta['tokens']}; {_REMEDY}")
        if verify:
            self.verify_files()

    def path(self, suffix: str) -> Path:
        """The path of this shard's file with `suffix` (".ids.npy", ".offsets.npy", ".keys.json", ".meta.json")."""
        return self.token_dir / f"{self.name}{suffix}"

    @property
    def has_checksums(self) -> bool:
        """Whether the meta records file checksums (shards written before they were added do not)."""
        return isinstance(self.meta.get("files"), dict)

    def verify_files(self) -> None:
        """Check each file's size and sha256 against the meta (no-op for shards written without checksums)."""
        if not self.has_checksums:
            return
        optional = ((FEATURES_FILE,) if self.has_features else ()) + ((TARGETS_FILE,) if self.has_targets else ())
        for suffix in SHARD_FILES + optional:
            expected = self.meta["files"].get(f"{self.name}{suffix}")
            if not isinstance(expected, dict):
                raise ShardError(f"{self.path('.meta.json')}: no checksum for {self.name}{suffix}; {_REMEDY}")
            try:
                check_file(self.path(suffix), expected)
            except ShardError as err:
                if suffix == ".ids.npy":  # name the document when the damage put an id outside the vocabulary
                    for start in range(0, len(self.ids), _HASH_CHUNK):
                        try:
                            self.check_ids(start, min(start + _HASH_CHUNK, len(self.ids)))
                        except ShardError as id_err:
                            raise ShardError(f"{id_err} ({err})") from err
                raise

    @property
    def has_targets(self) -> bool:
        """Whether the shard stores a target mask (`NAME.targets.npy`: it holds conversations)."""
        return self.has_checksums and f"{self.name}{TARGETS_FILE}" in self.meta["files"]

    @property
    def targets(self) -> np.ndarray | None:
        """The target mask (uint8 per id, read-only memmap; `TARGET` / `CONVERSATION` bits), or None for a shard
        without conversations (every token a target)."""
        if self._targets is None and self.has_targets:
            path = self.path(TARGETS_FILE)
            try:
                targets = np.load(path, mmap_mode="r", allow_pickle=False)
            except Exception as err:  # noqa: BLE001 - a damaged .npy header surfaces as almost anything
                raise ShardError(f"shard {self.name}: unreadable {path} ({type(err).__name__}: {err}); {_REMEDY}") from err
            if targets.dtype != np.uint8 or targets.shape != self.ids.shape:
                raise ShardError(f"shard {self.name}: {path} holds {targets.dtype} {targets.shape}, not uint8 "
                                 f"({len(self.ids)},) like its ids; {_REMEDY}")
            self._targets = targets
        return self._targets

    def conversation_documents(self) -> np.ndarray:
        """Per document: whether it is a conversation (never cut; the `CONVERSATION` bit of its first token)."""
        lengths = self.lengths
        out = np.zeros(len(lengths), dtype=bool)
        targets = self.targets
        if targets is not None:
            filled = lengths > 0
            out[filled] = (np.asarray(targets[self.offsets[:-1][filled]]) & CONVERSATION) != 0
        return out

    def check_targets(self, sep_id: int, eos_id: int, target_roles: list[str] | tuple[str, ...]) -> None:
        """Raise ShardError naming the document whose stored target mask disagrees with its ids' markers and the
        trained roles (`shards verify`'s rule): the conversation bit constant within each document, plain documents
        all `TARGET`, and in a conversation `<s>` never a target, each turn (ended by `<sep>`, or by `</s>` for the
        assistant's, marker included) entirely a target or not as its role is trained."""
        targets = self.targets
        if targets is None or not len(self.ids):
            return
        ids = np.asarray(self.ids, dtype=np.int64)
        marks = np.asarray(targets)
        n = len(ids)
        doc_of = np.repeat(np.arange(len(self), dtype=np.int64), self.lengths)
        starts = self.offsets[:-1][self.lengths > 0]
        conv = (marks & CONVERSATION) != 0
        target = (marks & TARGET) != 0
        bad = np.zeros(n, dtype=bool)
        bad |= marks > (TARGET | CONVERSATION)
        bad |= conv != conv[self.offsets[:-1][doc_of]]  # the conversation bit is its document's first token's
        bad |= ~conv & ~target  # a plain document is a target everywhere
        # turns: a new segment at each document start, right after `<s>` and right after each end of turn
        is_end = (ids == sep_id) | (ids == eos_id)
        begins = np.zeros(n, dtype=bool)
        begins[starts] = True
        after_start = starts + 1
        begins[after_start[after_start < n]] = True
        begins[1:] |= is_end[:-1]
        segment = np.cumsum(begins) - 1
        first = np.flatnonzero(begins)
        last = np.concatenate([first[1:], [n]]) - 1
        roles = set(target_roles)
        others = len(roles & {"system", "user"})  # 0: no <sep> turn trained, 2: all, 1: each turn all or nothing
        kind = np.where(ids[last] == eos_id, 1, np.where(ids[last] == sep_id, 2, 0))  # answer / other / neither
        kind[np.isin(first, starts)] = 0  # `<s>` (a document's first token) is never a target
        expected = np.where(kind == 1, int("assistant" in roles), np.where(kind == 2, -1 if others == 1 else
                                                                            int(others == 2), 0))
        lowest = np.minimum.reduceat(target.astype(np.int8), first)
        highest = np.maximum.reduceat(target.astype(np.int8), first)
        wrong = np.where(expected < 0, lowest != highest, (lowest != expected) | (highest != expected))
        bad |= conv & wrong[segment]
        if bad.any():
            at = int(np.flatnonzero(bad)[0])
            document = int(doc_of[at])
            raise ShardError(f"shard {self.name}, document {document} (key {self.keys[document]!r}): its target mask "
                             f"({self.path(TARGETS_FILE)}) disagrees with its ids at id {at - int(self.offsets[document])}"
                             f" (value {int(marks[at])}; trained roles {', '.join(sorted(roles))}); {_REMEDY}")

    @property
    def has_features(self) -> bool:
        """Whether the shard stores image features (written by `shards tokenize --features`)."""
        return self.has_checksums and f"{self.name}{FEATURES_FILE}" in self.meta["files"]

    def image_features(self, start: int, stop: int, image_offset: int | None, image_codes: int | None,
                       placeholder_id: int | None = None) -> np.ndarray:
        """The feature rows (n, C) float16 of the image positions among ids [start, stop), in order: image codes
        (pre-quantisation features), or with `placeholder_id` the `<image>` positions of continuous images (their
        latent patches)."""
        if self._features is None:
            if not self.has_features:
                raise ShardError(f"shard {self.name} in {self.token_dir} stores no image features; re-run "
                                 "`train.py shards tokenize --features` into a fresh directory")
            try:
                self._features = np.load(self.path(FEATURES_FILE), mmap_mode="r", allow_pickle=False)
            except Exception as err:  # noqa: BLE001 - a damaged .npy header surfaces as almost anything
                raise ShardError(f"shard {self.name}: unreadable {self.path(FEATURES_FILE)} ({err}); {_REMEDY}") from err
            is_image = image_position_mask(self.ids, image_offset, image_codes, placeholder_id)
            # rows before each document: a piece then needs only a count within its own document
            self._feature_start = np.concatenate([[0], np.cumsum(is_image, dtype=np.int64)])[self.offsets]
            if self._feature_start[-1] != len(self._features):
                raise ShardError(f"shard {self.name}: {len(self._features)} feature rows in "
                                 f"{self.path(FEATURES_FILE)} for {int(self._feature_start[-1])} "
                                 f"{'image-code' if placeholder_id is None else '<image> placeholder'} positions; "
                                 f"{_REMEDY}")
        document = int(np.searchsorted(self.offsets, start, side="right") - 1)
        doc_start = int(self.offsets[document])
        ids = self.ids[doc_start:stop]
        is_image = image_position_mask(ids, image_offset, image_codes, placeholder_id)
        first = int(self._feature_start[document]) + int(is_image[: start - doc_start].sum())
        rows = self._features[first : first + int(is_image[start - doc_start :].sum())]
        # checksums only say the bytes are those written: NaN written by a broken encoder would reach the loss
        self._refuse_nonfinite(rows, first, placeholder_id)
        return rows

    def _refuse_nonfinite(self, rows: np.ndarray, first_row: int, placeholder_id: int | None) -> None:
        """Raise ShardError naming the document whose feature rows (`rows`, from row `first_row`) hold a NaN or an
        infinity: the one finiteness rule of `shards verify` and of the stream."""
        bad = np.flatnonzero(~np.isfinite(rows).all(axis=1))
        if not bad.size:
            return
        row = first_row + int(bad[0])
        document = int(np.searchsorted(self._feature_start, row, side="right") - 1)
        what = "image features" if placeholder_id is None else "latent patches"
        raise ShardError(f"shard {self.name}, document {document} (key {self.keys[document]!r}): its {what} hold a "
                         f"NaN or an infinity (row {row} of {self.path(FEATURES_FILE)}); {_REMEDY}, and run "
                         f"`train.py shards verify {self.token_dir}` to find every such shard")

    def check_features_finite(self, image_offset: int | None, image_codes: int | None,
                              placeholder_id: int | None = None) -> None:
        """Raise ShardError naming the sample whose stored features (or latents) hold a NaN or an infinity."""
        if not self.has_features:
            return
        self.image_features(0, 0, image_offset, image_codes, placeholder_id)  # maps the file, counts rows per document
        features = self._features
        step = max(1, _HASH_CHUNK // (2 * max(1, features.shape[1])))  # about 8 MB of float16 at a time
        for first in range(0, len(features), step):
            self._refuse_nonfinite(np.asarray(features[first : first + step]), first, placeholder_id)

    def __len__(self) -> int:
        """Documents in the shard."""
        return len(self.offsets) - 1

    @property
    def keys(self) -> list[str]:
        """Sample keys, one per document (read from NAME.keys.json the first time)."""
        if self._keys is None:
            try:
                keys = json.loads(self.path(".keys.json").read_text())
            except (OSError, ValueError) as err:
                raise ShardError(f"{self.path('.keys.json')}: unreadable ({err}); {_REMEDY}") from err
            if not isinstance(keys, list) or len(keys) != len(self):
                raise ShardError(f"{self.path('.keys.json')}: {len(keys) if isinstance(keys, list) else 'no'} keys "
                                 f"for {len(self)} documents; {_REMEDY}")
            self._keys = keys
        return self._keys

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per document."""
        return np.diff(self.offsets)

    def check_ids(self, start: int, stop: int) -> None:
        """Raise ShardError naming the key if any id in [start, stop) is outside the vocabulary."""
        chunk = self.ids[start:stop]
        if chunk.size and int(chunk.max()) >= self.vocab_size:
            bad = start + int(np.flatnonzero(chunk >= self.vocab_size)[0])
            doc = int(np.searchsorted(self.offsets, bad, side="right") - 1)
            raise ShardError(f"shard {self.name}, key {self.keys[doc]!r}: token id {int(self.ids[bad])} >= "
                             f"vocab_size {self.vocab_size} in {self.path('.ids.npy')}; the shard was made with another "
                             f"vocabulary or is corrupt: run `train.py shards verify {self.token_dir}`, then re-run "
                             "`train.py shards tokenize` into a fresh directory")


def verify_shard(token_dir: str | Path, entry: dict, vocab_size: int, layout: dict | None = None) -> None:
    """Check one shard fully (checksums, structure, every id < vocab_size, counts = meta = manifest entry, and with
    the manifest's `layout` fields every stored feature or latent finite)."""
    shard = TokenShard(token_dir, entry["name"], vocab_size)
    where = f"shard {shard.name} ({shard.path('.ids.npy')})"
    for field in ("documents", "tokens"):
        if field in entry and entry[field] != shard.meta.get(field):
            raise ShardError(f"{where}: the manifest says {entry[field]} {field}, its meta {shard.meta.get(field)}; "
                             f"{_REMEDY}")
    for start in range(0, len(shard.ids), _HASH_CHUNK):
        shard.check_ids(start, min(start + _HASH_CHUNK, len(shard.ids)))
    shard.keys  # noqa: B018 -- reading them checks their count
    if shard.has_targets:
        layout = layout or {}
        missing = [f for f in ("sep_id", "eos_id") if not isinstance(layout.get(f), int)]
        if missing:
            raise ShardError(f"{where}: holds conversations, but its manifest lacks {', '.join(missing)}; {_REMEDY}")
        shard.check_targets(layout["sep_id"], layout["eos_id"],
                            shard.meta.get("target_roles") or layout.get("target_roles") or ["assistant"])
    if layout is not None and layout.get("feature_dim"):
        shard.check_features_finite(layout.get("image_offset"), layout.get("image_codes"), latent_placeholder(layout))


def latent_placeholder(manifest: dict) -> int | None:
    """The `<image>` id whose positions hold continuous latent patches, for shards of a continuous image tokenizer
    (`feature_kind` "latent"); None for code shards, whose features sit at image-code positions."""
    return int(manifest["image_placeholder_id"]) if manifest.get("feature_kind") == LATENT_KIND else None


def verify_token_dir(token_dir: str | Path, rank: int = 0, world_size: int = 1) -> tuple[dict, list[tuple[str, str]]]:
    """Verify the shards of a token directory; returns (manifest, [(shard name, problem), ...]).

    With `world_size` > 1 only this rank's disjoint subset (`rank_subset`) is checked, so processes or nodes split
    the work. A manifest that cannot be read raises (nothing else can be checked then).
    """
    manifest = read_manifest(token_dir)
    mine = rank_subset([entry["name"] for entry in manifest["shards"]], rank, world_size)
    problems = []
    for entry in manifest["shards"]:
        if entry["name"] not in mine:
            continue
        try:
            verify_shard(token_dir, entry, manifest["vocab_size"], manifest)
        except ShardError as err:
            problems.append((entry["name"], str(err)))
    return manifest, problems
