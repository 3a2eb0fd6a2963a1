"""Checkpoint IO that survives a kill mid-write (tmp + fsync + os.replace) and RNG states as plain tensors.

Everything written here loads with `torch.load(path, weights_only=True)`: no numpy arrays, no pickled objects.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """Write `obj` with torch.save to `path` so that readers see either the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them visible
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)  # the rename itself is durable


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems (and Windows) do not open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Load a checkpoint with `weights_only=True`, naming the file in the error if it is not a safe checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist (pass an existing .ckpt file to --ckpt_path)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 - re-raised with the file name and what to do
        raise RuntimeError(
            f"checkpoint {path} could not be loaded with torch.load(weights_only=True): {err}. "
            "It is truncated or holds pickled objects; resume from an earlier checkpoint."
        ) from err


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO: atomic, fsynced writes; loads only with `weights_only=True`."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write the checkpoint atomically (a kill during the write leaves the previous file intact)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Load with `weights_only=True` whatever the caller asked: checkpoints never need unpickling."""
        return load_checkpoint_file(path, map_location=map_location if map_location is not None else "cpu")


# --- RNG states as tensors (torch.load(weights_only=True) refuses numpy arrays and arbitrary tuples) ---


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch / CUDA / Python / NumPy RNG states, each encoded as a tensor."""
    py_version, py_keys, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    assert np_name == "MT19937"
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([py_version, *py_keys], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if py_gauss is None else py_gauss], dtype=torch.float64),
        "numpy": torch.tensor([*np_keys.tolist(), np_pos, np_has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's current device
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"].cpu())
    py = state["python"].tolist()
    gauss = state["python_gauss"].item()
    random.setstate((py[0], tuple(py[1:]), None if gauss != gauss else gauss))
    np_vals = state["numpy"].tolist()
    keys = np.array(np_vals[:-2], dtype=np.uint32)
    np.random.set_state(("MT19937", keys, np_vals[-2], np_vals[-1], state["numpy_gauss"].item()))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
