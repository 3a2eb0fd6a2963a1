"""Training images for the tokenizer: the built-in offline photos (skimage.data) as random crops with held-out
photos for validation, an image folder, or raw webdataset shards; bad files are skipped and counted."""

from __future__ import annotations

import glob
import logging
import math
import re
import tarfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from tokenizer.image.preprocess import ImageLoadError, open_image, preprocess

# Natural photos that skimage ships (no download). Held-out photos never appear in training crops.
TRAIN_PHOTOS = (
    "astronaut",
    "coffee",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "camera",
    "brick",
    "grass",
    "moon",
    "coins",
    "clock",
    "cell",
)
HELD_OUT_PHOTOS = ("chelsea", "rocket", "gravel")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
REPORT_NAMES = 5  # bad files named in a skip report; the rest are counted

log = logging.getLogger(__name__)


def skip_report(skipped: dict[str, str], where: str, what: str = "unreadable image(s) or shard(s)",
                flag: str = "--data.skip_bad_images") -> str:
    """One line for the log: how many bad `what` were skipped in `where`, the first few by name, what to do."""
    names = list(skipped)[:REPORT_NAMES]
    first = next(iter(skipped.values()), "")
    more = f" and {len(skipped) - len(names)} more" if len(skipped) > len(names) else ""
    return (
        f"skipped {len(skipped)} {what} in {where}: {', '.join(names)}{more} "
        f"(first error: {first}); fix or remove them, or set {flag} false to stop at the first"
    )


def note_skip(skipped: dict[str, str], name: str, reason: str, where: str, **report: str) -> None:
    """Record a bad file in `skipped` and log `skip_report` for the first few, then at each power of ten: a
    map-style dataset has no end of epoch of its own, so a folder of broken files is never silent."""
    if name in skipped:
        return
    skipped[name] = reason
    count = len(skipped)
    if count <= REPORT_NAMES or math.log10(count).is_integer():
        log.warning(skip_report(skipped, where, **report))


def load_photo(name: str) -> torch.Tensor:
    """A skimage.data photo as (3, H, W) float in [-1, 1] (grayscale repeated to RGB)."""
    import skimage.data

    array = np.asarray(getattr(skimage.data, name)())
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=2)
    return torch.from_numpy(array[..., :3].astype(np.float32) / 127.5 - 1.0).permute(2, 0, 1).contiguous()


