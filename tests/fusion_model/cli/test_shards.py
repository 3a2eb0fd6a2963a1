"""`python train.py shards write|tokenize|inspect|verify` end to end on tiny inputs, and help for every option."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from data_shards.token_shards import read_manifest
from fusion_model import cli
from fusion_model.cli.shards import build_parser
from tokenizer.image import ImageTokenizer, ImageTokenizerConfig
from tokenizer.vocab import train_unified_vocab


def test_every_option_has_help():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "write" in a.choices).choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"shards {name} {action.option_strings or action.dest} has no help"


def test_help_shows_the_defaults_without_importing_torch(capsys):
    for action, shown in (("tokenize", ["[image, caption] (default: 0.5)", "flip decisions (default: 0)",
                                        "image-tokenizer call (default: 64)"]),
                          ("write", ["per shard (default: 10000)", "(MB) (default: 256.0)"])):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["shards", action, "--help"])
        assert exit_.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert all(default in text for default in shown) and "(default: None)" not in text
        assert "(default: False)" not in text and "(default: [])" not in text
    code = ("import sys\nfrom fusion_model import cli\ntry:\n    cli.main(['shards', 'tokenize', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip() == "False"


def test_write_tokenize_inspect(tmp_path, capsys):
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(np.full((16, 16, 3), 60 * i, dtype=np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a gray square number {i}")
    (folder / "bad.png").write_bytes(b"nope")
    (folder / "bad.txt").write_text("bad")
    (tmp_path / "book.txt").write_text("a gray square and some words")

    raw = tmp_path / "raw"
    assert cli.main(["shards", "write", "--out", str(raw), "--image-folder", str(folder), "--text",
                       str(tmp_path / "book.txt"), "--shard-max-docs", "2"]) == 0
    assert "wrote 4 documents (3 images) in 2 shards" in capsys.readouterr().out
    assert json.loads((raw / "manifest.json").read_text())["skipped"][0]["key"] == "bad"

    vocab_path = train_unified_vocab(["a gray square number", "and some words"] * 50, vocab_size=1024,
                                     image_codes=512).save(tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    config = ImageTokenizerConfig(image_size=16, base_channels=8, channel_multiplier=(1, 1, 1),
                                  num_res_blocks=1, latent_channels=8, norm_groups=4, codebook_size=64)
    ImageTokenizer(config).save_pretrained(tmp_path / "vq")
    tokens = tmp_path / "tokens"
    assert cli.main(["shards", "tokenize", str(raw), "--out", str(tokens), "--vocab", str(vocab_path),
                       "--image-tokenizer", str(tmp_path / "vq"), "--no-progress"]) == 0
    manifest = read_manifest(tokens)
    assert (manifest["documents"], manifest["images"], manifest["grid_shape"]) == (4, 3, [4, 4])

    capsys.readouterr()
    assert cli.main(["shards", "inspect", str(tokens), "--show", "2", "--vocab", str(vocab_path)]) == 0
    out = capsys.readouterr().out
    assert "<image (4, 4)>" in out and "a gray square number" in out
    assert "opened 2 shards, checksums match" in out
    assert cli.main(["shards", "verify", str(tokens)]) == 0
    assert "all 2 shards" in capsys.readouterr().out
    assert cli.main(["shards", "inspect", str(raw), "--show", "1"]) == 0
    assert "<image" in capsys.readouterr().out


def test_write_without_sources_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["shards", "write", "--out", str(tmp_path / "raw")]) == 2
    assert "at least one source" in capsys.readouterr().err


def test_strict_write_stops_at_a_bad_image(tmp_path, capsys):
    (tmp_path / "bad.png").write_bytes(b"nope")
    (tmp_path / "bad.txt").write_text("bad")
    assert cli.main(["shards", "write", "--out", str(tmp_path / "raw"), "--image-folder", str(tmp_path), "--strict"]) == 2
    assert "sample 'bad' rejected" in capsys.readouterr().err


def test_tokenize_of_a_missing_directory_says_what_to_run(tmp_path, capsys):
    code = cli.main(["shards", "tokenize", str(tmp_path / "nope"), "--out", str(tmp_path / "out"), "--vocab", "x.json"])
    assert code == 2 and "run `shards write`" in capsys.readouterr().err


def test_jsonl_text_key_and_a_second_write_into_the_same_directory(tmp_path, capsys):
    (tmp_path / "docs.jsonl").write_text('{"body": "first words"}\n{"body": "more words"}\n')
    write = ["shards", "write", "--out", str(tmp_path / "raw"), "--text", str(tmp_path / "docs.jsonl"),
             "--text-key", "body"]
    assert cli.main(write) == 0
    assert "wrote 2 documents" in capsys.readouterr().out
    assert cli.main(write) == 2  # FileExistsError is bad input too: one line, exit 2
    assert "already holds raw shards" in capsys.readouterr().err


def test_inspect_of_a_directory_without_a_manifest_or_with_a_broken_one(tmp_path, capsys):
    assert cli.main(["shards", "inspect", str(tmp_path)]) == 2
    assert "manifest.json not found" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text("{not json")
    assert cli.main(["shards", "inspect", str(tmp_path)]) == 2
    assert "train.py shards:" in capsys.readouterr().err


def test_verify_of_a_damaged_directory_names_the_bad_shard_and_exits_2(tmp_path, capsys):
    from data_shards.token_shards import write_manifest, write_token_shard

    info = {"vocab_fingerprint": "v", "image_tokenizer_fingerprint": "none", "vocab_size": 100}
    metas = [write_token_shard(tmp_path, f"s{i}", ["a", "b"], [[1, 2], [3, 4, 5]], info) for i in range(2)]
    write_manifest(tmp_path, {**info, "pad_id": 0}, metas)
    keys = tmp_path / "s1.keys.json"
    keys.write_text(keys.read_text().replace('"b"', '"c"'))
    assert cli.main(["shards", "verify", str(tmp_path)]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("BAD s1:") and str(keys) in out[0] and "shards tokenize` into a fresh directory" in out[0]
    assert out[1].startswith("1 of 2 shards") and len(out) == 2


def test_video_folder_write_tokenize_inspect_with_the_real_video_tokenizer_and_vocabulary(tmp_path, capsys):
    from tokenizer.video import VideoTokenizer, VideoTokenizerConfig
    from tokenizer.video.clips import write_mp4

    folder = tmp_path / "clips"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        clip = np.repeat(np.linspace(30, 220, 16, dtype=np.uint8)[None, None, :, None], 16, axis=1)
        clip = np.repeat(np.repeat(clip, 6, axis=0), 3, axis=-1)  # 6 frames: the first 4 are tokenized
        clip[:, 4:10, 4:10] = rng.integers(0, 255, 3).astype(np.uint8)
        write_mp4(clip, folder / f"clip{i}.mp4")
        (folder / f"clip{i}.txt").write_text(f"a square number {i}")
    np.save(folder / "array.npy", np.zeros((4, 16, 16, 3), np.uint8))
    (folder / "array.txt").write_text("a black clip")
    (folder / "short.npy").write_bytes(b"")  # no caption: skipped and listed

    raw = tmp_path / "raw"
    assert cli.main(["shards", "write", "--out", str(raw), "--video-folder", str(folder)]) == 0
    assert "wrote 3 documents (0 images, 3 clips) in 1 shards" in capsys.readouterr().out

    vocab_path = train_unified_vocab(["a square number", "a black clip"] * 50, vocab_size=512, image_codes=32,
                                     video=True).save(tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    config = VideoTokenizerConfig(image_size=16, clip_frames=4, codebook_size=32, embed_dim=4, latent_channels=4,
                                  base_channels=8, channel_multiplier=(1, 2), num_res_blocks=1, attn_resolutions=(),
                                  norm_groups=4)
    VideoTokenizer(config).save_pretrained(tmp_path / "video")
    tokens = tmp_path / "tokens"
    assert cli.main(["shards", "tokenize", str(raw), "--out", str(tokens), "--vocab", str(vocab_path),
                     "--image-tokenizer", str(tmp_path / "video"), "--no-progress", "--workers", "1",
                     "--flip-probability", "0"]) == 0
    assert "3 clips (4 frames -> 1x8x8 codes each)" in capsys.readouterr().out
    manifest = read_manifest(tokens)
    assert manifest["video_grid"] == [1, 8, 8] and manifest["clip_frames"] == 4 and manifest["grid_shape"] == [8, 8]
    from tokenizer.vocab import UnifiedVocab

    vocab = UnifiedVocab.load(vocab_path)
    assert (manifest["bov_id"], manifest["eov_id"]) == (vocab.bov_id, vocab.eov_id)
    from data_shards.token_shards import TokenShard

    shard = TokenShard(tokens, manifest["shards"][0]["name"], manifest["vocab_size"])
    ids = shard.ids[shard.offsets[0] : shard.offsets[1]].astype(np.int64).tolist()
    start = ids.index(vocab.bov_id)
    assert ids[start + 65] == vocab.eov_id and ids[0] == vocab.bos_id and ids[-1] == vocab.eos_id
    assert all(vocab.image_offset <= i < vocab.image_offset + 32 for i in ids[start + 1 : start + 65])
    assert cli.main(["shards", "verify", str(tokens)]) == 0
    capsys.readouterr()
    assert cli.main(["shards", "inspect", str(tokens), "--show", "1", "--vocab", str(vocab_path)]) == 0
    assert "<video (1, 8, 8)>" in capsys.readouterr().out
