"""Pre-tokenization split across ranks: two `shards tokenize --world-size 2` processes plus the merge give the bytes one
process writes; restarts skip finished shards unless another device or dtype made their codes; `shards verify` splits
across ranks; features streamed to disk in chunks give the file `np.save` writes."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_shards import pretokenize as pretokenize_module
from data_shards import token_shards
from data_shards.pretokenize import merge_parts, part_name, pretokenize
from data_shards.ranks import process_split, rank_subset
from data_shards.raw import ShardError
from data_shards.token_shards import (
    FEATURES_FILE,
    FeatureWriter,
    write_token_shard,
)
from fusion_model import cli

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def _image(i: int) -> Image.Image:
    rng = np.random.default_rng(i)
    return Image.fromarray(rng.integers(0, 256, size=(16, 16, 3), dtype=np.uint8))


# 5 raw shards of 3 documents (the last of 1): rank 0 of 2 gets shards 0, 2, 4 (6 images) and rank 1 gets shards 1, 3
# (3 + 6 images)
DOCS = {
    **{f"pair{i}": [f"the digit {['one', 'two'][i % 2]}", _image(i)] for i in range(10)},
    "mixed": ["some interleaved text", _image(100), "here", _image(101)],
    "three": [_image(102), "a photo of a cat", _image(103), _image(104)],
    "plain": ["a photo of a cat"],
}


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    """No launcher variables leak in from the shell that runs the tests."""
    for name in LAUNCHER:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, vocab, image_tokenizer):
    """The vocabulary and image tokenizer on disk, as the CLI loads them."""
    path = tmp_path_factory.mktemp("bundle")
    image_tokenizer.save_pretrained(path / "vq")
    return {"vocab": vocab.save(path / "tokenizer.json"), "vq": path / "vq"}


def _tokenize_argv(raw_dir, out, bundle, *extra) -> list[str]:
    return ["shards", "tokenize", str(raw_dir), "--out", str(out), "--vocab", str(bundle["vocab"]), "--image-tokenizer",
            str(bundle["vq"]), "--features", "--batch-size", "3", "--workers", "1", "--device", "cpu",
            "--no-progress", *extra]


def _files(directory: Path) -> dict[str, bytes]:
    """Every file of a token directory but the per-rank parts, by name."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
            if p.is_file() and not p.name.startswith("manifest.part-")}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, raw_dir, bundle):
    """The token directory of a one-process `shards tokenize --features`."""
    out = tmp_path_factory.mktemp("one") / "tok"
    assert cli.main(_tokenize_argv(raw_dir, out, bundle)) == 0
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, raw_dir, bundle):
    """The same, as two concurrent `--world-size 2` processes (ranks 0 and 1), as a user would launch them."""
    out = tmp_path_factory.mktemp("two") / "tok"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    logs = [out.parent / f"rank{rank}.log" for rank in (0, 1)]
    processes = [subprocess.Popen([sys.executable, str(REPO / "train.py"),
                                   *_tokenize_argv(raw_dir, out, bundle, "--rank", str(rank), "--world-size", "2")],
                                  cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
                  for rank, log in zip((0, 1), logs)]
    try:
        codes = [process.wait(timeout=300) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]
    return out, [log.read_text() for log in logs]


def test_two_ranks_write_the_bytes_of_one_process(one_process, two_ranks):
    out, logs = two_ranks
    assert all("rank" in log for log in logs)
    # one of them finished last, found both parts and wrote the manifest
    assert sum("(all 2 ranks' parts merged)" in log for log in logs) >= 1, logs
    one = _files(one_process)
    assert sorted(one) == sorted(_files(out)) and any(name.endswith(FEATURES_FILE) for name in one)
    assert _files(out) == one, "shards, metas, features and the manifest are byte-identical"
    parts = [json.loads((out / part_name(rank, 2)).read_text()) for rank in (0, 1)]
    assert [[item["entry"]["name"] for item in part["shards"]] for part in parts] == [
        ["shard-000000", "shard-000002", "shard-000004"], ["shard-000001", "shard-000003"]]
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["encoder_device"], manifest["encoder_dtype"]) == ("cpu", "float32")


