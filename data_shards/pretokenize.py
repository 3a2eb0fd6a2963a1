"""Pre-tokenize raw shards into token shards: batched image encoding, pair flipping, several processes, resumable."""

from __future__ import annotations

import hashlib
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from data_shards.raw import ShardError, iter_raw_shard, read_raw_manifest
from data_shards.token_shards import read_shard_meta, sha256_file, write_manifest, write_token_shard
from tokenizer.image.preprocess import ImageLoadError, open_image

# Settings that change what a shard holds; a finished shard is reused only if they all match.
_REUSE_FIELDS = ("vocab_fingerprint", "image_tokenizer_fingerprint", "vocab_size", "flip_probability", "seed",
                 "features")
# What shards written before a field existed hold for it.
_REUSE_DEFAULTS = {"features": False}


def flip_pair(key: str, seed: int, probability: float) -> bool:
    """Whether the [text, image] pair document `key` is emitted in the other order (deterministic per key)."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < probability


def _is_pair(segments: list) -> bool:
    return len(segments) == 2 and sum(isinstance(s, str) for s in segments) == 1


def tokenize_shard(raw_path: Path, out_dir: Path, vocab, image_tokenizer, info: dict, batch_size: int,
                   raw_sha256: str | None = None) -> dict:
    """Tokenize one raw shard into the token shard of the same stem; returns the shard's meta.

    `raw_sha256` is the hash the caller decided on (computed here when None); the tar is hashed again after
    reading, so a raw shard rewritten meanwhile is refused rather than recorded under the wrong hash.
    """
    name = raw_path.name.removesuffix(".tar")
    raw_sha256 = raw_sha256 or sha256_file(raw_path)
    keys: list[str] = []
    documents: list[list[int]] = []
    pending: list[tuple[str, list]] = []
    images_done = 0
    with_features = bool(info.get("features"))
    features: list[np.ndarray] = []  # per image (h*w, C) float16, in the order the images appear in the ids

    def flush() -> None:
        nonlocal images_done
        images = [s for _, segments in pending for s in segments if isinstance(s, Image.Image)]
        grids: list[torch.Tensor] = []
        image_features: list[torch.Tensor] = []
        for start in range(0, len(images), batch_size):
            chunk = images[start : start + batch_size]
            with torch.inference_mode():
                # plain `encode` without features: an image tokenizer then needs only encode/grid_shape/fingerprint
                if with_features:
                    codes, feats = image_tokenizer.encode_with_features(chunk)
                    image_features.extend(feats.float().cpu())
                else:
                    codes = image_tokenizer.encode(chunk)
            grids.extend(codes.cpu())
        grid_iter, feature_iter = iter(grids), iter(image_features)
        for key, segments in pending:
            segments = [next(grid_iter) if isinstance(s, Image.Image) else s for s in segments]
            if with_features:
                features.extend(next(feature_iter).numpy().astype(np.float16)
                                for s in segments if not isinstance(s, str))
            try:
                ids = vocab.encode_document(segments, bos=True, eos=True)
            except (ValueError, IndexError) as err:
                raise ShardError(f"shard {raw_path.name}, key {key!r}: cannot encode document ({err})") from err
            keys.append(key)
            documents.append([int(i) for i in ids])
        images_done += len(images)
        pending.clear()

    pending_images = 0
    for key, raw_segments in iter_raw_shard(raw_path):
        segments: list[str | Image.Image] = []
        for segment in raw_segments:
            if isinstance(segment, str):
                segments.append(segment)
                continue
            if image_tokenizer is None:
                raise ShardError(f"shard {raw_path.name}, key {key!r}: holds an image but no image tokenizer was given")
            try:
                segments.append(open_image(segment[1], name=f"{raw_path.name}:{key}"))
            except ImageLoadError as err:
                raise ShardError(f"shard {raw_path.name}, key {key!r}: {err}") from err
        if _is_pair(segments) and flip_pair(key, info["seed"], info["flip_probability"]):
            segments.reverse()
        pending.append((key, segments))
        pending_images += sum(isinstance(s, Image.Image) for s in segments)
        if pending_images >= batch_size:
            flush()
            pending_images = 0
    flush()
    if sha256_file(raw_path) != raw_sha256:
        raise ShardError(f"shard {raw_path}: the raw shard changed while it was being tokenized; run "
                         "`shards tokenize` again once it is no longer being written")
    stacked = None
    if with_features:
        dim = image_tokenizer.config.embed_dim
        stacked = np.concatenate(features) if features else np.zeros((0, dim), dtype=np.float16)
    return write_token_shard(out_dir, name, keys, documents,
                             {**info, "images": images_done, "source": raw_path.name, "raw_sha256": raw_sha256},
                             features=stacked)


# How often, at most, a plain progress line is printed when stderr is a log file rather than a terminal.
PROGRESS_EVERY_SECONDS = 30.0


class TokenizeProgress:
    """Progress of `pretokenize` in samples (documents), counted per finished shard: a tqdm bar on a terminal,
    plain lines on stderr at most every `PROGRESS_EVERY_SECONDS` otherwise (a bar's carriage returns make a log
    file unreadable), nothing when off. Rates and the ETA count only the samples tokenized in this run."""

    def __init__(self, total_samples: int, total_shards: int, done_samples: int, done_shards: int, *,
                 enabled: bool) -> None:
        self.total_samples, self.total_shards = total_samples, total_shards
        self.done_samples, self.done_shards = done_samples, done_shards
        self._resumed_samples = done_samples
        self._start = self._last = time.perf_counter()
        self._printed = False
        self._lines = enabled and not _stderr_is_terminal()
        self._bar = tqdm(total=total_samples, initial=done_samples, desc="tokenize", unit="sample",
                         disable=not enabled or self._lines)
        self._bar.set_postfix_str(self._shards(), refresh=False)
        if self._lines:
            resumed = f" ({done_shards} shards, {done_samples:,} samples already done)" if done_shards else ""
            self._write(f"tokenize: {total_shards} shards, {total_samples:,} samples{resumed}")

    def shard_done(self, samples: int) -> None:
        """Count a finished shard of `samples` documents; print a line when due (the first one at once)."""
        self.done_samples += samples
        self.done_shards += 1
        self._bar.set_postfix_str(self._shards(), refresh=False)
        self._bar.update(samples)
        now = time.perf_counter()
        if self._lines and self.done_shards < self.total_shards and (
                not self._printed or now - self._last >= PROGRESS_EVERY_SECONDS):
            self._write(self._line(now, final=False))
            self._last, self._printed = now, True

    def close(self) -> None:
        """Close the bar, or print the last line."""
        self._bar.close()
        if self._lines:
            self._write(self._line(time.perf_counter(), final=True))

    def _shards(self) -> str:
        return f"{self.done_shards} of {self.total_shards} shards"

    def _line(self, now: float, *, final: bool) -> str:
        elapsed = now - self._start
        rate = (self.done_samples - self._resumed_samples) / max(elapsed, 1e-9)
        percent = 100 * self.done_samples / self.total_samples if self.total_samples else 100.0
        parts = [f"tokenize: {self.done_samples:,}/{self.total_samples:,} samples ({percent:.0f}%)",
                 f"{rate:,.1f} samples/s", self._shards()]
        if final:
            parts.append(f"{timedelta(seconds=int(elapsed))} elapsed")
        elif rate > 0:
            left = max(self.total_samples - self.done_samples, 0) / rate
            parts.append(f"ETA {timedelta(seconds=int(left))}")
        return " | ".join(parts)

    @staticmethod
    def _write(line: str) -> None:
        print(line, file=sys.stderr, flush=True)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


_WORKER: dict = {}


def _init_worker(vocab, image_tokenizer) -> None:
    torch.set_num_threads(1)  # one process per core; intra-op threads would oversubscribe
    _WORKER.update(vocab=vocab, image_tokenizer=image_tokenizer)


def _run_in_worker(raw_path: Path, out_dir: Path, info: dict, batch_size: int, raw_sha256: str) -> dict:
    return tokenize_shard(raw_path, out_dir, _WORKER["vocab"], _WORKER["image_tokenizer"], info, batch_size,
                          raw_sha256)


def pretokenize(
    raw_dir: str | Path,
    out_dir: str | Path,
    vocab,
    image_tokenizer,
    *,
    flip_probability: float = 0.5,
    seed: int = 0,
    num_workers: int = 1,
    batch_size: int = 64,
    progress: bool = True,
    features: bool = False,
) -> dict:
    """Turn every raw shard of `raw_dir` into a token shard in `out_dir`; returns the written manifest.
    `progress`: samples done, samples/s and ETA on stderr (`TokenizeProgress`).

    Finished shards (same raw tar bytes by sha256, vocabulary, image tokenizer, flip probability and seed)
    are skipped, so an interrupted run resumes; a shard whose raw tar changed is tokenized again. Each
    shard's files are written tmp + rename, its meta last.
    `image_tokenizer` may be None for text-only data. `features`: also store each image's pre-quantisation
    features (float16, one row per image-code position, `NAME.features.npy`), which late-fusion connectors read.
    """
    if features and image_tokenizer is None:
        raise ValueError("features=True needs the image tokenizer: its encoder computes the features")
    if not 0.0 <= flip_probability <= 1.0:
        raise ValueError(f"flip_probability must be in [0, 1], got {flip_probability}")
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    raw_manifest = read_raw_manifest(raw_dir)
    if not raw_manifest["shards"]:
        raise ShardError(f"{raw_dir}: no raw shards (0 documents, {raw_manifest.get('skipped_count', 0)} skipped; "
                         "see the manifest's 'skipped' list for why)")
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {
        "vocab_fingerprint": vocab.fingerprint(),
        "image_tokenizer_fingerprint": image_tokenizer.fingerprint() if image_tokenizer is not None else "none",
        "vocab_size": int(vocab.vocab_size),
        "flip_probability": float(flip_probability),
        "seed": int(seed),
        "features": bool(features),
    }
    metas: dict[str, dict] = {}
    todo: list[tuple[Path, str]] = []
    for shard in raw_manifest["shards"]:
        name = shard["name"].removesuffix(".tar")
        meta = read_shard_meta(out_dir, name)
        # reuse keys on the raw bytes too: the same shard names in a rewritten raw directory hold other documents
        raw_sha256 = sha256_file(raw_dir / shard["name"])
        if meta is not None and any(meta.get(f, _REUSE_DEFAULTS.get(f)) != info[f] for f in _REUSE_FIELDS):
            changed = [f for f in _REUSE_FIELDS if meta.get(f, _REUSE_DEFAULTS.get(f)) != info[f]]
            raise ShardError(f"{out_dir}: shard {name} was tokenized with other settings ({', '.join(changed)}); "
                             "use an empty output directory")
        if meta is not None and meta.get("raw_sha256") == raw_sha256:
            metas[name] = meta
            continue
        if meta is not None:  # stale: made from other raw bytes (or before raw hashes were recorded)
            (out_dir / f"{name}.meta.json").unlink()  # the shard counts as unfinished until rewritten
        todo.append((raw_dir / shard["name"], raw_sha256))
    bar = TokenizeProgress(sum(int(shard.get("documents", 0)) for shard in raw_manifest["shards"]),
                           len(raw_manifest["shards"]), sum(int(meta["documents"]) for meta in metas.values()),
                           len(metas), enabled=progress)
    if num_workers <= 1 or len(todo) <= 1:
        for path, raw_sha256 in todo:
            meta = tokenize_shard(path, out_dir, vocab, image_tokenizer, info, batch_size, raw_sha256)
            metas[meta["name"]] = meta
            bar.shard_done(int(meta["documents"]))
    else:
        # never fork: torch has started its OpenMP threads by now, and a forked child can deadlock in its first
        # matmul. forkserver forks each worker from a clean server process (torch imported once there);
        # spawn where there is no forkserver (macOS, Windows). Each worker then uses one intra-op thread.
        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        context = multiprocessing.get_context(method)
        with ProcessPoolExecutor(num_workers, mp_context=context, initializer=_init_worker,
                                 initargs=(vocab, image_tokenizer)) as pool:
            futures = [pool.submit(_run_in_worker, path, out_dir, info, batch_size, raw_sha256)
                       for path, raw_sha256 in todo]
            for future in as_completed(futures):  # the progress counts shards as they finish
                meta = future.result()
                metas[meta["name"]] = meta
                bar.shard_done(int(meta["documents"]))
    bar.close()
    header = {
        **{k: info[k] for k in ("vocab_fingerprint", "image_tokenizer_fingerprint", "vocab_size")},
        # the id layout, so `fit` can check a model's image block without being given the vocabulary
        "pad_id": int(vocab.pad_id),
        "bos_id": int(vocab.bos_id),
        "eos_id": int(vocab.eos_id),
        "image_offset": int(vocab.image_offset),
        "image_codes": int(vocab.image_codes),
        "boi_id": int(vocab.boi_id),
        "eoi_id": int(vocab.eoi_id),
        "image_placeholder_id": int(vocab.image_placeholder_id),
        # per image-code position, when the shards carry the features late-fusion models read
        "feature_dim": int(image_tokenizer.config.embed_dim) if features else None,
        "grid_shape": list(image_tokenizer.grid_shape) if image_tokenizer is not None else None,
        "flip_probability": info["flip_probability"],
        "seed": info["seed"],
        "raw_skipped": raw_manifest.get("skipped_count", 0),
    }
    return write_manifest(out_dir, header, [metas[s["name"].removesuffix(".tar")] for s in raw_manifest["shards"]])
