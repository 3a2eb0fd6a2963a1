"""A token shard's optional `NAME.features.npy`: its suffix and `FeatureWriter`, which writes it batch by batch."""

from __future__ import annotations

import io
import os
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from common.files import atomic_path
from data_shards.checksums import sha256_file

FEATURES_FILE = ".features.npy"  # optional: pre-quantisation image features, one row per image-code position


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