def test_shards_merge_rewrites_the_same_manifest(one_process, two_ranks, tmp_path, capsys):
    out, _ = two_ranks
    copy = tmp_path / "tok"
    copy.mkdir()
    for path in out.iterdir():
        if path.name != "manifest.json":
            (copy / path.name).write_bytes(path.read_bytes())
    assert cli.main(["shards", "merge", str(copy)]) == 0
    assert "token shards at" in capsys.readouterr().out
    assert (copy / "manifest.json").read_bytes() == (one_process / "manifest.json").read_bytes()
    # a missing part names the rank still to run; nothing is written
    (copy / "manifest.json").unlink()
    (copy / part_name(1, 2)).unlink()
    assert cli.main(["shards", "merge", str(copy)]) == 2
    assert "rank 1 of 2 has not finished (no manifest.part-00001-of-00002.json)" in capsys.readouterr().err
    assert not (copy / "manifest.json").exists()


def _copy_dir(source: Path, target: Path) -> Path:
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


class _CountingTokenizer:
    """Wraps the image tokenizer and counts the images it encodes (to see which shards a rerun redoes)."""

    def __init__(self, inner):
        self.inner, self.grid_shape, self.config, self.images = inner, inner.grid_shape, inner.config, 0
        self.calls: list[dict] = []

    def encode_with_features(self, images, **sizes):
        self.images += len(images)
        self.calls.append(sizes)
        return self.inner.encode_with_features(images, **sizes)

    def fingerprint(self):
        return self.inner.fingerprint()


def _rank(raw_dir, out, vocab, image_tokenizer, rank):
    return pretokenize(raw_dir, out, vocab, image_tokenizer, batch_size=3, progress=False, features=True, rank=rank,
                       world_size=2)


def test_a_restarted_rank_redoes_only_its_unfinished_shard(two_ranks, tmp_path, raw_dir, vocab, image_tokenizer):
    out = _copy_dir(two_ranks[0], tmp_path / "tok")
    before = _files(out)
    # rank 1 was killed in shard 1 (its meta is written last) before writing its part; the old manifest stays
    (out / "shard-000001.meta.json").unlink()
    (out / part_name(1, 2)).unlink()
    counting = _CountingTokenizer(image_tokenizer)
    waiting = _rank(raw_dir, out, vocab, counting, 0)  # rank 0 restarted first: nothing to do, no merge yet
    assert counting.images == 0 and waiting["waiting"] == "rank 1 of 2 has not finished yet"
    manifest = _rank(raw_dir, out, vocab, counting, 1)
    assert counting.images == 3, "only shard 1 (3 pair documents) is encoded again"
    assert counting.calls == [{}], "on the CPU the tokenizer's own batching, as before"
    assert manifest["format"] != pretokenize_module.PART_FORMAT, "rank 0's part is there: rank 1 merges"
    assert _files(out) == before
    # rank 0 rerun: all its shards skipped, nothing encoded, the same manifest
    counting = _CountingTokenizer(image_tokenizer)
    assert _rank(raw_dir, out, vocab, counting, 0) == manifest and counting.images == 0


