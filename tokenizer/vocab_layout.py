"""Where each id range of the unified vocabulary lives (VocabLayout): sized before a build, read back after one."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from tokenizer.bpe import BYTE_ALPHABET
from tokenizer.specials import NAMED_SPECIALS, VIDEO_SPECIALS
from tokenizer.token_names import IMAGE_PREFIX, RESERVED, image_token_name


@dataclass(frozen=True)
class VocabLayout:
    """Where each range lives: [0, image_offset) specials, image block, [text_offset, text_end) BPE, then filler."""

    vocab_size: int
    image_codes: int
    image_offset: int
    text_offset: int
    text_end: int

    @property
    def num_text_tokens(self) -> int:
        """Learned text tokens (256 bytes + merges)."""
        return self.text_end - self.text_offset

    @property
    def num_filler(self) -> int:
        """`<reserved_N>` tokens appended because BPE stopped before filling the text range."""
        return self.vocab_size - self.text_end


def text_room(vocab_size: int, image_codes: int, num_specials: int, video: bool = False) -> int:
    """Ids left for text; errors (with the shortfall) when not even the 256 byte tokens fit."""
    if num_specials < len(NAMED_SPECIALS):
        raise ValueError(
            f"num_specials={num_specials} cannot hold the {len(NAMED_SPECIALS)} named specials {NAMED_SPECIALS}"
        )
    if video and num_specials < len(NAMED_SPECIALS) + len(VIDEO_SPECIALS):
        raise ValueError(
            f"num_specials={num_specials} cannot hold the {len(NAMED_SPECIALS)} named specials and the video markers "
            f"{VIDEO_SPECIALS}: use at least {len(NAMED_SPECIALS) + len(VIDEO_SPECIALS)}"
        )
    if image_codes < 1:
        raise ValueError(f"image_codes must be at least 1, got {image_codes}")
    room = vocab_size - num_specials - image_codes
    if room < len(BYTE_ALPHABET):
        short = len(BYTE_ALPHABET) - room
        raise ValueError(
            f"vocab_size={vocab_size} leaves {room} ids for text after {num_specials} specials and {image_codes} image "
            f"codes, but byte-level BPE needs at least {len(BYTE_ALPHABET)}: {short} short; raise vocab_size to "
            f"{vocab_size + short} or lower image_codes to {image_codes - short}"
        )
    return room


def read_layout(tokenizer: Tokenizer, source: str) -> VocabLayout:
    """Recover and check the layout from token names: specials, contiguous IMGIMG block, text, filler."""
    by_name = tokenizer.get_vocab(with_added_tokens=True)
    size = len(by_name)
    names = sorted(by_name, key=by_name.__getitem__)
    if [by_name[name] for name in names] != list(range(size)):
        raise ValueError(
            f"{source}: token ids are not contiguous 0..{size - 1}; this is not a unified vocabulary"
        )
    missing = [name for name in NAMED_SPECIALS if tokenizer.token_to_id(name) is None]
    if missing:
        raise ValueError(
            f"{source}: missing special tokens {missing}; it was not made by `python train.py vocab`"
        )
    image_ids = [i for i, name in enumerate(names) if name.startswith(IMAGE_PREFIX)]
    if not image_ids:
        raise ValueError(f"{source}: has no {IMAGE_PREFIX}* image tokens; it is not a unified vocabulary")
    offset, codes = image_ids[0], len(image_ids)
    for code, i in enumerate(image_ids):
        if i != offset + code or names[i] != image_token_name(code):
            raise ValueError(
                f"{source}: image token {names[i]!r} at id {i} breaks the contiguous image block at code {code}"
            )
    if max(tokenizer.token_to_id(name) for name in NAMED_SPECIALS) >= offset:
        raise ValueError(f"{source}: special tokens must come before the image block (id {offset})")
    markers = [tokenizer.token_to_id(name) for name in VIDEO_SPECIALS]
    if sum(i is not None and i < offset for i in markers) == 1:
        raise ValueError(f"{source}: has one of the video markers {VIDEO_SPECIALS} among its specials but not the "
                         "other; rebuild it with `train.py vocab --video`")
    text_offset = offset + codes
    # BPE never learns a <reserved_N> name (build_unified_vocab prunes them), so the trailing run of them is filler.
    text_end = size
    while text_end > text_offset and RESERVED.fullmatch(names[text_end - 1]):
        text_end -= 1
    return VocabLayout(
        vocab_size=size, image_codes=codes, image_offset=offset, text_offset=text_offset, text_end=text_end
    )
