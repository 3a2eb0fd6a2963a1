"""Video clips in the unified vocabulary: the `<bov>` / `<eov>` markers, clip spans, encode/decode, old vocabularies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fusion_model.cli.vocab import main as vocab_main
from tokenizer.specials import BOV, EOV
from tokenizer.vocab import Span, UnifiedVocab, train_unified_vocab

CORPUS = [f"the quick brown fox jumps over the lazy dog {i} times, said the cat" for i in range(60)]
# Fingerprints of vocabularies built from CORPUS before video markers existed (computed on the commit before them):
# a vocabulary built without markers must stay the same, name for name.
FINGERPRINT_16_SPECIALS = "e83346c52dc23b43aad7f1c7bd9e3cde3e6d4524bf4ae1f31a53beb512da6200"
FINGERPRINT_7_SPECIALS = "4856db04cd34c290b03e5b120a951a9ec1bd98106f8271b7f30cc58261bbc1d5"
IMAGE_CODES = 64


@pytest.fixture(scope="module")
def plain() -> UnifiedVocab:
    return train_unified_vocab(CORPUS, vocab_size=600, image_codes=IMAGE_CODES)


@pytest.fixture(scope="module")
def video() -> UnifiedVocab:
    return train_unified_vocab(CORPUS, vocab_size=600, image_codes=IMAGE_CODES, video=True)


def test_without_markers_the_fingerprint_is_the_one_before_video(plain):
    assert plain.fingerprint() == FINGERPRINT_16_SPECIALS
    assert train_unified_vocab(CORPUS, vocab_size=600, image_codes=IMAGE_CODES, num_specials=7).fingerprint() == (
        FINGERPRINT_7_SPECIALS)
    assert plain.bov_id is None and plain.eov_id is None and not plain.has_video
    assert [plain.id_to_token(i) for i in (7, 8)] == ["<reserved_0>", "<reserved_1>"]


def test_markers_take_the_first_two_reserved_slots(video, plain):
    assert video.has_video and (video.bov_id, video.eov_id) == (7, 8)
    assert [video.id_to_token(i) for i in (7, 8, 9, 15)] == [BOV, EOV, "<reserved_2>", "<reserved_8>"]
    # everything else is where it was: same layout, same image block, same text ids
    assert video.layout == plain.layout and video.fingerprint() != plain.fingerprint()
    for i in range(video.vocab_size):
        if i not in (7, 8):
            assert video.id_to_token(i) == plain.id_to_token(i)
    assert video.encode_text("the lazy dog") == plain.encode_text("the lazy dog")
    # typed by a user, the marker names are text
    assert video.bov_id not in video.encode_text("a <bov> and <eov>")


def test_markers_survive_save_and_load(video, plain, tmp_path):
    video.save(tmp_path / "v.json")
    plain.save(tmp_path / "p.json")
    loaded = UnifiedVocab.load(tmp_path / "v.json")
    assert (loaded.bov_id, loaded.eov_id) == (7, 8) and loaded.fingerprint() == video.fingerprint()
    old = UnifiedVocab.load(tmp_path / "p.json")
    assert not old.has_video and old.fingerprint() == FINGERPRINT_16_SPECIALS


def test_a_text_token_spelled_like_a_marker_is_not_a_marker():
    # an old vocabulary whose BPE learned "<bov>" as text (markers were not pruned then): it stays text
    vocab = train_unified_vocab(["<bov> clip <eov> " * 3] * 200, vocab_size=800, image_codes=IMAGE_CODES)
    assert vocab.bov_id is None and not vocab.has_video


def test_too_few_specials_for_the_markers():
    with pytest.raises(ValueError, match="video markers"):
        train_unified_vocab(CORPUS, vocab_size=600, image_codes=IMAGE_CODES, num_specials=8, video=True)
    assert train_unified_vocab(CORPUS, vocab_size=600, image_codes=IMAGE_CODES, num_specials=9,
                               video=True).has_video


def test_mixed_document_round_trips(video):
    clip = torch.arange(2 * 3 * 4).reshape(2, 3, 4) % IMAGE_CODES
    image = torch.full((3, 4), 5)
    ids = video.encode_document(["a caption", clip, "then", image, np.asarray(clip.numpy())[:1]], video_grid=None)
    # <bov>, t*h*w codes in raster order (time, rows, columns), <eov>
    start = ids.index(video.bov_id)
    assert ids[start + 1 : start + 25] == (clip.reshape(-1) + video.image_offset).tolist()
    assert ids[start + 25] == video.eov_id
    kinds = [(s.kind, s.closed) for s in video.spans(ids)]
    assert kinds == [("text", True), ("video", True), ("text", True), ("image", True), ("video", True),
                     ("text", True)]
    back = video.decode_document(ids, grid_shape=(3, 4))
    assert back[0] == "a caption" and torch.equal(back[1], clip) and back[2] == "then"
    assert torch.equal(back[3], image) and torch.equal(back[4], clip[:1]) and back[4].ndim == 3
    # with the recorded video grid, a clip of the wrong size is refused
    with pytest.raises(ValueError, match="2x3x4"):
        video.decode_document(video.encode_document([clip[:1]]), video_grid=(2, 3, 4))
    with pytest.raises(ValueError, match=r"expected grid is \(2, 3, 4\)"):
        video.encode_document([clip[:1]], video_grid=(2, 3, 4))


def test_span_properties(video):
    ids = video.encode_document([torch.zeros(1, 1, 2, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)],
                                bos=False, eos=False)
    clip, image = video.spans(ids)
    assert clip.is_video and clip.is_visual and not clip.is_image and ids[clip.body] == [video.image_offset] * 2
    assert image.is_image and image.is_visual and not image.is_video
    assert not Span("text", 0, 1).is_visual


def test_unfinished_clip_comes_back_flat(video):
    ids = video.encode_document(["x"], eos=False) + [video.bov_id] + [video.image_offset + 3] * 5
    *_, last = video.spans(ids)
    assert last == Span("video", len(ids) - 6, len(ids), closed=False) and last.body == slice(len(ids) - 5, len(ids))
    segments = video.decode_document(ids, video_grid=(2, 2, 2))
    assert segments[-1].tolist() == [3] * 5


def test_markers_of_the_other_kind_stay_inside_and_are_refused(video):
    code = video.image_offset
    # a clip cut short by <boi>, an image cut short by <bov>
    ids = [video.bov_id, code, video.boi_id, code, video.eoi_id]
    assert [(s.kind, s.closed) for s in video.spans(ids)] == [("video", False), ("image", True)]
    ids = [video.boi_id, code, video.bov_id, code, video.eov_id]
    assert [(s.kind, s.closed) for s in video.spans(ids)] == [("image", False), ("video", True)]
    # <eoi> inside a clip is part of the clip, and not an image code
    with pytest.raises(ValueError, match="inside a clip"):
        video.decode_document([video.bov_id, code, video.eoi_id, code, video.eov_id])
    with pytest.raises(ValueError, match="<eov>.*no matching <bov>"):
        video.decode_document([code - code + video.text_offset, video.eov_id])


def test_a_vocabulary_without_markers_refuses_clips(plain):
    clip = torch.zeros(2, 2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"no video markers.*train\.py vocab --video"):
        plain.encode_document(["a clip", clip])
    # and its spans never see a clip (the reserved ids are just specials)
    assert all(not s.is_video for s in plain.spans([7, plain.image_offset, 8]))


def test_cli_video_flag(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(CORPUS), encoding="utf-8")
    args = ["--corpus", str(corpus), "--vocab-size", "600", "--image-codes", str(IMAGE_CODES), "--no-progress"]
    assert vocab_main([*args, "--out", str(tmp_path / "plain.json")]) == 0
    assert "video markers" not in capsys.readouterr().out
    assert vocab_main([*args, "--out", str(tmp_path / "video.json"), "--video"]) == 0
    assert "video markers: <bov> id 7, <eov> id 8" in capsys.readouterr().out
    assert UnifiedVocab.load(tmp_path / "video.json").has_video
    assert not UnifiedVocab.load(tmp_path / "plain.json").has_video


_VOCAB: list[UnifiedVocab] = []


def _shared() -> UnifiedVocab:
    if not _VOCAB:
        _VOCAB.append(train_unified_vocab(CORPUS, vocab_size=600, image_codes=IMAGE_CODES, video=True))
    return _VOCAB[0]


def _grids(dims: int) -> st.SearchStrategy:
    shape = st.tuples(*[st.integers(1, 3)] * dims)
    return shape.flatmap(lambda s: arrays("int64", s, elements=st.integers(0, IMAGE_CODES - 1)).map(torch.from_numpy))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.sampled_from(["a", "dog", "cat 1"]), _grids(2), _grids(3)), max_size=6))
def test_any_mix_of_text_images_and_clips_has_one_span_per_segment(segments):
    vocab = _shared()
    ids = vocab.encode_document(segments, bos=False, eos=False)
    visual = [s for s in vocab.spans(ids) if s.is_visual]
    grids = [g for g in segments if not isinstance(g, str)]
    assert [s.kind for s in visual] == ["video" if g.ndim == 3 else "image" for g in grids]
    assert all(s.closed for s in visual)
    for span, grid in zip(visual, grids):
        assert ids[span.body] == (grid.reshape(-1) + vocab.image_offset).tolist()
    decoded = [d for d in vocab.decode_document(ids) if not isinstance(d, str)]
    assert [d.reshape(-1).tolist() for d in decoded] == [g.reshape(-1).tolist() for g in grids]
