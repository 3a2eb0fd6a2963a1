"""`python train.py shards write|tokenize|inspect|verify|plan`: ingest sources, pre-tokenize, look inside and check
shard directories, and write the row plan the training stream reads."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from fusion_model.cli import DefaultsHelpFormatter


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `shards` command."""
    parser = argparse.ArgumentParser(prog="train.py shards", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)

    write = sub.add_parser("write", help="read sources into raw webdataset shards (one sample = one document)",
                           formatter_class=DefaultsHelpFormatter)
    write.add_argument("--out", required=True, metavar="RAW_DIR",
                       help="output directory for raw shards (must not hold a manifest yet)")
    write.add_argument("--image-folder", action="append", default=[], metavar="DIR",
                       help="folder of images with sidecar NAME.txt captions (repeatable)")
    write.add_argument("--video-folder", action="append", default=[], metavar="DIR",
                       help="folder of clips with sidecar NAME.txt captions (repeatable): .mp4/.webm/.mkv/.mov/.avi "
                            "files (decoded with PyAV to check them, stored as they are), .npy uint8 (T,H,W,3) or "
                            "(T,H,W) arrays (never unpickled) and folders of PNG/JPEG frames (NAME/ + NAME.txt), "
                            "both stored as one PNG per frame")
    write.add_argument("--min-clip-frames", type=int, default=1, metavar="N",
                       help="clips of --video-folder with fewer frames are skipped and listed (refused with "
                            "--strict); set it to the video tokenizer's clip_frames to catch short clips here, not at "
                            "`shards tokenize`")
    write.add_argument("--img2dataset", action="append", default=[], metavar="TAR",
                       help="img2dataset output tar with KEY.jpg + KEY.txt + KEY.json (repeatable)")
    write.add_argument("--obelics", action="append", default=[], metavar="JSONL",
                       help="OBELICS-style interleaved jsonl with 'texts' and 'images' lists (repeatable)")
    write.add_argument("--image-root", default=None,
                       help="folder that relative image paths in --obelics files resolve against "
                            "(default: the jsonl's folder)")
    write.add_argument("--text", action="append", default=[], metavar="FILE",
                       help="text-only corpus: a .txt file (one document) or .jsonl (one per line) (repeatable)")
    write.add_argument("--text-key", default="text", help="field holding the text in --text .jsonl files")
    write.add_argument("--chat", action="append", default=[], metavar="FILE_OR_DIR",
                       help="conversations for post-training (repeatable): a JSON Lines file, or a folder of them "
                            "(every *.jsonl, sorted), one {\"messages\": [{\"role\": system|user|assistant, "
                            "\"content\": str or [{\"type\": \"text\", \"text\": ...}, {\"type\": \"image\", "
                            "\"path\": ...}]}]} per line (image paths relative to the file's folder). A structural "
                            "error refuses the run naming file and line; a missing image skips its conversation")
    write.add_argument("--demo", action="append", default=[], choices=["digits", "photos", "text", "scenes"],
                       help="built-in offline demo data: captioned MNIST digits, scikit-image photos, "
                            "KJV English text, the scene world (data_shards/scenes.py: captions, questions, edits) (repeatable)")
    write.add_argument("--emoji-dir", default=None,
                       help="an unpacked npm emoji-datasource-twitter package (named 64x64 emoji)")
    write.add_argument("--demo-limit", type=int, default=None, help="at most this many documents per demo source")
    write.add_argument("--shard-max-mb", type=float, default=256.0, help="start a new shard past this size (MB)")
    write.add_argument("--shard-max-docs", type=int, default=10_000, help="at most this many documents per shard")
    write.add_argument("--strict", action="store_true",
                       help="stop at the first bad sample instead of skipping it and listing it in the manifest")

    tok = sub.add_parser("tokenize", help="pre-tokenize raw shards into token shards (resumable)",
                         formatter_class=DefaultsHelpFormatter)
    tok.add_argument("raw", metavar="RAW_DIR", help="raw shard directory (from `shards write`)")
    tok.add_argument("--out", required=True, metavar="TOKENS_DIR",
                     help="token shard directory; a rerun skips the shards already finished there")
    tok.add_argument("--vocab", required=True, help="unified vocabulary tokenizer.json (from `train.py vocab`)")
    tok.add_argument("--media-tokenizer", "--image-tokenizer", dest="image_tokenizer", metavar="BUNDLE", default=None,
                     help="trained image tokenizer directory (from `train.py tokenizer`); omit for text-only data. "
                          "Raw shards with clips need a video tokenizer bundle (kind video): each clip becomes <bov> "
                          "t*h*w codes <eov>; a clip longer than its clip_frames keeps its first clip_frames frames, "
                          "a shorter one is refused, naming it")
    tok.add_argument("--flip-probability", type=float, default=0.5,
                     help="probability that a [caption, image] pair is emitted as [image, caption]")
    tok.add_argument("--seed", type=int, default=0, help="seed of the per-document flip decisions")
    tok.add_argument("--train-roles", default="assistant", metavar="ROLES",
                     help="conversations (from `shards write --chat`): the roles whose turns are training targets, "
                          "comma-separated from system, user, assistant; recorded as the manifest's target_roles "
                          "and stored per token (NAME.targets.npy). Conversations are never flipped")
    tok.add_argument("--workers", default="auto",
                     help="processes, each tokenizing whole shards on one thread; auto: the cores other processes "
                          "leave idle (measured at start)")
    tok.add_argument("--batch-size", type=int, default=64, help="images per image-tokenizer call")
    tok.add_argument("--features", action="store_true",
                     help="also store each image's pre-quantisation features from the image tokenizer's encoder "
                          "(float16, embed_dim per code position): what late-fusion models (model.late_fusion) read")
    tok.add_argument("--patch-size", type=int, default=None,
                     help="with a continuous image tokenizer (Transfusion's; e.g. trained with "
                          "configs/tokenizer/kl-demo-64.yaml): latents per side of one patch, i.e. one `<image>` "
                          "position per patch; must divide the latent grid (default 1). Refused for a VQ tokenizer")
    tok.add_argument("--no-progress", action="store_true", help="print no progress (by default: a bar on a terminal, "
                     "otherwise a plain line at most every 30 s with samples/s and ETA)")
    _add_split(tok, "tokenizes (and hashes) every world-size-th raw shard; the last rank to finish writes the manifest")
    tok.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="where the image tokenizer encodes (float32 either way; no TF32); auto: the GPU of this "
                          "rank (LOCAL_RANK) when there is one. A restart on another device or GPU model tokenizes "
                          "the shards again instead of mixing codes")

    merge = sub.add_parser("merge", help="write the manifest of a tokenize split across ranks from the ranks' parts "
                                         "(the last rank does it itself)", formatter_class=DefaultsHelpFormatter)
    merge.add_argument("dir", metavar="TOKENS_DIR", help="token shard directory holding manifest.part-R-of-W.json files")
    merge.add_argument("--world-size", type=int, default=None,
                       help="the run to merge, when parts of several world sizes are there")

    ins = sub.add_parser("inspect", help="summarise a raw or token shard directory",
                         formatter_class=DefaultsHelpFormatter)
    ins.add_argument("dir", metavar="DIR", help="raw or token shard directory")
    ins.add_argument("--show", type=int, default=0, help="also print the first N documents")
    ins.add_argument("--vocab", default=None, help="tokenizer.json to decode token shards with --show")

    ver = sub.add_parser("verify", help="check every token shard (checksums, ids < vocab_size, offsets, counts); "
                                        "exit 2 when any is bad", formatter_class=DefaultsHelpFormatter)
    ver.add_argument("dir", metavar="TOKENS_DIR", help="token shard directory (from `shards tokenize`)")
    _add_split(ver, "checks every world-size-th shard")

    plan = sub.add_parser("plan", help="write the dataset index and each shard's row count at a seq_len (TOKENS_DIR/plans/: "
                                       "index.json, names.npy, rows-N-<manifest sha256>.npy), so a training rank "
                                       "lays out an epoch without reading the manifest or opening every shard",
                          formatter_class=DefaultsHelpFormatter)
    plan.add_argument("dir", metavar="TOKENS_DIR", help="token shard directory (from `shards tokenize`)")
    plan.add_argument("--seq-len", type=int, required=True, help="the training sequence length (data.seq_len)")
    plan.add_argument("--workers", type=int, default=1, help="processes that share the shards (packing is pure "
                                                             "Python: about 0.8 s of CPU per million documents)")
    return parser


