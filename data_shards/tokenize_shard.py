"""Tokenize one raw shard into the token shard of its stem: images, clips and latents encoded in batches.

A [text, image] pair document is emitted in the other order by a rule seeded per key (`flip_pair`); a conversation
never is: it becomes `tokenizer.chat.encode_conversation`'s ids and its per-token target mask (the trained roles,
`info["target_roles"]`), stored as the shard's `NAME.targets.npy` (`data_shards.token_shards`). What this
writes depends only on the raw shard and the settings in `info` (`pretokenize` decides them, and which shards to
do); the token shard format is `data_shards.token_shards`.
"""

from __future__ import annotations

import hashlib
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from data_shards.raw import Conversation, ShardError, iter_raw_shard, open_video
from data_shards.token_shards import CONVERSATION, TARGET, FeatureWriter, sha256_file, write_token_shard
from tokenizer.chat import DEFAULT_TARGET_ROLES, Turn, encode_conversation
from tokenizer.image.preprocess import ImageLoadError, open_image
from tokenizer.layout import patchify
from tokenizer.vocab import NO_VIDEO_MARKERS, LatentImage

__all__ = ["clip_frames_of", "flip_pair", "is_continuous", "is_video_tokenizer", "latent_dim", "tokenize_shard"]


def is_continuous(image_tokenizer) -> bool:
    """Whether the image tokenizer gives continuous latents (`kind` "continuous") rather than codes."""
    return getattr(image_tokenizer, "kind", "vq") == "continuous"


def latent_dim(image_tokenizer, patch_size: int) -> int:
    """Values per latent patch: channels x patch_size x patch_size."""
    return int(image_tokenizer.latent_channels) * patch_size * patch_size


