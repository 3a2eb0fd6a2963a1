"""Pre-tokenize raw shards into token shards: settings and reuse checks, worker processes or ranks, progress.

Resumable: a finished shard made with the same settings from the same raw bytes is kept. One shard's tokenizing
(batched image encoding, pair flipping) is `data_shards.tokenize_shard`; the per-rank manifest parts of a split run
and their merge are `data_shards.manifest_parts`. `flip_pair`, `merge_parts`, `part_name` and `PART_FORMAT` are
part of this module's API (`__all__`), imported from those.
"""

from __future__ import annotations

import functools
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager, suppress
from datetime import timedelta
from pathlib import Path

import torch
from tqdm import tqdm

from common.files import atomic_write_json
from data_shards.manifest_parts import PART_FORMAT, merge_parts, part_name, ranks_of
from data_shards.ranks import rank_subset
from data_shards.raw import MANIFEST as RAW_MANIFEST
from data_shards.raw import ShardError, read_raw_manifest
from data_shards.token_shards import (
    LATENT_KIND,
    manifest_entry,
    read_shard_meta,
    sha256_file,
    write_manifest,
)
from data_shards.tokenize_shard import (
    clip_frames_of,
    flip_pair,
    is_continuous,
    is_video_tokenizer,
    latent_dim,
    tokenize_shard,
)
from tokenizer.chat import DEFAULT_TARGET_ROLES, parse_roles

__all__ = ["PART_FORMAT", "PROGRESS_EVERY_SECONDS", "TokenizeProgress", "encoder_key", "flip_pair", "merge_parts",
           "part_name", "pretokenize"]

# Settings that change what a shard holds; a finished shard is reused only if they all match.
_REUSE_FIELDS = ("vocab_fingerprint", "image_tokenizer_fingerprint", "vocab_size", "flip_probability", "seed",
                 "features", "patch_size", "target_roles")
# What shards written before a field existed hold for it.
_REUSE_DEFAULTS = {"features": False, "patch_size": None, "target_roles": list(DEFAULT_TARGET_ROLES)}


def encoder_key(image_tokenizer) -> dict[str, str]:
    """{"encoder_device", "encoder_dtype"} of the image tokenizer as it is now ("none" for text-only data); a CUDA
    device is named by its model, since two GPU models need not round alike."""
    if image_tokenizer is None:
        return {"encoder_device": "none", "encoder_dtype": "none"}
    device = torch.device(getattr(image_tokenizer, "device", "cpu"))
    where = f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type
    dtype = torch.float32  # stand-ins without parameters (tests' wrappers) encode with their inner fp32 model
    if isinstance(image_tokenizer, torch.nn.Module):
        dtype = next(image_tokenizer.parameters(), torch.empty(0)).dtype
    return {"encoder_device": where, "encoder_dtype": str(dtype).removeprefix("torch.")}


def _made_by(meta: dict) -> tuple[str, str]:
    """A finished shard's encoder key; shards from before it was recorded were made on the CPU in float32 (the
    only way `shards tokenize` ran then)."""
    if "encoder_device" in meta:
        return meta["encoder_device"], meta.get("encoder_dtype", "float32")
    return ("none", "none") if meta.get("image_tokenizer_fingerprint") == "none" else ("cpu", "float32")


@contextmanager
def _exact_cuda_math(enabled: bool) -> Iterator[None]:
    """On CUDA: full fp32 convolutions and matmuls (no TF32) with deterministic kernels while tokenizing, so
    every rank and every restart on the same GPU model computes the same codes; restored afterwards."""
    if not enabled:
        yield
        return
    backends = torch.backends
    saved = (backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32, backends.cudnn.deterministic,
             backends.cudnn.benchmark)
    backends.cudnn.allow_tf32 = backends.cuda.matmul.allow_tf32 = False
    backends.cudnn.deterministic, backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        (backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32, backends.cudnn.deterministic,
         backends.cudnn.benchmark) = saved


# How often, at most, a plain progress line is printed when stderr is a log file rather than a terminal.
PROGRESS_EVERY_SECONDS = 30.0


