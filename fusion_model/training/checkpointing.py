"""Checkpoint IO that survives a kill mid-write (tmp + fsync + os.replace) and RNG states as plain tensors.

Everything written here loads with `torch.load(path, weights_only=True)`: no numpy arrays, no pickled objects.
"""

from __future__ import annotations

import random
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

from common.files import (
    PICKLED_OBJECTS,
    atomic_torch_save,
    holds_pickled_objects,
    load_checkpoint_file,
    replace_directory,
)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning CheckpointIO: atomic, fsynced writes; loads only with `weights_only=True`."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Write the checkpoint atomically (a kill during the write leaves the previous file intact)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Load with `weights_only=True` whatever the caller asked; a broken file names a good one to resume from."""
        try:
            return load_checkpoint_file(path, map_location=map_location if map_location is not None else "cpu")
        except ValueError as err:
            if "://" in str(path):
                raise
            raise ValueError(broken_checkpoint_message(Path(path), err)) from err


def _is_complete(path: Path) -> bool:
    """Cheap check that a torch.save file is whole: its zip central directory (written last) is readable."""
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def previous_good_checkpoint(path: str | Path) -> Path | None:
    """The newest other `*.ckpt` file in `path`'s folder that is complete, or None."""
    path = Path(path)
    try:
        candidates = [p for p in path.parent.glob("*.ckpt") if p.is_file() and p.resolve() != path.resolve()]
    except OSError:
        return None
    for candidate in sorted(candidates, key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True):
        if _is_complete(candidate):
            return candidate
    return None


def broken_checkpoint_message(path: Path, err: Exception) -> str:
    """One line: which checkpoint cannot be loaded, why (first line of the error), and which one to resume from."""
    text = str(err.__cause__ or err).strip()
    reason = text.splitlines()[0][:200] if text else type(err).__name__
    size = path.stat().st_size if path.is_file() else 0
    what = (
        "is empty (0 bytes)"
        if size == 0
        else PICKLED_OBJECTS  # not torch's message: it advises weights_only=False
        if holds_pickled_objects(err.__cause__ or err)
        else f"could not be loaded with torch.load(weights_only=True): it is truncated or holds pickled objects "
        f"({size} bytes; {reason})"
    )
    good = previous_good_checkpoint(path)
    todo = (
        f"resume from the previous good checkpoint in the same folder instead: --ckpt_path {good}"
        if good is not None
        else "no other complete checkpoint is in its folder: start without --ckpt_path or pass an earlier one"
    )
    return f"checkpoint {path} {what}; {todo}"


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy (FSDP2) whose sharded checkpoints appear all at once.

    With `save_distributed_checkpoint=True` every rank writes its shard into `.<name>.partial` next to
    the target; after a barrier rank 0 renames the finished directory into place. A kill mid-write
    leaves the previous checkpoint intact and only a `.partial` directory, which the next save removes.
    With `save_distributed_checkpoint=False` the full state goes through the CheckpointIO
    (AtomicCheckpointIO in `train.py fit`), atomic already.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write the sharded checkpoint to a temporary directory, then rename it to `filepath` on rank 0."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))  # every rank writes under rank 0's path
        partial = path.with_name(f".{path.name}.partial")
        if self.global_rank == 0 and partial.exists():
            shutil.rmtree(partial)  # left by a save that was killed
        self.barrier("atomic_checkpoint_clean")
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier("atomic_checkpoint_written")
        if self.global_rank == 0:
            replace_directory(partial, path)
        self.barrier("atomic_checkpoint_renamed")


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
