"""Image features in token shards: `tokenize --features` stores each image's encoder features in id order, the stream
puts them at the image-code positions (also for images cut across rows), and damaged or mismatched data is refused."""

from __future__ import annotations

import json
import re
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from data_shards.datamodule import FusionDataModule
from data_shards.pretokenize import flip_pair, pretokenize
from data_shards.raw import ShardError
from data_shards.stream import PackedTokenStream
from data_shards.token_shards import FEATURES_FILE, read_manifest, verify_token_dir
from fusion_model import cli

FLIP_PROBABILITY, SEED = 0.5, 0
# shorter than an image with its markers (18 ids), so images are cut across rows; documents' tails then share rows
SEQ_LEN = 16


def _image(i: int) -> Image.Image:
    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8))


DOCS = {
    **{f"pair{i}": [f"the digit {['one', 'two'][i % 2]}", _image(i)] for i in range(8)},
    "mixed": ["some interleaved text", _image(100), "here", _image(101)],
    "three": [_image(102), "a photo of a cat", _image(103), _image(104)],
    "plain": ["a photo of a cat"],
}


def _tokenize(raw, out, vocab, image_tokenizer, features):
    return pretokenize(raw, out, vocab, image_tokenizer, flip_probability=FLIP_PROBABILITY, seed=SEED, batch_size=3,
                       progress=False, features=features)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory, vocab, image_tokenizer, raw_dir):
    out = tmp_path_factory.mktemp("plain")
    _tokenize(raw_dir, out, vocab, image_tokenizer, False)
    return out


@pytest.fixture(scope="module")
def features_dir(tmp_path_factory, vocab, image_tokenizer, raw_dir):
    out = tmp_path_factory.mktemp("features")
    _tokenize(raw_dir, out, vocab, image_tokenizer, True)
    return out


def _code_mask(ids: np.ndarray, manifest: dict) -> np.ndarray:
    return (ids >= manifest["image_offset"]) & (ids < manifest["image_offset"] + manifest["image_codes"])


def _stored(token_dir: Path) -> dict[str, dict]:
    """Per shard, read straight from its files: ids, offsets, keys, feature rows and each id's feature row (-1: none)."""
    manifest = read_manifest(token_dir)
    out = {}
    for entry in manifest["shards"]:
        name = entry["name"]
        ids = np.load(token_dir / f"{name}.ids.npy").astype(np.int64)
        is_code = _code_mask(ids, manifest)
        out[name] = {
            "ids": ids,
            "offsets": np.load(token_dir / f"{name}.offsets.npy"),
            "keys": json.loads((token_dir / f"{name}.keys.json").read_text()),
            "features": np.load(token_dir / f"{name}{FEATURES_FILE}"),
            "row_of": np.where(is_code, np.cumsum(is_code) - 1, -1),
        }
    return out


def test_tokenize_stores_each_images_encoder_features_in_id_order(vocab, image_tokenizer, features_dir):
    manifest = read_manifest(features_dir)
    assert manifest["feature_dim"] == image_tokenizer.config.embed_dim == 8
    assert (manifest["boi_id"], manifest["eoi_id"], manifest["image_placeholder_id"]) == (
        vocab.boi_id, vocab.eoi_id, vocab.image_placeholder_id)
    flipped = {key for key in DOCS if key.startswith("pair") and flip_pair(key, SEED, FLIP_PROBABILITY)}
    assert 0 < len(flipped) < 8, "the data must hold both flipped and unflipped [text, image] documents"
    checked = 0
    for shard in _stored(features_dir).values():
        assert shard["features"].dtype == np.float16 and shard["features"].shape[1] == 8
        assert len(shard["features"]) == int((shard["row_of"] >= 0).sum())
        for i, key in enumerate(shard["keys"]):
            segments = DOCS[key][::-1] if key in flipped else DOCS[key]
            images = [s for s in segments if isinstance(s, Image.Image)]
            lo, hi = shard["offsets"][i], shard["offsets"][i + 1]
            rows = shard["row_of"][lo:hi][shard["row_of"][lo:hi] >= 0]
            assert len(rows) == 16 * len(images), key
            if not images:
                continue
            codes, expected = image_tokenizer.encode_with_features(images)
            expected = expected.numpy().reshape(-1, 8)  # images in document order, each in raster order
            np.testing.assert_allclose(shard["features"][rows].astype(np.float32), expected, rtol=2e-3, atol=2e-3,
                                       err_msg=key)
            doc_ids = shard["ids"][lo:hi]
            assert (doc_ids[_code_mask(doc_ids, manifest)] == codes.flatten().numpy() + vocab.image_offset).all()
            checked += len(images)
    assert checked == sum(isinstance(s, Image.Image) for segments in DOCS.values() for s in segments) == 13


