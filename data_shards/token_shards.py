"""Token shards: flat uint16 ids + per-document offsets (.npy, never pickled) + keys, and a checked manifest.

Layout of a token directory: `manifest.json` and, per shard NAME, `NAME.ids.npy` (all ids concatenated),
`NAME.offsets.npy` (int64, documents + 1 entries), `NAME.keys.json` (sample keys, read only to name a
document in an error) and `NAME.meta.json` (counts and settings; written last, so its presence means the
shard is complete).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from data_shards.raw import ShardError
from tokenizer.files import atomic_open, atomic_write_json

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


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id (uint16 for Chameleon's 65,536)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    with atomic_open(path, "wb") as handle:
        np.save(handle, array, allow_pickle=False)


def write_token_shard(out_dir: str | Path, name: str, keys: list[str], documents: list[list[int]], info: dict) -> dict:
    """Write one token shard atomically (ids, offsets, then meta last); returns its meta."""
    out_dir = Path(out_dir)
    vocab_size = info["vocab_size"]
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.fromiter((t for d in documents for t in d), dtype=np.int64, count=int(offsets[-1]))
    if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
        bad = int(np.flatnonzero((flat < 0) | (flat >= vocab_size))[0])
        doc = int(np.searchsorted(offsets, bad, side="right") - 1)
        raise ShardError(f"shard {name}, key {keys[doc]!r}: token id {int(flat[bad])} outside the vocabulary "
                         f"(size {vocab_size}); the vocabulary and image tokenizer do not match")
    out_dir.mkdir(parents=True, exist_ok=True)
    _save_npy_atomic(out_dir / f"{name}.ids.npy", flat.astype(id_dtype(vocab_size)))
    _save_npy_atomic(out_dir / f"{name}.offsets.npy", offsets)
    atomic_write_json(out_dir / f"{name}.keys.json", keys)
    meta = {
        "name": name,
        "documents": len(documents),
        "tokens": int(offsets[-1]),
        "max_id": int(flat.max()) if flat.size else -1,
        **info,
    }
    atomic_write_json(out_dir / f"{name}.meta.json", meta)
    return meta


def write_manifest(token_dir: str | Path, header: dict, shard_metas: list[dict]) -> dict:
    """Write `manifest.json` for finished shards: `header` (fingerprints, vocab_size, pad_id, ...) + totals."""
    shards = [{k: v for k, v in meta.items() if k in ("name", "source", "documents", "tokens", "images", "max_id")}
              for meta in shard_metas]
    manifest = {
        "format": TOKEN_FORMAT,
        "dtype": id_dtype(header["vocab_size"]).name,
        **header,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "images": sum(s.get("images", 0) for s in shards),
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
    return json.loads(path.read_text())


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
    for field, kind in MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(field), kind):
            raise ShardError(f"{path}: field {field!r} missing or not {kind.__name__}")
    if manifest["format"] != TOKEN_FORMAT:
        raise ShardError(f"{path}: format {manifest['format']!r}, expected {TOKEN_FORMAT!r}")
    if not manifest["shards"]:
        raise ShardError(f"{path}: lists no shards")
    for shard in manifest["shards"]:
        for suffix in (".ids.npy", ".offsets.npy", ".keys.json", ".meta.json"):
            if not (token_dir / f"{shard['name']}{suffix}").is_file():
                raise ShardError(f"{path}: shard {shard['name']} lists a missing file {shard['name']}{suffix}")
        if shard.get("max_id", -1) >= manifest["vocab_size"]:
            raise ShardError(f"{path}: shard {shard['name']} holds id {shard['max_id']} >= vocab_size "
                             f"{manifest['vocab_size']}")
    return manifest


class TokenShard:
    """Read access to one token shard: ids as a read-only memmap, offsets in memory, keys loaded on demand."""

    def __init__(self, token_dir: str | Path, name: str, vocab_size: int) -> None:
        self.token_dir = Path(token_dir)
        self.name = name
        self.vocab_size = vocab_size
        self._keys: list[str] | None = None
        try:
            self.ids = np.load(self.token_dir / f"{name}.ids.npy", mmap_mode="r", allow_pickle=False)
            self.offsets = np.load(self.token_dir / f"{name}.offsets.npy", allow_pickle=False)
            documents = json.loads((self.token_dir / f"{name}.meta.json").read_text())["documents"]
        except (OSError, ValueError, KeyError) as err:
            raise ShardError(f"shard {name}: unreadable token shard ({err}); re-run `shards tokenize`") from err
        if self.ids.ndim != 1 or self.offsets.ndim != 1 or self.offsets.dtype != np.int64:
            raise ShardError(f"shard {name}: ids must be 1-D and offsets 1-D int64")
        if len(self.offsets) != documents + 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.ids):
            raise ShardError(f"shard {name}: offsets ({len(self.offsets)}) do not match its {documents} documents "
                             f"and {len(self.ids)} ids; the shard is corrupt, re-run `shards tokenize`")
        if np.any(np.diff(self.offsets) < 0):
            raise ShardError(f"shard {name}: offsets are not increasing; the shard is corrupt")
        if documents == 0:
            raise ShardError(f"shard {name}: empty shard (no documents)")

    def __len__(self) -> int:
        """Documents in the shard."""
        return len(self.offsets) - 1

    @property
    def keys(self) -> list[str]:
        """Sample keys, one per document (read from NAME.keys.json the first time)."""
        if self._keys is None:
            keys = json.loads((self.token_dir / f"{self.name}.keys.json").read_text())
            if len(keys) != len(self):
                raise ShardError(f"shard {self.name}: {len(keys)} keys for {len(self)} documents; re-run `shards tokenize`")
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
                             f"vocab_size {self.vocab_size}; this shard was made with another vocabulary")
