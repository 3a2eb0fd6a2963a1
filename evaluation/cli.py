"""`python train.py eval --checkpoint CKPT --suite NAME`: score any family's checkpoint on a registered suite;
writes `results.json` and `index.html` under --out."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any

from evaluation import BUILTIN_SUITES, suite_class
from evaluation.base import EvalSettings
from fusion_model.cli import DefaultsHelpFormatter


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_fields(group: Any, cls: type, hints_of: type) -> None:
    """One option per dataclass field, typed from its annotation, with its metadata["help"]."""
    hints = typing.get_type_hints(hints_of)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if base is bool:
            group.add_argument(_flag(f.name), type=lambda v: v.lower() in ("1", "true", "yes"), default=default,
                               metavar="BOOL", help=f.metadata.get("help", ""))
        else:
            group.add_argument(_flag(f.name), type=base if base in (int, float, str) else str, default=default,
                               help=f.metadata.get("help", ""))


def parser(suite: type | None = None) -> argparse.ArgumentParser:
    """The options: the checkpoint and its tokenizers, the suite, the sampling settings and the suite's own."""
    p = argparse.ArgumentParser(prog="train.py eval", formatter_class=DefaultsHelpFormatter, description=__doc__)
    p.add_argument("--checkpoint", required=True, help="a train.py fit checkpoint of any family (or a convert "
                   "import file / transformers folder)")
    p.add_argument("--suite", required=True, metavar="NAME",
                   help=f"one of {', '.join(BUILTIN_SUITES)} (or package.module:Class of your own Suite)")
    p.add_argument("--vocab", required=True, help="the tokenizer.json the checkpoint was trained with")
    p.add_argument("--media-tokenizer", "--image-tokenizer", dest="media_tokenizer", default=None, metavar="BUNDLE",
                   help="the image tokenizer bundle its shards were made with (VQ, or continuous for transfusion)")
    p.add_argument("--base", default=None, help="a LoRA adapter checkpoint's base, when it moved")
    p.add_argument("--out", default=None, metavar="DIR", help="where results.json and index.html go "
                   "(default: runs/eval/<suite>)")
    _add_fields(p.add_argument_group("sampling and sizes"), EvalSettings, EvalSettings)
    if suite is not None and dataclasses.fields(suite.Options):
        _add_fields(p.add_argument_group(f"the {suite.name} suite"), suite.Options, suite.Options)
    return p


def _given_suite(argv: list[str]) -> str | None:
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--suite")
    return early.parse_known_args(argv)[0].suite


def main(argv: list[str] | None = None) -> int:
    """Entry point; bad input raises ValueError / FileNotFoundError (one line, exit 2 in train.py)."""
    from evaluation.run import evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    name = _given_suite(argv)
    suite = suite_class(name) if name else None
    args = parser(suite).parse_args(argv)
    values = vars(args)
    settings = EvalSettings(**{f.name: values[f.name] for f in dataclasses.fields(EvalSettings)})
    options = suite.Options(**{f.name: values[f.name] for f in dataclasses.fields(suite.Options)})
    out = Path(args.out or Path("runs") / "eval" / suite.name)
    results = evaluate(args.checkpoint, args.suite, vocab=args.vocab, media_tokenizer=args.media_tokenizer, out=out,
                       settings=settings, options=options, base=args.base,
                       progress=lambda line: print(line, flush=True))
    print(json.dumps(results["figures"].get("summary", results["figures"]), indent=1))
    print(f"eval: wrote {out / 'results.json'} and {out / 'index.html'}")
    return 0


if __name__ == "__main__":  # `python -m evaluation.cli ...` where train.py is absent: bad input is one line there too
    from fusion_model import cli

    sys.exit(cli.main(["eval", *sys.argv[1:]], commands={"eval": ("evaluation.cli", "score a checkpoint")}))
