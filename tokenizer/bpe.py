"""Byte-level BPE training with the `tokenizers` library: the text part of the unified vocabulary."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# 256 printable stand-ins for the 256 byte values (GPT-2's mapping): every string is encodable.
BYTE_ALPHABET: list[str] = sorted(pre_tokenizers.ByteLevel.alphabet())


@dataclass
class BpeResult:
    """A trained byte-level BPE: tokens in id order (the 256 bytes first) and the merges in rank order."""

    tokens: list[str]
    merges: list[tuple[str, str]]
    texts_seen: int
    chars_seen: int


def byte_level_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """GPT-2 style split (words, numbers, punctuation, spaces) then bytes -> printable characters."""
    # No prefix space and no normalizer: decode(encode(s)) must give back s byte for byte.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def byte_level_decoder() -> decoders.Decoder:
    """The inverse of the byte mapping (invalid UTF-8 in a partial sequence becomes U+FFFD)."""
    return decoders.ByteLevel()


class _CountingTexts:
    """Iterates the texts once, counting them, so an empty corpus is reported instead of silently training nothing."""

    def __init__(self, texts: Iterable[str]):
        self._texts = texts
        self.texts = 0
        self.chars = 0

    def __iter__(self) -> Iterator[str]:
        for index, text in enumerate(self._texts):
            if not isinstance(text, str):
                raise TypeError(f"corpus item {index} is a {type(text).__name__}, not str; pass text strings")
            if text:
                self.texts += 1
                self.chars += len(text)
                yield text


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    show_progress: bool = False,
    length: int | None = None,
    max_token_length: int | None = 32,
) -> BpeResult:
    """Train a byte-level BPE of at most `vocab_size` tokens (256 byte tokens + merges) on `texts`."""
    if vocab_size < len(BYTE_ALPHABET):
        raise ValueError(
            f"a byte-level BPE needs at least {len(BYTE_ALPHABET)} tokens (one per byte), got vocab_size={vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer()
    tokenizer.decoder = byte_level_decoder()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=show_progress,
        initial_alphabet=BYTE_ALPHABET,
        special_tokens=[],
        max_token_length=max_token_length,
    )
    counted = _CountingTexts(texts)
    tokenizer.train_from_iterator(counted, trainer=trainer, length=length)
    if counted.texts == 0:
        raise ValueError(
            "the corpus is empty (no non-empty text); give files, directories or strings with text in them"
        )
    return _result_from(tokenizer, counted.texts, counted.chars)


def _result_from(tokenizer: Tokenizer, texts: int, chars: int) -> BpeResult:
    """Read tokens and merges back out of a trained BPE model."""
    import json

    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    by_id = sorted(model["vocab"].items(), key=lambda item: item[1])
    produced = {a + b for a, b in merges}
    # Base tokens (the byte alphabet) first, then merge results in merge order, so ids follow merge rank.
    base = [token for token, _ in by_id if token not in produced]
    missing = set(BYTE_ALPHABET) - set(base)
    if missing:
        raise RuntimeError(
            f"BPE training lost {len(missing)} byte tokens; this is a bug in the trainer setup"
        )
    tokens = base + [a + b for a, b in merges]
    return BpeResult(tokens=tokens, merges=merges, texts_seen=texts, chars_seen=chars)


def prune_tokens(result: BpeResult, forbidden: Callable[[str], bool]) -> BpeResult:
    """Drop learned tokens for which `forbidden(token)` holds (and every merge that builds on them)."""
    # A corpus that contains e.g. "IMGIMGBZ" could teach BPE that exact string; it must stay text,
    # never collide with the image token of the same name, so such merges are removed.
    alive = {t for t in result.tokens[: len(result.tokens) - len(result.merges)]}
    kept: list[tuple[str, str]] = []
    for a, b in result.merges:
        merged = a + b
        if a in alive and b in alive and not forbidden(merged):
            kept.append((a, b))
            alive.add(merged)
    base = result.tokens[: len(result.tokens) - len(result.merges)]
    return BpeResult(
        tokens=base + [a + b for a, b in kept],
        merges=kept,
        texts_seen=result.texts_seen,
        chars_seen=result.chars_seen,
    )
