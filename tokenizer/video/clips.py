"""Clip input and output: read a clip (.npy, a video file decoded by PyAV, or a folder of frames) as uint8
(T, H, W, 3); write animated GIF / MP4; a strip of frames for HTML pages.

Video files are decoded with PyAV (FFmpeg inside the wheel), never `torchvision.io.read_video` (removed from
current torchvision). `.npy` clips are loaded with `allow_pickle=False`: an array of objects is refused, and the
header is checked first (dtype, shape, bytes present, MAX_CLIP_BYTES) so a lying header allocates nothing. Frames
follow the images' size policy (`tokenizer.image.preprocess.check_image_size`: at least MIN_SIDE px a side).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, closing
from pathlib import Path
from typing import BinaryIO

import numpy as np
import numpy.lib.format as npy_format
from PIL import Image

from common.files import atomic_path
from tokenizer.image.preprocess import ImageLoadError, check_image_size

# Video containers PyAV decodes here (their original bytes are what raw shards store).
VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov", ".avi")
# A clip is one of these files, or a folder of frames (FRAME_SUFFIXES, in name order).
CLIP_SUFFIXES = (".npy", *VIDEO_SUFFIXES)
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg")
# A clip decoded past this many bytes of uint8 pixels is refused (a long film, not a clip).
MAX_CLIP_BYTES = 2 * 1024**3


class ClipLoadError(ValueError):
    """A clip that cannot be used; the message names the file and what to do."""


ClipSource = str | os.PathLike | bytes


def _label(source: ClipSource, name: str | None) -> str:
    if name is not None:
        return name
    if isinstance(source, bytes):
        return f"<{len(source)} bytes>"
    return str(source)


def _check_layout(dtype: np.dtype, shape: tuple[int, ...], label: str) -> None:
    """Refuse a clip array of another dtype or layout than uint8 (T, H, W, 3), (T, H, W, 1) or (T, H, W), or an
    empty one: from the array, or from a .npy header before anything is loaded."""
    if dtype != np.uint8:
        raise ClipLoadError(
            f"{label}: clip arrays must be uint8 (T, H, W, 3) or (T, H, W) grey, got dtype {dtype}; "
            "convert it (e.g. (x * 255).round().astype(np.uint8)) and save it again"
        )
    if not (len(shape) == 3 or (len(shape) == 4 and shape[-1] in (1, 3))):
        raise ClipLoadError(
            f"{label}: clip arrays must have shape (T, H, W, 3) or (T, H, W), got {tuple(shape)}; "
            "save the frames in that layout"
        )
    if min(shape[:3]) < 1:
        raise ClipLoadError(f"{label}: empty clip (shape {tuple(shape)}); remove it")


def _check_frame_size(width: int, height: int, label: str) -> None:
    """Frames follow the images' size policy (`tokenizer.image.preprocess.check_image_size`): a frame the image
    path would refuse is refused here, naming the clip, rather than failing unnamed inside the tokenizer."""
    try:
        check_image_size(width, height, f"{label} (frames)")
    except ImageLoadError as err:
        raise ClipLoadError(str(err)) from err


def _as_clip(array: np.ndarray, label: str) -> np.ndarray:
    """Check and normalise an array to uint8 (T, H, W, 3): grey (T, H, W) and (T, H, W, 1) are repeated to RGB."""
    _check_layout(array.dtype, array.shape, label)
    if array.ndim == 4 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim == 3:
        array = np.repeat(array[..., None], 3, axis=-1)
    return np.ascontiguousarray(array)


def _check_npy_header(handle: BinaryIO, available: int, label: str) -> None:
    """Read a .npy header and refuse, before any allocation, what loading would refuse or could not hold: objects
    (never unpickled), another dtype or layout, more pixels than MAX_CLIP_BYTES, more bytes than the file has, or
    frames under the images' minimum. `available` is the file's size; the handle is left after the header."""
    if handle.read(4) == b"PK\x03\x04":  # np.savez's zip archive under a .npy name
        raise ClipLoadError(f"{label}: a .npz archive, not a single .npy array; save one uint8 array with np.save")
    handle.seek(0)
    try:
        version = npy_format.read_magic(handle)
        if version == (1, 0):
            shape, _, dtype = npy_format.read_array_header_1_0(handle)
        elif version == (2, 0):
            shape, _, dtype = npy_format.read_array_header_2_0(handle)
        else:
            raise ClipLoadError(f"{label}: .npy format version {version[0]}.{version[1]} is not read here; save it "
                                "again with np.save")
    except ClipLoadError:
        raise
    except (ValueError, OSError, EOFError) as err:
        raise ClipLoadError(f"{label}: not a readable .npy array ({err}); save it again with np.save") from err
    if dtype.hasobject:
        raise ClipLoadError(f"{label}: holds pickled Python objects, which are never loaded; "
                            "save a plain uint8 array (np.save(path, frames)) instead")
    _check_layout(dtype, shape, label)
    frames, height, width = (int(side) for side in shape[:3])
    if frames * height * width * 3 > MAX_CLIP_BYTES:  # as RGB: grey frames are repeated to 3 channels
        raise ClipLoadError(f"{label}: its header claims shape {tuple(shape)}, more than {MAX_CLIP_BYTES >> 30} GiB "
                            "of pixels; cut it into clips")
    claimed = math.prod(int(side) for side in shape) * dtype.itemsize
    left = available - handle.tell()
    if claimed > left:
        raise ClipLoadError(f"{label}: truncated: its header claims shape {tuple(shape)} ({claimed:,} bytes) but "
                            f"{max(left, 0):,} bytes follow; save it again with np.save")
    _check_frame_size(width, height, label)


def _read_npy(source: ClipSource, label: str) -> np.ndarray:
    with ExitStack() as stack:
        if isinstance(source, bytes):
            handle, available = io.BytesIO(source), len(source)
        else:
            handle = stack.enter_context(open(source, "rb"))
            available = os.fstat(handle.fileno()).st_size
        _check_npy_header(handle, available, label)
        handle.seek(0)
        try:
            array = np.load(handle, allow_pickle=False)
        except ValueError as err:
            raise ClipLoadError(f"{label}: not a readable .npy array ({err}); save it again with np.save") from err
        except (OSError, EOFError) as err:
            raise ClipLoadError(f"{label}: truncated or corrupt .npy file ({err}); save it again with np.save") from err
    return _as_clip(array, label)


def _check_not_empty(source: ClipSource, label: str) -> None:
    """Refuse a zero-byte clip file (or bytes) in plain words, before a decoder reports it in its own."""
    if (len(source) if isinstance(source, bytes) else Path(source).stat().st_size) == 0:
        raise ClipLoadError(f"{label}: empty file (0 bytes); remove it or write it again")


def _video_frames(source: ClipSource, label: str, pixels: bool) -> Iterator[np.ndarray | tuple[int, int]]:
    """A video file's frames decoded one at a time (uint8 (H, W, 3) with `pixels`, else only checked: their
    (height, width)), so memory is one frame's whatever the length. Every frame must have the first one's size,
    within the images' size policy, and the clip at most MAX_CLIP_BYTES of RGB pixels; anything else is a
    `ClipLoadError`."""
    import av

    first: tuple[int, int] | None = None
    count = total = 0
    try:
        handle = io.BytesIO(source) if isinstance(source, bytes) else str(source)
        with av.open(handle, mode="r") as container:
            if not container.streams.video:
                raise ClipLoadError(f"{label}: the file has no video stream; remove it or re-encode it")
            for frame in container.decode(container.streams.video[0]):
                size = (frame.width, frame.height)
                if first is None:
                    first = size
                    _check_frame_size(*size, label)
                elif size != first:
                    raise ClipLoadError(f"{label}: frame {count} is {size[0]}x{size[1]}, the first "
                                        f"{first[0]}x{first[1]}; re-encode it at one size")
                total += size[0] * size[1] * 3
                if total > MAX_CLIP_BYTES:
                    raise ClipLoadError(
                        f"{label}: decodes to more than {MAX_CLIP_BYTES >> 30} GiB of pixels; cut it into clips"
                    )
                count += 1
                yield frame.to_ndarray(format="rgb24") if pixels else (size[1], size[0])
    except ClipLoadError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError, IndexError) as err:
        raise ClipLoadError(
            f"{label}: truncated, corrupt or undecodable video ({type(err).__name__}: {err}); "
            "re-download or re-encode it (e.g. ffmpeg -i IN -c:v libx264 OUT.mp4)"
        ) from err
    if not count:
        raise ClipLoadError(f"{label}: no video frame could be decoded (truncated or empty); re-encode it")


def _read_video(source: ClipSource, label: str, max_frames: int | None) -> np.ndarray:
    frames: list[np.ndarray] = []
    with closing(_video_frames(source, label, pixels=True)) as decoded:
        for pixels in decoded:
            frames.append(pixels)
            if max_frames is not None and len(frames) >= max_frames:
                break
    return np.stack(frames)


def probe_video(source: ClipSource, name: str | None = None) -> tuple[int, int, int]:
    """(frames, height, width) of a video file (a path or its bytes), decoding every frame to check it but
    holding one at a time; a `ClipLoadError` naming it where `read_clip` would refuse it."""
    label = _label(source, name)
    _check_not_empty(source, label)
    count, last = 0, (0, 0)
    for size in _video_frames(source, label, pixels=False):
        count, last = count + 1, size
    return count, *last


def _decode_frames(frames: list[tuple[str, object]], label: str) -> np.ndarray:
    """(frame name, path or bytes) pairs in order as one uint8 (T, H, W, 3) clip; all frames need one size."""
    decoded: list[np.ndarray] = []
    total = 0
    for frame_name, source in frames:
        try:
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
                if not decoded:  # from the header, before the first frame's pixels are decoded
                    _check_frame_size(*image.size, label)
                decoded.append(np.asarray(image.convert("RGB")))
        except ClipLoadError:
            raise
        except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as err:
            raise ClipLoadError(
                f"{label}: frame {frame_name} is truncated or not an image ({type(err).__name__}: {err}); "
                "re-export the frames"
            ) from err
        if decoded[-1].shape != decoded[0].shape:
            raise ClipLoadError(
                f"{label}: frame {frame_name} is {decoded[-1].shape[1]}x{decoded[-1].shape[0]}, frame "
                f"{frames[0][0]} {decoded[0].shape[1]}x{decoded[0].shape[0]}; all frames need one size"
            )
        total += decoded[-1].nbytes
        if total > MAX_CLIP_BYTES:
            raise ClipLoadError(f"{label}: its frames hold more than {MAX_CLIP_BYTES >> 30} GiB of pixels; cut it "
                                "into clips")
    if not decoded:
        raise ClipLoadError(f"{label}: a clip needs at least one frame")
    return np.stack(decoded)


def _read_frame_folder(folder: Path, label: str, max_frames: int | None) -> np.ndarray:
    paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES and p.is_file())
    if not paths:
        raise ClipLoadError(f"{label}: a folder of frames needs PNG or JPEG files ({', '.join(FRAME_SUFFIXES)})")
    return _decode_frames([(p.name, p) for p in paths[:max_frames]], label)


def read_frame_images(frames: Sequence[bytes], name: str = "<frames>") -> np.ndarray:
    """Encoded frame images (PNG/JPEG bytes, in order) as one uint8 (T, H, W, 3) clip; `ClipLoadError` naming
    `name` and the frame otherwise."""
    return _decode_frames([(f"{t:06d}", data) for t, data in enumerate(frames)], name)


def read_clip(
    source: ClipSource, name: str | None = None, suffix: str | None = None, max_frames: int | None = None
) -> np.ndarray:
    """A clip as uint8 (T, H, W, 3): a `.npy` array, a video file (PyAV), a folder of frames, or `bytes` of a
    `.npy`/video file with its `suffix` (clips stored inside tar shards). `max_frames` stops reading early.

    Raises `ClipLoadError` naming the clip (`name`, else the path) for anything unusable.
    """
    label = _label(source, name)
    if isinstance(source, bytes):
        if suffix is None:
            raise ClipLoadError(f"{label}: clip bytes need their suffix (one of {', '.join(CLIP_SUFFIXES)})")
        path = None
    elif isinstance(source, str | os.PathLike):
        path = Path(source)
        if path.is_dir():
            return _read_frame_folder(path, label, max_frames)
        if not path.is_file():
            raise ClipLoadError(f"{label}: no such file or folder of frames; check the path")
        suffix = suffix or path.suffix
    else:
        raise ClipLoadError(f"{label}: unsupported clip source {type(source).__name__}; pass a path or bytes")
    _check_not_empty(source, label)
    suffix = suffix.lower() if suffix.startswith(".") else f".{suffix.lower()}"
    if suffix == ".npy":
        clip = _read_npy(source, label)
        return clip[:max_frames] if max_frames is not None else clip
    if suffix in VIDEO_SUFFIXES:
        return _read_video(source, label, max_frames)
    raise ClipLoadError(
        f"{label}: unknown clip type {suffix!r}; use {', '.join(CLIP_SUFFIXES)} or a folder of frames"
    )


def is_frame_folder(path: Path) -> bool:
    """Whether `path` is a directory holding at least one frame image (PNG/JPEG) directly."""
    return path.is_dir() and any(p.suffix.lower() in FRAME_SUFFIXES and p.is_file() for p in path.iterdir())


def list_clip_files(folder: str | os.PathLike) -> list[Path]:
    """Clip files (CLIP_SUFFIXES) and folders of frames under `folder` (recursive; `folder` itself is never a
    clip, and a folder of frames is not searched further), sorted."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"clip folder {root} does not exist")
    found: list[Path] = []

    def walk(directory: Path) -> None:
        for child in sorted(directory.iterdir()):
            if child.is_dir():
                if is_frame_folder(child):
                    found.append(child)
                else:
                    walk(child)
            elif child.suffix.lower() in CLIP_SUFFIXES:
                found.append(child)

    walk(root)
    return sorted(found)