def test_features_are_what_the_codes_were_rounded_from(image_tokenizer):
    codes, features = image_tokenizer.encode_with_features([_image(7), _image(8)], batch_size=1)
    assert features.shape == (2, 16, 8) and codes.shape == (2, 4, 4)
    nearest = torch.cdist(features, image_tokenizer.quantize.codebook[None]).argmin(-1)  # Euclidean (chameleon)
    assert torch.equal(nearest, codes.flatten(1)), "feature k must be the latent of code k (raster order)"
    assert torch.equal(image_tokenizer.encode([_image(7), _image(8)]), codes)
    empty_codes, empty_features = image_tokenizer.encode_with_features(torch.zeros(0, 3, 16, 16))
    assert empty_codes.shape == (0, 4, 4) and empty_features.shape == (0, 16, 8)


def test_ids_are_byte_identical_to_a_run_without_features(features_dir, plain_dir):
    manifest = read_manifest(plain_dir)
    assert manifest["feature_dim"] is None and not list(plain_dir.glob(f"*{FEATURES_FILE}"))
    assert len(manifest["shards"]) == len(read_manifest(features_dir)["shards"]) == 4
    for entry in manifest["shards"]:
        for suffix in (".ids.npy", ".offsets.npy", ".keys.json"):
            path = f"{entry['name']}{suffix}"
            assert (plain_dir / path).read_bytes() == (features_dir / path).read_bytes(), path


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_stream_puts_each_code_positions_feature_there_and_zeros_elsewhere(features_dir, shuffle):
    stored = _stored(features_dir)
    stream = PackedTokenStream(features_dir, SEQ_LEN, 3, seed=5, rank=0, world_size=1, shuffle=shuffle,
                               image_features=True)
    manifest = stream.manifest
    names = stream.shard_names
    used: list[tuple[str, int]] = []
    cut_images = later_pieces_with_codes = 0
    seen_features = []
    for b, batch in enumerate(stream):
        features = batch["image_features"]
        assert features.dtype == torch.float32 and features.shape == (3, SEQ_LEN, 8)
        is_code = torch.from_numpy(_code_mask(batch["input_ids"].numpy(), manifest))
        assert torch.equal(features.abs().sum(-1) != 0, is_code), "nonzero features exactly at image codes"
        expected = np.zeros(features.shape, dtype=np.float32)
        for i, row in enumerate(stream.batch_pieces(0, b)):
            cursor = 0
            for index, start, length in row:
                name = names[index]
                shard = stored[name]
                assert (batch["input_ids"][i, cursor : cursor + length].numpy() == shard["ids"][start:start + length]).all()
                rows = shard["row_of"][start : start + length]
                expected[i, cursor + np.flatnonzero(rows >= 0)] = shard["features"][rows[rows >= 0]]
                used += [(name, r) for r in rows[rows >= 0].tolist()]
                # a piece that starts inside an image: the image's codes are split over two pieces
                cut_images += bool(start > 0 and shard["row_of"][start - 1] >= 0 and shard["row_of"][start] >= 0)
                later_pieces_with_codes += bool(cursor > 0 and (rows >= 0).any())
                cursor += length
        assert torch.equal(features, torch.from_numpy(expected))
        seen_features.append(features[is_code])
    assert cut_images >= 3 and later_pieces_with_codes >= 2, "the test needs images cut across rows and shared rows"
    every_row = [(name, r) for name, shard in stored.items() for r in range(len(shard["features"]))]
    assert sorted(used) == every_row, "each stored feature row lands once per epoch"
    # the same without the stream's own bookkeeping: the features seen are the stored rows, each once
    seen = torch.cat(seen_features).numpy()
    stored_rows = np.concatenate([shard["features"] for shard in stored.values()]).astype(np.float32)
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, stored_rows.tolist()))


def test_a_stream_without_image_features_has_no_such_key(features_dir):
    batch = next(iter(PackedTokenStream(features_dir, SEQ_LEN, 2, rank=0, world_size=1)))
    assert "image_features" not in batch


def test_the_data_module_reads_features_when_the_model_does(features_dir):
    def first_batch(image_features, reads):
        module = FusionDataModule(str(features_dir), seq_len=SEQ_LEN, batch_size=2, num_workers=0,
                                  image_features=image_features)
        model = types.SimpleNamespace(batch_keys=("image_features",) if reads else ())
        module.trainer = types.SimpleNamespace(global_rank=0, world_size=1, accumulate_grad_batches=1,
                                               lightning_module=model)
        return next(iter(module.train_dataloader()))

    assert "image_features" in first_batch(None, True)
    assert "image_features" not in first_batch(None, False)
    assert "image_features" in first_batch(True, False)
    assert "image_features" not in first_batch(False, True)


def test_a_stream_with_image_features_over_shards_without_them_names_the_flag(plain_dir):
    with pytest.raises(ShardError, match=r"holds no image features.*shards tokenize --features"):
        PackedTokenStream(plain_dir, SEQ_LEN, 2, image_features=True)


