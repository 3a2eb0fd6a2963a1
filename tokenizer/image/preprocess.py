"""Loading and preprocessing images exactly as Chameleon does: RGB on white, shortest side resized
(LANCZOS), center crop, scaled to [-1, 1]; every bad file becomes an `ImageLoadError` naming it."""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

ImageSource = str | os.PathLike | bytes | Image.Image

# Policy for absurd sizes (checked from the header, before any pixel is decoded):
# - more than MAX_PIXELS pixels is refused as a probable decompression bomb (a 20,000 x 20,000 PNG
#   would need 1.2 GB of RGB memory);
# - an aspect ratio above MAX_ASPECT is refused: after resizing the shortest side the center crop
#   would keep under 1/MAX_ASPECT of the picture, and a 20,000 x 1 strip would be resized to
#   ~10M x 512 pixels. So a 20,000-px-wide panorama of height >= 1,000 is accepted and cropped,
#   a 20,000 x 100 banner is refused with a clear error;
# - a shortest side under MIN_SIDE (1x1 tracking pixels, icons) is refused: upscaling it to 512 px
#   makes a flat or blurred picture that only teaches the tokenizer noise.
MAX_PIXELS = 64_000_000
MAX_ASPECT = 20.0
MIN_SIDE = 8


class ImageLoadError(ValueError):
    """An image that cannot be used; the message names the file and what to do."""


@dataclass
class LoadedBatch:
    """Result of `load_batch`: pixels of the usable images and what was skipped."""

    pixels: torch.Tensor  # (N, 3, size, size) in [-1, 1]
    indices: list[int]  # positions of the usable images in the input
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, reason)


def _name_of(source: ImageSource, name: str | None) -> str:
    if name is not None:
        return name
    if isinstance(source, str | os.PathLike):
        return str(source)
    if isinstance(source, bytes):
        return f"<{len(source)} bytes>"
    return getattr(source, "filename", None) or "<PIL image>"


def check_image_size(width: int, height: int, name: str) -> None:
    """Refuse a picture (an image, or a clip's frames) outside the size policy above, naming `name`."""
    if width * height > MAX_PIXELS:
        raise ImageLoadError(
            f"{name}: {width}x{height} pixels exceeds the limit of {MAX_PIXELS:,} (possible decompression "
            "bomb); downscale the file before using it."
        )
    if min(width, height) < MIN_SIDE:
        raise ImageLoadError(
            f"{name}: {width}x{height} is too small (shortest side < {MIN_SIDE} px); drop it or supply "
            "a larger image."
        )
    if max(width, height) / min(width, height) > MAX_ASPECT:
        raise ImageLoadError(
            f"{name}: aspect ratio {width}x{height} exceeds {MAX_ASPECT:g}:1, a center crop would keep almost "
            "nothing of it; crop it into tiles yourself or drop it."
        )


def _to_8bit(img: Image.Image) -> Image.Image:
    """Convert high-bit-depth grayscale ('I;16', 'I', 'F') to 8-bit 'L' by scaling, not by clipping."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        values = np.asarray(img, dtype=np.float64)
        top = 65535.0 if values.max(initial=0) > 255 or img.mode.startswith("I;16") else 255.0
        return Image.fromarray(np.clip(np.rint(values / top * 255.0), 0, 255).astype(np.uint8), "L")
    if img.mode == "F":
        values = np.asarray(img, dtype=np.float64)
        top = 1.0 if values.max(initial=0) <= 1.0 else 255.0  # float images are either [0, 1] or [0, 255]
        return Image.fromarray(np.clip(np.rint(values / top * 255.0), 0, 255).astype(np.uint8), "L")
    return img


def whiten_transparency(img: Image.Image) -> Image.Image:
    """RGB image; transparent pixels blended on white exactly as Chameleon's `_whiten_transparency`."""
    if img.mode == "RGB":
        return img
    rgba = np.array(img.convert("RGBA"))
    if not (rgba[:, :, 3] < 255).any():
        return img.convert("RGB")
    alpha = rgba[:, :, 3:4] / 255.0
    rgb = (1 - alpha) * 255 + alpha * rgba[:, :, :3]
    return Image.fromarray(rgb.astype("uint8"), "RGB")  # truncation, not rounding, as in Chameleon


