"""The unified vocabulary: layout, Chameleon names, text and document encoding, masks, files, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from tokenizer.vocab import (
    BOI,
    BOS,
    EOI,
    EOS,
    IMAGE_PLACEHOLDER,
    PAD,
    SEP,
    Span,
    UnifiedVocab,
    image_code_of_name,
    image_token_name,
    train_unified_vocab,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A picture of a cat sitting on a mat, drawn in pencil.",
    "Numbers like 123 and 4567 appear in captions, too.",
    "In the beginning was the word, and the word was written twice.",
] * 20

SAMPLES = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "emoji 🙂👍🏽 and flags 🇫🇷",
    "中文字符 日本語 한국어",
    "combining e\u0301 vs é, a\u0308\u0301",
    "control \x00\x01\x1b[31m \r\n\t\x7f",
    "specials as text: <s> </s> <pad> <racm3:break> <eoss> <image> <sep> <reserved_3> IMGIMGBZ IMGIMGAZ",
]


@pytest.fixture(scope="module")
def vocab() -> UnifiedVocab:
    return train_unified_vocab(CORPUS, vocab_size=1024, image_codes=512)


def test_layout_is_specials_then_image_block_then_text(vocab):
    lay = vocab.layout
    assert len(vocab) == vocab.vocab_size == 1024 == vocab.tokenizer.get_vocab_size()
    assert [vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.boi_id, vocab.eoi_id] == [0, 1, 2, 3, 4]
    assert vocab.image_offset == 16 and vocab.image_codes == 512 and vocab.text_offset == 16 + 512
    assert lay.text_offset + lay.num_text_tokens + lay.num_filler == 1024
    names = {vocab.id_to_token(i) for i in range(vocab.image_offset)}
    assert {PAD, BOS, EOS, BOI, EOI, SEP, IMAGE_PLACEHOLDER} <= names
    # ids past the learned text tokens are <reserved_N> filler: the size is exact even when BPE stops early
    assert lay.num_filler > 0
    assert all(vocab.id_to_token(i).startswith("<reserved_") for i in range(lay.text_end, 1024))


def test_image_tokens_have_chameleon_names(vocab):
    assert image_token_name(0) == "IMGIMGAZ"
    assert image_token_name(123) == "IMGIMGBCDZ"
    assert image_token_name(8191) == "IMGIMGIBJBZ"
    for code in (0, 7, 123, 511):
        assert vocab.id_to_token(vocab.image_id(code)) == image_token_name(code)
        assert vocab.image_id(code) == vocab.image_offset + code


def test_image_names_parse_back_to_their_codes_and_nothing_else_does():
    for code in (0, 9, 10, 123, 8191):
        assert image_code_of_name(image_token_name(code)) == code
    for name in ("IMGIMGZ", "IMGIMGBQ", "IMGIMGABZ", "IMGIMGbZ", "IMGIMGKZ", "xIMGIMGBZ", "IMGIMGBZ ", "<s>"):
        assert image_code_of_name(name) is None, name


def test_transformers_chameleon_mapping_finds_our_image_tokens(vocab, tmp_path):
    from transformers.models.chameleon.modeling_chameleon import ChameleonImageVocabularyMapping

    path = vocab.save(tmp_path / "tokenizer.json")
    mapping = ChameleonImageVocabularyMapping(Tokenizer.from_file(str(path)).get_vocab())
    assert mapping.image_token_id == vocab.image_placeholder_id
    assert mapping.image_tokens == list(range(vocab.image_offset, vocab.text_offset))
    codes = torch.tensor([[0, 5, 123, 511]])
    expected = torch.tensor([[vocab.image_id(c) for c in codes[0].tolist()]], dtype=torch.int)
    torch.testing.assert_close(mapping.convert_img2bpe(codes), expected)
    assert all(mapping.bpe2img[vocab.image_id(c)] == c for c in range(512))


@pytest.mark.parametrize("text", SAMPLES)
def test_text_round_trips_exactly(vocab, text):
    ids = vocab.encode_text(text)
    assert vocab.decode_text(ids) == text
    assert vocab.is_text(torch.tensor(ids, dtype=torch.long)).all()


def test_literal_special_and_image_names_in_text_stay_text(vocab):
    for literal in [
        "<s>",
        "</s>",
        "<pad>",
        "<racm3:break>",
        "<eoss>",
        "<image>",
        "<sep>",
        "IMGIMGBZ",
        "IMGIMGAZ",
    ]:
        ids = vocab.encode_text(literal)
        assert len(ids) > 1, literal
        assert vocab.is_text(torch.tensor(ids)).all(), literal


def test_bpe_never_learns_image_or_special_names():
    # A corpus full of image-token names: BPE would learn "IMGIMGBZ" as one token; it must stay text.
    vocab = train_unified_vocab(["IMGIMGBZ IMGIMGAZ <s> hello"] * 200, vocab_size=1024, image_codes=512)
    text_names = [vocab.id_to_token(i) for i in range(vocab.text_offset, vocab.layout.text_end)]
    assert not [name for name in text_names if name.startswith("IMGIMG")]
    ids = vocab.encode_text("IMGIMGBZ")
    assert vocab.is_text(torch.tensor(ids)).all() and vocab.decode_text(ids) == "IMGIMGBZ"


def test_one_megabyte_string_round_trips(vocab):
    text = ("lorem ipsum 🙂 dolor\n" * 60_000)[:1_000_000]
    assert vocab.decode_text(vocab.encode_text(text)) == text


def test_document_layout(vocab):
    grid = torch.arange(6).reshape(2, 3)
    ids = vocab.encode_document(["a cat", grid, "the end"])
    caption, rest = vocab.encode_text("a cat"), vocab.encode_text("the end")
    image = [vocab.boi_id] + [vocab.image_offset + c for c in range(6)] + [vocab.eoi_id]
    assert ids == [vocab.bos_id] + caption + image + rest + [vocab.eos_id]
    assert vocab.encode_document(["x"], bos=False, eos=False) == vocab.encode_text("x")
    segments = vocab.decode_document(ids, grid_shape=(2, 3))
    assert segments[0] == "a cat" and segments[2] == "the end"
    torch.testing.assert_close(segments[1], grid)


def test_document_accepts_numpy_grids_and_infers_square_shapes(vocab):
    grid = np.arange(16, dtype=np.int32).reshape(4, 4)
    (decoded,) = vocab.decode_document(vocab.encode_document([grid]))
    assert decoded.dtype == torch.long and decoded.shape == (4, 4)
    assert decoded.tolist() == grid.tolist()
    (flat,) = vocab.decode_document(vocab.encode_document([np.zeros((2, 3), dtype=np.int64)]))
    assert flat.shape == (6,)  # not square and no grid_shape given: the codes in raster order


def test_decode_document_keeps_other_specials_by_name_and_drops_padding(vocab):
    ids = [vocab.bos_id] + vocab.encode_text("Q?") + [vocab.sep_id] + vocab.encode_text("A.") + [vocab.eos_id]
    ids += [vocab.pad_id] * 3
    assert vocab.decode_document(ids) == ["Q?<sep>A."]


def test_spans_give_text_runs_and_images_with_their_positions(vocab):
    ids = vocab.encode_document(["a cat", torch.zeros(1, 2, dtype=torch.long), "sat"], eos=True)
    n_text, n_tail = len(vocab.encode_text("a cat")), len(vocab.encode_text("sat"))
    boi = 1 + n_text
    assert vocab.spans(ids) == [
        Span("text", 0, boi),
        Span("image", boi, boi + 4),
        Span("text", boi + 4, boi + 4 + n_tail + 1),
    ]
    assert ids[vocab.spans(ids)[1].body] == [vocab.image_offset] * 2
    assert vocab.spans([]) == []
    # an image the sequence ends inside is open; so is one cut short by the next <boi>, which starts an image
    code, boi_id, eoi_id = vocab.image_offset, vocab.boi_id, vocab.eoi_id
    cut = vocab.spans([boi_id, code, boi_id, code, code])
    assert cut == [Span("image", 0, 2, closed=False), Span("image", 2, 5, closed=False)]
    assert [len(range(5)[s.body]) for s in cut] == [1, 2]
    # an <eoi> outside an image stays in the text run; an <eoi> right after <boi> closes an empty image
    assert vocab.spans([vocab.bos_id, eoi_id, boi_id, eoi_id]) == [Span("text", 0, 2), Span("image", 2, 4)]
    assert range(4)[Span("image", 2, 4).body] == range(3, 3)


def test_decode_document_returns_an_unfinished_image_flat(vocab):
    ids = vocab.encode_document(["draw:", torch.ones(2, 2, dtype=torch.long)], eos=False)[:-2]  # cut inside
    text, image = vocab.decode_document(torch.tensor(ids), grid_shape=(2, 2))
    assert text == "draw:" and image.tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match=rf"one 1-D sequence, got shape \(1, {len(ids)}\)"):
        vocab.decode_document(torch.tensor([ids]))


def test_decode_text_shows_or_skips_non_text_ids(vocab):
    ids = (
        vocab.encode_text("é") + [vocab.sep_id, vocab.image_id(12)] + vocab.encode_text("ok") + [vocab.eos_id]
    )
    assert vocab.decode_text(ids) == "é<sep>IMGIMGBCZok</s>"
    assert vocab.decode_text(ids, skip_special=True) == "éok"


def test_masks_partition_every_id(vocab):
    ids = torch.arange(vocab.vocab_size).reshape(4, -1)
    text, image, special = vocab.is_text(ids), vocab.is_image(ids), vocab.is_special(ids)
    assert text.shape == ids.shape and text.dtype == torch.bool
    assert (text.int() + image.int() + special.int() == 1).all()
    assert image.sum() == vocab.image_codes
    assert text.sum() == vocab.layout.num_text_tokens
    assert special.flatten()[: vocab.image_offset].all()
    codes = vocab.image_codes_of(torch.tensor([vocab.image_offset, vocab.image_offset + 9, vocab.bos_id]))
    assert codes.tolist() == [0, 9, -1]


def test_save_load_round_trip_identical_ids_and_fingerprint(vocab, tmp_path):
    path = vocab.save(tmp_path / "sub" / "tokenizer.json")
    loaded = UnifiedVocab.load(path, expected_vocab_size=1024, expected_image_codes=512)
    assert loaded.layout == vocab.layout
    assert loaded.fingerprint() == vocab.fingerprint()
    for text in SAMPLES:
        assert loaded.encode_text(text) == vocab.encode_text(text)
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]  # no temporary file left behind


def test_fingerprint_changes_with_the_vocabulary(vocab):
    other = train_unified_vocab(CORPUS, vocab_size=1024, image_codes=256)
    assert len(vocab.fingerprint()) == 64 and other.fingerprint() != vocab.fingerprint()
    assert train_unified_vocab(CORPUS, vocab_size=1024, image_codes=512).fingerprint() == vocab.fingerprint()


def test_transformers_fast_tokenizer_gives_identical_ids(vocab, tmp_path):
    from transformers import PreTrainedTokenizerFast

    path = vocab.save(tmp_path / "tokenizer.json")
    fast = PreTrainedTokenizerFast(tokenizer_file=str(path))
    assert len(fast) == vocab.vocab_size
    for text in SAMPLES[:7]:
        assert fast(text, add_special_tokens=False)["input_ids"] == vocab.encode_text(text)
        assert fast.decode(vocab.encode_text(text)) == text
    assert fast.convert_tokens_to_ids([BOS, EOS, BOI, EOI, IMAGE_PLACEHOLDER]) == [
        vocab.bos_id,
        vocab.eos_id,
        vocab.boi_id,
        vocab.eoi_id,
        vocab.image_placeholder_id,
    ]


def test_transformers_chameleon_processor_expands_images_with_our_tokens(vocab):
    from PIL import Image
    from transformers import ChameleonImageProcessor, ChameleonProcessor

    fast = vocab.to_transformers()
    processor = ChameleonProcessor(
        image_processor=ChameleonImageProcessor(), tokenizer=fast, image_seq_length=4
    )
    ids = processor(text=["a cat <image>"], images=[Image.new("RGB", (32, 32))])["input_ids"][0]
    image = [vocab.boi_id] + [vocab.image_placeholder_id] * 4 + [vocab.eoi_id]
    assert list(ids) == [vocab.bos_id] + vocab.encode_text("a cat ") + image + [vocab.sep_id]


@pytest.mark.slow
def test_exact_65536_from_the_builtin_english_corpus(tmp_path):
    from tokenizer.corpus import iter_kjv

    vocab = train_unified_vocab(iter_kjv())
    assert vocab.vocab_size == 65_536 and vocab.tokenizer.get_vocab_size() == 65_536
    assert vocab.image_codes == 8_192 and vocab.text_offset == vocab.image_offset + 8_192
    assert vocab.layout.num_text_tokens > 10_000  # a real English BPE, not just the 256 bytes
    loaded = UnifiedVocab.load(vocab.save(tmp_path / "tokenizer.json"), expected_vocab_size=65_536)
    verse = "And God said, Let there be light: and there was light."
    assert loaded.encode_text(verse) == vocab.encode_text(verse)
    assert len(vocab.encode_text(verse)) <= 16  # whole English words are single tokens


# ----- bad input ---------------------------------------------------------------------------------


def test_text_part_too_small_says_by_how_much():
    with pytest.raises(ValueError, match=r"leaves 200 ids.*56 short.*vocab_size to 784"):
        train_unified_vocab(CORPUS, vocab_size=728, image_codes=512)


def test_empty_corpus_is_an_error():
    with pytest.raises(ValueError, match="corpus is empty"):
        train_unified_vocab(["", ""], vocab_size=1024, image_codes=512)
    with pytest.raises(ValueError, match="corpus is empty"):
        train_unified_vocab([], vocab_size=1024, image_codes=512)


def test_bad_image_grids_name_the_problem(vocab):
    with pytest.raises(ValueError, match=r"code 512 outside \[0, 512\)"):
        vocab.encode_document([torch.tensor([[1, 512]])])
    with pytest.raises(ValueError, match=r"code -1 outside"):
        vocab.encode_document([torch.tensor([[-1, 2]])])
    with pytest.raises(ValueError, match=r"shape \(4,\).*2-D"):
        vocab.encode_document([torch.arange(4)])
    with pytest.raises(ValueError, match="dtype float32"):
        vocab.encode_document([torch.zeros(2, 2)])
    with pytest.raises(ValueError, match=r"shape \(2, 2\) but the expected grid is \(4, 4\)"):
        vocab.encode_document([torch.zeros(2, 2, dtype=torch.long)], grid_shape=(4, 4))
    with pytest.raises(TypeError, match="segment 0 is a int"):
        vocab.encode_document([3])
    with pytest.raises(ValueError, match="outside"):
        vocab.image_id(512)


def test_bad_ids_on_decode_name_the_id(vocab):
    with pytest.raises(ValueError, match=r"id 1024 at position 1 is outside the vocabulary \[0, 1024\)"):
        vocab.decode_document([vocab.bos_id, 1024])
    with pytest.raises(ValueError, match="id -3"):
        vocab.decode_text([-3])
    with pytest.raises(ValueError, match=r"4 codes, not 2x3"):
        vocab.decode_document(vocab.encode_document([torch.zeros(2, 2, dtype=torch.long)]), grid_shape=(2, 3))
    with pytest.raises(ValueError, match="inside an image"):
        vocab.decode_document([vocab.boi_id, vocab.image_offset, vocab.bos_id])
    nested = [vocab.boi_id, vocab.image_offset, vocab.boi_id, vocab.image_offset, vocab.eoi_id]
    with pytest.raises(ValueError, match="at position 2 is inside an image"):  # a <boi> inside an open image
        vocab.decode_document(nested)
    with pytest.raises(ValueError, match="outside <boi>"):
        vocab.decode_document([vocab.image_offset])


def test_load_errors_name_the_file_and_the_mismatch(vocab, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.json.*train\.py vocab"):
        UnifiedVocab.load(tmp_path / "missing.json")
    path = vocab.save(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"vocab_size=1024 but the configuration expects vocab_size=65536"):
        UnifiedVocab.load(path, expected_vocab_size=65_536)
    with pytest.raises(ValueError, match=r"image_codes=512 but the configuration expects image_codes=8192"):
        UnifiedVocab.load(path, expected_image_codes=8_192)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json is not a valid tokenizer.json"):
        UnifiedVocab.load(broken)
    plain = Tokenizer.from_file(str(path))
    body = json.loads(plain.to_str())
    body["model"]["vocab"] = {k: v for k, v in body["model"]["vocab"].items() if not k.startswith("IMGIMG")}
    body["model"]["merges"] = []
    no_images = tmp_path / "text_only.json"
    no_images.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="text_only.json"):
        UnifiedVocab.load(no_images)


def test_save_is_atomic_when_writing_fails(vocab, tmp_path, monkeypatch):
    path = vocab.save(tmp_path / "tokenizer.json")
    before = path.read_bytes()

    class FailingMidWrite:
        def save(self, tmp, pretty=True):
            with open(tmp, "w") as handle:
                handle.write("{partial")
            raise OSError("disk full")

    monkeypatch.setattr(vocab, "tokenizer", FailingMidWrite())
    with pytest.raises(OSError, match="disk full"):
        vocab.save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]