def test_codes_of_another_device_or_dtype_are_redone_and_never_merged(two_ranks, tmp_path, raw_dir, vocab,
                                                                       image_tokenizer, monkeypatch, capsys):
    out = _copy_dir(two_ranks[0], tmp_path / "tok")
    gpu = {"encoder_device": "cuda:Some GPU", "encoder_dtype": "float32"}
    monkeypatch.setattr(pretokenize_module, "encoder_key", lambda tokenizer: dict(gpu))
    counting = _CountingTokenizer(image_tokenizer)
    waiting = _rank(raw_dir, out, vocab, counting, 1)
    assert counting.images == 9, "every shard of rank 1 (1 and 3: 9 images) is encoded again on the other device"
    assert counting.calls == [{"batch_size": 3}] * 3, "on a GPU, one encoder call per batch"
    assert "encoded on cpu float32 are tokenized again on cuda:Some GPU float32" in capsys.readouterr().err
    metas = [json.loads((out / f"shard-00000{i}.meta.json").read_text()) for i in range(5)]
    assert [m["encoder_device"] for m in metas] == ["cpu", "cuda:Some GPU", "cpu", "cuda:Some GPU", "cpu"]
    # rank 0's codes are the CPU's: the parts are not merged, and the reason names the devices
    assert waiting["format"] == pretokenize_module.PART_FORMAT
    assert "different devices or dtypes (cpu float32; cuda:Some GPU float32)" in waiting["waiting"]
    with pytest.raises(ShardError, match="different devices or dtypes"):
        merge_parts(out)
    # rank 0 on the same device and dtype as rank 1: its shards redone, then the parts merge
    counting = _CountingTokenizer(image_tokenizer)
    manifest = _rank(raw_dir, out, vocab, counting, 0)
    assert counting.images == 6 and manifest["encoder_device"] == "cuda:Some GPU"
    assert [s["name"] for s in manifest["shards"]] == [f"shard-00000{i}" for i in range(5)]
    # and a bfloat16 encoder is another key again
    gpu["encoder_dtype"] = "bfloat16"
    counting = _CountingTokenizer(image_tokenizer)
    _rank(raw_dir, out, vocab, counting, 0)
    assert counting.images == 6


def test_shards_from_before_the_encoder_key_count_as_cpu_float32(two_ranks, tmp_path, raw_dir, vocab,
                                                                  image_tokenizer):
    out = _copy_dir(two_ranks[0], tmp_path / "tok")
    for path in out.glob("*.meta.json"):
        meta = json.loads(path.read_text())
        del meta["encoder_device"], meta["encoder_dtype"]
        path.write_text(json.dumps(meta))
    counting = _CountingTokenizer(image_tokenizer)
    _rank(raw_dir, out, vocab, counting, 0)
    assert counting.images == 0, "reused: old shards were made on the CPU in float32"


def test_a_part_left_by_a_run_over_other_raw_shards_is_not_merged(two_ranks, tmp_path):
    out = _copy_dir(two_ranks[0], tmp_path / "tok")
    path = out / part_name(1, 2)
    part = json.loads(path.read_text())
    path.write_text(json.dumps({**part, "raw_manifest_sha256": "0" * 64}))
    with pytest.raises(ShardError, match=r"other raw shards.*rank 0; rank 1"):
        merge_parts(out)
    path.write_text(json.dumps(part))
    (out / "shard-000003.meta.json").unlink()  # rank 1 redoing its shard 3 right now
    with pytest.raises(ShardError, match="shard shard-000003 is not the one rank 1 finished"):
        merge_parts(out)


def test_rank_subsets_are_disjoint_and_cover_every_name():
    names = [f"s{i:03d}" for i in range(17)][::-1]
    for world_size in (1, 2, 3, 8, 20):
        subsets = [rank_subset(names, rank, world_size) for rank in range(world_size)]
        assert sorted(n for s in subsets for n in s) == sorted(names)
    assert rank_subset(names, 1, 8) == {"s001", "s009"}
    with pytest.raises(ValueError, match="rank 2 of world size 2"):
        rank_subset(names, 2, 2)


