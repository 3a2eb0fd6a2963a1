"""Continuous-image token shards (Transfusion): `shards tokenize` with a continuous image tokenizer stores each image as
`<boi>`, one `<image>` placeholder per latent patch, `<eoi>`, and the patches beside the ids; the stream puts them at
the placeholder positions and never cuts an image across rows; NaN latents and the wrong kind of shards are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from data_shards.datamodule import FusionDataModule
from data_shards.plan import shard_rows, whole_images
from data_shards.pretokenize import pretokenize
from data_shards.raw import ShardError
from data_shards.stream import PackedTokenStream
from data_shards.token_shards import (
    FEATURES_FILE,
    LATENT_KIND,
    read_manifest,
    verify_token_dir,
    write_manifest,
    write_token_shard,
)
from fusion_model import cli
from tokenizer.layout import patchify
from tokenizer.vocab import LatentImage

SEQ_LEN = 40  # longer than any image with its markers (18 positions at patch size 1), shorter than most documents


def _image(i: int) -> Image.Image:
    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8))


DOCS = {
    **{f"pair{i}": [f"the digit {['one', 'two'][i % 2]} is drawn here in ink", _image(i)] for i in range(6)},
    "mixed": ["some interleaved text before", _image(100), "and some after it", _image(101), "the end of it"],
    "three": [_image(102), "a photo of a cat on a mat", _image(103), _image(104)],
    "plain": ["a photo of a cat"],
}


class ContinuousStandIn(nn.Module):
    """The interface `shards tokenize` uses of a continuous image tokenizer: 16-px images -> (3, 4, 4) latents."""

    kind = "continuous"
    latent_channels = 3
    grid_shape = (4, 4)

    def __init__(self, nan_for: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 3, kernel_size=4, stride=4)
        self.nan_for = nan_for  # the red value of the top-left pixel of the image whose latents come back NaN

    def pixels(self, images) -> torch.Tensor:
        return torch.stack([torch.from_numpy(np.asarray(i.convert("RGB"), dtype=np.float32)).permute(2, 0, 1)
                            for i in images]) / 127.5 - 1

    def encode(self, images, batch_size: int = 32) -> torch.Tensor:
        latents = self.conv(self.pixels(images))
        if self.nan_for is not None:
            for n, image in enumerate(images):
                if image.getpixel((0, 0))[0] == self.nan_for:
                    latents[n, 0, 1, 2] = float("nan")
        return latents

    def fingerprint(self) -> str:
        return "continuous-stand-in"


def _tokenize(raw, out, vocab, tokenizer, patch_size=None):
    return pretokenize(raw, out, vocab, tokenizer, flip_probability=0.0, seed=0, batch_size=3, progress=False,
                       patch_size=patch_size)


@pytest.fixture(scope="module")
def stand_in():
    return ContinuousStandIn().eval()


@pytest.fixture(scope="module", params=[1, 2], ids=["patch1", "patch2"])
def latent_dir(request, tmp_path_factory, vocab, stand_in, raw_dir):
    out = tmp_path_factory.mktemp(f"latents{request.param}")
    _tokenize(raw_dir, out, vocab, stand_in, patch_size=request.param)
    return out, request.param


def test_the_manifest_records_latent_patches_and_each_image_is_boi_placeholders_eoi(latent_dir, vocab, stand_in):
    token_dir, k = latent_dir
    manifest = read_manifest(token_dir)
    assert manifest["feature_kind"] == LATENT_KIND and manifest["feature_dim"] == 3 * k * k
    assert manifest["latent"] == {"channels": 3, "grid": [4, 4], "patch_size": k}
    patches = 16 // (k * k)
    for entry in manifest["shards"]:
        name = entry["name"]
        ids = np.load(token_dir / f"{name}.ids.npy").astype(np.int64)
        offsets = np.load(token_dir / f"{name}.offsets.npy")
        keys = json.loads((token_dir / f"{name}.keys.json").read_text())
        rows = np.load(token_dir / f"{name}{FEATURES_FILE}")
        assert rows.dtype == np.float16 and rows.shape == (int((ids == vocab.image_placeholder_id).sum()), 3 * k * k)
        row = 0
        for d, key in enumerate(keys):
            segments = DOCS[key]
            expected = vocab.encode_document([s if isinstance(s, str) else LatentImage(patches) for s in segments])
            assert ids[offsets[d] : offsets[d + 1]].tolist() == expected
            images = [s for s in segments if not isinstance(s, str)]
            if images:
                with torch.no_grad():
                    want = patchify(stand_in.encode(images).numpy(), k).reshape(-1, 3 * k * k)
                np.testing.assert_array_equal(rows[row : row + len(want)], want.astype(np.float16))
                row += len(want)
        assert row == len(rows)


def test_the_stream_puts_each_patch_at_its_placeholder_and_never_cuts_an_image(latent_dir, vocab):
    token_dir, k = latent_dir
    patches = 16 // (k * k)
    stream = PackedTokenStream(token_dir, SEQ_LEN, 2, seed=1, image_latents=True, token_keys=True)
    manifest = read_manifest(token_dir)
    stored = {e["name"]: np.load(token_dir / f"{e['name']}{FEATURES_FILE}") for e in manifest["shards"]}
    names = [e["name"] for e in manifest["shards"]]
    seen = 0
    for batch in stream:
        ids, latents, keys = batch["input_ids"], batch["image_latents"], batch["token_keys"]
        assert latents.shape == (*ids.shape, 3 * k * k) and latents.dtype == torch.float32
        is_patch = ids == vocab.image_placeholder_id
        assert bool((latents[~is_patch] == 0).all()), "zeros where there is no patch"
        for r in range(ids.shape[0]):
            row = ids[r].tolist()
            for at in np.flatnonzero(np.array(row) == vocab.boi_id).tolist():
                assert row[at + 1 : at + 1 + patches] == [vocab.image_placeholder_id] * patches
                assert row[at + 1 + patches] == vocab.eoi_id, "the whole image, then <eoi>, in this row"
            assert row.count(vocab.image_placeholder_id) == patches * row.count(vocab.boi_id), "no part-image"
            for t in np.flatnonzero(is_patch[r].numpy()).tolist():
                shard, offset = int(keys[r, t]) >> 40, int(keys[r, t]) & ((1 << 40) - 1)
                shard_ids = np.load(token_dir / f"{names[shard]}.ids.npy")
                which = int((shard_ids[:offset] == vocab.image_placeholder_id).sum())
                assert torch.equal(latents[r, t], torch.from_numpy(stored[names[shard]][which].astype(np.float32)))
                seen += 1
    assert seen == sum(len(v) for v in stored.values()), "every patch once per epoch"


def test_cuts_move_back_to_the_start_of_an_image(vocab):
    header = {"feature_kind": LATENT_KIND, "image_placeholder_id": vocab.image_placeholder_id,
              "eoi_id": vocab.eoi_id}
    text, image = [5] * 7, [vocab.boi_id, *[vocab.image_placeholder_id] * 4, vocab.eoi_id]
    ids = np.array(text + image + text + image, dtype=np.int64)  # 26 ids, one document
    offsets = np.array([0, len(ids)], dtype=np.int64)
    rows = shard_rows(offsets, 10, whole_images(ids, header))
    pieces = sorted((int(s), int(n)) for s, n in zip(rows.piece_start, rows.piece_len))
    assert pieces == [(0, 7), (7, 10), (17, 9)]  # the first cut (at 10) would split the image: moved to its <boi>
    assert shard_rows(offsets, 10).piece_len.tolist() == [10, 10, 6], "shards of codes keep cutting every seq_len"
    with pytest.raises(ShardError, match="longer than seq_len 5.*--patch-size"):
        shard_rows(offsets, 5, whole_images(ids, header))


def test_nan_latents_are_refused_when_tokenizing_naming_the_sample(tmp_path, vocab, raw_dir):
    red = np.asarray(DOCS["mixed"][1])[0, 0, 0]
    with pytest.raises(ShardError, match=r"key 'mixed'.*NaN or infinite latents"):
        _tokenize(raw_dir, tmp_path / "out", vocab, ContinuousStandIn(nan_for=int(red)).eval())


def test_shards_verify_counts_the_images_whose_latents_it_checked(latent_dir, capsys):
    token_dir, _ = latent_dir
    assert cli.main(["shards", "verify", str(token_dir)]) == 0
    images = read_manifest(token_dir)["images"]
    assert images > 0 and f"{images} images' latents finite" in capsys.readouterr().out


def test_shards_verify_finds_nan_latents_written_by_another_writer(tmp_path, vocab, capsys):
    info = {"vocab_size": vocab.vocab_size, "vocab_fingerprint": "x", "image_tokenizer_fingerprint": "x"}
    doc = vocab.encode_document(["a cat", LatentImage(4)])
    rows = np.ones((4, 3), dtype=np.float16)
    rows[2, 1] = np.nan
    meta = write_token_shard(tmp_path, "shard-000000", ["cat"], [doc], info, features=rows)
    write_manifest(tmp_path, {**info, "pad_id": vocab.pad_id, "image_offset": vocab.image_offset,
                              "image_codes": vocab.image_codes, "eoi_id": vocab.eoi_id,
                              "image_placeholder_id": vocab.image_placeholder_id, "feature_dim": 3,
                              "feature_kind": LATENT_KIND}, [meta])
    _, problems = verify_token_dir(tmp_path)
    assert len(problems) == 1 and "key 'cat'" in problems[0][1] and "NaN or an infinity" in problems[0][1]
    assert cli.main(["shards", "verify", str(tmp_path)]) == 2
    assert "BAD shard-000000" in capsys.readouterr().out


def test_a_patch_size_that_does_not_divide_the_grid_or_a_vq_tokenizer_is_refused(tmp_path, vocab, raw_dir,
                                                                                   image_tokenizer, stand_in):
    with pytest.raises(ValueError, match="--patch-size 3 does not divide .* 4x4 latent grid"):
        _tokenize(raw_dir, tmp_path / "a", vocab, stand_in, patch_size=3)
    with pytest.raises(ValueError, match="--patch-size cuts a continuous .* VQ one"):
        _tokenize(raw_dir, tmp_path / "b", vocab, image_tokenizer, patch_size=2)


def test_shards_of_the_other_kind_are_refused_before_training(latent_dir, tmp_path, vocab, image_tokenizer, raw_dir):
    token_dir, _ = latent_dir
    with pytest.raises(ValueError, match="continuous image latents.*--model.family transfusion"):
        FusionDataModule(str(token_dir)).check(None, batch_keys=("input_ids",))
    codes = tmp_path / "codes"
    pretokenize(raw_dir, codes, vocab, image_tokenizer, progress=False)
    with pytest.raises(ValueError, match="holds image codes, not continuous latents.*continuous image tokenizer"):
        FusionDataModule(str(codes)).check(None, batch_keys=("input_ids", "image_latents"))
    with pytest.raises(ShardError, match="no continuous image latents"):
        PackedTokenStream(codes, SEQ_LEN, 2, image_latents=True)
    with pytest.raises(ShardError, match="latents, not codes"):
        PackedTokenStream(token_dir, SEQ_LEN, 2, image_features=True)