class TokenizeProgress:
    """Progress of `pretokenize` in samples (documents), counted per finished shard: a tqdm bar on a terminal,
    plain lines on stderr at most every `PROGRESS_EVERY_SECONDS` otherwise (a bar's carriage returns make a log
    file unreadable), nothing when off. Rates and the ETA count only the samples tokenized in this run."""

    def __init__(self, total_samples: int, total_shards: int, done_samples: int, done_shards: int, *,
                 enabled: bool, label: str = "tokenize") -> None:
        self.label = label  # what each line starts with ("tokenize rank 1 of 4" on a split run)
        self.total_samples, self.total_shards = total_samples, total_shards
        self.done_samples, self.done_shards = done_samples, done_shards
        self._resumed_samples = done_samples
        self._start = self._last = time.perf_counter()
        self._printed = False
        self._lines = enabled and not _stderr_is_terminal()
        self._bar = tqdm(total=total_samples, initial=done_samples, desc=label, unit="sample",
                         disable=not enabled or self._lines)
        self._bar.set_postfix_str(self._shards(), refresh=False)
        if self._lines:
            resumed = f" ({done_shards} shards, {done_samples:,} samples already done)" if done_shards else ""
            self._write(f"{label}: {total_shards} shards, {total_samples:,} samples{resumed}")

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
        parts = [f"{self.label}: {self.done_samples:,}/{self.total_samples:,} samples ({percent:.0f}%)",
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


def _no_empty_out_dir_on_error(function: Callable[..., dict]) -> Callable[..., dict]:
    """`function(raw_dir, out_dir, ...)` that, when it fails, removes `out_dir` again if it made it and left it
    empty: a refused run leaves no empty folder, while finished shards stay for the next run to resume from."""

    @functools.wraps(function)
    def wrapper(raw_dir: str | Path, out_dir: str | Path, *args, **kwargs) -> dict:
        created = not Path(out_dir).exists()
        try:
            return function(raw_dir, out_dir, *args, **kwargs)
        except BaseException:
            if created:
                with suppress(OSError):  # not empty (a finished shard, another rank's files) or already gone
                    Path(out_dir).rmdir()
            raise

    return wrapper


@_no_empty_out_dir_on_error
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
    rank: int = 0,
    world_size: int = 1,
    patch_size: int | None = None,
    target_roles: str | tuple[str, ...] = DEFAULT_TARGET_ROLES,
) -> dict:
    """Turn every raw shard of `raw_dir` into a token shard in `out_dir`; returns the written manifest.
    `progress`: samples done, samples/s and ETA on stderr (`TokenizeProgress`).

    Finished shards (same raw tar bytes by sha256, vocabulary, image tokenizer, flip probability, seed, and the
    device and dtype that encoded the images) are skipped, so an interrupted run resumes; a shard whose raw tar
    changed, or whose codes another device or dtype made, is tokenized again. Each shard's files are written
    tmp + rename, its meta last.
    `image_tokenizer` may be None for text-only data; it encodes on its own device (fp32 math there: no TF32).
    `features`: also store each image's pre-quantisation features (float16, one row per image-code position,
    `NAME.features.npy`, written in chunks), which late-fusion connectors read.
    A continuous image tokenizer (`kind` "continuous", Transfusion's) stores each image as its latents instead:
    `<boi>`, one `<image>` placeholder per `patch_size` x `patch_size` latent patch (default 1), `<eoi>` in the
    ids, and the patches (float16, channel-major, `tokenizer.layout.patchify`) as the feature rows of those
    positions; the manifest records `feature_kind` "latent" and the latent grid. NaN or infinite latents are
    refused, naming the sample.
    Conversations (raw samples of `shards write --chat`) become `tokenizer.chat.encode_conversation`'s ids; the
    tokens of the `target_roles` turns ("assistant" by default; `parse_roles` spellings) are the targets, stored per
    shard as `NAME.targets.npy` and recorded as the shards' and manifest's `target_roles`; they are never flipped.

    `world_size` > 1 splits the work: this process tokenizes (and hashes) only its `rank_subset` of the raw shards,
    writes their entries to `manifest.part-RANK-of-WORLD.json`, and writes the manifest (`merge_parts`, the same
    bytes as one process writes) when every rank's part is there. A rank whose manifest is not complete yet returns
    its part instead, with "waiting" saying why (its "format" is `PART_FORMAT`).
    """
    if features and image_tokenizer is None:
        raise ValueError("features=True needs the image tokenizer: its encoder computes the features")
    continuous = is_continuous(image_tokenizer)
    if continuous:
        patch_size = 1 if patch_size is None else patch_size
        grid = tuple(image_tokenizer.grid_shape)
        if isinstance(patch_size, bool) or not isinstance(patch_size, int) or patch_size < 1 or any(
                side % patch_size for side in grid):
            raise ValueError(f"--patch-size {patch_size} does not divide the image tokenizer's {grid[0]}x{grid[1]} "
                             "latent grid: choose a divisor of both sides (1 keeps one position per latent)")
        features = True  # the latents are the images' content: there is nothing else to store
    elif patch_size is not None:
        raise ValueError("--patch-size cuts a continuous image tokenizer's latents into patches; this image tokenizer "
                         f"is {'absent' if image_tokenizer is None else 'a VQ one (its codes are the positions)'}")
    if not 0.0 <= flip_probability <= 1.0:
        raise ValueError(f"flip_probability must be in [0, 1], got {flip_probability}")
    target_roles = parse_roles(target_roles)
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    raw_manifest = read_raw_manifest(raw_dir)
    if not raw_manifest["shards"]:
        raise ShardError(f"{raw_dir}: no raw shards (0 documents, {raw_manifest.get('skipped_count', 0)} skipped; "
                         "see the manifest's 'skipped' list for why)")
    mine = rank_subset([shard["name"] for shard in raw_manifest["shards"]], rank, world_size)
    made_by = encoder_key(image_tokenizer)
    on_cuda = made_by["encoder_device"].startswith("cuda")
    if on_cuda and num_workers > 1:
        raise ValueError("the image tokenizer is on a GPU: tokenize with one process per GPU (a rank each, "
                         "--rank/--world-size or torchrun), not with worker processes")
    out_dir.mkdir(parents=True, exist_ok=True)
    info = {
        "vocab_fingerprint": vocab.fingerprint(),
        "image_tokenizer_fingerprint": image_tokenizer.fingerprint() if image_tokenizer is not None else "none",
        "vocab_size": int(vocab.vocab_size),
        "flip_probability": float(flip_probability),
        "seed": int(seed),
        "features": bool(features),
        "patch_size": patch_size,
        "target_roles": list(target_roles),
        **made_by,
    }
    label = "tokenize" if world_size == 1 else f"tokenize rank {rank} of {world_size}"
    own = [shard for shard in raw_manifest["shards"] if shard["name"] in mine]
    found: dict[str, dict | None] = {}
    for shard in own:  # settings first, from the metas alone: a refused run hashes nothing
        name = shard["name"].removesuffix(".tar")
        meta = found[name] = read_shard_meta(out_dir, name)
        if meta is not None and any(meta.get(f, _REUSE_DEFAULTS.get(f)) != info[f] for f in _REUSE_FIELDS):
            changed = [f for f in _REUSE_FIELDS if meta.get(f, _REUSE_DEFAULTS.get(f)) != info[f]]
            redo = (f"use an empty output directory, or give the settings it was made with, or delete "
                    f"{out_dir / (name + '.meta.json')} (and any other shard so made) to redo it with these")
            raise ShardError(f"{out_dir}: shard {name} was tokenized with other settings ({', '.join(changed)}); "
                             f"{redo}")
    metas: dict[str, dict] = {}
    todo: list[tuple[Path, str]] = []
    other_encoders: set[tuple[str, str]] = set()
    for shard in own:
        name = shard["name"].removesuffix(".tar")
        meta = found[name]
        # reuse keys on the raw bytes too: the same shard names in a rewritten raw directory hold other documents.
        # Only this rank's shards are hashed: a split run hashes each raw shard once, on the rank that owns it.
        raw_sha256 = sha256_file(raw_dir / shard["name"])
        current = meta is not None and meta.get("raw_sha256") == raw_sha256
        if current and _made_by(meta) == (made_by["encoder_device"], made_by["encoder_dtype"]):
            metas[name] = meta
            continue
        if meta is not None:  # stale: other raw bytes (or none recorded), or codes made on another device/dtype
            if current:
                other_encoders.add(_made_by(meta))
            (out_dir / f"{name}.meta.json").unlink()  # the shard counts as unfinished until rewritten
        todo.append((raw_dir / shard["name"], raw_sha256))
    if other_encoders:
        was = ", ".join(" ".join(key) for key in sorted(other_encoders))
        print(f"{label}: shards in {out_dir} whose images were encoded on {was} are tokenized again on "
              f"{made_by['encoder_device']} {made_by['encoder_dtype']}, so that no directory mixes codes of two "
              "devices or dtypes", file=sys.stderr, flush=True)
    bar = TokenizeProgress(sum(int(shard.get("documents", 0)) for shard in own), len(own),
                           sum(int(meta["documents"]) for meta in metas.values()), len(metas), enabled=progress,
                           label=label)
    with _exact_cuda_math(on_cuda):
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
        # what `shards verify` reads a conversation's turns by: `<sep>` ends a system or user turn, `</s>` an answer
        **({"sep_id": int(vocab.sep_id)} if getattr(vocab, "sep_id", None) is not None else {}),
        # per image-code position, when the shards carry the features late-fusion models read; per `<image>`
        # position, a latent patch, for a continuous image tokenizer
        "feature_dim": (latent_dim(image_tokenizer, patch_size) if continuous else
                        int(image_tokenizer.config.embed_dim) if features else None),
        "feature_kind": LATENT_KIND if continuous else "pre-quantisation" if features else None,
        **({"latent": {"channels": int(image_tokenizer.latent_channels), "grid": list(image_tokenizer.grid_shape),
                       "patch_size": patch_size}} if continuous else {}),
        "grid_shape": list(image_tokenizer.grid_shape) if image_tokenizer is not None else None,
        # a video tokenizer's clip grid (t, h, w) and frames per clip, and the vocabulary's video markers: what a
        # clip span of these shards is (`<bov>`, t*h*w codes in (t, h, w) raster order, `<eov>`)
        **({"video_grid": [int(side) for side in image_tokenizer.video_grid],
            "clip_frames": clip_frames_of(image_tokenizer)} if is_video_tokenizer(image_tokenizer) else {}),
        **({"bov_id": int(vocab.bov_id), "eov_id": int(vocab.eov_id)} if getattr(vocab, "has_video", False) else {}),
        "flip_probability": info["flip_probability"],
        "seed": info["seed"],
        "target_roles": info["target_roles"],
        "raw_skipped": raw_manifest.get("skipped_count", 0),
        **made_by,  # every shard's codes were made so (a merge refuses parts made otherwise)
    }
    ordered = [(index, shard["name"].removesuffix(".tar")) for index, shard in enumerate(raw_manifest["shards"])
               if shard["name"] in mine]
    if world_size == 1:
        return write_manifest(out_dir, header, [metas[name] for _, name in ordered])
    part = {
        "format": PART_FORMAT,
        "rank": rank,
        "world_size": world_size,
        # which run a part belongs to: parts left by a run over other raw shards are never merged with this one's
        "raw_manifest_sha256": sha256_file(raw_dir / RAW_MANIFEST),
        "raw_shards": len(raw_manifest["shards"]),
        "header": header,
        "shards": [{"index": index, "entry": manifest_entry(metas[name])} for index, name in ordered],
    }
    atomic_write_json(out_dir / part_name(rank, world_size), part)
    # the last rank to finish finds every part and writes the manifest (two finishing at once write the same bytes)
    missing = [r for r in range(world_size) if not (out_dir / part_name(r, world_size)).is_file()]
    if missing:
        return {**part, "waiting": f"{ranks_of(missing, world_size)} not finished yet"}
    try:
        return merge_parts(out_dir, world_size)
    except ShardError as err:
        return {**part, "waiting": str(err)}