def test_the_split_comes_from_the_flags_then_torchrun_then_slurm():
    assert process_split(environ={}) == (0, 1, "one process")
    assert process_split(1, 4, environ={"RANK": "0", "WORLD_SIZE": "2"}) == (1, 4, "--rank/--world-size")
    assert process_split(environ={"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "3", "SLURM_NTASKS": "4"}) == (
        1, 2, "RANK/WORLD_SIZE")
    assert process_split(environ={"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}) == (3, 4, "SLURM_PROCID/SLURM_NTASKS")
    with pytest.raises(ValueError, match="together"):
        process_split(rank=1, environ={})
    with pytest.raises(ValueError, match=r"rank 4 of world size 4 \(from SLURM_PROCID/SLURM_NTASKS\)"):
        process_split(environ={"SLURM_PROCID": "4", "SLURM_NTASKS": "4"})


def test_verify_split_across_two_ranks_checks_every_shard_once(tmp_path, tok, monkeypatch, capsys):
    tok.make_token_dir(tmp_path, tok.make_documents(20), per_shard=4)  # 5 shards
    checked: list[str] = []
    real = token_shards.verify_shard
    monkeypatch.setattr(token_shards, "verify_shard", lambda d, entry, *rest: (checked.append(entry["name"]), real(d, entry, *rest)))
    per_rank = []
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))  # as torchrun runs it
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert cli.main(["shards", "verify", str(tmp_path)]) == 0
        per_rank.append(list(checked))
        checked.clear()
        out = capsys.readouterr().out
        assert f"rank {rank} of 2: all {len(per_rank[-1])} shards it checked (of 5)" in out
    assert sorted(per_rank[0] + per_rank[1]) == [f"shard-00000{i}" for i in range(5)]
    assert not set(per_rank[0]) & set(per_rank[1])
    # a damaged shard: only the rank that owns it says BAD and exits 2; the flags override the environment
    bad = tmp_path / "shard-000003.ids.npy"
    data = bytearray(bad.read_bytes())
    data[-2] ^= 1
    bad.write_bytes(bytes(data))
    owner = 0 if "shard-000003" in per_rank[0] else 1
    codes = {rank: cli.main(["shards", "verify", str(tmp_path), "--rank", str(rank), "--world-size", "2"])
             for rank in (0, 1)}
    assert codes == {owner: 2, 1 - owner: 0}
    out = capsys.readouterr().out
    assert out.count("BAD shard-000003:") == 1 and f"rank {owner} of 2: 1 of the" in out
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert cli.main(["shards", "verify", str(tmp_path)]) == 2  # one process: today's messages
    out = capsys.readouterr().out
    assert "1 of 5 shards in" in out and "rank" not in out


@pytest.mark.parametrize("chunks", [[], [0], [3], [1, 4, 2], [5, 0, 7]])
def test_features_written_in_chunks_are_the_bytes_of_np_save(tmp_path, chunks):
    rng = np.random.default_rng(len(chunks))
    rows = [rng.standard_normal((n, 8)).astype(np.float32) for n in chunks]
    whole = np.concatenate(rows) if rows else np.zeros((0, 8), dtype=np.float32)
    buffer = io.BytesIO()
    np.save(buffer, whole.astype(np.float16), allow_pickle=False)
    with FeatureWriter(tmp_path, "s0", 8) as writer:
        for chunk in rows:
            writer.write(chunk)
        checked = writer.finish()
    data = (tmp_path / f"s0{FEATURES_FILE}").read_bytes()
    assert data == buffer.getvalue()
    assert checked == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert [p.name for p in tmp_path.iterdir()] == [f"s0{FEATURES_FILE}"], "no temporary left"


def test_a_shard_with_streamed_features_equals_one_written_whole(tmp_path):
    rng = np.random.default_rng(0)
    features = rng.standard_normal((32, 8)).astype(np.float16)
    info = {"vocab_size": 100}
    whole = write_token_shard(tmp_path / "whole", "s0", ["a", "b"], [[1, 2], [3, 4, 5]], info, features=features)
    with FeatureWriter(tmp_path / "chunks", "s0", 8) as writer:
        for start in range(0, 32, 16):
            writer.write(features[start : start + 16])
        chunked = write_token_shard(tmp_path / "chunks", "s0", ["a", "b"], [[1, 2], [3, 4, 5]], info,
                                    features=writer)
    assert chunked == whole
    assert _files(tmp_path / "chunks") == _files(tmp_path / "whole")
    # a shard refused before its meta leaves no features file, not even a temporary one
    with pytest.raises(ShardError, match="outside the vocabulary"), FeatureWriter(tmp_path / "bad", "s0", 8) as writer:
        writer.write(features)
        write_token_shard(tmp_path / "bad", "s0", ["a"], [[100]], info, features=writer)
    assert list((tmp_path / "bad").iterdir()) == []
