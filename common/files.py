"""The project's one rule for files on disk: atomic writes (temp file, fsync, rename, fsync of the directory)
and checkpoint loading with `weights_only=True`. The lowest layer, so every package uses the same code."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _process_alive(pid: int) -> bool:
    """Whether a process with this id exists (one owned by another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, OverflowError):
        return True
    return True


_TEMPORARY = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<pid>\d+)$")
# Temporary files seen in each directory at this process's first atomic write there, by target name: listing the
# directory once, not at every write, keeps writing thousands of shards into one directory linear.
_seen_temporaries: dict[str, dict[str, list[Path]]] = {}


# The permission bits a plain open() gives a new file in this process (0o666 less the umask); read once.
_cached_new_file_mode: int | None = None


def _new_file_mode(directory: str | os.PathLike) -> int:
    """The mode open() would give a new file: 0o666 less the umask. Read once per process from a probe file in
    `directory`, since os.umask can only be read by setting it, which races with threads creating files."""
    global _cached_new_file_mode
    if _cached_new_file_mode is None:
        probe = Path(directory) / f".mode-probe.tmp-{os.getpid()}"
        probe.unlink(missing_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _cached_new_file_mode = stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    return _cached_new_file_mode


def _remove_if_stale(candidate: Path) -> bool:
    """Delete one `.<name>.tmp-<pid>` file if its writer is gone (never this process's or a live one's)."""
    match = _TEMPORARY.match(candidate.name)
    if match is None:
        return False
    pid = int(match["pid"])
    if pid == os.getpid() or _process_alive(pid):
        return False
    try:
        if candidate.is_file() and not candidate.is_symlink():
            candidate.unlink()
            return True
    except OSError:
        pass  # another writer cleaned it up first, or it is not ours to delete
    return False


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Delete `.<name>.tmp-<pid>` files next to `path` left by writers that were killed; returns them.

    A kill during a save leaves its temporary file behind (a whole checkpoint at 7B); the next write to
    the same name removes it once its process is gone. Files of live processes (a concurrent writer,
    or this one) are kept.
    """
    path = Path(path)
    try:
        siblings = sorted(path.parent.iterdir())
    except OSError:
        return []
    prefix = f".{path.name}.tmp-"
    return [s for s in siblings if s.name.startswith(prefix) and _remove_if_stale(s)]


def _remove_stale_seen_at_first_write(path: Path) -> None:
    """remove_stale_temporaries for atomic writes, listing each directory once per process."""
    directory = str(path.parent)
    seen = _seen_temporaries.get(directory)
    if seen is None:
        seen = {}
        try:
            names = os.listdir(directory)
        except OSError:
            names = []
        for name in names:
            match = _TEMPORARY.match(name)
            if match is not None:
                seen.setdefault(match["target"], []).append(path.parent / name)
        _seen_temporaries[directory] = seen
    for candidate in seen.pop(path.name, []):
        _remove_if_stale(candidate)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `path`; when the block succeeds, the file there becomes `path` atomically.

    For writers that want a file name (safetensors, tokenizers, PIL). Readers see the old file or the complete
    new one, never half of it; on an exception the temporary file is removed and `path` is untouched.
    Temporary files of earlier writers to `path` that were killed are removed first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_seen_at_first_write(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        # some writers create their file 0600 (safetensors does): give it the mode a plain open() would
        os.chmod(tmp, _new_file_mode(path.parent))
        _fsync_file(tmp)  # the bytes are on disk before the rename makes them visible
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)  # the rename itself is durable


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", **kwargs: Any) -> Iterator[IO]:
    """`open(path, mode)` whose content appears at `path` only once the block has finished without error."""
    if not mode.startswith("w"):
        raise ValueError(f"atomic_open writes whole files; mode {mode!r} must start with 'w'")
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as handle:
        yield handle


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically; returns the path."""
    with atomic_open(path, "wb") as handle:
        handle.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 `text` to `path` atomically; returns the path."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> Path:
    """Write `obj` as JSON (plus a newline) atomically; values JSON cannot hold are written with str()."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """torch.save to `path` atomically (so a kill mid-write leaves the previous file whole)."""
    import torch

    with atomic_open(path, "wb") as handle:
        torch.save(obj, handle)
    return Path(path)


def replace_directory(new: str | os.PathLike, path: str | os.PathLike) -> None:
    """Move the finished directory `new` to `path`, replacing what is there.

    A directory cannot be renamed over a non-empty one, so an old `path` first moves aside to
    `.<name>.old`, deleted only once the new one is in place: a kill between the two renames leaves
    the old one whole under that name, never a half-written one under `path`.
    """
    path, new = Path(path), Path(new)
    old = path.with_name(f".{path.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if path.is_dir():
        os.replace(path, old)
    elif path.exists():
        path.unlink()
    os.replace(new, path)
    fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """torch.load with `weights_only=True` (never unpickles code); errors name the file and what to do."""
    import torch

    text = str(path)
    if "://" in text:
        raise ValueError(f"checkpoint {text} is a URL; download it yourself and pass the local file")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist: pass an existing checkpoint file")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 - re-raised with the file name and what to do
        if holds_pickled_objects(err):
            raise ValueError(
                f"checkpoint {path} {PICKLED_OBJECTS}: save its weights again as plain tensors with the project's "
                "tools (fusion_model.checkpoint.save_model, or `train.py convert import` for a transformers folder) "
                "and pass that file"
            ) from err
        raise ValueError(
            f"checkpoint {path} could not be loaded with torch.load(weights_only=True): {first_line(err)}. "
            "It is truncated, not a checkpoint, or holds pickled objects; use an earlier checkpoint."
        ) from err


# why a file of pickled objects is refused; never torch's advice (weights_only=False runs the file's code)
PICKLED_OBJECTS = ("holds pickled Python objects, which torch.load(weights_only=True) refuses and this project never "
                   "unpickles (that can run code)")


def holds_pickled_objects(error: BaseException) -> bool:
    """Whether torch.load(weights_only=True) refused a file for the pickled Python objects in it (not its tensors)."""
    import pickle

    return isinstance(error, pickle.UnpicklingError) and "weights only load failed" in str(error).lower()


def first_line(error: BaseException) -> str:
    """The first line of an error's message (torch's run to several paragraphs), or its type's name."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