def open_image(source: ImageSource, name: str | None = None) -> Image.Image:
    """Open a path, bytes or PIL image as an RGB PIL image (EXIF-rotated, alpha on white).

    Animated images (GIF, APNG, WebP) give their first frame. Raises `ImageLoadError` for truncated,
    corrupt, non-image, too large, too small or too elongated inputs.
    """
    label = _name_of(source, name)
    try:
        if isinstance(source, Image.Image):
            img = source
        elif isinstance(source, bytes):
            img = Image.open(io.BytesIO(source))
        elif isinstance(source, str | os.PathLike):
            path = Path(source)
            if not path.is_file():
                raise ImageLoadError(f"{label}: no such file; check the path.")
            img = Image.open(path)
        else:
            raise ImageLoadError(
                f"{label}: unsupported image source type {type(source).__name__}; "
                "pass a path, bytes or a PIL image."
            )
        check_image_size(*img.size, label)
        if getattr(img, "n_frames", 1) > 1:
            img.seek(0)  # policy: the first frame of an animation
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()
        img = ImageOps.exif_transpose(img)
        return whiten_transparency(_to_8bit(img))
    except ImageLoadError:
        raise
    except Image.UnidentifiedImageError as err:
        raise ImageLoadError(
            f"{label}: not an image file PIL can read ({err}); remove it or convert it."
        ) from err
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageLoadError(
            f"{label}: refused as a decompression bomb ({err}); downscale it first."
        ) from err
    except (OSError, SyntaxError, ValueError, EOFError) as err:
        raise ImageLoadError(
            f"{label}: truncated or corrupt image ({type(err).__name__}: {err}); re-download or re-encode it."
        ) from err


def preprocess(image: ImageSource, size: int, name: str | None = None) -> torch.Tensor:
    """FloatTensor (3, size, size) in [-1, 1]: shortest side resized (LANCZOS) to `size`, center crop."""
    img = open_image(image, name)
    scale = size / min(img.size)
    new_size = (round(scale * img.size[0]), round(scale * img.size[1]))
    img = img.resize(new_size, Image.LANCZOS)
    x0 = (img.width - size) // 2
    y0 = (img.height - size) // 2
    img = img.crop((x0, y0, x0 + size, y0 + size))
    pixels = np.asarray(img, dtype=np.float64) / 255.0 * 2 - 1  # float64 then float, as Chameleon does
    return torch.from_numpy(pixels).permute(2, 0, 1).float()


def load_batch(
    images: Sequence[ImageSource], size: int, *, skip_errors: bool = False, names: Sequence[str] | None = None
) -> LoadedBatch:
    """Preprocess many images into one (N, 3, size, size) tensor; bad ones raise, or are skipped and counted."""
    tensors: list[torch.Tensor] = []
    indices: list[int] = []
    skipped: list[tuple[str, str]] = []
    for i, image in enumerate(images):
        name = names[i] if names is not None else None
        try:
            tensors.append(preprocess(image, size, name))
            indices.append(i)
        except ImageLoadError as err:
            if not skip_errors:
                raise
            skipped.append((_name_of(image, name), str(err)))
    pixels = torch.stack(tensors) if tensors else torch.empty(0, 3, size, size)
    return LoadedBatch(pixels=pixels, indices=indices, skipped=skipped)


def to_pil(images: torch.Tensor) -> Image.Image | list[Image.Image]:
    """Convert (3, H, W) or (B, 3, H, W) tensors in [-1, 1] to PIL RGB images (clamped, rounded)."""
    batch = images.detach().float().cpu()
    single = batch.dim() == 3
    if single:
        batch = batch.unsqueeze(0)
    if batch.dim() != 4 or batch.shape[1] != 3:
        raise ValueError(f"to_pil expects (3, H, W) or (B, 3, H, W) tensors, got shape {tuple(images.shape)}")
    array = ((batch.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    pils = [Image.fromarray(a, "RGB") for a in array]
    return pils[0] if single else pils