def _checked_frames(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    return _as_clip(frames, f"frames of shape {tuple(frames.shape)}")


def write_gif(frames: np.ndarray, path: str | os.PathLike, fps: float = 4) -> Path:
    """Write uint8 (T, H, W, 3) frames as a looping animated GIF (atomically); returns the path."""
    frames = _checked_frames(frames)
    images = [Image.fromarray(frame) for frame in frames]
    path = Path(path)
    with atomic_path(path) as tmp:
        images[0].save(
            tmp, format="GIF", save_all=True, append_images=images[1:], duration=max(1, round(1000 / fps)),
            loop=0, disposal=1,
        )
    return path


def _mp4_codec() -> str:
    """H.264 through libx264 where the PyAV wheel has it, else FFmpeg's own MPEG-4 part 2 encoder."""
    import av

    return next((c for c in ("libx264", "mpeg4") if c in av.codecs_available), "mpeg4")


def write_mp4(frames: np.ndarray, path: str | os.PathLike, fps: int = 8) -> Path:
    """Write uint8 (T, H, W, 3) frames as H.264 MP4 (PyAV, atomically); odd sizes are padded by edge
    repetition to even ones (yuv420p needs them). Returns the path."""
    import av

    frames = _checked_frames(frames)
    _, height, width, _ = frames.shape
    pad_h, pad_w = height % 2, width % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    path = Path(path)
    with atomic_path(path) as tmp:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            stream = container.add_stream(_mp4_codec(), rate=int(fps))
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": "18"} if stream.codec_context.name == "libx264" else {"qscale": "2"}
            for frame in frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    return path


def frame_strip(frames: np.ndarray, gap: int = 2) -> Image.Image:
    """The frames side by side (left to right, `gap` white pixels between them), for HTML pages."""
    frames = _checked_frames(frames)
    count, height, width, _ = frames.shape
    strip = np.full((height, count * width + (count - 1) * gap, 3), 255, dtype=np.uint8)
    for i, frame in enumerate(frames):
        strip[:, i * (width + gap) : i * (width + gap) + width] = frame
    return Image.fromarray(strip)
