"""File checksums of token shards: write a file recording its size and sha256, and check a file against them."""

from __future__ import annotations

import hashlib
from pathlib import Path

from common.files import atomic_write_bytes
from data_shards.raw import ShardError

_REMEDY = "the shard is corrupt or stale: re-run `train.py shards tokenize` into a fresh directory"
_HASH_CHUNK = 8 << 20
# (path, size, mtime_ns) -> sha256 of files already checked in this process (inherited by forked workers).
_VERIFIED: dict[tuple[str, int, int], str] = {}


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