@pytest.mark.parametrize("damage", ["truncate", "change"])
def test_a_damaged_features_file_is_refused_at_open_naming_it(features_dir, tmp_path, damage):
    copy = shutil.copytree(features_dir, tmp_path / "tok")  # a fresh path: no checksum of it is cached yet
    path = copy / f"shard-000001{FEATURES_FILE}"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[:-10]))
    else:
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    why = "truncated" if damage == "truncate" else "sha256"
    with pytest.raises(ShardError, match=re.escape(str(path)) + f".*{why}"):
        list(PackedTokenStream(copy, SEQ_LEN, 2, image_features=True))  # checked when the shard is first opened
    _, problems = verify_token_dir(copy)
    assert [name for name, _ in problems] == ["shard-000001"] and str(path) in problems[0][1]


def test_features_rows_that_do_not_match_the_code_positions_are_refused(features_dir, tmp_path):
    from data_shards.token_shards import write_manifest, write_token_shard

    manifest = read_manifest(features_dir)
    code = manifest["image_offset"]
    header = {k: manifest[k] for k in ("vocab_fingerprint", "image_tokenizer_fingerprint", "vocab_size", "pad_id",
                                       "image_offset", "image_codes", "feature_dim")}
    # two code positions but three feature rows (checksums match: written that way)
    meta = write_token_shard(tmp_path, "s", ["a"], [[1, code, code + 1, 2]], {"vocab_size": manifest["vocab_size"]},
                             features=np.ones((3, 8), dtype=np.float16))
    write_manifest(tmp_path, header, [meta])
    stream = PackedTokenStream(tmp_path, SEQ_LEN, 1, image_features=True)
    with pytest.raises(ShardError, match=r"3 feature rows .*s\.features\.npy for 2 image-code positions"):
        next(iter(stream))


@pytest.mark.parametrize("first", [False, True])
def test_resuming_a_tokenize_with_features_switched_names_the_setting(tmp_path, vocab, image_tokenizer, raw_dir,
                                                                      plain_dir, features_dir, first):
    out = shutil.copytree(features_dir if first else plain_dir, tmp_path / "tok")
    with pytest.raises(ShardError, match=r"tokenized with other settings \(features\); use an empty output directory"):
        _tokenize(raw_dir, out, vocab, image_tokenizer, not first)


def test_shards_from_before_the_features_setting_count_as_without_features(tmp_path, vocab, image_tokenizer,
                                                                          raw_dir, plain_dir):
    out = shutil.copytree(plain_dir, tmp_path / "tok")
    for path in out.glob("*.meta.json"):
        meta = json.loads(path.read_text())
        del meta["features"]
        path.write_text(json.dumps(meta))
    with pytest.raises(ShardError, match=r"other settings \(features\)"):
        _tokenize(raw_dir, out, vocab, image_tokenizer, True)
    ids_before = {p.name: p.read_bytes() for p in out.glob("*.ids.npy")}
    manifest = _tokenize(raw_dir, out, vocab, image_tokenizer, False)  # reused, not refused
    assert manifest["documents"] == len(DOCS) and {p.name: p.read_bytes() for p in out.glob("*.ids.npy")} == ids_before


def test_cli_features_without_an_image_tokenizer_is_one_line_and_exit_2(tmp_path, vocab, raw_dir, capsys):
    vocab_path = vocab.save(tmp_path / "tokenizer.json")
    code = cli.main(["shards", "tokenize", str(raw_dir), "--out", str(tmp_path / "tok"), "--vocab", str(vocab_path),
                     "--features", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1
    assert "--features needs --image-tokenizer" in err
    assert not (tmp_path / "tok").exists()


def test_cli_tokenize_with_features_then_verify_passes(tmp_path, vocab, image_tokenizer, raw_dir, features_dir,
                                                       capsys):
    vocab_path = vocab.save(tmp_path / "tokenizer.json")
    image_tokenizer.save_pretrained(tmp_path / "vq")
    out = tmp_path / "tok"
    assert cli.main(["shards", "tokenize", str(raw_dir), "--out", str(out), "--vocab", str(vocab_path),
                     "--image-tokenizer", str(tmp_path / "vq"), "--features", "--flip-probability",
                     str(FLIP_PROBABILITY), "--seed", str(SEED), "--batch-size", "3", "--no-progress"]) == 0
    manifest = read_manifest(out)
    assert manifest["feature_dim"] == 8
    # the same shards as pretokenize gave (features to float16 tolerance: the CLI runs on one thread)
    reference = _stored(features_dir)
    for name, shard in _stored(out).items():
        assert (shard["ids"] == reference[name]["ids"]).all()
        np.testing.assert_allclose(shard["features"].astype(np.float32),
                                   reference[name]["features"].astype(np.float32), rtol=2e-3, atol=2e-3)
    capsys.readouterr()
    for directory in (out, features_dir):
        assert verify_token_dir(directory)[1] == []
        assert cli.main(["shards", "verify", str(directory)]) == 0
        assert f"all {len(manifest['shards'])} shards" in capsys.readouterr().out
