"""Token shard format: compact ids, checked manifests, out-of-vocabulary ids named by shard and key."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_shards.raw import ShardError
from data_shards.token_shards import TokenShard, id_dtype, read_manifest, write_token_shard


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