def _add_split(parser: argparse.ArgumentParser, what: str) -> None:
    """--rank/--world-size: split the work across processes or nodes."""
    parser.add_argument("--rank", type=int, default=None,
                        help=f"this process's rank; each rank {what} (default: torchrun's RANK, else SLURM's "
                             "SLURM_PROCID, else 0)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="how many ranks split the work (default: torchrun's WORLD_SIZE, else SLURM's "
                             "SLURM_NTASKS, else 1)")


def _split(args: argparse.Namespace, command: str) -> tuple[int, int]:
    """(rank, world size) from the flags or the launcher's environment; says so when split."""
    from data_shards.ranks import process_split

    rank, world_size, source = process_split(args.rank, args.world_size)
    if world_size > 1:
        print(f"{command}: rank {rank} of {world_size} (from {source})", flush=True)
    return rank, world_size


def _encoder_device(choice: str) -> str:
    """The torch device the image tokenizer encodes on: this rank's GPU (LOCAL_RANK) for auto when there is one."""
    import os

    import torch

    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device here")
    local = os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or "0"
    return f"cuda:{int(local) % torch.cuda.device_count()}"


def _write(args: argparse.Namespace) -> int:
    from data_shards import sources

    streams = [sources.image_folder(d) for d in args.image_folder]
    streams += [sources.video_folder(d, min_frames=args.min_clip_frames) for d in args.video_folder]
    if args.img2dataset:
        streams.append(sources.img2dataset_tars(args.img2dataset))
    streams += [sources.obelics_jsonl(p, args.image_root) for p in args.obelics]
    if args.text:
        streams.append(sources.text_corpus(args.text, args.text_key))
    if args.chat:  # every file's structure is checked here, before anything is written
        streams.append(sources.chat_jsonl(args.chat))
    demos = {"digits": lambda: sources.demo_digits(args.demo_limit), "photos": sources.demo_photos,
             "text": lambda: sources.demo_text(limit=args.demo_limit),
             "scenes": lambda: sources.demo_scenes(args.demo_limit)}
    streams += [itertools.islice(demos[name](), args.demo_limit) for name in args.demo]
    if args.emoji_dir:
        streams.append(itertools.islice(sources.demo_emoji(args.emoji_dir), args.demo_limit))
    if not streams:
        raise ValueError("give `shards write` at least one source (--image-folder, --video-folder, --img2dataset, "
                         "--obelics, --text, --chat, --demo)")
    manifest = sources.write_raw(itertools.chain(*streams), args.out, strict=args.strict,
                                 shard_max_bytes=int(args.shard_max_mb * 1024 * 1024),
                                 shard_max_docs=args.shard_max_docs)
    videos = f", {manifest['videos']} clips" if manifest.get("videos") else ""
    videos += f", {manifest['conversations']} conversations" if manifest.get("conversations") else ""
    print(f"wrote {manifest['documents']} documents ({manifest['images']} images{videos}) in "
          f"{len(manifest['shards'])} shards to {args.out}; skipped {manifest['skipped_count']}")
    for skip in manifest["skipped"][:10]:
        print(f"  skipped {skip['key']}: {skip['reason']}")
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    from common.threads import choose_threads, free_cores, parse_threads, usable_cores
    from data_shards.pretokenize import PART_FORMAT, pretokenize
    from data_shards.raw import read_raw_manifest
    from tokenizer.vocab import UnifiedVocab

    rank, world_size = _split(args, "tokenize")
    device = _encoder_device(args.device) if args.image_tokenizer else "cpu"
    workers = parse_threads(args.workers, flag="--workers")
    if device != "cpu":
        if workers not in ("auto", 1):
            raise ValueError(f"--workers {workers} with the image tokenizer on {device}: one process per GPU; split "
                             "across GPUs with a rank each (--rank/--world-size, or torchrun --nproc-per-node)")
        workers = 1
        print(f"tokenize: encoding images on {device} in one process", flush=True)
    elif workers == "auto":
        workers = free_cores()
        print(f"tokenize with {workers} worker process{'es' if workers > 1 else ''} ({workers} of {usable_cores()} "
              "cores idle; --workers N to override)", flush=True)
    if workers == 1:  # in this process: one thread, as each worker process uses
        choose_threads(1, log=None)
    read_raw_manifest(args.raw)  # fail before loading models
    from tokenizer.chat import parse_roles

    parse_roles(args.train_roles)  # an unknown role too
    if args.features and not args.image_tokenizer:
        raise ValueError("--features needs --image-tokenizer: its encoder computes the features")
    vocab = UnifiedVocab.load(args.vocab)
    image_tokenizer = None
    if args.image_tokenizer:
        from tokenizer.bundle import load_media_tokenizer

        # VQ (codes) or continuous (latents, Transfusion's): pretokenize asks the bundle its kind
        image_tokenizer = load_media_tokenizer(args.image_tokenizer, map_location=device).eval()
    manifest = pretokenize(args.raw, args.out, vocab, image_tokenizer, flip_probability=args.flip_probability,
                           seed=args.seed, num_workers=workers, batch_size=args.batch_size,
                           progress=not args.no_progress, features=args.features, rank=rank, world_size=world_size,
                           patch_size=args.patch_size, target_roles=args.train_roles)
    if manifest["format"] == PART_FORMAT:
        shards = manifest["shards"]
        print(f"rank {rank} of {world_size}: {len(shards)} token shards ({sum(s['entry']['documents'] for s in shards)} "
              f"documents) done at {args.out}; no manifest yet: {manifest['waiting']}. The last rank to finish writes "
              f"it, or run `train.py shards merge {args.out}` once all have")
        return 0
    merged = f" (all {world_size} ranks' parts merged)" if world_size > 1 else ""
    clips = ""
    if manifest.get("video_grid"):  # the manifest's shard entries carry no clip count: the shards' metas do
        from data_shards.token_shards import read_shard_meta

        count = sum((read_shard_meta(args.out, s["name"]) or {}).get("clips", 0) for s in manifest["shards"])
        clips = (f", {count} clips ({manifest['clip_frames']} frames -> "
                 f"{'x'.join(map(str, manifest['video_grid']))} codes each)")
    if manifest.get("conversations"):
        clips += (f", {manifest['conversations']} conversations (targets: the turns of "
                  f"{', '.join(manifest['target_roles'])})")
    print(f"{manifest['documents']} documents, {manifest['tokens']} tokens, {manifest['images']} images{clips} "
          f"in {len(manifest['shards'])} token shards at {args.out}{merged}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    from data_shards.pretokenize import merge_parts

    manifest = merge_parts(args.dir, args.world_size)
    print(f"{manifest['documents']} documents, {manifest['tokens']} tokens, {manifest['images']} images "
          f"in {len(manifest['shards'])} token shards at {args.dir}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    manifest_path = Path(args.dir) / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} not found; give `shards inspect` a directory written by "
                                "`shards write` or `shards tokenize`")
    manifest = json.loads(manifest_path.read_text())  # a JSONDecodeError is a ValueError: exit code 2
    kind = manifest.get("format", "") if isinstance(manifest, dict) else ""
    if kind.startswith("early-fusion-raw"):
        from data_shards.raw import Conversation, iter_raw_shard, read_raw_manifest

        manifest = read_raw_manifest(args.dir)
        print(json.dumps({k: v for k, v in manifest.items() if k != "skipped"}, indent=2))
        shown = 0
        for shard in manifest["shards"]:
            for key, segments in iter_raw_shard(Path(args.dir) / shard["name"]):
                if shown >= args.show:
                    return 0
                if isinstance(segments, Conversation):
                    parts = [f"{turn.role}: " + " ".join(p if isinstance(p, str) else _describe_raw(p)
                                                         for p in turn.parts) for turn in segments.turns]
                else:
                    parts = [s if isinstance(s, str) else _describe_raw(s) for s in segments]
                print(f"{shard['name']} {key}: {parts}")
                shown += 1
        return 0
    from data_shards.token_shards import TokenShard, read_manifest

    manifest = read_manifest(args.dir)
    print(json.dumps(manifest, indent=2))
    # open what is summarised: a damaged shard fails here (naming its file), not in the middle of training
    opened = [TokenShard(args.dir, s["name"], manifest["vocab_size"]) for s in manifest["shards"]]
    unchecked = [s.name for s in opened if not s.has_checksums]
    print(f"opened {len(opened)} shards" + (f" ({len(unchecked)} written without checksums)" if unchecked else
                                            ", checksums match"))
    if args.show:
        vocab = None
        if args.vocab:
            from tokenizer.vocab import UnifiedVocab

            vocab = UnifiedVocab.load(args.vocab)
        shard = TokenShard(args.dir, manifest["shards"][0]["name"], manifest["vocab_size"])
        for i in range(min(args.show, len(shard))):
            ids = shard.ids[shard.offsets[i] : shard.offsets[i + 1]].astype("int64").tolist()
            grids = {"grid_shape": manifest.get("grid_shape"),
                     **({"video_grid": manifest["video_grid"]} if manifest.get("video_grid") else {})}
            shown = vocab.decode_document(ids, **grids) if vocab else ids[:64]
            shown = [s if isinstance(s, str) else f"<{'video' if s.ndim == 3 else 'image'} {tuple(s.shape)}>"
                     for s in shown] if vocab else shown
            print(f"{shard.name} {shard.keys[i]} ({len(ids)} tokens): {shown}")
    return 0


def _describe_raw(segment: tuple) -> str:
    """How `shards inspect --show` prints a raw image or clip segment."""
    if segment[0] == "video":
        payload, suffix = segment[1], segment[2]
        if suffix == ".png":
            return f"<video {len(payload)} PNG frames, {sum(map(len, payload))} bytes>"
        return f"<video {suffix} {len(payload)} bytes>"
    return f"<image {len(segment[1])} bytes>"


def _verify(args: argparse.Namespace) -> int:
    from data_shards.ranks import rank_subset
    from data_shards.token_shards import verify_token_dir

    rank, world_size = _split(args, "verify")
    manifest, problems = verify_token_dir(args.dir, rank, world_size)
    for name, problem in problems:
        print(f"BAD {name}: {problem}")
    total = len(manifest["shards"])
    if world_size > 1:  # this rank's share: the others report theirs
        mine = rank_subset([s["name"] for s in manifest["shards"]], rank, world_size)
        checked = [s for s in manifest["shards"] if s["name"] in mine]
        where = f"rank {rank} of {world_size}: "
        if problems:
            print(f"{where}{len(problems)} of the {len(checked)} shards it checked (of {total}) in {args.dir} are bad; "
                  "re-run `train.py shards tokenize` into a fresh directory")
            return 2
        print(f"{where}all {len(checked)} shards it checked (of {total}) in {args.dir} are good "
              f"({sum(s['documents'] for s in checked)} documents, {sum(s['tokens'] for s in checked)} tokens)")
        return 0
    if problems:
        print(f"{len(problems)} of {total} shards in {args.dir} are bad; re-run `train.py shards tokenize` into a "
              "fresh directory")
        return 2
    latents = (f", {manifest.get('images', 0)} images' latents finite" if manifest.get("feature_kind") == "latent"
               else "")
    print(f"all {total} shards in {args.dir} are good ({manifest['documents']} documents, {manifest['tokens']} "
          f"tokens{latents})")
    return 0


def _plan(args: argparse.Namespace) -> int:
    import numpy as np

    from data_shards.plan import write_plan

    if args.seq_len < 1:  # a ValueError: the dispatcher's one line and exit code 2
        raise ValueError(f"--seq-len {args.seq_len}: give the training sequence length (data.seq_len), a positive "
                         "number of tokens")
    path = write_plan(args.dir, args.seq_len, workers=max(1, args.workers))
    rows = int(np.load(path, allow_pickle=False).sum())
    print(f"wrote the dataset index and the row counts at seq_len {args.seq_len} in {path.parent} ({path.name}): "
          f"{rows} rows of {args.seq_len} tokens")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python train.py shards ...`; bad input (ShardError, ImageLoadError: ValueErrors) exits 2."""
    args = build_parser().parse_args(argv)
    return {"write": _write, "tokenize": _tokenize, "merge": _merge, "inspect": _inspect, "verify": _verify,
            "plan": _plan}[args.action](args)
