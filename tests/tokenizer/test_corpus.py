"""Corpora: the built-in KJV text, files, directories, jsonl, iterators, and the errors for bad input."""

from __future__ import annotations

import json

import pytest

from tokenizer.corpus import CorpusStats, iter_corpus, iter_kjv, kjv_path


def test_builtin_corpus_is_real_english_text():
    stats = CorpusStats()
    verses = iter_kjv(stats)
    first = next(verses)
    assert first == "In the beginning God created the heaven and the earth."
    rest = sum(1 for _ in verses)
    assert rest + 1 > 30_000 and 3_500_000 < stats.bytes < 5_000_000
    assert kjv_path().name == "kjv.jsonl"


def test_kjv_name_selects_the_builtin_corpus():
    assert next(iter_corpus(["kjv"])) == next(iter_kjv())


def test_files_directories_and_iterators_stream_in_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a.txt").write_text("first line\nsecond line\n", encoding="utf-8")
    (tmp_path / "b" / "c.md").write_text("markdown ü\r\nno newline at end", encoding="utf-8")
    (tmp_path / "b" / "d.jsonl").write_text(
        json.dumps({"text": "from jsonl", "id": 1}) + "\n\n", encoding="utf-8"
    )
    (tmp_path / "image.png").write_bytes(
        b"\x89PNG\r\n\x1a\n\x00"
    )  # not a text suffix: ignored in directories
    (tmp_path / ".hidden.txt").write_text("hidden", encoding="utf-8")
    stats = CorpusStats()
    texts = list(iter_corpus([tmp_path, ["from an iterator"]], stats=stats))
    assert texts == [
        "first line\n",
        "second line\n",
        "markdown ü\r\n",
        "no newline at end",
        "from jsonl",
        "from an iterator",
    ]
    assert stats.files == 3 and stats.texts == 6 and stats.bytes == sum(len(t.encode()) for t in texts)


def test_a_corpus_inside_a_hidden_directory_is_still_read(tmp_path):
    corpus = tmp_path / ".cache" / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "a.txt").write_text("text", encoding="utf-8")
    assert list(iter_corpus([corpus])) == ["text"]


def test_long_lines_across_read_chunks_stay_whole(tmp_path):
    line = "é" * 700_000  # 1.4 MB of two-byte characters: split across the 1 MiB read chunks
    (tmp_path / "long.txt").write_text(line + "\nnext", encoding="utf-8")
    assert list(iter_corpus([tmp_path / "long.txt"])) == [line + "\n", "next"]


def test_missing_path_and_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt does not exist"):
        list(iter_corpus([tmp_path / "nope.txt"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        list(iter_corpus([tmp_path / "empty"]))


def test_non_utf8_file_is_an_error_naming_file_and_offset(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 text \(byte 0xe9 at offset 3\).*iconv"):
        list(iter_corpus([bad]))


def test_non_utf8_files_can_be_skipped_and_are_counted(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00b\x00i\x00n")
    (tmp_path / "good.txt").write_text("good text", encoding="utf-8")
    stats = CorpusStats()
    assert list(iter_corpus([tmp_path], skip_bad_files=True, stats=stats)) == ["good text"]
    assert stats.skipped == [str(tmp_path / "bad.txt")]


def test_bad_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text field"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"data.jsonl:2 has no string field 'text'.*--text-key"):
        list(iter_corpus([path]))
    path.write_text('{"body": "chosen field"}\n{"body": broken\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"data.jsonl:2 is not valid JSON"):
        list(iter_corpus([path], text_key="body"))
    assert next(iter_corpus([path], text_key="body")) == "chosen field"
