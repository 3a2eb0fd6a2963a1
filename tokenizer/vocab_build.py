"""Assembling the unified vocabulary's `tokenizers.Tokenizer`: specials, image names, pruned BPE text, filler."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, models

from tokenizer.bpe import (
    BYTE_ALPHABET,
    BpeResult,
    byte_level_decoder,
    byte_level_pre_tokenizer,
    prune_tokens,
    train_bpe,
)
from tokenizer.specials import NAMED_SPECIALS, VIDEO_SPECIALS
from tokenizer.token_names import IMAGE_PREFIX, RESERVED, image_token_name, reserved_name
from tokenizer.vocab_layout import text_room


def build_tokenizer(bpe: BpeResult, vocab_size: int, image_codes: int, num_specials: int,
                    video: bool = False) -> Tokenizer:
    """The tokenizer of exactly `vocab_size` ids that build_unified_vocab wraps (its docstring has the rules)."""
    room = text_room(vocab_size, image_codes, num_specials, video)
    reserved = [reserved_name(i) for i in range(num_specials - len(NAMED_SPECIALS))]
    if video:  # the markers take the first two reserved slots; the other slots keep their names
        reserved[: len(VIDEO_SPECIALS)] = VIDEO_SPECIALS
    specials = list(NAMED_SPECIALS) + reserved
    images = [image_token_name(k) for k in range(image_codes)]
    # No text token may look like an image token (transformers finds those by prefix) or a special/filler name.
    taken = set(specials)
    bpe = prune_tokens(
        bpe, lambda t: t.startswith(IMAGE_PREFIX) or t in taken or RESERVED.fullmatch(t) is not None
    )
    text = bpe.tokens[:room]
    merges = bpe.merges[: max(0, len(text) - len(BYTE_ALPHABET))]
    filler: list[str] = []
    next_reserved = num_specials - len(NAMED_SPECIALS)
    while len(text) + len(filler) < room:
        filler.append(reserved_name(next_reserved))
        next_reserved += 1
    names = specials + images + text + filler
    model = models.BPE(vocab={name: i for i, name in enumerate(names)}, merges=merges, ignore_merges=False)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer()
    tokenizer.decoder = byte_level_decoder()
    # Registered as special so transformers treats them as control tokens; ids come from the model vocab.
    # The filler is not registered: it is never produced, and 40k added tokens would slow every load.
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    return tokenizer


def train_text_bpe(texts: Iterable[str], vocab_size: int, image_codes: int, num_specials: int, *,
                   min_frequency: int = 2, show_progress: bool = False, length: int | None = None,
                   video: bool = False) -> BpeResult:
    """The BPE that train_unified_vocab builds from: the text room of the layout, plus a few spare merges."""
    room = text_room(vocab_size, image_codes, num_specials, video)
    # A few spare merges make up for any pruned by prune_reserved.
    return train_bpe(texts, room + 64, min_frequency=min_frequency, show_progress=show_progress, length=length)
