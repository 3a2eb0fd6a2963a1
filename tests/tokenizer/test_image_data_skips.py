"""Tokenizer training data: skipped bad images are reported by name and count; a truncated shard is a clear error."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
from PIL import Image

from tokenizer.image.data import REPORT_NAMES, ImageFiles, ShardImages


def _png(value: int = 100) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((24, 40, 3), value, np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def _shard(path, docs: int, bad: int = 0):
    import webdataset as wds

    with wds.TarWriter(str(path)) as sink:
        for i in range(docs):
            image = b"not a png" if i < bad else _png(10 * i)
            sink.write({"__key__": f"doc{i}", "json": b'{"segments": [{"image": 0}]}', "0.png": image})
    return path


def test_image_files_report_the_first_bad_files_by_name_and_then_the_count(tmp_path, caplog):
    good = tmp_path / "good.png"
    good.write_bytes(_png())
    bad = []
    for i in range(12):
        bad.append(tmp_path / f"bad{i:02d}.png")
        bad[-1].write_bytes(b"\x89PNG broken")
    dataset = ImageFiles([*bad, good], size=16, train=False)
    with caplog.at_level(logging.WARNING, logger="tokenizer.image.data"):
        for index in range(len(bad)):
            assert dataset[index].shape == (3, 16, 16)  # replaced by the next good file
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == REPORT_NAMES + 1  # one per bad file for the first five, then at 10
    assert lines[0].startswith("skipped 1 unreadable image(s)") and "bad00.png" in lines[0]
    assert "skipped 10 unreadable image(s) or shard(s) in the validation image files" in lines[-1]
    assert "and 5 more" in lines[-1] and "--data.skip_bad_images false" in lines[-1]


def test_shard_images_report_skips_at_the_end_of_a_pass(tmp_path, caplog):
    _shard(tmp_path / "shard-000000.tar", docs=4, bad=2)
    dataset = ShardImages(str(tmp_path / "shard-*.tar"), size=16, train=False)
    with caplog.at_level(logging.WARNING, logger="tokenizer.image.data"):
        assert len(list(dataset)) == 2
    (line,) = [r.getMessage() for r in caplog.records]
    assert "skipped 2 unreadable image(s) or shard(s)" in line and "doc0.0.png" in line and "doc1.0.png" in line


def _truncated(tmp_path):
    whole = _shard(tmp_path / "whole.tar", docs=6).read_bytes()
    path = tmp_path / "shard-000000.tar"
    path.write_bytes(whole[: len(whole) // 2 + 100])  # a copy that stopped halfway
    return path


def test_a_truncated_shard_is_a_value_error_naming_it(tmp_path):
    path = _truncated(tmp_path)
    dataset = ShardImages(str(path), size=16, train=False, skip_bad=False)
    with pytest.raises(ValueError, match=r"image shard .*shard-000000\.tar: truncated or unreadable tar.*re-create"):
        list(dataset)


def test_a_truncated_shard_is_skipped_and_counted_when_skipping_bad_images(tmp_path, caplog):
    path = _truncated(tmp_path)
    dataset = ShardImages(str(path), size=16, train=False, skip_bad=True)
    with caplog.at_level(logging.WARNING, logger="tokenizer.image.data"):
        images = list(dataset)
    assert 0 < len(images) < 6  # what was readable before the damage
    assert list(dataset.skipped) == [str(path.resolve())]
    assert "shard-000000.tar" in caplog.records[-1].getMessage()
