"""Every ingest source round-trips into raw shards; bad images are skipped and listed, or stop a strict run."""

from __future__ import annotations

import io
import itertools
import json
import tarfile

import pytest
from PIL import Image

from data_shards import sources
from data_shards.raw import iter_raw_shard, read_raw_manifest


def _png(color=(10, 200, 30), size=(16, 16), fmt="PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format=fmt)
    return buffer.getvalue()


def _read_all(raw_dir) -> dict:
    manifest = read_raw_manifest(raw_dir)
    docs = {}
    for shard in manifest["shards"]:
        docs.update(iter_raw_shard(raw_dir / shard["name"]))
    return docs


def _shape(segments) -> list:
    return [s if isinstance(s, str) else Image.open(io.BytesIO(s[1])).size for s in segments]


def test_image_folder_with_sidecar_captions(tmp_path):
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    (folder / "cat.png").write_bytes(_png())
    (folder / "cat.txt").write_text("a green square\n")
    (folder / "sub" / "dog.jpg").write_bytes(_png(fmt="JPEG", size=(20, 12)))
    (folder / "sub" / "dog.txt").write_text("a jpeg")
    (folder / "nocaption.png").write_bytes(_png())
    (folder / "broken.png").write_bytes(_png()[:40])
    (folder / "broken.txt").write_text("truncated")
    (folder / "c.a.png").write_bytes(_png())  # its key c_a collides with c_a.png's
    (folder / "c.a.txt").write_text("first")
    (folder / "c_a.png").write_bytes(_png())
    (folder / "c_a.txt").write_text("second")
    manifest = sources.write_raw(sources.image_folder(folder), tmp_path / "raw")
    docs = _read_all(tmp_path / "raw")
    assert {k: _shape(v) for k, v in docs.items()} == {
        "cat": ["a green square", (16, 16)],
        "sub_dog": ["a jpeg", (20, 12)],
        "c_a": ["first", (16, 16)],
    }
    skipped = {s["key"]: s["reason"] for s in manifest["skipped"]}
    assert set(skipped) == {"broken", "nocaption", "c_a"}
    assert "duplicate key" in skipped["c_a"]
    assert "broken.png" in skipped["broken"] and "nocaption.txt" in skipped["nocaption"]


def test_bad_image_stops_a_strict_run(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "broken.png").write_bytes(b"not an image at all")
    (folder / "broken.txt").write_text("x")
    with pytest.raises(ValueError, match="sample 'broken' rejected.*broken.png"):
        sources.write_raw(sources.image_folder(folder), tmp_path / "raw", strict=True)
    assert not list((tmp_path / "raw").glob("*.tar"))


def test_img2dataset_tar(tmp_path):
    path = tmp_path / "00000.tar"
    members = {
        "000000000.jpg": _png(fmt="JPEG"),
        "000000000.txt": b"a photo of a square",
        "000000000.json": json.dumps({"status": "success", "caption": "ignored"}).encode(),
        "000000001.png": _png(size=(9, 9)),
        "000000001.json": json.dumps({"status": "success", "caption": "caption from json"}).encode(),
        "000000002.json": json.dumps({"status": "failed_to_download"}).encode(),
        "000000003.jpg": b"\xff\xd8garbage",
        "000000003.txt": b"bad jpeg",
    }
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    manifest = sources.write_raw(sources.img2dataset_tars([path]), tmp_path / "raw")
    docs = _read_all(tmp_path / "raw")
    assert {k: _shape(v) for k, v in docs.items()} == {
        "00000_000000000": ["a photo of a square", (16, 16)],
        "00000_000000001": ["caption from json", (9, 9)],
    }
    reasons = {s["key"]: s["reason"] for s in manifest["skipped"]}
    assert "failed_to_download" in reasons["00000_000000002"]
    assert "000000003" in reasons["00000_000000003"]


def test_obelics_jsonl_interleaved(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(_png(size=(10, 11)))
    (tmp_path / "imgs" / "b.png").write_bytes(_png(size=(12, 13)))
    rows = [
        {"id": "d1", "texts": ["intro", None, "middle", None], "images": [None, "imgs/a.png", None, "imgs/b.png"]},
        {"id": "d2", "texts": [None, "caption after"], "images": ["imgs/missing.png", None]},
        {"id": "d3", "texts": ["x"], "images": ["https://example.com/a.png"]},
        {"id": "d4", "texts": [None, "text"], "images": ["http://example.com/x.jpg", None]},
        {"id": "d5", "texts": ["a", "b"], "images": [None]},
    ]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken\n")
    manifest = sources.write_raw(sources.obelics_jsonl(jsonl), tmp_path / "raw")
    docs = _read_all(tmp_path / "raw")
    assert {k: _shape(v) for k, v in docs.items()} == {"docs_d1": ["intro", (10, 11), "middle", (12, 13)]}
    reasons = {s["key"]: s["reason"] for s in manifest["skipped"]}
    assert set(reasons) == {"docs_d2", "docs_d3", "docs_d4", "docs_d5", "docs_6"}
    assert "missing.png" in reasons["docs_d2"] and "exactly one" in reasons["docs_d3"]
    assert "not a local path" in reasons["docs_d4"] and "equal length" in reasons["docs_d5"]


def test_text_corpus_txt_and_jsonl(tmp_path):
    (tmp_path / "book.txt").write_text("Call me Ishmael.")
    (tmp_path / "lines.jsonl").write_text('{"text": "first"}\n{"body": "no text"}\n{"text": "third"}\n')
    manifest = sources.write_raw(sources.text_corpus([tmp_path / "book.txt", tmp_path / "lines.jsonl"]), tmp_path / "raw")
    assert _read_all(tmp_path / "raw") == {
        "book": ["Call me Ishmael."], "lines_1": ["first"], "lines_3": ["third"]}
    assert [s["key"] for s in manifest["skipped"]] == ["lines_2"]


def test_demo_sources_are_offline_and_captioned(tmp_path):
    samples = list(itertools.chain(sources.demo_digits(12), itertools.islice(sources.demo_photos(), 2),
                                   sources.demo_text(verses_per_document=5, limit=3)))
    sources.write_raw(samples, tmp_path / "raw")
    docs = _read_all(tmp_path / "raw")
    digits = {k: v for k, v in docs.items() if k.startswith("digit_")}
    assert len(digits) == 12 and len({v[0] for v in digits.values()}) > 3, "digit prefix is class-balanced"
    assert all(_shape(v)[1] == (28, 28) and v[0].startswith("the digit ") for v in digits.values())
    assert _shape(docs["photo_astronaut"]) == ["a photo of an astronaut in a spacesuit", (512, 512)]
    texts = [v for k, v in docs.items() if k.startswith("kjv_")]
    assert len(texts) == 3 and texts[0][0].startswith("In the beginning God created the heaven and the earth.")


def test_emoji_from_an_unpacked_npm_package_layout(tmp_path):
    (tmp_path / "img" / "twitter" / "64").mkdir(parents=True)
    (tmp_path / "img" / "twitter" / "64" / "1f600.png").write_bytes(_png(size=(64, 64)))
    (tmp_path / "emoji.json").write_text(json.dumps([
        {"unified": "1F600", "name": "GRINNING FACE", "image": "1f600.png"},
        {"unified": "1F601", "name": "BEAMING FACE", "image": "1f601.png"}]))
    manifest = sources.write_raw(sources.demo_emoji(tmp_path), tmp_path / "raw")
    assert {k: _shape(v) for k, v in _read_all(tmp_path / "raw").items()} == {
        "emoji_1F600": ["an emoji of grinning face", (64, 64)]}
    assert [s["key"] for s in manifest["skipped"]] == ["emoji_1F601"]


LATIN1 = "café crème".encode("latin-1")  # not UTF-8: byte 0xe9 starts an unfinished sequence


def test_non_utf8_captions_and_texts_are_skipped_and_listed(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "good.png").write_bytes(_png())
    (folder / "good.txt").write_text("a green square")
    (folder / "latin.png").write_bytes(_png())
    (folder / "latin.txt").write_bytes(LATIN1)
    (tmp_path / "book.txt").write_bytes(LATIN1)
    (tmp_path / "lines.jsonl").write_bytes(b'{"text": "first"}\n{"text": "' + LATIN1 + b'"}\n{"text": "third"}\n')
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(_png())
    (tmp_path / "docs.jsonl").write_bytes(
        b'{"id": "d1", "texts": ["' + LATIN1 + b'", null], "images": [null, "imgs/a.png"]}\n'
        + json.dumps({"id": "d2", "texts": ["ok", None], "images": [None, "imgs/a.png"]}).encode() + b"\n"
    )
    samples = itertools.chain(
        sources.image_folder(folder),
        sources.text_corpus([tmp_path / "book.txt", tmp_path / "lines.jsonl"]),
        sources.obelics_jsonl(tmp_path / "docs.jsonl"),
    )
    manifest = sources.write_raw(samples, tmp_path / "raw")  # finishes: shards plus a manifest
    assert set(_read_all(tmp_path / "raw")) == {"good", "lines_1", "lines_3", "docs_d2"}
    reasons = {s["key"]: s["reason"] for s in manifest["skipped"]}
    assert set(reasons) == {"latin", "book", "lines_2", "docs_1"}
    assert "latin.txt" in reasons["latin"] and "book.txt" in reasons["book"]
    assert "lines.jsonl line 2" in reasons["lines_2"] and "docs.jsonl line 1" in reasons["docs_1"]
    assert all("not UTF-8" in r and "re-save it as UTF-8" in r for r in reasons.values())


def test_non_utf8_caption_stops_a_strict_run_naming_the_file(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "latin.png").write_bytes(_png())
    (folder / "latin.txt").write_bytes(LATIN1)
    with pytest.raises(ValueError, match=r"sample 'latin' rejected: caption file .*latin\.txt: not UTF-8.*--strict"):
        sources.write_raw(sources.image_folder(folder), tmp_path / "raw", strict=True)


def test_obelics_image_paths_must_stay_inside_the_image_root(tmp_path):
    root = tmp_path / "data"
    (root / "imgs").mkdir(parents=True)
    (root / "imgs" / "a.png").write_bytes(_png(size=(10, 11)))
    (tmp_path / "secret.png").write_bytes(_png())  # outside the root: must never be read
    rows = [
        {"id": "ok", "texts": ["x", None], "images": [None, "imgs/../imgs/a.png"]},
        {"id": "up", "texts": ["x", None], "images": [None, "../secret.png"]},
        {"id": "deep", "texts": ["x", None], "images": [None, "imgs/../../secret.png"]},
        {"id": "abs", "texts": ["x", None], "images": [None, str(tmp_path / "secret.png")]},
        {"id": "etc", "texts": ["x", None], "images": [None, "/etc/hostname"]},
    ]
    jsonl = root / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    manifest = sources.write_raw(sources.obelics_jsonl(jsonl), tmp_path / "raw")
    assert {k: _shape(v) for k, v in _read_all(tmp_path / "raw").items()} == {"docs_ok": ["x", (10, 11)]}
    reasons = {s["key"]: s["reason"] for s in manifest["skipped"]}
    assert set(reasons) == {"docs_up", "docs_deep", "docs_abs", "docs_etc"}
    assert "'../secret.png' is absolute or leaves the image root" in reasons["docs_up"]
    assert "'/etc/hostname'" in reasons["docs_etc"] and all("relative to the image root" in r for r in reasons.values())


def test_image_folder_lists_a_symlink_loop_and_a_broken_link(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "cat.png").write_bytes(_png())
    (folder / "cat.txt").write_text("a cat")
    (folder / "loop.png").symlink_to("loop.png")
    (folder / "gone.png").symlink_to("nowhere.png")
    manifest = sources.write_raw(sources.image_folder(folder), tmp_path / "raw")
    assert set(_read_all(tmp_path / "raw")) == {"cat"}
    reasons = {s["key"]: s["reason"] for s in manifest["skipped"]}
    assert set(reasons) == {"loop", "gone"}
    assert "loop.png: symbolic link loop" in reasons["loop"] and "fix or remove the link" in reasons["loop"]


def test_img2dataset_tar_with_a_repeated_key_lists_the_second_copy(tmp_path):
    path = tmp_path / "00000.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in [("a.png", _png()), ("a.txt", b"first"), ("b.png", _png()), ("b.txt", b"b"),
                           ("a.png", _png(size=(9, 9))), ("a.txt", b"again")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    manifest = sources.write_raw(sources.img2dataset_tars([path]), tmp_path / "raw")
    assert {k: _shape(v) for k, v in _read_all(tmp_path / "raw").items()} == {
        "00000_a": ["first", (16, 16)], "00000_b": ["b", (16, 16)]}
    assert [(s["key"], "duplicate key" in s["reason"]) for s in manifest["skipped"]] == [("00000_a", True)]
