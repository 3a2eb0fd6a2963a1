"""Raw shards: webdataset tars where one sample is one document (`KEY.json` segments + `KEY.0.png`, ...).

Written atomically (common.files) and read without ever unpickling or using a member name as a path.

Clips (segment `{"video": i}`) are stored in one of two ways, never as a pickle or `.npy` member:
- a video file (.mp4, .webm, .mkv, .mov, .avi): its original bytes, as member `KEY.video<i>.<ext>`;
- decoded frames (from a `.npy` array or a folder of frames): one lossless PNG per frame, as members
  `KEY.video<i>.<t>.png` with t = 000000, 000001, ... in frame order.

A conversation (chat SFT data) is a sample whose `KEY.json` is `{"messages": [{"role": ..., "segments": [{"text":
...} | {"image": i}, ...]}, ...]}` (images numbered across the whole conversation, members `KEY.<i>.png` as for
documents); `parse_document` returns it as a `Conversation`.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from common.files import atomic_path, atomic_write_json
from tokenizer.chat import ROLES, Turn
from tokenizer.video.clips import VIDEO_SUFFIXES, read_clip, read_frame_images

RAW_FORMAT = "early-fusion-raw/1"
MANIFEST = "manifest.json"
# Extensions that some tar readers decode by unpickling (webdataset's default decoders do): never accepted.
FORBIDDEN_EXTENSIONS = {"pyd", "pickle", "pkl", "pth", "pt", "npy", "npz", "joblib"}
IMAGE_EXTENSIONS = {"png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff"}
# Video files stored with their original bytes (the containers tokenizer.video.clips decodes with PyAV).
VIDEO_EXTENSIONS = {suffix.lstrip(".") for suffix in VIDEO_SUFFIXES}
_VIDEO_MEMBER = re.compile(r"^video(?P<index>\d+)\.(?:(?P<frame>\d{6})\.png|(?P<ext>[a-z0-9]+))$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_\-]+(/[A-Za-z0-9_\-]+)*$")


class ShardError(ValueError):
    """A shard (raw or token) is malformed; the message names the shard and the sample key."""


@dataclass(frozen=True)
class VideoFile:
    """A clip segment for `RawShardWriter.add` kept as the original bytes of a video file (`suffix` ".mp4", ...)."""

    data: bytes
    suffix: str

    def __post_init__(self) -> None:
        if self.suffix.lower().lstrip(".") not in VIDEO_EXTENSIONS:
            raise ValueError(f"video suffix {self.suffix!r} is not one of {sorted(VIDEO_EXTENSIONS)}")


@dataclass(frozen=True)
class Conversation:
    """A conversation sample of a raw shard: its turns in order, each a `tokenizer.chat.Turn` whose parts are `str`
    text and ("image", bytes) images (decode with open_image)."""

    turns: tuple[Turn, ...]


def _png(image: Image.Image) -> bytes:
    """An image as lossless PNG bytes (palette and other modes as RGBA)."""
    buffer = io.BytesIO()
    (image if image.mode in ("RGB", "RGBA", "L") else image.convert("RGBA")).save(buffer, format="PNG")
    return buffer.getvalue()


def check_key(key: str) -> str:
    """Return `key` if webdataset can round-trip it (no dots, no path tricks), else raise ValueError."""
    if not isinstance(key, str) or not _KEY_RE.match(key) or len(key) > 200:
        raise ValueError(
            f"invalid sample key {key!r}: use letters, digits, '_', '-' (and '/' between parts), "
            "no dots, at most 200 characters"
        )
    return key


def safe_key(text: str) -> str:
    """Turn a file name / id into a valid sample key (dots and odd characters become '_')."""
    key = re.sub(r"[^A-Za-z0-9_\-]+", "_", text).strip("_") or "sample"
    return key[:200]


class RawShardWriter:
    """Context manager writing documents into size-limited raw shards plus a manifest with counts and skips.

    `add(key, segments)` takes a list of `str` (text), `PIL.Image.Image` (stored as lossless PNG) and clips:
    `VideoFile` (the video file's bytes, as they are) or a uint8 (T, H, W, 3) array (one PNG per frame);
    `skip(key, reason)` records a sample that could not be ingested (listed in the manifest, never silent).
    """

    def __init__(
        self,
        out_dir: str | Path,
        shard_max_bytes: int = 256 * 1024 * 1024,
        shard_max_docs: int = 10_000,
        prefix: str = "shard",
        strict: bool = False,
    ) -> None:
        if shard_max_bytes <= 0 or shard_max_docs <= 0:
            raise ValueError("shard_max_bytes and shard_max_docs must be positive")
        self.out_dir = Path(out_dir)
        self.shard_max_bytes = shard_max_bytes
        self.shard_max_docs = shard_max_docs
        self.prefix = safe_key(prefix)
        self.strict = strict
        self.shards: list[dict] = []
        self.skipped: list[dict] = []
        self.counts = {"documents": 0, "images": 0, "videos": 0, "text_segments": 0}
        self._keys: set[str] = set()
        self._tar: tarfile.TarFile | None = None
        self._shard_files: ExitStack | None = None  # the open tar inside common.files.atomic_path
        self._current: dict | None = None
        self._created_dir = False
        self.manifest: dict | None = None

    def __enter__(self) -> RawShardWriter:
        if (self.out_dir / MANIFEST).exists():
            raise FileExistsError(f"{self.out_dir} already holds raw shards ({MANIFEST}); choose an empty directory")
        self._created_dir = not self.out_dir.exists()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if self.manifest is None:
                self.close()
        else:  # leave no half-written shard behind, nor an empty folder this writer made
            if self._tar is not None:
                self._shard_files.__exit__(exc_type, exc, tb)  # closes the tar and removes its temporary file
                self._tar, self._shard_files = None, None
            if self._created_dir and not any(self.out_dir.iterdir()):
                self.out_dir.rmdir()

    def _open_shard(self) -> None:
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        self._shard_files = ExitStack()
        tmp = self._shard_files.enter_context(atomic_path(self.out_dir / name))
        self._tar = self._shard_files.enter_context(tarfile.open(tmp, "w"))
        self._current = {"name": name, "documents": 0, "images": 0, "videos": 0, "bytes": 0}

    def _finish_shard(self) -> None:
        if self._tar is None:
            return
        self._shard_files.close()  # closes the tar, then fsyncs it and renames it into place
        self.shards.append(self._current)
        self._tar, self._shard_files, self._current = None, None, None

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mtime = int(time.time())
        info.mode = 0o644
        self._tar.addfile(info, io.BytesIO(data))
        self._current["bytes"] += len(data) + 512

    def add(self, key: str, segments: list[str | Image.Image | VideoFile | np.ndarray]) -> None:
        """Append one document; text segments are `str`, images are PIL images (saved as PNG), clips are
        `VideoFile`s (stored as they are) or uint8 (T, H, W, 3) frame arrays (one PNG member per frame)."""
        check_key(key)
        if key in self._keys:
            raise ValueError(f"duplicate sample key {key!r}: keys must be unique within a raw shard directory")
        if not segments:
            raise ValueError(f"sample {key!r} has no segments")
        json_segments, images, videos = [], [], []
        for i, segment in enumerate(segments):
            if isinstance(segment, str):
                json_segments.append({"text": segment})
            elif isinstance(segment, Image.Image):
                json_segments.append({"image": len(images)})
                images.append(_png(segment))
            elif isinstance(segment, VideoFile):
                json_segments.append({"video": len(videos)})
                videos.append([(segment.suffix.lower().lstrip("."), segment.data)])
            elif isinstance(segment, np.ndarray):
                if segment.dtype != np.uint8 or segment.ndim != 4 or segment.shape[-1] != 3 or not segment.shape[0]:
                    raise ValueError(f"sample {key!r} segment {i}: a clip array must be uint8 (T, H, W, 3), got "
                                     f"{segment.dtype} {tuple(segment.shape)}")
                frames = []
                for t, frame in enumerate(segment):
                    buffer = io.BytesIO()
                    Image.fromarray(frame).save(buffer, format="PNG")
                    frames.append((f"{t:06d}.png", buffer.getvalue()))
                json_segments.append({"video": len(videos)})
                videos.append(frames)
            else:
                raise TypeError(f"sample {key!r} segment {i}: expected str, PIL.Image, VideoFile or a uint8 "
                                f"(T, H, W, 3) array, got {type(segment).__name__}")
        body = json.dumps({"segments": json_segments}, ensure_ascii=False).encode()
        self._store(key, body, images, videos)
        self.counts["text_segments"] += len(json_segments) - len(images) - len(videos)

    def add_conversation(self, key: str, turns: Sequence[Turn]) -> None:
        """Append one conversation: turns of roles system/user/assistant whose parts are `str` text and PIL images
        (stored as PNG members numbered across the conversation); at least one assistant turn."""
        check_key(key)
        if key in self._keys:
            raise ValueError(f"duplicate sample key {key!r}: keys must be unique within a raw shard directory")
        if not any(turn.role == "assistant" for turn in turns):
            raise ValueError(f"conversation {key!r} has no assistant turn, so nothing would be trained")
        messages, images, texts = [], [], 0
        for number, turn in enumerate(turns):
            if turn.role not in ROLES:
                raise ValueError(f"conversation {key!r} message {number}: unknown role {turn.role!r}")
            segments = []
            for part in turn.parts:
                if isinstance(part, str):
                    segments.append({"text": part})
                    texts += 1
                elif isinstance(part, Image.Image):
                    segments.append({"image": len(images)})
                    images.append(_png(part))
                else:
                    raise TypeError(f"conversation {key!r} message {number}: a part is str or a PIL image, got "
                                    f"{type(part).__name__}")
            messages.append({"role": turn.role, "segments": segments})
        self._store(key, json.dumps({"messages": messages}, ensure_ascii=False).encode(), images, [])
        self.counts["text_segments"] += texts
        self.counts["conversations"] = self.counts.get("conversations", 0) + 1

    def _store(self, key: str, body: bytes, images: list[bytes], videos: list[list[tuple[str, bytes]]]) -> None:
        """Write one sample's members (json, images, clips), starting a new shard when this one is full."""
        size = len(body) + sum(len(b) for b in images) + sum(len(b) for members in videos for _, b in members)
        if self._tar is not None and (
            self._current["documents"] >= self.shard_max_docs
            or self._current["bytes"] + size > self.shard_max_bytes
        ):
            self._finish_shard()
        if self._tar is None:
            self._open_shard()
        self._member(f"{key}.json", body)
        for index, data in enumerate(images):
            self._member(f"{key}.{index}.png", data)
        for index, members in enumerate(videos):
            for ext, data in members:
                self._member(f"{key}.video{index}.{ext}", data)
        self._keys.add(key)
        self._current["documents"] += 1
        self._current["images"] += len(images)
        self._current["videos"] += len(videos)
        self.counts["documents"] += 1
        self.counts["images"] += len(images)
        self.counts["videos"] += len(videos)

    def has_key(self, key: str) -> bool:
        """Whether a document with this key was already added."""
        return key in self._keys

    def skip(self, key: str, reason: str) -> None:
        """Record a sample that was not ingested; under `strict` this raises instead."""
        if self.strict:
            raise ValueError(f"sample {key!r} rejected: {reason} (run without --strict to skip and list it)")
        self.skipped.append({"key": key, "reason": reason})

    def close(self) -> dict:
        """Finish the last shard and write `manifest.json`; returns the manifest."""
        self._finish_shard()
        manifest = {
            "format": RAW_FORMAT,
            **self.counts,
            "skipped_count": len(self.skipped),
            "shards": self.shards,
            "skipped": self.skipped,
        }
        atomic_write_json(self.out_dir / MANIFEST, manifest)
        self.manifest = manifest
        return manifest


def read_raw_manifest(raw_dir: str | Path) -> dict:
    """Load and check a raw shard directory's manifest."""
    path = Path(raw_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {raw_dir} is not a raw shard directory (run `shards write`)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != RAW_FORMAT or not isinstance(manifest.get("shards"), list):
        raise ShardError(f"{path}: not a raw shard manifest (format {manifest.get('format')!r})")
    for shard in manifest["shards"]:
        if not (Path(raw_dir) / shard["name"]).is_file():
            raise ShardError(f"{path}: shard {shard['name']} is listed but missing")
    return manifest


def _split_member(name: str) -> tuple[str, str]:
    """webdataset's rule: key = path up to the first dot of the base name, extension = the rest."""
    directory, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext.lower()


def iter_tar_samples(
    path: str | Path, allowed: set[str] | None = None, repeated_keys: bool = False
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Yield (key, {extension: bytes}) from a tar, checking every member; nothing is decoded here.

    Members of one sample must be adjacent (as webdataset writes them). Pickle-like members, links,
    absolute/parent paths, duplicate members, a key that comes back after another key (unless
    `repeated_keys`, for foreign tars whose caller lists the repeat itself) and truncated archives
    raise ShardError naming shard and key.
    """
    path = Path(path)
    key, files, count = None, {}, 0
    seen: set[str] = set()
    try:
        with tarfile.open(path, "r|*") as tar:
            for member in tar:
                if member.isdir():
                    continue
                current_key, ext = _split_member(member.name)
                where = f"shard {path.name}, key {current_key!r} (member {member.name!r})"
                if not member.isfile():
                    raise ShardError(f"{where}: links and special files are not allowed in shards")
                if member.name.startswith("/") or ".." in member.name.split("/"):
                    raise ShardError(f"{where}: absolute or parent-relative member names are not allowed")
                last = ext.rpartition(".")[2]
                if last in FORBIDDEN_EXTENSIONS:
                    raise ShardError(
                        f"{where}: .{last} members can hold pickled code and are refused; "
                        "re-create the shard with json/txt/image members only"
                    )
                if allowed is not None and last not in allowed:
                    raise ShardError(f"{where}: unexpected member type .{ext} (allowed: {sorted(allowed)})")
                if current_key != key:
                    if current_key in seen and not repeated_keys:
                        raise ShardError(
                            f"{where}: sample key {current_key!r} appears twice in this shard (its members are "
                            "not adjacent, or two samples share the key); re-create the shard with unique keys"
                        )
                    if key is not None:
                        yield key, files
                        count += 1
                    key, files = current_key, {}
                    seen.add(current_key)
                if ext in files:
                    raise ShardError(f"{where}: duplicate member")
                handle = tar.extractfile(member)
                data = handle.read()
                if len(data) != member.size:
                    raise ShardError(f"{where}: truncated member ({len(data)} of {member.size} bytes)")
                files[ext] = data
    except (tarfile.TarError, EOFError, OSError) as err:
        raise ShardError(
            f"shard {path.name}: unreadable or truncated tar after key {key!r} ({type(err).__name__}: {err}); "
            "re-create this shard"
        ) from err
    if key is not None:
        yield key, files
        count += 1
    if count == 0:
        raise ShardError(f"shard {path.name}: empty shard (no samples); remove it or re-create it")


def _video_members(where: str, index: int, files: dict[str, bytes]) -> tuple[bytes | tuple[bytes, ...], str]:
    """Clip `index` of a sample: (the video file's bytes, ".mp4"...) or (the frames' PNG bytes in order, ".png")."""
    whole, frames = [], {}
    for ext, data in files.items():
        match = _VIDEO_MEMBER.match(ext)
        if match is None or int(match["index"]) != index:
            continue
        if match["frame"] is not None:
            frames[int(match["frame"])] = data
        elif match["ext"] in VIDEO_EXTENSIONS:
            whole.append((match["ext"], data))
        else:
            raise ShardError(f"{where}: clip member video{index}.{match['ext']} is not a video file "
                             f"({', '.join(sorted(VIDEO_EXTENSIONS))}) or a frame video{index}.NNNNNN.png")
    if whole and frames or len(whole) > 1:
        raise ShardError(f"{where}: clip {index} has several kinds of members (one video file, or PNG frames); "
                         "re-create the shard")
    if whole:
        return whole[0][1], "." + whole[0][0]
    if not frames:
        raise ShardError(f"{where}: a segment references clip {index} but no video{index}.<ext> or "
                         f"video{index}.000000.png member exists")
    if sorted(frames) != list(range(len(frames))):
        raise ShardError(f"{where}: clip {index}'s frames are not numbered 000000..{len(frames) - 1:06d} without gaps "
                         f"(found {sorted(frames)[:8]}...); re-create the shard")
    return tuple(frames[t] for t in range(len(frames))), ".png"


def parse_document(shard: str, key: str, files: dict[str, bytes]) -> list[str | tuple] | Conversation:
    """Check one raw sample and return its segments: `str` for text, ("image", bytes) for an image,
    ("video", bytes, suffix) for a clip stored as a video file (suffix ".mp4", ".webm", ...) and
    ("video", (png bytes, ...), ".png") for a clip stored as frames; decode clips with `open_video`. A conversation
    sample (`{"messages": [...]}`) comes back as a `Conversation` of turns with text and image parts."""
    where = f"shard {shard}, key {key!r}"
    if "json" not in files:
        raise ShardError(f"{where}: no .json member (members: {sorted(files)})")
    try:
        body = json.loads(files["json"])
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ShardError(f"{where}: .json is not valid JSON ({err})") from err
    if isinstance(body, dict) and "messages" in body and "segments" not in body:
        return _parse_conversation(where, body["messages"], files)
    segments = body.get("segments") if isinstance(body, dict) else None
    if not isinstance(segments, list) or not segments:
        raise ShardError(f'{where}: .json must be {{"segments": [...]}} with at least one segment')
    out: list[str | tuple[str, bytes]] = []
    for i, segment in enumerate(segments):
        if isinstance(segment, dict) and set(segment) == {"text"} and isinstance(segment["text"], str):
            out.append(segment["text"])
        elif isinstance(segment, dict) and set(segment) == {"image"} and isinstance(segment["image"], int):
            out.append(_image_member(where, i, segment["image"], files))
        elif (isinstance(segment, dict) and set(segment) == {"video"} and isinstance(segment["video"], int)
              and not isinstance(segment["video"], bool)):
            out.append(("video", *_video_members(where, segment["video"], files)))
        else:
            raise ShardError(f'{where}: segment {i} must be {{"text": str}}, {{"image": int}} or {{"video": int}}, '
                             f"got {segment!r}")
    return out


def _image_member(where: str, segment: int, index: int, files: dict[str, bytes]) -> tuple[str, bytes]:
    """("image", bytes) of image `index` of a sample, or ShardError when no image member holds it."""
    member = next((ext for ext in files if ext.partition(".")[0] == str(index)), None)
    if member is None or member.rpartition(".")[2] not in IMAGE_EXTENSIONS:
        raise ShardError(f"{where}: segment {segment} references image {index} but no {index}.png/.jpg member exists")
    return "image", files[member]


def _parse_conversation(where: str, messages: object, files: dict[str, bytes]) -> Conversation:
    """The `Conversation` of a sample's `{"messages": [{"role", "segments"}, ...]}`; ShardError on any other shape."""
    if not isinstance(messages, list) or not messages:
        raise ShardError(f'{where}: a conversation\'s .json is {{"messages": [{{"role": ..., "segments": [...]}}, '
                         "...]}} with at least one message")
    turns = []
    for number, message in enumerate(messages):
        at = f"{where}, message {number}"
        if (not isinstance(message, dict) or set(message) != {"role", "segments"} or message["role"] not in ROLES
                or not isinstance(message["segments"], list)):
            raise ShardError(f'{at}: a message is {{"role": one of {", ".join(ROLES)}, "segments": [...]}}, got '
                             f"{message!r:.80}")
        parts: list[str | tuple[str, bytes]] = []
        for i, segment in enumerate(message["segments"]):
            if isinstance(segment, dict) and set(segment) == {"text"} and isinstance(segment["text"], str):
                parts.append(segment["text"])
            elif (isinstance(segment, dict) and set(segment) == {"image"} and isinstance(segment["image"], int)
                  and not isinstance(segment["image"], bool)):
                parts.append(_image_member(at, i, segment["image"], files))
            else:
                raise ShardError(f'{at}: segment {i} must be {{"text": str}} or {{"image": int}}, got {segment!r:.80}')
        turns.append(Turn(message["role"], tuple(parts)))
    if not any(turn.role == "assistant" for turn in turns):
        raise ShardError(f"{where}: the conversation has no assistant turn; re-create the shard")
    return Conversation(tuple(turns))


def open_video(segment: tuple, name: str, max_frames: int | None = None) -> np.ndarray:
    """A ("video", ...) segment of `parse_document` as uint8 (T, H, W, 3) frames; `ClipLoadError` (a ValueError)
    naming `name` when it cannot be decoded. `max_frames` stops decoding early."""
    _, payload, suffix = segment
    if suffix == ".png":
        return read_frame_images(payload[:max_frames] if max_frames is not None else payload, name=name)
    return read_clip(payload, name=name, suffix=suffix, max_frames=max_frames)


def iter_raw_shard(path: str | Path) -> Iterator[tuple[str, list[str | tuple] | Conversation]]:
    """Yield (key, segments) from one raw shard, or (key, Conversation) for a conversation sample; images and clips
    stay encoded bytes (decode with open_image, open_video)."""
    path = Path(path)
    allowed = {"json"} | IMAGE_EXTENSIONS | VIDEO_EXTENSIONS
    for key, files in iter_tar_samples(path, allowed):
        yield key, parse_document(path.name, key, files)