def random_crop(image: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """A random square crop (side uniform between `size` and the shortest side), resized to `size`, maybe flipped."""
    _, h, w = image.shape
    short = min(h, w)
    low = min(size, short)
    side = int(torch.randint(low, short + 1, (1,), generator=generator))
    top = int(torch.randint(0, h - side + 1, (1,), generator=generator))
    left = int(torch.randint(0, w - side + 1, (1,), generator=generator))
    crop = image[:, top : top + side, left : left + side].unsqueeze(0)
    if side != size:
        crop = F.interpolate(crop, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
    crop = crop.squeeze(0).clamp(-1, 1)
    if bool(torch.rand((), generator=generator) < 0.5):
        crop = crop.flip(-1)
    return crop


class PhotoCrops(Dataset):
    """`length` random crops of the given skimage photos; crop i is a pure function of (seed, i)."""

    def __init__(self, photos: tuple[str, ...], size: int, length: int, seed: int = 0):
        self.images = [load_photo(name) for name in photos]
        self.size, self.length, self.seed = size, length, seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        image = self.images[int(torch.randint(len(self.images), (1,), generator=generator))]
        return random_crop(image, self.size, generator)


class ImageFiles(Dataset):
    """Image files: Chameleon's center crop (validation) or a random crop of the resized image (training).

    Unreadable files raise `ImageLoadError`, or with `skip_bad=True` are replaced by the next good file and
    recorded in `skipped` (per worker process).
    """

    def __init__(self, files: list[Path], size: int, train: bool, skip_bad: bool = True, seed: int = 0):
        if not files:
            raise ValueError("no image files found; check the folder or pattern")
        self.files, self.size, self.train, self.skip_bad, self.seed = files, size, train, skip_bad, seed
        self.skipped: dict[str, str] = {}
        self.epoch_offset = 0

    def __len__(self) -> int:
        return len(self.files)

    def _load(self, index: int) -> torch.Tensor:
        path = self.files[index]
        if not self.train:
            return preprocess(path, self.size)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index + self.epoch_offset)
        img = open_image(path)
        scale = self.size * 1.25 / min(img.size)  # slightly larger than the crop, so crops move
        pixels = torch.from_numpy(
            np.asarray(
                img.resize(
                    (max(self.size, round(img.width * scale)), max(self.size, round(img.height * scale)))
                ),
                dtype=np.float32,
            )
            / 127.5
            - 1.0
        ).permute(2, 0, 1)
        return random_crop(pixels, self.size, generator)

    def _note_skip(self, name: str, reason: str) -> None:
        note_skip(self.skipped, name, reason, f"the {'training' if self.train else 'validation'} image files")

    def __getitem__(self, index: int) -> torch.Tensor:
        for attempt in range(len(self.files)):
            i = (index + attempt) % len(self.files)
            try:
                return self._load(i)
            except ImageLoadError as err:
                if not self.skip_bad:
                    raise
                self._note_skip(str(self.files[i]), str(err))
        raise ImageLoadError(
            f"none of the {len(self.files)} image files could be read; first error: "
            f"{next(iter(self.skipped.values()), '?')}"
        )


# "pipe:cmd" runs cmd in a shell and "http://..." downloads, in webdataset's opener: a path from a config must
# never do either. A one-letter scheme is a Windows drive ("C:/data"), not a URL.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")


def local_shard_files(pattern: str) -> list[str]:
    """The local tar files a shard path or glob pattern names, as absolute paths; refuses commands and URLs."""
    if _SCHEME.match(pattern):
        raise ValueError(
            f"data source {pattern!r} is a command or URL, not a path: give local shard files (a path or a glob "
            "such as data/shards/*.tar); shell commands and downloads are never run"
        )
    files = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
    # absolute paths, so that a file named like "pipe:..." is still opened as a file
    files = [str(Path(f).resolve()) for f in files if Path(f).is_file()]
    if not files:
        raise FileNotFoundError(f"no shard files match {pattern!r}: give an image folder, 'photos', or local .tar shards")
    return files


class ShardImages(IterableDataset):
    """Every image of raw webdataset shards (documents' `0.png`, `1.jpg`, ...), split over ranks and workers.

    Reads tar members as bytes only: webdataset's decoders (which unpickle `.pyd` entries) are never used.
    """

    def __init__(self, pattern: str, size: int, train: bool, skip_bad: bool = True, seed: int = 0):
        self.urls = local_shard_files(pattern)
        self.size, self.train, self.skip_bad, self.seed = size, train, skip_bad, seed
        self.skipped: dict[str, str] = {}

    def count_images(self) -> int:
        """How many image members the shards hold, from the tar headers alone (nothing is decoded); a tar that
        cannot be read counts the members before the damage, and the pass over it reports the damage."""
        count = 0
        for url in self.urls:
            try:
                with tarfile.open(url, "r") as tar:
                    for member in tar:
                        count += member.isfile() and member.name.lower().endswith(IMAGE_SUFFIXES)
            except (tarfile.TarError, EOFError, OSError):
                continue
        return count

    def __iter__(self):
        import webdataset as wds

        worker = get_worker_info()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        urls = self.urls[rank * workers + worker_id :: world * workers] or self.urls[:1]
        generator = torch.Generator().manual_seed(self.seed * 7919 + rank * 101 + worker_id)
        before = len(self.skipped)
        for url in urls:
            yield from self._shard_images(wds, url, generator)
        if len(self.skipped) > before:  # the end of this worker's pass over its shards: one report line
            split = "training" if self.train else "validation"
            log.warning(skip_report(self.skipped, f"the {split} shards (this pass: {len(self.skipped) - before})"))

    def _shard_images(self, wds, url: str, generator: torch.Generator):
        """The images of one shard; a truncated or unreadable tar is a ValueError naming it, or a skip."""
        samples = iter(wds.WebDataset([url], shardshuffle=False, empty_check=False))
        while True:
            try:
                sample = next(samples)
            except StopIteration:
                return
            except (tarfile.TarError, EOFError, OSError) as err:
                reason = f"truncated or unreadable tar ({type(err).__name__}: {err.args[0] if err.args else err})"
                if not self.skip_bad:
                    raise ValueError(
                        f"image shard {url}: {reason}; re-create this shard or remove it from data.source "
                        "(or set --data.skip_bad_images true to skip the rest of it)"
                    ) from err
                self.skipped[url] = reason  # the images read before the damage were used
                return
            for key, value in sample.items():
                if not key.lower().endswith(tuple(s[1:] for s in IMAGE_SUFFIXES)) or not isinstance(
                    value, bytes
                ):
                    continue
                name = f"{sample.get('__url__', '?')}:{sample.get('__key__', '?')}.{key}"
                try:
                    if self.train:
                        img = open_image(value, name)
                        big = preprocess(img, math.ceil(self.size * 1.25), name)
                        yield random_crop(big, self.size, generator)
                    else:
                        yield preprocess(value, self.size, name)
                except ImageLoadError as err:
                    if not self.skip_bad:
                        raise
                    self.skipped[name] = str(err)


def is_shard_folder(source: str | Path) -> bool:
    """Whether `source` is a folder of tar shards and no images (img2dataset's output, or `shards write`'s)."""
    root = Path(source)
    return root.is_dir() and any(root.glob("*.tar")) and not list_image_files(root)


def list_image_files(folder: str | Path) -> list[Path]:
    """All image files under `folder` (recursive, sorted)."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"image folder {root} does not exist")
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
