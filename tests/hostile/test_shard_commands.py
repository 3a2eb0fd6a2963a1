"""Hostile input met by the dataset index and the shard commands: `shards plan` on a read-only dataset, a bad
--seq-len, a raw or foreign directory; an index edited by hand or left stale by its manifest; `shards merge` of
ranks tokenized with other settings, of a missing rank or of another dataset's part (its printed advice, followed
literally, works); `shards verify` on an empty directory; `train.py vocab` given a continuous (KL) bundle, and the
vocabulary-without-video-markers advice. Each refusal is one line on stderr with exit code 2, and writes nothing."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from data_shards import plan as plan_module
from data_shards.plan import index_path, read_index
from data_shards.raw import RawShardWriter
from data_shards.stream import PackedTokenStream
from fusion_model import cli
from tokenizer.vocab import train_unified_vocab

SEQ_LEN = 8
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    """No launcher variables leak in from the shell that runs the tests (they would split every tokenize)."""
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)


def _one_line(capsys) -> str:
    """The command's stderr, checked to be one line."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> dict[str, Path]:
    """Raw text shards (3 documents, one per shard) from `shards write`, another raw directory, and a vocabulary."""
    root = tmp_path_factory.mktemp("text")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"hello world number {i}"}) + "\n" for i in range(3)))
    other = root / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"another world {i}"}) + "\n" for i in range(3)))
    for name, source in (("raw", corpus), ("other_raw", other)):
        assert cli.main(["shards", "write", "--out", str(root / name), "--text", str(source),
                         "--shard-max-docs", "1"]) == 0
    vocab = train_unified_vocab(["hello world number another"] * 50, vocab_size=1024, image_codes=16)
    return {"raw": root / "raw", "other_raw": root / "other_raw", "vocab": vocab.save(root / "tokenizer.json")}


def _tokenize(data: dict, out: Path, *extra: str, raw: str = "raw") -> int:
    return cli.main(["shards", "tokenize", str(data[raw]), "--out", str(out), "--vocab", str(data["vocab"]),
                     "--workers", "1", "--no-progress", *extra])


@pytest.fixture
def tokens(tmp_path, text_data, capsys) -> Path:
    """A token directory of the 3 text shards, with no index yet."""
    out = tmp_path / "tokens"
    assert _tokenize(text_data, out) == 0
    capsys.readouterr()
    return out


