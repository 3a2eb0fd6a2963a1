"""One evaluation run: load a checkpoint (any family) and its tokenizers, refuse a mismatch, run a suite, write
`results.json` (figures, settings, fingerprints, seed) and `index.html` (the samples per skill)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch

from common.files import atomic_write_json
from data_shards.checksums import sha256_file
from evaluation import suite_class
from evaluation.base import EvalContext, EvalSettings, SuiteResult
from evaluation.page import write_page


def _fingerprint(path: Path) -> str:
    """sha256 of a checkpoint file, or of a directory's files in name order (a transformers folder)."""
    if path.is_file():
        return sha256_file(path)
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode())
        digest.update(sha256_file(file).encode())
    return digest.hexdigest()


def load_context(checkpoint: str | os.PathLike, vocab: str | os.PathLike, media_tokenizer: str | os.PathLike | None,
                 settings: EvalSettings, base: str | os.PathLike | None = None, progress=print) -> EvalContext:
    """The checkpoint's family with its weights, the vocabulary and the image tokenizer, checked to belong together."""
    from fusion_model.families.loading import load_family
    from tokenizer.vocab import UnifiedVocab

    for label, path in (("--checkpoint", checkpoint), ("--vocab", vocab), ("--media-tokenizer", media_tokenizer)):
        if path is not None and not Path(path).exists():
            raise FileNotFoundError(f"{label} {path} does not exist")
    loaded = load_family(checkpoint, map_location=settings.device, base=base)
    unified = UnifiedVocab.load(vocab)
    tokenizer = None
    if media_tokenizer is not None:
        from tokenizer.bundle import load_media_tokenizer

        tokenizer = load_media_tokenizer(media_tokenizer, map_location=settings.device)
    loaded.check_tokenizers(unified, tokenizer, where=f"--checkpoint {checkpoint}")
    model = loaded.parts.get("model")
    if model is not None and hasattr(model, "config") and getattr(tokenizer, "kind", "vq") == "vq":
        from common.compat import check_compatible

        check_compatible(model=model.config, vocab=unified, image_tokenizer=tokenizer)
    return EvalContext(loaded, unified, tokenizer, settings, progress)


def evaluate(checkpoint: str | os.PathLike, suite: str, *, vocab: str | os.PathLike,
             media_tokenizer: str | os.PathLike | None = None, out: str | os.PathLike | None = None,
             settings: EvalSettings | None = None, options: Any = None, base: str | os.PathLike | None = None,
             progress=print) -> dict[str, Any]:
    """Score `checkpoint` on the suite named `suite`; returns results.json's content (written to `out` with the
    sample page when given). The same checkpoint, tokenizers, suite options and settings give the same file."""
    return evaluate_with_samples(checkpoint, suite, vocab=vocab, media_tokenizer=media_tokenizer, out=out,
                                 settings=settings, options=options, base=base, progress=progress)[0]


def evaluate_with_samples(checkpoint: str | os.PathLike, suite: str, *, vocab: str | os.PathLike,
                          media_tokenizer: str | os.PathLike | None = None, out: str | os.PathLike | None = None,
                          settings: EvalSettings | None = None, options: Any = None,
                          base: str | os.PathLike | None = None, progress=print) -> tuple[dict[str, Any], SuiteResult]:
    """`evaluate`, also returning the suite's `SuiteResult` (its page samples and whatever else the suite keeps,
    e.g. the digits suite's `outputs`) for a caller that shows them its own way (the demo's report)."""
    settings = settings or EvalSettings()
    suite_type = suite_class(suite)
    runner = suite_type(options)
    context = load_context(checkpoint, vocab, media_tokenizer, settings, base, progress)
    runner.check(context)
    started = time.perf_counter()
    torch.manual_seed(settings.seed)  # a family that draws from the global RNG still repeats itself
    result = runner.run(context)
    progress(f"eval: {suite} scored in {time.perf_counter() - started:.0f} s")
    results = {
        "suite": suite_type.name,
        "family": context.family,
        "figures": result.figures,
        "settings": dataclasses.asdict(settings),
        "options": dataclasses.asdict(runner.options) if dataclasses.is_dataclass(runner.options) else {},
        "seed": settings.seed,
        "fingerprints": {
            "checkpoint": _fingerprint(Path(checkpoint)),
            "vocab": context.vocab.fingerprint(),
            "media_tokenizer": context.media_tokenizer.fingerprint() if context.media_tokenizer is not None else None,
        },
        "files": {"checkpoint": str(checkpoint), "vocab": str(vocab),
                  "media_tokenizer": None if media_tokenizer is None else str(media_tokenizer)},
    }
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "results.json", results)
        write_page(out / "index.html", f"train.py eval --suite {suite}: {checkpoint}", results, result.samples)
    return results, result
