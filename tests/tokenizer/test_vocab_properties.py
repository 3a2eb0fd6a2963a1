"""Property tests (hypothesis): any text and any mix of text and image grids round-trips through the vocabulary."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tokenizer.vocab import UnifiedVocab, train_unified_vocab

IMAGE_CODES = 300
PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

_VOCAB: list[UnifiedVocab] = []


def small_vocab() -> UnifiedVocab:
    """One small vocabulary shared by every example (training it takes milliseconds, but not per example)."""
    if not _VOCAB:
        corpus = ["a small corpus with some words, some numbers 42 and ünïcödé 😀 text"] * 30
        _VOCAB.append(train_unified_vocab(corpus, vocab_size=900, image_codes=IMAGE_CODES))
    return _VOCAB[0]


def grids(shape: tuple[int, int] | None = None) -> st.SearchStrategy:
    """Integer code grids of a fixed shape, or of any small shape."""
    shapes = st.just(shape) if shape else st.tuples(st.integers(1, 5), st.integers(1, 5))
    return shapes.flatmap(
        lambda s: arrays("int64", s, elements=st.integers(0, IMAGE_CODES - 1)).map(torch.from_numpy)
    )


def normalise(segments: list) -> list:
    """What decoding can give back: adjacent texts joined, empty texts gone (they have no ids)."""
    out: list = []
    for segment in segments:
        if isinstance(segment, str):
            if not segment:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += segment
                continue
        out.append(segment)
    return out


@PROPERTY_SETTINGS
@given(st.text())
def test_any_text_round_trips(text):
    vocab = small_vocab()
    ids = vocab.encode_text(text)
    assert vocab.decode_text(ids) == text
    assert all(vocab.text_offset <= i < vocab.layout.text_end for i in ids)


@PROPERTY_SETTINGS
@given(st.lists(st.one_of(st.text(max_size=40), grids((3, 4))), max_size=6), st.booleans(), st.booleans())
def test_documents_round_trip_with_a_known_grid_shape(segments, bos, eos):
    vocab = small_vocab()
    ids = vocab.encode_document(segments, bos=bos, eos=eos)
    decoded = vocab.decode_document(ids, grid_shape=(3, 4))
    expected = normalise(segments)
    assert len(decoded) == len(expected)
    for got, want in zip(decoded, expected):
        if isinstance(want, str):
            assert got == want
        else:
            assert torch.equal(got, want)


@PROPERTY_SETTINGS
@given(st.lists(st.one_of(st.text(max_size=20), grids()), max_size=6))
def test_documents_of_any_grid_shape_keep_codes_and_masks_count_them(segments):
    vocab = small_vocab()
    ids = torch.tensor(vocab.encode_document(segments), dtype=torch.long)
    images = [s for s in segments if not isinstance(s, str)]
    assert int(vocab.is_image(ids).sum()) == sum(g.numel() for g in images)
    assert int(vocab.is_special(ids).sum()) == 2 + 2 * len(
        images
    )  # <s> </s> and a <boi>/<eoi> pair per image
    decoded_images = [s for s in vocab.decode_document(ids) if not isinstance(s, str)]
    assert [d.flatten().tolist() for d in decoded_images] == [g.flatten().tolist() for g in images]
    assert vocab.image_codes_of(ids[vocab.is_image(ids)]).tolist() == [
        c for g in images for c in g.flatten().tolist()
    ]


@PROPERTY_SETTINGS
@given(st.lists(st.text(max_size=30), max_size=8))
def test_batch_encoding_matches_one_at_a_time(texts):
    vocab = small_vocab()
    assert vocab.encode_text_batch(texts) == [vocab.encode_text(t) for t in texts]


@pytest.mark.parametrize("bad", ["\ud800", "ok \udfff"])
def test_lone_surrogates_are_rejected_with_a_clear_error(bad):
    with pytest.raises(ValueError, match="surrogate"):
        small_vocab().encode_text(bad)
    with pytest.raises(ValueError, match="surrogate"):
        small_vocab().encode_text_batch(["fine", bad])