def _read_only(directory: Path, monkeypatch) -> None:
    """Make `directory` unwritable: chmod where that binds (not root), else the write answers what a read-only
    mount answers."""
    directory.chmod(0o555)
    if not os.access(directory, os.W_OK):
        return
    directory.chmod(0o755)

    def erofs(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(plan_module, "_atomic_save", erofs)


# ---- 1. `shards plan` on a read-only dataset -----------------------------------------------------------------------


def test_plan_on_a_read_only_dataset_says_it_cannot_write_and_that_fit_builds_the_index_in_memory(
        tokens, monkeypatch, capsys):
    _read_only(tokens, monkeypatch)
    try:
        assert cli.main(["shards", "plan", str(tokens), "--seq-len", str(SEQ_LEN)]) == 2
        err = _one_line(capsys)
        assert f"cannot write the dataset index in {tokens / 'plans'}" in err, err
        assert ("Read-only file system" in err or "Permission denied" in err) and "in memory" in err, err
        assert not (tokens / "plans").exists(), "nothing half made"
        # what the message promises: the stream (fit) reads the dataset as it is
        assert PackedTokenStream(tokens, SEQ_LEN, 2).num_rows > 0
    finally:
        tokens.chmod(0o755)


# ---- 2. a bad --seq-len, a raw or foreign directory ----------------------------------------------------------------


@pytest.mark.parametrize("seq_len", ["0", "-5"])
def test_plan_with_a_seq_len_below_1_exits_2_with_one_line(tokens, capsys, seq_len):
    assert cli.main(["shards", "plan", str(tokens), "--seq-len", seq_len]) == 2
    assert f"--seq-len {seq_len}: give the training sequence length" in _one_line(capsys)
    assert not (tokens / "plans").exists()


@pytest.mark.parametrize("command", ["plan", "verify"])
def test_a_raw_directory_is_named_as_raw_with_the_tokenize_step_to_run(text_data, capsys, command):
    raw = text_data["raw"]
    argv = ["shards", command, str(raw)] + (["--seq-len", str(SEQ_LEN)] if command == "plan" else [])
    assert cli.main(argv) == 2
    err = _one_line(capsys)
    assert f"{raw} is a raw shard directory (from `shards write`)" in err, err
    assert f"run `train.py shards tokenize {raw} --out TOKENS_DIR" in err and "vocab_fingerprint" not in err
    assert not (raw / "plans").exists()


@pytest.mark.parametrize("manifest", ['{"format": "something-else", "shards": []}', "[1, 2]"])
def test_a_foreign_manifest_says_what_a_token_directory_is(tmp_path, capsys, manifest):
    (tmp_path / "manifest.json").write_text(manifest)
    assert cli.main(["shards", "plan", str(tmp_path), "--seq-len", str(SEQ_LEN)]) == 2
    err = _one_line(capsys)
    assert "not a token shard manifest" in err and "the --out of `train.py shards tokenize`" in err, err
    assert not (tmp_path / "plans").exists()


# ---- 3. `shards merge` advice that works ---------------------------------------------------------------------------


def _follow_merge_advice(message: str) -> list[str]:
    """Delete the files the message lists; returns the flags it says to rerun the stale rank with."""
    listed = re.search(r"delete (.+?); then run", message)
    assert listed, message
    for path in listed[1].split(" "):
        Path(path).unlink()
    rerun = re.search(r"again \((--rank \d+ --world-size \d+)\) with (.+?), as rank", message)
    assert rerun, message
    flags = rerun[1].split()
    return flags + (rerun[2].split() if rerun[2].startswith("--") else [])


def test_merge_of_a_rank_tokenized_with_another_seed_gives_advice_that_works_when_followed(
        tmp_path, text_data, capsys):
    one = tmp_path / "one"
    assert _tokenize(text_data, one) == 0
    out = tmp_path / "split"
    assert _tokenize(text_data, out, "--rank", "0", "--world-size", "2") == 0
    assert _tokenize(text_data, out, "--rank", "1", "--world-size", "2", "--seed", "5") == 0
    capsys.readouterr()
    assert cli.main(["shards", "merge", str(out)]) == 2
    err = _one_line(capsys)
    assert "rank 0 (seed 0); rank 1 (seed 5)" in err, err
    assert f"{out / 'manifest.part-00001-of-00002.json'} {out / 'shard-000001.meta.json'}" in err, err
    flags = _follow_merge_advice(err)
    assert flags == ["--rank", "1", "--world-size", "2", "--seed", "0"]
    assert _tokenize(text_data, out, *flags) == 0, capsys.readouterr().err
    assert (out / "manifest.json").read_bytes() == (one / "manifest.json").read_bytes()


def test_merge_of_another_datasets_part_gives_advice_that_works_when_followed(tmp_path, text_data, capsys):
    out, foreign = tmp_path / "split", tmp_path / "foreign"
    for directory, raw in ((out, "raw"), (foreign, "other_raw")):
        for rank in (0, 1):
            assert _tokenize(text_data, directory, "--rank", str(rank), "--world-size", "2", raw=raw) == 0
    (out / "manifest.json").unlink()
    part = "manifest.part-00001-of-00002.json"
    (out / part).write_bytes((foreign / part).read_bytes())
    capsys.readouterr()
    assert cli.main(["shards", "merge", str(out)]) == 2
    err = _one_line(capsys)
    assert "other raw shards" in err and "the same raw directory and settings" in err, err
    flags = _follow_merge_advice(err)
    assert _tokenize(text_data, out, *flags) == 0
    assert json.loads((out / "manifest.json").read_text())["documents"] == 3


def test_merge_with_a_missing_rank_names_it_and_writes_nothing(tmp_path, text_data, capsys):
    out = tmp_path / "split"
    assert _tokenize(text_data, out, "--rank", "0", "--world-size", "2") == 0
    capsys.readouterr()
    assert cli.main(["shards", "merge", str(out)]) == 2
    assert "rank 1 of 2 has not finished" in _one_line(capsys)
    assert not (out / "manifest.json").exists()


def test_verify_of_an_empty_directory_exits_2_with_one_line(tmp_path, capsys):
    assert cli.main(["shards", "verify", str(tmp_path)]) == 2
    assert "is not a token shard directory (run `shards tokenize`)" in _one_line(capsys)


# ---- 4. an edited or stale index is never trusted -------------------------------------------------------------------


def _manifest_header(tokens: Path) -> dict:
    return {k: v for k, v in json.loads((tokens / "manifest.json").read_text()).items() if k != "shards"}


@pytest.mark.parametrize("read_only", [False, True])
def test_an_index_whose_header_was_edited_is_made_again_from_the_manifest_naming_it(
        tokens, capsys, monkeypatch, read_only):
    assert cli.main(["shards", "plan", str(tokens), "--seq-len", str(SEQ_LEN)]) == 0
    stored = json.loads(index_path(tokens).read_text())
    stored["header"]["vocab_size"] = 2048  # what the manifest says is 1024
    index_path(tokens).write_text(json.dumps(stored))
    capsys.readouterr()
    if read_only:
        _read_only(tokens, monkeypatch)
    try:
        assert read_index(tokens).header == _manifest_header(tokens)
        err = _one_line(capsys)
        assert f"dataset index: {index_path(tokens)} does not match its checksum" in err, err
        assert PackedTokenStream(tokens, SEQ_LEN, 2).manifest["vocab_size"] == 1024
    finally:
        tokens.chmod(0o755)
    if not read_only:
        assert json.loads(index_path(tokens).read_text())["header"]["vocab_size"] == 1024, "written back"


def test_an_index_left_stale_by_a_manifest_with_the_same_size_and_mtime_is_made_again(tokens, capsys):
    assert cli.main(["shards", "plan", str(tokens), "--seq-len", str(SEQ_LEN)]) == 0
    manifest = tokens / "manifest.json"
    before = manifest.stat()
    text = manifest.read_text()
    assert '"vocab_size": 1024' in text
    # re-written with another vocab_size of the same width, and its mtime given back (`cp -p`, `touch -r`)
    manifest.write_text(text.replace('"vocab_size": 1024', '"vocab_size": 2048'))
    os.utime(manifest, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert manifest.stat().st_size == before.st_size
    assert read_index(tokens).header["vocab_size"] == 2048
    assert PackedTokenStream(tokens, SEQ_LEN, 2).manifest == _manifest_header(tokens)


# ---- other hostile input to the index ------------------------------------------------------------------------------


def test_a_plans_file_in_place_of_the_folder_is_named_by_plan_and_fit_still_reads_the_data(tokens, capsys):
    (tokens / "plans").write_text("not a folder")
    assert cli.main(["shards", "plan", str(tokens), "--seq-len", str(SEQ_LEN)]) == 2
    err = _one_line(capsys)
    assert f"{tokens / 'plans'} is a file, not a directory; move it away" in err, err
    assert PackedTokenStream(tokens, SEQ_LEN, 2).num_rows > 0


@pytest.mark.parametrize("damage", ["truncated", "not json", "a list"])
def test_a_damaged_index_is_made_again_with_one_line(tokens, capsys, damage):
    assert cli.main(["shards", "plan", str(tokens), "--seq-len", str(SEQ_LEN)]) == 0
    path = index_path(tokens)
    good = path.read_text()
    path.write_text({"truncated": good[: len(good) // 2], "not json": "{{{", "a list": "[]"}[damage])
    capsys.readouterr()
    assert PackedTokenStream(tokens, SEQ_LEN, 2).manifest == _manifest_header(tokens)
    assert f"dataset index: {path}" in _one_line(capsys)
    assert cli.main(["shards", "plan", str(tokens), "--seq-len", str(SEQ_LEN)]) == 0


# ---- 5. `train.py vocab` with a continuous bundle; the advice for a vocabulary without video markers --------------


def test_vocab_refuses_a_continuous_bundle_and_its_advice_builds_a_vocabulary_that_tokenizes_latents(
        tmp_path, capsys):
    from tokenizer.image import ImageTokenizerConfig
    from tokenizer.image.continuous import ContinuousImageTokenizer

    torch.manual_seed(0)
    config = ImageTokenizerConfig(image_size=16, base_channels=8, channel_multiplier=(1, 1, 1), num_res_blocks=1,
                                  latent_channels=8, norm_groups=4, bottleneck="kl", embed_dim=4)
    ContinuousImageTokenizer(config).save_pretrained(tmp_path / "kl")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a gray square\n" * 50)
    out = tmp_path / "vocab" / "tokenizer.json"
    argv = ["vocab", "--corpus", str(corpus), "--out", str(out), "--vocab-size", "512", "--no-progress"]
    assert cli.main([*argv, "--image-tokenizer", str(tmp_path / "kl")]) == 2
    err = _one_line(capsys)
    assert "is a continuous (KL) image tokenizer" in err and "without --image-tokenizer" in err, err
    assert not out.parent.exists(), "nothing written"
    # the advice: the vocabulary without the bundle (a small image block: --vocab-size 512 holds no 8,192 codes),
    # the bundle at `shards tokenize`
    assert cli.main([*argv, "--image-codes", "16"]) == 0
    with RawShardWriter(tmp_path / "raw") as writer:
        writer.add("cat", ["a gray square", Image.fromarray(np.full((16, 16, 3), 90, dtype=np.uint8))])
    assert cli.main(["shards", "tokenize", str(tmp_path / "raw"), "--out", str(tmp_path / "tok"), "--vocab",
                     str(out), "--image-tokenizer", str(tmp_path / "kl"), "--workers", "1", "--no-progress",
                     "--device", "cpu"]) == 0
    assert json.loads((tmp_path / "tok" / "manifest.json").read_text())["feature_kind"] == "latent"


def test_tokenizing_clips_with_a_vocabulary_without_video_markers_prints_a_vocab_command_that_works(
        tmp_path, capsys):
    from tokenizer.video import VideoTokenizer, VideoTokenizerConfig

    torch.manual_seed(0)
    config = VideoTokenizerConfig(image_size=16, clip_frames=4, codebook_size=32, embed_dim=4, latent_channels=4,
                                  base_channels=8, channel_multiplier=(1, 2), num_res_blocks=1, attn_resolutions=(),
                                  norm_groups=4)
    bundle = tmp_path / "video"
    VideoTokenizer(config).save_pretrained(bundle)
    clip = np.zeros((4, 16, 16, 3), dtype=np.uint8)
    clip[:, 4:12, 4:12] = 200
    with RawShardWriter(tmp_path / "raw") as writer:
        writer.add("clip", ["a white square", clip])
    no_video = train_unified_vocab(["a white square"] * 50, vocab_size=512, image_codes=32)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a white square\n" * 50)

    def tokenize(vocab: Path) -> int:
        return cli.main(["shards", "tokenize", str(tmp_path / "raw"), "--out", str(tmp_path / "tok"), "--vocab",
                         str(vocab), "--image-tokenizer", str(bundle), "--workers", "1", "--no-progress",
                         "--device", "cpu"])

    assert tokenize(no_video.save(tmp_path / "no-video.json")) == 2
    err = _one_line(capsys)
    command = re.search(r"`train\.py (vocab [^`]+)`", err)
    assert command and "--video" in command[1], err
    filled = (command[1].replace("VIDEO_BUNDLE", str(bundle)).replace("TEXT", str(corpus))
              .replace("tokenizer.json", str(tmp_path / "video-vocab.json")))
    assert cli.main(filled.split()[:1] + filled.split()[1:]) == 0
    assert tokenize(tmp_path / "video-vocab.json") == 0
    assert json.loads((tmp_path / "tok" / "manifest.json").read_text())["video_grid"]
