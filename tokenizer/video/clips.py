"""Clip input and output: read a clip (.npy, a video file decoded by PyAV, or a folder of frames) as uint8
(T, H, W, 3); write animated GIF / MP4; a strip of frames for HTML pages.

Video files are decoded with PyAV (FFmpeg inside the wheel), never `torchvision.io.read_video` (removed from
current torchvision). `.npy` clips are loaded with `allow_pickle=False`: an array of objects is refused.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from common.files import atomic_path

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


def _as_clip(array: np.ndarray, label: str) -> np.ndarray:
    """Check and normalise an array to uint8 (T, H, W, 3): grey (T, H, W) and (T, H, W, 1) are repeated to RGB."""
    if array.dtype != np.uint8:
        raise ClipLoadError(
            f"{label}: clip arrays must be uint8 (T, H, W, 3) or (T, H, W) grey, got dtype {array.dtype}; "
            "convert it (e.g. (x * 255).round().astype(np.uint8)) and save it again"
        )
    if array.ndim == 4 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim == 3:
        array = np.repeat(array[..., None], 3, axis=-1)
    if array.ndim != 4 or array.shape[-1] != 3:
        raise ClipLoadError(
            f"{label}: clip arrays must have shape (T, H, W, 3) or (T, H, W), got {tuple(array.shape)}; "
            "save the frames in that layout"
        )
    if min(array.shape[:3]) < 1:
        raise ClipLoadError(f"{label}: empty clip (shape {tuple(array.shape)}); remove it")
    return np.ascontiguousarray(array)


def _read_npy(source: ClipSource, label: str) -> np.ndarray:
    try:
        handle = io.BytesIO(source) if isinstance(source, bytes) else source
        array = np.load(handle, allow_pickle=False)
    except ValueError as err:
        if "allow_pickle" in str(err) or "pickle" in str(err).lower():
            raise ClipLoadError(
                f"{label}: holds pickled Python objects, which are never loaded; "
                "save a plain uint8 array (np.save(path, frames)) instead"
            ) from err
        raise ClipLoadError(f"{label}: not a readable .npy array ({err}); save it again with np.save") from err
    except (OSError, EOFError) as err:
        raise ClipLoadError(f"{label}: truncated or corrupt .npy file ({err}); save it again with np.save") from err
    if not isinstance(array, np.ndarray):  # np.load returns an NpzFile for .npz bytes
        raise ClipLoadError(f"{label}: not a single .npy array; save one uint8 array with np.save")
    return _as_clip(array, label)


def _read_video(source: ClipSource, label: str, max_frames: int | None) -> np.ndarray:
    import av

    frames: list[np.ndarray] = []
    total = 0
    try:
        handle = io.BytesIO(source) if isinstance(source, bytes) else str(source)
        with av.open(handle, mode="r") as container:
            if not container.streams.video:
                raise ClipLoadError(f"{label}: the file has no video stream; remove it or re-encode it")
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                pixels = frame.to_ndarray(format="rgb24")
                if frames and pixels.shape != frames[0].shape:
                    raise ClipLoadError(
                        f"{label}: frame {len(frames)} is {pixels.shape[1]}x{pixels.shape[0]}, the first "
                        f"{frames[0].shape[1]}x{frames[0].shape[0]}; re-encode it at one size"
                    )
                total += pixels.nbytes
                if total > MAX_CLIP_BYTES:
                    raise ClipLoadError(
                        f"{label}: decodes to more than {MAX_CLIP_BYTES >> 30} GiB of pixels; cut it into clips"
                    )
                frames.append(pixels)
                if max_frames is not None and len(frames) >= max_frames:
                    break
    except ClipLoadError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError, IndexError) as err:
        raise ClipLoadError(
            f"{label}: truncated, corrupt or undecodable video ({type(err).__name__}: {err}); "
            "re-download or re-encode it (e.g. ffmpeg -i IN -c:v libx264 OUT.mp4)"
        ) from err
    if not frames:
        raise ClipLoadError(f"{label}: no video frame could be decoded (truncated or empty); re-encode it")
    return np.stack(frames)


def _decode_frames(frames: list[tuple[str, object]], label: str) -> np.ndarray:
    """(frame name, path or bytes) pairs in order as one uint8 (T, H, W, 3) clip; all frames need one size."""
    decoded: list[np.ndarray] = []
    for frame_name, source in frames:
        try:
            with Image.open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
                decoded.append(np.asarray(image.convert("RGB")))
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
