"""Pre-tokenization: ids equal the vocabulary's own encoding, pairs flip by probability, reruns resume, workers agree."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image

from data_shards import pretokenize as pretokenize_module
from data_shards.pretokenize import flip_pair, pretokenize
from data_shards.raw import RawShardWriter, ShardError
from data_shards.stream import PackedTokenStream
from data_shards.token_shards import TokenShard, read_manifest, sha256_file


def _image(i: int) -> Image.Image:
    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8))


DOCS = {
    **{f"pair{i}": [f"the digit {['one', 'two'][i % 2]}", _image(i)] for i in range(8)},
    "mixed": ["some interleaved text", _image(100), "here", _image(101)],
    "plain": ["a photo of a cat"],
}


def _documents(token_dir) -> dict[str, list[int]]:
    manifest = read_manifest(token_dir)
    out = {}
    for shard in manifest["shards"]:
        reader = TokenShard(token_dir, shard["name"], manifest["vocab_size"])
        for i, key in enumerate(reader.keys):
            out[key] = reader.ids[reader.offsets[i] : reader.offsets[i + 1]].astype(np.int64).tolist()
    return out


def _expected(vocab, image_tokenizer, segments, flip):
    segments = list(reversed(segments)) if flip else segments
    grids = iter(image_tokenizer.encode([s for s in segments if isinstance(s, Image.Image)]))
    return vocab.encode_document([next(grids) if isinstance(s, Image.Image) else s for s in segments])


@pytest.mark.parametrize("probability", [0.0, 1.0])
def test_ids_are_the_vocabularys_encoding_and_pairs_flip(tmp_path, vocab, image_tokenizer, raw_dir, probability):
    manifest = pretokenize(raw_dir, tmp_path / "tok", vocab, image_tokenizer, flip_probability=probability,
                           batch_size=3, progress=False)
    assert manifest["vocab_fingerprint"] == vocab.fingerprint()
    assert manifest["image_tokenizer_fingerprint"] == image_tokenizer.fingerprint()
    assert (manifest["vocab_size"], manifest["documents"], manifest["images"]) == (1024, 10, 10)
    assert manifest["dtype"] == "uint16" and len(manifest["shards"]) == 4
    got = _documents(tmp_path / "tok")
    for key, segments in DOCS.items():
        flip = probability == 1.0 and key.startswith("pair")  # only [text, image] pairs are flipped
        assert got[key] == _expected(vocab, image_tokenizer, segments, flip), key
    first = got["pair0"][1]
    assert first == (vocab.boi_id if probability == 1.0 else vocab.encode_text("the digit one")[0])


def test_flip_decisions_are_deterministic_and_follow_the_probability():
    keys = [f"k{i}" for i in range(4000)]
    flips = [flip_pair(k, 0, 0.3) for k in keys]
    assert flips == [flip_pair(k, 0, 0.3) for k in keys]
    assert 0.27 < np.mean(flips) < 0.33
    assert flips != [flip_pair(k, 1, 0.3) for k in keys]


class _CountingTokenizer:
    """Wraps the image tokenizer and counts images it encodes (to see which shards a rerun redoes)."""

    def __init__(self, inner):
        self.inner, self.grid_shape, self.images = inner, inner.grid_shape, 0

    def encode(self, images):
        self.images += len(images)
        return self.inner.encode(images)

    def fingerprint(self):
        return self.inner.fingerprint()


def test_rerun_skips_finished_shards_and_redoes_an_unfinished_one(tmp_path, vocab, image_tokenizer, raw_dir):
    out = tmp_path / "tok"
    first = pretokenize(raw_dir, out, vocab, image_tokenizer, progress=False)
    before = _documents(out)
    # an interrupted run: shard 1 has its ids but no meta (written last), plus a stray temporary file
    (out / "shard-000001.meta.json").unlink()
    (out / "shard-000002.ids.npy.tmp").write_bytes(b"partial")
    counting = _CountingTokenizer(image_tokenizer)
    second = pretokenize(raw_dir, out, vocab, counting, progress=False)
    assert counting.images == 3, "only the unfinished shard (3 pair documents) is tokenized again"
    assert second == first and _documents(out) == before


def test_rerun_with_other_settings_is_refused(tmp_path, vocab, image_tokenizer, raw_dir):
    pretokenize(raw_dir, tmp_path / "tok", vocab, image_tokenizer, progress=False)
    with pytest.raises(ShardError, match="shard-000000 was tokenized with other settings.*flip_probability"):
        pretokenize(raw_dir, tmp_path / "tok", vocab, image_tokenizer, flip_probability=0.1, progress=False)


def test_two_worker_processes_give_the_same_shards(tmp_path, vocab, image_tokenizer, raw_dir):
    one = pretokenize(raw_dir, tmp_path / "one", vocab, image_tokenizer, num_workers=1, progress=False)
    two = pretokenize(raw_dir, tmp_path / "two", vocab, image_tokenizer, num_workers=2, progress=False)
    assert one == two and _documents(tmp_path / "one") == _documents(tmp_path / "two")


def test_codes_outside_the_vocabulary_name_shard_and_key(tmp_path, vocab, raw_dir):
    class TooBigCodebook:
        grid_shape = (2, 2)

        def encode(self, images):
            return torch.full((len(images), 2, 2), 600)  # the vocabulary has 512 image codes

        def fingerprint(self):
            return "too-big"

    with pytest.raises(ShardError, match=r"shard shard-000000.tar, key 'pair0'.*code 600"):
        pretokenize(raw_dir, tmp_path / "tok", vocab, TooBigCodebook(), progress=False)
    assert not list((tmp_path / "tok").glob("shard-000000*"))


def test_token_shards_stream_into_batches(tmp_path, vocab, image_tokenizer, raw_dir):
    pretokenize(raw_dir, tmp_path / "tok", vocab, image_tokenizer, progress=False)
    batches = list(PackedTokenStream(tmp_path / "tok", 64, 2))
    ids = torch.cat([b["input_ids"][b["document_ids"] >= 0] for b in batches])
    assert int((ids == vocab.bos_id).sum()) == len(DOCS)
    assert int((ids == vocab.boi_id).sum()) == 10
    assert (batches[0]["input_ids"][batches[0]["document_ids"] < 0] == vocab.pad_id).all()


def test_raw_directory_without_documents_is_an_error(tmp_path, vocab, image_tokenizer):
    with RawShardWriter(tmp_path / "raw") as writer:
        writer.skip("only", "bad image")
    with pytest.raises(ShardError, match="no raw shards.*1 skipped"):
        pretokenize(tmp_path / "raw", tmp_path / "tok", vocab, image_tokenizer, progress=False)


def test_rerun_on_changed_raw_shards_of_the_same_names_tokenizes_the_new_documents(tmp_path, vocab, image_tokenizer,
                                                                                    raw_dir):
    out = tmp_path / "tok"
    pretokenize(raw_dir, out, vocab, image_tokenizer, progress=False)
    changed = tmp_path / "raw2"  # the same shard names (shard-000000.tar, ...) holding other documents
    with RawShardWriter(changed, shard_max_docs=3) as writer:
        for i in range(5):
            writer.add(f"new{i}", [f"the digit {['one', 'two'][i % 2]}", _image(200 + i)])
    assert {p.name for p in changed.glob("*.tar")} <= {p.name for p in raw_dir.glob("*.tar")}
    counting = _CountingTokenizer(image_tokenizer)
    manifest = pretokenize(changed, out, vocab, counting, progress=False)
    assert counting.images == 5, "every changed shard is tokenized again"
    fresh = pretokenize(changed, tmp_path / "fresh", vocab, image_tokenizer, progress=False)
    assert _documents(out) == _documents(tmp_path / "fresh") and sorted(_documents(out)) == [f"new{i}" for i in range(5)]
    assert manifest == fresh and manifest["documents"] == 5
    assert [s["raw_sha256"] for s in manifest["shards"]] == [sha256_file(changed / f"shard-{i:06d}.tar") for i in (0, 1)]


def test_the_manifest_carries_the_vocabulary_layout(tmp_path, vocab, image_tokenizer, raw_dir):
    manifest = pretokenize(raw_dir, tmp_path / "tok", vocab, image_tokenizer, progress=False)
    layout = {k: manifest[k] for k in ("vocab_size", "image_offset", "image_codes", "pad_id", "bos_id", "eos_id")}
    assert layout == {"vocab_size": vocab.vocab_size, "image_offset": vocab.image_offset, "image_codes": 512,
                      "pad_id": vocab.pad_id, "bos_id": vocab.bos_id, "eos_id": vocab.eos_id}
    assert read_manifest(tmp_path / "tok") == manifest


def test_progress_in_a_log_is_plain_lines_counting_samples(tmp_path, vocab, image_tokenizer, raw_dir, capsys,
                                                            monkeypatch):
    # under pytest stderr is captured, not a terminal: the log-file form
    monkeypatch.setattr(pretokenize_module, "PROGRESS_EVERY_SECONDS", 1e9)
    pretokenize(raw_dir, tmp_path / "tok", vocab, image_tokenizer)
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    assert len(lines) == 3
    assert lines[0] == "tokenize: 4 shards, 10 samples"
    assert re.fullmatch(r"tokenize: 3/10 samples \(30%\) \| [\d,.]+ samples/s \| 1 of 4 shards \| ETA \d+:\d\d:\d\d",
                        lines[1])
    assert re.fullmatch(r"tokenize: 10/10 samples \(100%\) \| [\d,.]+ samples/s \| 4 of 4 shards \| "
                        r"\d+:\d\d:\d\d elapsed", lines[2])
    # a resumed run counts the finished shards' samples as done and prints a line per shard when due
    (tmp_path / "tok" / "shard-000000.meta.json").unlink()
    (tmp_path / "tok" / "shard-000001.meta.json").unlink()
    monkeypatch.setattr(pretokenize_module, "PROGRESS_EVERY_SECONDS", 0.0)
    pretokenize(raw_dir, tmp_path / "tok", vocab, image_tokenizer)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "tokenize: 4 shards, 10 samples (2 shards, 4 samples already done)"
    assert [line.split(" | ")[0] for line in lines[1:]] == ["tokenize: 7/10 samples (70%)",
                                                            "tokenize: 10/10 samples (100%)"]
    pretokenize(raw_dir, tmp_path / "tok", vocab, image_tokenizer, progress=False)
    assert capsys.readouterr().err == ""
