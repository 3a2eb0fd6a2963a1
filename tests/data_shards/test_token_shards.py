"""Token shard format: compact ids, checked manifests and checksums, damaged shards named by file and key."""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np
import pytest

from data_shards.raw import ShardError
from data_shards.stream import PackedTokenStream
from data_shards.token_shards import TokenShard, id_dtype, read_manifest, verify_token_dir, write_token_shard
from fusion_model import cli


def test_round_trip_with_compact_ids(tmp_path, tok):
    documents = tok.make_documents(10)
    tok.make_token_dir(tmp_path, documents, per_shard=4)
    manifest = read_manifest(tmp_path)
    assert (manifest["documents"], manifest["tokens"]) == (10, sum(map(len, documents)))
    assert [s["documents"] for s in manifest["shards"]] == [4, 4, 2]
    shard = TokenShard(tmp_path, "shard-000001", tok.VOCAB_SIZE)
    assert shard.ids.dtype == np.uint16 and shard.keys == ["doc-4", "doc-5", "doc-6", "doc-7"]
    assert shard.ids[shard.offsets[1] : shard.offsets[2]].tolist() == documents[5]
    assert id_dtype(65_536) == np.uint16 and id_dtype(65_537) == np.uint32


def test_writing_an_id_outside_the_vocabulary_names_shard_and_key(tmp_path):
    info = {"vocab_size": 100}
    with pytest.raises(ShardError, match=r"shard s0, key 'b': token id 100 outside the vocabulary"):
        write_token_shard(tmp_path, "s0", ["a", "b"], [[1, 2], [3, 100]], info)
    assert not list(tmp_path.iterdir()), "nothing is written for a failed shard"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("vocab_fingerprint"), "vocab_fingerprint"),
        (lambda m: m.update(format="something-else"), "format"),
        (lambda m: m.update(shards=[]), "lists no shards"),
        (lambda m: m["shards"][0].update(max_id=5000), "holds id 5000 >= vocab_size"),
        (lambda m: m["shards"][0].update(name="shard-000099"), "missing file shard-000099.ids.npy"),
    ],
)
def test_manifest_is_validated(tmp_path, tok, edit, message):
    tok.make_token_dir(tmp_path, tok.make_documents(5))
    path = tmp_path / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=message):
        read_manifest(tmp_path)


def test_missing_manifest_says_what_to_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="shards tokenize"):
        read_manifest(tmp_path)


def test_corrupt_offsets_are_detected(tmp_path, tok):
    tok.make_token_dir(tmp_path, tok.make_documents(5))
    np.save(tmp_path / "shard-000000.offsets.npy", np.array([0, 3, 2, 9, 10, 11], dtype=np.int64))
    with pytest.raises(ShardError, match="shard shard-000000: offsets"):
        TokenShard(tmp_path, "shard-000000", tok.VOCAB_SIZE)


def test_pickled_arrays_are_never_loaded(tmp_path, tok):
    tok.make_token_dir(tmp_path, tok.make_documents(5))
    np.save(tmp_path / "shard-000000.ids.npy", np.array([{"evil": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ShardError, match="unreadable token shard"):
        TokenShard(tmp_path, "shard-000000", tok.VOCAB_SIZE)


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-2] ^= 1  # the low byte of the last id: still inside the vocabulary
    path.write_bytes(bytes(data))


def _damage_header(path):
    data = path.read_bytes()
    end = data.index(b"}")
    path.write_bytes(data[:end] + b" " + data[end + 1 :])  # an unclosed dict: numpy's parser gives up


def _id_out_of_range(path):
    ids = np.load(path)
    ids[3] = 60000
    np.save(path, ids)


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-3])


CORRUPTIONS = {"flipped-byte": _flip_last_byte, "npy-header": _damage_header, "id-out-of-range": _id_out_of_range,
               "truncated": _truncate}


def test_written_shards_record_checksums_of_their_files(tmp_path, tok):
    tok.make_token_dir(tmp_path, tok.make_documents(5))
    meta = json.loads((tmp_path / "shard-000000.meta.json").read_text())
    assert sorted(meta["files"]) == ["shard-000000.ids.npy", "shard-000000.keys.json", "shard-000000.offsets.npy"]
    for name, recorded in meta["files"].items():
        data = (tmp_path / name).read_bytes()
        assert recorded == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert read_manifest(tmp_path)["shards"][0]["files"] == meta["files"]
    assert verify_token_dir(tmp_path)[1] == []


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_a_damaged_shard_is_named_by_the_stream_and_by_shards_verify(tmp_path, tok, capsys, corrupt):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(10))
    path = token_dir / "shard-000001.ids.npy"
    corrupt(path)
    with pytest.raises(ValueError, match=re.escape(str(path))) as info:
        list(PackedTokenStream(token_dir, 32, 2))  # checked when the stream first opens the shard
    assert "shards tokenize` into a fresh directory" in str(info.value)
    assert cli.main(["shards", "verify", str(token_dir)]) == 2
    out = capsys.readouterr().out.splitlines()
    bad = [line for line in out if line.startswith("BAD ")]
    assert len(bad) == 1 and bad[0].startswith("BAD shard-000001:") and str(path) in bad[0], out
    assert cli.main(["shards", "inspect", str(token_dir)]) == 2
    assert str(path) in capsys.readouterr().err


def test_shards_verify_checks_ids_and_counts_beyond_the_checksums(tmp_path, tok, capsys):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(10))
    assert cli.main(["shards", "verify", str(token_dir)]) == 0
    assert "all 2 shards" in capsys.readouterr().out
    manifest = json.loads((token_dir / "manifest.json").read_text())
    manifest["vocab_size"] = 10  # the files are intact, but hold ids of a 1000-entry vocabulary
    for shard in manifest["shards"]:
        shard["max_id"] = 5
    manifest["shards"][1]["documents"] = 99
    (token_dir / "manifest.json").write_text(json.dumps(manifest))
    assert cli.main(["shards", "verify", str(token_dir)]) == 2
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("BAD shard-000000: shard shard-000000, key 'doc-0'") and ">= vocab_size 10" in out[0]
    assert out[1].startswith("BAD shard-000001:") and "the manifest says 99 documents, its meta 3" in out[1]
    assert out[2].startswith("2 of 2 shards")
