"""Token shards: flat uint16 ids + per-document offsets (.npy, never pickled) + keys, and a checked manifest.

Layout of a token directory: `manifest.json` and, per shard NAME, `NAME.ids.npy` (all ids concatenated),
`NAME.offsets.npy` (int64, documents + 1 entries), `NAME.keys.json` (sample keys, read only to name a
document in an error) and `NAME.meta.json` (counts, settings, the sha256 of the raw shard it came from and
the size + sha256 of each of the three files above; written last, so its presence means the shard is complete).
Opening a shard checks those checksums (once per process and file); `verify_token_dir` checks everything.

A shard holding at least one conversation also has `NAME.targets.npy`, its target mask (`data_shards.target_mask`:
the format and why it is stored). Checksums are `data_shards.checksums`; the optional `NAME.features.npy` is written
by `FeatureWriter` (`data_shards.feature_file`).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

from common.files import atomic_write_json

# re-exported: every name imported from checksums, feature_file and target_mask (moved there from this module) stays
# importable from here; `X as X` marks the ones this module does not use itself
from data_shards.checksums import _HASH_CHUNK, _REMEDY, _write_checked, check_file
from data_shards.checksums import _VERIFIED as _VERIFIED
from data_shards.checksums import sha256_file as sha256_file
from data_shards.feature_file import FEATURES_FILE, FeatureWriter
from data_shards.ranks import rank_subset
from data_shards.raw import RAW_FORMAT, ShardError
from data_shards.target_mask import CONVERSATION, TARGETS_FILE, first_mismatch
from data_shards.target_mask import TARGET as TARGET
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
# A manifest's `feature_kind` when its features are continuous images' latent patches (one row per `<image>`
# placeholder position, written by a continuous image tokenizer); pre-quantisation features have "pre-quantisation".
LATENT_KIND = "latent"


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id (uint16 for Chameleon's 65,536)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


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
        trained roles (`shards verify`'s rule: `data_shards.target_mask.first_mismatch`)."""
        targets = self.targets
        if targets is None or not len(self.ids):
            return
        roles = set(target_roles)
        at = first_mismatch(self.ids, targets, self.offsets, sep_id, eos_id, roles)
        if at is not None:
            document = int(np.searchsorted(self.offsets, at, side="right") - 1)
            raise ShardError(f"shard {self.name}, document {document} (key {self.keys[document]!r}): its target mask "
                             f"({self.path(TARGETS_FILE)}) disagrees with its ids at id {at - int(self.offsets[document])}"
                             f" (value {int(targets[at])}; trained roles {', '.join(sorted(roles))}); {_REMEDY}")

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
