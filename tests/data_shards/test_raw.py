"""Raw shards: the writer round-trips documents; the reader refuses unsafe or broken shards, naming shard and key."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
from PIL import Image

from data_shards.raw import RawShardWriter, ShardError, iter_raw_shard, read_raw_manifest


def _image(color=(200, 30, 30), size=(12, 10)) -> Image.Image:
    return Image.new("RGB", size, color)


def _tar(path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_writer_round_trips_interleaved_documents_and_splits_shards(tmp_path):
    docs = {f"doc{i}": ["caption", _image((i * 20, 0, 0)), "more text", _image()] for i in range(5)}
    with RawShardWriter(tmp_path, shard_max_docs=2) as writer:
        for key, segments in docs.items():
            writer.add(key, segments)
        writer.skip("broken", "unreadable image")
    manifest = read_raw_manifest(tmp_path)
    assert (manifest["documents"], manifest["images"], manifest["text_segments"]) == (5, 10, 10)
    assert [s["documents"] for s in manifest["shards"]] == [2, 2, 1]
    assert manifest["skipped"] == [{"key": "broken", "reason": "unreadable image"}]
    read = {}
    for shard in manifest["shards"]:
        read.update(iter_raw_shard(tmp_path / shard["name"]))
    assert list(read) == list(docs)
    for key, segments in read.items():
        assert [s if isinstance(s, str) else "IMG" for s in segments] == ["caption", "IMG", "more text", "IMG"]
        first = Image.open(io.BytesIO(segments[1][1]))
        assert first.size == (12, 10) and first.getpixel((0, 0)) == docs[key][1].getpixel((0, 0))
    names = ["manifest.json"] + [shard["name"] for shard in manifest["shards"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names), "no temporary files are left behind"


def test_a_failing_writer_leaves_no_shard_and_no_temporary_file(tmp_path):
    with pytest.raises(RuntimeError, match="crash"), RawShardWriter(tmp_path, shard_max_docs=1) as writer:
        writer.add("done", ["finished shard"])
        writer.add("half", ["open shard"])  # starts a second shard, never finished
        raise RuntimeError("crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-000000.tar"]


def test_writer_limits_shard_bytes(tmp_path):
    with RawShardWriter(tmp_path, shard_max_bytes=4000) as writer:
        for i in range(6):
            writer.add(f"k{i}", ["x" * 1500])
    assert len(read_raw_manifest(tmp_path)["shards"]) >= 3


def test_writer_rejects_bad_keys_duplicates_and_types(tmp_path):
    with RawShardWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match="invalid sample key"):
            writer.add("a.b", ["text"])
        with pytest.raises(ValueError, match="invalid sample key"):
            writer.add("../escape", ["text"])
        writer.add("a", ["text"])
        with pytest.raises(ValueError, match="duplicate sample key 'a'"):
            writer.add("a", ["text"])
        with pytest.raises(TypeError, match="segment 0"):
            writer.add("b", [3])


def test_strict_writer_raises_on_skip(tmp_path):
    with pytest.raises(ValueError, match="sample 'bad' rejected: decode error"):
        with RawShardWriter(tmp_path, strict=True) as writer:
            writer.skip("bad", "decode error")


@pytest.mark.parametrize("ext", ["pyd", "pickle", "pth"])
def test_pickle_members_are_refused(tmp_path, ext):
    path = tmp_path / "evil.tar"
    _tar(path, {"k1.json": b'{"segments": [{"text": "hi"}]}', f"k1.{ext}": b"cos\nsystem\n(S'echo pwned'\ntR."})
    with pytest.raises(ShardError, match=rf"shard evil.tar, key 'k1'.*\.{ext} members can hold pickled code"):
        list(iter_raw_shard(path))


def test_truncated_tar_names_shard_and_last_key(tmp_path):
    good = tmp_path / "good.tar"
    _tar(good, {f"k{i}.json": json.dumps({"segments": [{"text": "x" * 3000}]}).encode() for i in range(3)})
    cut = tmp_path / "cut.tar"
    cut.write_bytes(good.read_bytes()[:5000])
    with pytest.raises(ShardError, match=r"shard cut.tar.*(truncated|unreadable)"):
        list(iter_raw_shard(cut))


def test_json_referencing_a_missing_image(tmp_path):
    path = tmp_path / "s.tar"
    _tar(path, {"k1.json": b'{"segments": [{"text": "a"}, {"image": 0}]}'})
    with pytest.raises(ShardError, match=r"shard s.tar, key 'k1': segment 1 references image 0"):
        list(iter_raw_shard(path))


@pytest.mark.parametrize(
    "body, message",
    [
        (b"{not json", "not valid JSON"),
        (b'{"segments": []}', "at least one segment"),
        (b'{"segments": [{"audio": 1}]}', "segment 0 must be"),
        (b'{"segments": [{"video": 1}]}', "references clip 1 but no video1"),  # clips are segments now
        (b'["text"]', "segments"),
    ],
)
def test_schema_errors_name_shard_and_key(tmp_path, body, message):
    path = tmp_path / "s.tar"
    _tar(path, {"k9.json": body})
    with pytest.raises(ShardError, match=rf"shard s.tar, key 'k9'.*{message}"):
        list(iter_raw_shard(path))


def test_empty_shard_and_links_are_errors(tmp_path):
    empty = tmp_path / "empty.tar"
    _tar(empty, {})
    with pytest.raises(ShardError, match="shard empty.tar: empty shard"):
        list(iter_raw_shard(empty))
    linked = tmp_path / "link.tar"
    with tarfile.open(linked, "w") as tar:
        info = tarfile.TarInfo("k1.json")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        tar.addfile(info)
    with pytest.raises(ShardError, match="shard link.tar, key 'k1'.*links"):
        list(iter_raw_shard(linked))


def test_unexpected_member_types_are_refused(tmp_path):
    path = tmp_path / "s.tar"
    _tar(path, {"k1.json": b'{"segments": [{"text": "a"}]}', "k1.sh": b"rm -rf /"})
    with pytest.raises(ShardError, match=r"shard s.tar, key 'k1'.*unexpected member type \.sh"):
        list(iter_raw_shard(path))


def test_raw_shards_are_plain_webdataset_shards(tmp_path):
    import webdataset as wds

    with RawShardWriter(tmp_path) as writer:
        writer.add("doc0", ["a caption", _image()])
        writer.add("doc1", ["text only"])
    # decoding only json and png by hand: webdataset's default decoders would unpickle .pyd members
    samples = list(wds.WebDataset(str(tmp_path / "shard-000000.tar"), shardshuffle=False))
    assert [s["__key__"] for s in samples] == ["doc0", "doc1"]
    assert json.loads(samples[0]["json"]) == {"segments": [{"text": "a caption"}, {"image": 0}]}
    assert Image.open(io.BytesIO(samples[0]["0.png"])).size == (12, 10)


def test_a_key_that_comes_back_after_another_key_is_refused_naming_it(tmp_path):
    body = json.dumps({"segments": [{"text": "x"}]}).encode()
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        for name in ("a.json", "b.json", "a.json"):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    with pytest.raises(ShardError, match=r"shard dup.tar, key 'a'.*appears twice.*re-create the shard with unique keys"):
        list(iter_raw_shard(path))


def test_writer_refuses_a_non_adjacent_duplicate_key_across_shards(tmp_path):
    with RawShardWriter(tmp_path, shard_max_docs=1) as writer:
        writer.add("a", ["x"])
        writer.add("b", ["y"])  # "a" is now in a finished shard
        with pytest.raises(ValueError, match="duplicate sample key 'a'"):
            writer.add("a", ["z"])
    assert read_raw_manifest(tmp_path)["documents"] == 2