def flip_pair(key: str, seed: int, probability: float) -> bool:
    """Whether the [text, image] pair document `key` is emitted in the other order (deterministic per key)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < probability


def _is_pair(segments: list) -> bool:
    return len(segments) == 2 and sum(isinstance(s, str) for s in segments) == 1


def is_video_tokenizer(image_tokenizer) -> bool:
    """Whether the tokenizer encodes clips (`encode_clips`, `video_grid`: tokenizer.video.VideoTokenizer's kind)."""
    return callable(getattr(image_tokenizer, "encode_clips", None)) and hasattr(image_tokenizer, "video_grid")


def clip_frames_of(image_tokenizer) -> int:
    """Frames per clip the video tokenizer encodes (its config's `clip_frames`)."""
    return int(image_tokenizer.config.clip_frames)


def _open_clip(raw_path: Path, key: str, segment: tuple, vocab, image_tokenizer, with_features: bool) -> np.ndarray:
    """A raw clip segment as the uint8 (clip_frames, H, W, 3) frames the video tokenizer encodes.

    The rule for frame counts: a clip longer than the tokenizer's `clip_frames` keeps its first `clip_frames`
    frames; a shorter one is refused, naming it (`shards write --min-clip-frames` skips those at ingest instead).
    """
    where = f"shard {raw_path.name}, key {key!r}"
    if image_tokenizer is None:
        raise ShardError(f"{where}: holds a clip but no image tokenizer was given; pass a video tokenizer bundle "
                         "as --image-tokenizer")
    if not is_video_tokenizer(image_tokenizer):
        raise ShardError(f"{where}: holds a clip, but the image tokenizer (kind "
                         f"{getattr(image_tokenizer, 'kind', 'vq')!r}) is not a video tokenizer; pass a video "
                         "tokenizer bundle (kind 'video') as --image-tokenizer")
    if not getattr(vocab, "has_video", False):
        raise ShardError(f"{where}: holds a clip, but {NO_VIDEO_MARKERS}")
    if with_features:
        raise ShardError(f"{where}: holds a clip, and --features stores image features only; tokenize clips "
                         "without --features")
    frames = clip_frames_of(image_tokenizer)
    try:
        clip = open_video(segment, name=f"{raw_path.name}:{key}", max_frames=frames)
    except ValueError as err:  # ClipLoadError
        raise ShardError(f"{where}: {err}") from err
    if clip.shape[0] < frames:
        raise ShardError(f"{where}: its clip has {clip.shape[0]} frames, fewer than the video tokenizer's "
                         f"clip_frames {frames}; remove it, or write the raw shards again with --min-clip-frames "
                         f"{frames} to skip such clips")
    return clip


def tokenize_shard(raw_path: Path, out_dir: Path, vocab, image_tokenizer, info: dict, batch_size: int,
                   raw_sha256: str | None = None) -> dict:
    """Tokenize one raw shard into the token shard of the same stem; returns the shard's meta.

    `raw_sha256` is the hash the caller decided on (computed here when None); the tar is hashed again after
    reading, so a raw shard rewritten meanwhile is refused rather than recorded under the wrong hash. Features
    (`info["features"]`) go to disk batch by batch (`FeatureWriter`), never a whole shard's in memory.
    """
    name = raw_path.name.removesuffix(".tar")
    raw_sha256 = raw_sha256 or sha256_file(raw_path)
    keys: list[str] = []
    documents: list[np.ndarray] = []  # int64 ids: 8 bytes a token where a list of ints takes about 36
    # per document its target mask (uint8, token_shards' bits) for a conversation, None for a plain document
    marks: list[np.ndarray | None] = []
    target_roles = tuple(info.get("target_roles") or DEFAULT_TARGET_ROLES)
    # (key, segments, turns): a conversation's segments are its turns' parts in order, `turns` its turns
    pending: list[tuple[str, list, tuple[Turn, ...] | None]] = []
    images_done = clips_done = 0
    with_features = bool(info.get("features"))
    patch_size = info.get("patch_size")  # set for a continuous image tokenizer: its latents are cut into patches
    # on a GPU one encoder call per batch (the tokenizer's own default splits into 32s); on the CPU the calls stay
    # as they were, so shards from before the device was recorded keep the codes a rerun would compute
    whole_batch = str(info.get("encoder_device", "")).startswith("cuda")
    with ExitStack() as stack:
        # per image (h*w, C) float16 rows, in the order the images appear in the ids
        dim = (latent_dim(image_tokenizer, patch_size) if patch_size else
               image_tokenizer.config.embed_dim if with_features else 0)
        writer = stack.enter_context(FeatureWriter(out_dir, name, dim)) if with_features else None

        def flush() -> None:
            nonlocal images_done, clips_done
            images = [s for _, segments, _ in pending for s in segments if isinstance(s, Image.Image)]
            clips = [s for _, segments, _ in pending for s in segments if isinstance(s, np.ndarray)]
            grids: list[torch.Tensor] = []
            image_features: list[torch.Tensor] = []
            for start in range(0, len(images), batch_size):
                chunk = images[start : start + batch_size]
                sizes = {"batch_size": len(chunk)} if whole_batch else {}
                with torch.inference_mode():
                    # plain `encode` without features: an image tokenizer then needs only encode/grid_shape/fingerprint
                    if patch_size:  # continuous: the latents are the image; each becomes its patches' rows
                        latents = image_tokenizer.encode(chunk, **sizes).float().cpu()
                        image_features.extend(torch.from_numpy(patchify(latents.numpy(), patch_size)))
                        codes = torch.full((len(chunk),), latents.shape[2] * latents.shape[3] // patch_size**2)
                    elif with_features:
                        codes, feats = image_tokenizer.encode_with_features(chunk, **sizes)
                        image_features.extend(feats.float().cpu())
                    else:
                        codes = image_tokenizer.encode(chunk, **sizes)
                grids.extend(codes.cpu())
            clip_grids: list[torch.Tensor] = []
            if clips:  # several frames each: fewer clips than images per encoder call
                per_call = max(1, batch_size // clip_frames_of(image_tokenizer))
                expected = tuple(int(side) for side in image_tokenizer.video_grid)
                for start in range(0, len(clips), per_call):
                    chunk = clips[start : start + per_call]
                    sizes = {"batch_size": len(chunk)} if whole_batch else {}
                    with torch.inference_mode():
                        codes = image_tokenizer.encode_clips(chunk, **sizes).cpu()
                    if tuple(codes.shape[1:]) != expected:
                        raise ShardError(f"shard {raw_path.name}: the video tokenizer gave codes of shape "
                                         f"{tuple(codes.shape[1:])} for clips, its video_grid is {expected}; check "
                                         "the tokenizer bundle")
                    clip_grids.extend(codes)
            grid_iter, clip_iter, feature_iter = iter(grids), iter(clip_grids), iter(image_features)
            for key, segments, turns in pending:
                segments = [next(grid_iter) if isinstance(s, Image.Image) else
                            next(clip_iter) if isinstance(s, np.ndarray) else s for s in segments]
                if patch_size:  # an image is its count of patches: `<boi>`, that many `<image>`, `<eoi>`
                    segments = [s if isinstance(s, str) else LatentImage(int(s)) for s in segments]
                if writer is not None:
                    for segment in segments:
                        if not isinstance(segment, str):  # images only: a clip with --features was refused
                            rows = next(feature_iter).numpy()
                            # float16 as stored: a latent past its range becomes infinite there
                            if not np.isfinite(rows.astype(np.float16)).all():
                                raise ShardError(f"shard {raw_path.name}, key {key!r}: the image tokenizer gave "
                                                 "NaN or infinite latents (or features beyond float16) for its image; "
                                                 "check the image and the tokenizer bundle")
                            writer.write(rows)
                mark = None
                try:
                    if turns is None:
                        ids = vocab.encode_document(segments, bos=True, eos=True)
                    else:  # the turns again, their images now code grids (or latent patches)
                        rebuilt, at = [], 0
                        for turn in turns:
                            rebuilt.append(Turn(turn.role, tuple(segments[at : at + len(turn.parts)])))
                            at += len(turn.parts)
                        ids, targets = encode_conversation(vocab, rebuilt, target_roles)
                        mark = CONVERSATION | (np.asarray(targets, dtype=np.uint8) * TARGET)
                except (ValueError, IndexError) as err:
                    what = "document" if turns is None else "conversation"
                    raise ShardError(f"shard {raw_path.name}, key {key!r}: cannot encode {what} ({err})") from err
                keys.append(key)
                documents.append(np.asarray(ids, dtype=np.int64))
                marks.append(mark)
            images_done += len(images)
            clips_done += len(clips)
            pending.clear()

        pending_images = pending_frames = 0
        for key, sample in iter_raw_shard(raw_path):
            turns = sample.turns if isinstance(sample, Conversation) else None
            if turns is not None and getattr(vocab, "sep_id", None) is None:
                raise ShardError(f"shard {raw_path.name}, key {key!r}: a conversation needs the vocabulary's <sep> "
                                 "(the end of a system or user turn), which this vocabulary lacks; build one with "
                                 "`train.py vocab`")
            raw_segments = [part for turn in turns for part in turn.parts] if turns is not None else sample
            segments: list[str | Image.Image] = []
            for segment in raw_segments:
                if isinstance(segment, str):
                    segments.append(segment)
                    continue
                if segment[0] == "video":
                    segments.append(_open_clip(raw_path, key, segment, vocab, image_tokenizer, with_features))
                    continue
                if image_tokenizer is None:
                    raise ShardError(f"shard {raw_path.name}, key {key!r}: holds an image but no image tokenizer "
                                     "was given")
                try:
                    segments.append(open_image(segment[1], name=f"{raw_path.name}:{key}"))
                except ImageLoadError as err:
                    raise ShardError(f"shard {raw_path.name}, key {key!r}: {err}") from err
            # never a conversation: its order is the dialogue's
            if turns is None and _is_pair(segments) and flip_pair(key, info["seed"], info["flip_probability"]):
                segments.reverse()
            pending.append((key, segments, turns))
            pending_images += sum(isinstance(s, Image.Image) for s in segments)
            pending_frames += sum(s.shape[0] for s in segments if isinstance(s, np.ndarray))
            if pending_images >= batch_size or pending_frames >= batch_size:
                flush()
                pending_images = pending_frames = 0
        flush()
        if sha256_file(raw_path) != raw_sha256:
            raise ShardError(f"shard {raw_path}: the raw shard changed while it was being tokenized; run "
                             "`shards tokenize` again once it is no longer being written")
        conversations = sum(mark is not None for mark in marks)
        # a shard without conversations has no targets file (every token is a target)
        targets = [np.full(len(ids), TARGET, dtype=np.uint8) if mark is None else mark
                   for ids, mark in zip(documents, marks)] if conversations else None
        return write_token_shard(out_dir, name, keys, documents,
                                 {**info, "images": images_done, **({"clips": clips_done} if clips_done else {}),
                                  **({"conversations": conversations} if conversations else {}),
                                  "source": raw_path.name, "raw_sha256": raw_sha256},
                                 features=writer, targets=targets)
