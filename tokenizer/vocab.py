"""The unified early-fusion vocabulary: special tokens, then one image-code block, then byte-level BPE text.

One `tokenizer.json` holds it all; the layout is read back from the token names (Chameleon's naming). This module
holds the vocabulary (UnifiedVocab) and its constructors; the token names, the document parts, the layout and the
tokenizer's assembly live in token_names, spans, vocab_layout and vocab_build, and are importable from here too.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from common.files import atomic_path
from tokenizer.bpe import BpeResult
from tokenizer.layout import image_code_mask
from tokenizer.spans import LatentImage, Segment, Span, clip_of, find_spans, grid_of
from tokenizer.specials import (
    BOI,
    BOS,
    BOV,
    DEFAULT_IMAGE_CODES,
    DEFAULT_NUM_SPECIALS,
    DEFAULT_VOCAB_SIZE,
    EOI,
    EOS,
    EOV,
    IMAGE_PLACEHOLDER,
    NAMED_SPECIALS,
    PAD,
    SEP,
    VIDEO_SPECIALS,
)
from tokenizer.token_names import IMAGE_PREFIX, image_code_of_name, image_token_name, reserved_name
from tokenizer.token_names import RESERVED as _RESERVED  # noqa: F401 - importable here as before the split
from tokenizer.vocab_build import build_tokenizer, train_text_bpe
from tokenizer.vocab_layout import VocabLayout
from tokenizer.vocab_layout import read_layout as _read_layout
from tokenizer.vocab_layout import text_room as _text_room  # noqa: F401 - importable here as before the split

__all__ = [
    "BOI", "BOS", "BOV", "DEFAULT_IMAGE_CODES", "DEFAULT_NUM_SPECIALS", "DEFAULT_VOCAB_SIZE", "EOI", "EOS", "EOV",
    "IMAGE_PLACEHOLDER", "IMAGE_PREFIX", "NAMED_SPECIALS", "NO_VIDEO_MARKERS", "PAD", "SEP", "VIDEO_SPECIALS",
    "LatentImage", "Segment", "Span", "UnifiedVocab", "VocabLayout", "build_unified_vocab", "image_code_of_name",
    "image_token_name", "reserved_name", "text_mode_mask", "train_unified_vocab",
]

NO_VIDEO_MARKERS = (
    f"this vocabulary has no video markers ({BOV}/{EOV}): it was built without video; to use clips, rebuild it with "
    "`train.py vocab --video --media-tokenizer VIDEO_BUNDLE --corpus TEXT --out tokenizer.json` (the video "
    "tokenizer's codebook gives the image codes) and tokenize the shards again with it"
)


def text_mode_mask(vocab: object) -> torch.Tensor:
    """(vocab_size,) bool: the ids text mode may emit — text ids, `</s>` and `<sep>` (no image id, no other special).

    The one definition of that rule: the sampler masks with it, and a transformers export suppresses the rest.
    """
    all_ids = torch.arange(int(vocab.vocab_size))
    allowed = vocab.is_text(all_ids) & ~vocab.is_image(all_ids)
    allowed[vocab.eos_id] = True
    sep = getattr(vocab, "sep_id", None)
    if sep is not None:  # the separator / end-of-turn is text-mode punctuation for chat-style documents
        allowed[sep] = True
    return allowed


class UnifiedVocab:
    """One id space for text and image codes, wrapping a `tokenizers.Tokenizer` (see docs/architecture.md)."""

    def __init__(self, tokenizer: Tokenizer, source: str = "<memory>"):
        self.tokenizer = tokenizer
        # Special-token strings typed by a user ("<s>", "<image>") are text, never control ids.
        self.tokenizer.encode_special_tokens = True
        self.layout = _read_layout(tokenizer, source)
        self.source = source
        self._fingerprint: str | None = None
        ids = {name: tokenizer.token_to_id(name) for name in NAMED_SPECIALS}
        self.pad_id, self.bos_id, self.eos_id = ids[PAD], ids[BOS], ids[EOS]
        self.boi_id, self.eoi_id, self.sep_id = ids[BOI], ids[EOI], ids[SEP]
        self.image_placeholder_id = ids[IMAGE_PLACEHOLDER]
        # the video markers: specials (before the image block) of a vocabulary built with video, else None (a text
        # token that happens to spell "<bov>" in an older vocabulary is text, not a marker)
        markers = [tokenizer.token_to_id(name) for name in VIDEO_SPECIALS]
        if all(i is not None and i < self.layout.image_offset for i in markers):
            self.bov_id, self.eov_id = markers
        else:
            self.bov_id = self.eov_id = None

    # ----- layout -------------------------------------------------------------------------------
    vocab_size = property(lambda self: self.layout.vocab_size, doc="Total number of ids.")
    image_codes = property(lambda self: self.layout.image_codes, doc="Size of the image codebook.")
    image_offset = property(lambda self: self.layout.image_offset, doc="Id of image code 0.")
    text_offset = property(lambda self: self.layout.text_offset, doc="Id of the first text token.")

    @property
    def has_video(self) -> bool:
        """Whether the vocabulary has the video markers `<bov>` / `<eov>` (built with `train.py vocab --video`)."""
        return self.bov_id is not None

    def __len__(self) -> int:
        return self.layout.vocab_size

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"UnifiedVocab(vocab_size={lay.vocab_size}, specials={lay.image_offset}, image_codes={lay.image_codes}, "
            f"text={lay.num_text_tokens}, filler={lay.num_filler}{', video' if self.has_video else ''})"
        )

    def image_id(self, code: int) -> int:
        """Id of image code `code`."""
        if not 0 <= int(code) < self.image_codes:
            raise ValueError(
                f"image code {int(code)} is outside [0, {self.image_codes}); codes come from a codebook of that size"
            )
        return self.image_offset + int(code)

    def token_to_id(self, name: str) -> int | None:
        """Id of a token by its name (None when absent)."""
        return self.tokenizer.token_to_id(name)

    def id_to_token(self, token_id: int) -> str:
        """Name of a token id."""
        self._check_ids([token_id])
        return self.tokenizer.id_to_token(int(token_id))

    # ----- text ---------------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """Byte-level BPE ids of `text` (no bos/eos); round-trips exactly through decode_text."""
        if not isinstance(text, str):
            raise TypeError(f"encode_text takes a str, got {type(text).__name__}")
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        except Exception as error:  # lone surrogates cannot be turned into UTF-8 bytes
            raise ValueError(
                f"text cannot be encoded as UTF-8 ({error}); remove lone surrogate characters"
            ) from error

    def encode_text_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """encode_text over many strings at once (uses the tokenizers thread pool)."""
        texts = list(texts)
        for index, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"encode_text_batch: item {index} is a {type(text).__name__}, not str")
        try:
            return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        except Exception:  # find the offending text for a precise message
            return [self.encode_text(text) for text in texts]

    def decode_text(self, ids: Iterable[int] | torch.Tensor, skip_special: bool = False) -> str:
        """Text of text ids; other ids show as their names (`<sep>`, `IMGIMGBZ`), or are dropped with skip_special."""
        ids = self._as_list(ids)
        self._check_ids(ids)
        lay = self.layout
        if skip_special:
            ids = [i for i in ids if lay.text_offset <= i < lay.text_end]
        if all(lay.text_offset <= i < lay.text_end for i in ids):
            return self.tokenizer.decode(ids, skip_special_tokens=False)
        # Decode each run of text ids on its own so a name never merges into a neighbouring multi-byte character.
        pieces: list[str] = []
        run: list[int] = []
        for i in ids:
            if lay.text_offset <= i < lay.text_end:
                run.append(i)
                continue
            if run:
                pieces.append(self.tokenizer.decode(run, skip_special_tokens=False))
                run = []
            pieces.append(self.tokenizer.id_to_token(i))
        if run:
            pieces.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return "".join(pieces)

    # ----- documents ----------------------------------------------------------------------------
    def encode_document(
        self,
        segments: Sequence[object],
        bos: bool = True,
        eos: bool = True,
        grid_shape: tuple[int, int] | None = None,
        video_grid: tuple[int, int, int] | None = None,
    ) -> list[int]:
        """`<s> text <boi> codes (raster order) <eoi> ... </s>` for segments that are str or 2-D code grids (or
        `LatentImage`: `<boi>`, its `<image>` placeholders, `<eoi>`).

        A 3-D integer grid (t, h, w) is a video clip: `<bov>`, its t*h*w codes in raster order (time, then rows,
        then columns; ids of the image-code block), `<eov>`. Only a vocabulary with video markers (`has_video`)
        takes clips. The shape is not in the ids: it is recorded beside them (the token shards' manifest field
        `video_grid` [t, h, w], Emu3's meta) and passed back to `decode_document`. grid_shape / video_grid, when
        given, are the shapes every image / clip must have.
        """
        if isinstance(segments, (str, bytes)):
            raise TypeError("encode_document takes a list of segments; wrap a single text as [text]")
        ids = [self.bos_id] if bos else []
        for index, segment in enumerate(segments):
            if isinstance(segment, str):
                ids += self.encode_text(segment)
            elif isinstance(segment, LatentImage):
                if segment.patches < 1:
                    raise ValueError(f"segment {index}: a continuous image needs at least one patch")
                ids += [self.boi_id, *[self.image_placeholder_id] * segment.patches, self.eoi_id]
            elif getattr(segment, "ndim", None) == 3:
                if not self.has_video:
                    raise ValueError(f"segment {index} is a video clip (a 3-D code grid), but {NO_VIDEO_MARKERS}")
                codes = self._grid_codes(segment, index, video_grid, dims=3)
                ids.append(self.bov_id)
                ids += (codes + self.image_offset).tolist()
                ids.append(self.eov_id)
            else:
                codes = self._grid_codes(segment, index, grid_shape)
                ids.append(self.boi_id)
                ids += (codes + self.image_offset).tolist()
                ids.append(self.eoi_id)
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode_document(
        self,
        ids: Iterable[int] | torch.Tensor,
        grid_shape: tuple[int, int] | None = None,
        video_grid: tuple[int, int, int] | None = None,
    ) -> list[str | torch.Tensor]:
        """Segments of an id sequence: text strings and LongTensor code grids (pad/bos/eos dropped).

        Images become `grid_shape` grids, or square grids when it is None (1-D when the count is not square);
        an unfinished image at the end (no `<eoi>`) comes back 1-D. Clips (`<bov>` ... `<eov>`) become
        (t, h, w) grids: `video_grid` when given (the count must match), else (count / (h*w), h, w) when
        grid_shape (h, w) is given and divides the count, else 1-D; an unfinished clip comes back 1-D. Other
        specials (separator, placeholder, reserved) appear by name inside the text.
        """
        if isinstance(ids, (torch.Tensor, np.ndarray)) and ids.ndim != 1:
            raise ValueError(
                f"decode_document takes one 1-D sequence, got shape {tuple(ids.shape)}; loop over the rows"
            )
        ids = self._as_list(ids)
        self._check_ids(ids)
        lay = self.layout
        segments: list[str | torch.Tensor] = []
        for span in self.spans(ids):
            if not span.is_visual:
                text = []  # text ids and specials shown by name
                for position in range(span.start, span.end):
                    i = ids[position]
                    if i in (self.pad_id, self.bos_id, self.eos_id):
                        continue
                    if lay.image_offset <= i < lay.text_offset:
                        raise ValueError(f"image id {i} at position {position} is outside <boi> ... <eoi>")
                    if i == self.eoi_id:
                        raise ValueError(f"<eoi> (id {i}) at position {position} has no matching <boi>")
                    if self.eov_id is not None and i == self.eov_id:
                        raise ValueError(f"<eov> (id {i}) at position {position} has no matching <bov>")
                    text.append(i)
                if text:
                    segments.append(self.decode_text(text))
                continue
            # an image cut short by the next <boi> fails at that <boi>; one cut by the end is kept, 1-D
            stop = span.body.stop if span.closed or span.end == len(ids) else span.end + 1
            where = "a clip (after <bov>, before <eov>)" if span.is_video else "an image (after <boi>, before <eoi>)"
            for position in range(span.body.start, stop):
                i = ids[position]
                if not lay.image_offset <= i < lay.text_offset:
                    raise ValueError(
                        f"id {i} ({self.tokenizer.id_to_token(i)!r}) at position {position} is inside {where} "
                        f"but is not an image code"
                    )
            codes = [i - lay.image_offset for i in ids[span.body]]
            if span.closed and span.is_video:
                segments.append(clip_of(codes, video_grid, grid_shape, span.end - 1))
            elif span.closed:
                segments.append(grid_of(codes, grid_shape, span.end - 1))
            else:  # generation stopped inside an image or a clip
                segments.append(torch.tensor(codes, dtype=torch.long))
        return segments

    def spans(self, ids: Iterable[int] | torch.Tensor) -> list[Span]:
        """The document structure of an id sequence: its text runs, `<boi>` ... `<eoi>` images and (in a
        vocabulary with video markers) `<bov>` ... `<eov>` clips, in order.

        The one parser of documents; it never raises. Everything between `<boi>` and the next `<eoi>` belongs
        to the image, and everything between `<bov>` and the next `<eov>` to the clip (callers check that it is
        image codes). An image or clip is open (closed=False) when the sequence ends first or when another
        `<boi>` or `<bov>` comes first (that marker starts the next one). An end marker outside its kind of span
        (`<eoi>` in text or in a clip, `<eov>` in text or in an image) is part of the run around it.
        """
        return find_spans(self._as_list(ids), self.boi_id, self.eoi_id, self.bov_id, self.eov_id)

    # ----- masks --------------------------------------------------------------------------------
    def is_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Boolean mask of text ids (learned BPE tokens), any shape."""
        ids = torch.as_tensor(ids)
        return (ids >= self.layout.text_offset) & (ids < self.layout.text_end)

    def is_image(self, ids: torch.Tensor) -> torch.Tensor:
        """Boolean mask of image-code ids, any shape."""
        ids = torch.as_tensor(ids)
        return image_code_mask(ids, self.layout.image_offset, self.layout.image_codes)

    def is_special(self, ids: torch.Tensor) -> torch.Tensor:
        """Boolean mask of everything else: specials, reserved filler (and out-of-range ids)."""
        return ~(self.is_text(ids) | self.is_image(ids))

    def image_codes_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Image codes of image ids (ids that are not image ids give -1)."""
        ids = torch.as_tensor(ids)
        return torch.where(self.is_image(ids), ids - self.layout.image_offset, torch.full_like(ids, -1))

    # ----- files --------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A stable sha256 (hex) of the whole vocabulary: token names in id order, merges and layout."""
        if self._fingerprint is None:
            model = json.loads(self.tokenizer.to_str())["model"]
            body = {
                "layout": asdict(self.layout),
                "tokens": [self.tokenizer.id_to_token(i) for i in range(self.vocab_size)],
                "merges": [list(m) if isinstance(m, list) else m.split(" ", 1) for m in model["merges"]],
                "pre_tokenizer": "byte_level_gpt2",
            }
            self._fingerprint = hashlib.sha256(json.dumps(body, ensure_ascii=False).encode()).hexdigest()
        return self._fingerprint

    def save(self, path: str | os.PathLike) -> Path:
        """Write one tokenizer.json atomically; returns the path."""
        path = Path(path)
        with atomic_path(path) as tmp:
            self.tokenizer.save(str(tmp), pretty=True)
        return path

    def to_transformers(self):
        """A transformers `PreTrainedTokenizerFast` (bos/eos/pad/sep set, `<s>` prepended, the chat template of
        tokenizer.chat) for ChameleonProcessor."""
        from tokenizers import processors
        from transformers import PreTrainedTokenizerFast

        from tokenizer.chat import CHAT_TEMPLATE

        tokenizer = Tokenizer.from_str(self.tokenizer.to_str())
        # Chameleon's tokenizer starts every prompt with <s>; ours adds it in encode_document instead.
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, self.bos_id)]
        )
        # the template rides on the tokenizer: a processor's own chat_template is dropped on reload (transformers 5)
        return PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, sep_token=SEP,
            chat_template=CHAT_TEMPLATE,
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        expected_vocab_size: int | None = None,
        expected_image_codes: int | None = None,
    ) -> UnifiedVocab:
        """Load a tokenizer.json and check its layout against the configured sizes (when given)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"no vocabulary at {path}; train one with `python train.py vocab --out {path}`"
            )
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:
            raise ValueError(
                f"{path} is not a valid tokenizer.json ({error}); retrain it with `python train.py vocab`"
            ) from error
        vocab = cls(tokenizer, source=str(path))
        for name, expected, actual in (
            ("vocab_size", expected_vocab_size, vocab.vocab_size),
            ("image_codes", expected_image_codes, vocab.image_codes),
        ):
            if expected is not None and expected != actual:
                raise ValueError(
                    f"{path} has {name}={actual} but the configuration expects {name}={expected}; "
                    f"use a vocabulary trained with {name}={expected} or change the configuration to {actual}"
                )
        return vocab

    # ----- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _as_list(ids: Iterable[int] | torch.Tensor) -> list[int]:
        if isinstance(ids, (torch.Tensor, np.ndarray)):
            return [int(i) for i in ids.reshape(-1).tolist()]
        return [int(i) for i in ids]

    def _check_ids(self, ids: Sequence[int]) -> None:
        for position, i in enumerate(ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"id {i} at position {position} is outside the vocabulary [0, {self.vocab_size}); "
                    "was it produced with a different (larger) vocabulary or model head?"
                )

    def _grid_codes(self, segment: object, index: int, grid_shape: tuple[int, ...] | None, dims: int = 2
                    ) -> np.ndarray:
        """Validate an image grid (dims 2: h, w) or a clip (dims 3: t, h, w); its codes flattened in raster order."""
        if isinstance(segment, torch.Tensor):
            grid = segment.detach().cpu().numpy()
        elif isinstance(segment, np.ndarray):
            grid = segment
        else:
            raise TypeError(
                f"segment {index} is a {type(segment).__name__}; segments are str or 2-D integer grids"
            )
        what = "video clip segment" if dims == 3 else "image segment"
        if grid.ndim != dims or grid.size == 0:
            raise ValueError(
                f"image segment {index} has shape {tuple(grid.shape)}; an image is a non-empty 2-D (h, w) grid of codes"
                + (" and a video clip a non-empty 3-D (t, h, w) one" if self.has_video else "")
            )
        if grid.dtype == np.bool_ or not np.issubdtype(grid.dtype, np.integer):
            raise ValueError(
                f"{what} {index} has dtype {grid.dtype}; codes must be integers (e.g. torch.long)"
            )
        if grid_shape is not None and tuple(grid.shape) != tuple(grid_shape):
            raise ValueError(
                f"{what} {index} has shape {tuple(grid.shape)} but the expected grid is {tuple(grid_shape)}"
            )
        low, high = int(grid.min()), int(grid.max())
        if low < 0 or high >= self.image_codes:
            bad = low if low < 0 else high
            raise ValueError(
                f"{what} {index} has code {bad} outside [0, {self.image_codes}); "
                "the image tokenizer's codebook must not be larger than the vocabulary's image_codes"
            )
        return grid.astype(np.int64).reshape(-1)


def build_unified_vocab(
    bpe: BpeResult,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    image_codes: int = DEFAULT_IMAGE_CODES,
    num_specials: int = DEFAULT_NUM_SPECIALS,
    video: bool = False,
) -> UnifiedVocab:
    """Merge a trained BPE with the specials and the image block into exactly `vocab_size` ids.

    video: name the first two reserved slots `<bov>` / `<eov>` (video clip markers; ids 7 and 8 with the default
    specials) instead of `<reserved_0>` / `<reserved_1>`. Off by default: without it the vocabulary is the one
    built before video existed, name for name (same fingerprint).
    """
    return UnifiedVocab(build_tokenizer(bpe, vocab_size, image_codes, num_specials, video))


def train_unified_vocab(
    texts: Iterable[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    image_codes: int = DEFAULT_IMAGE_CODES,
    *,
    num_specials: int = DEFAULT_NUM_SPECIALS,
    min_frequency: int = 2,
    show_progress: bool = False,
    length: int | None = None,
    video: bool = False,
) -> UnifiedVocab:
    """Train BPE on `texts` and build the unified vocabulary; small sizes (a few hundred ids) work for tests.

    video: give the vocabulary the clip markers `<bov>` / `<eov>` (build_unified_vocab)."""
    bpe = train_text_bpe(texts, vocab_size, image_codes, num_specials, min_frequency=min_frequency,
                         show_progress=show_progress, length=length, video=video)
    return build_unified_vocab(bpe, vocab_size, image_codes, num_specials, video=video)
