"""Hostile conversation input: structural errors of a chat jsonl (no assistant turn, an unknown role, a line that is
not JSON, a bad part) refuse `shards write --chat` with one line naming file and line, exit 2 and nothing written;
a missing image skips its conversation (refused under --strict); an image in a conversation tokenized without an
image tokenizer names shard and key; conversations given to a model without an answer-only loss are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_shards.datamodule import FusionDataModule, check_conversations
from data_shards.raw import read_raw_manifest
from fusion_model import cli
from tokenizer.vocab import train_unified_vocab

GOOD = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}


def _one_line(capsys) -> str:
    """The command's stderr, checked to be one line."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _write(tmp_path: Path, *extra: str) -> int:
    return cli.main(["shards", "write", "--out", str(tmp_path / "raw"), "--chat", str(tmp_path / "chats"), *extra])


@pytest.mark.parametrize("bad, says", [
    ({"messages": [{"role": "user", "content": "hello"}]}, "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hello"}, GOOD["messages"][1]]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": [{"type": "audio", "path": "a.wav"}]}, GOOD["messages"][1]]},
     "a part is"),
    ('{"messages": [', "invalid JSON"),
])
def test_a_structural_error_anywhere_refuses_the_whole_write_naming_file_and_line(tmp_path, capsys, bad, says):
    (tmp_path / "chats").mkdir()
    (tmp_path / "chats" / "a.jsonl").write_text(json.dumps(GOOD) + "\n")  # a good file first: still nothing written
    line = bad if isinstance(bad, str) else json.dumps(bad)
    (tmp_path / "chats" / "b.jsonl").write_text(json.dumps(GOOD) + "\n\n" + line + "\n")
    assert _write(tmp_path) == 2
    err = _one_line(capsys)
    assert f"{tmp_path / 'chats' / 'b.jsonl'} line 3" in err and says in err, err
    assert not (tmp_path / "raw").exists()


def _chat_with_image(tmp_path: Path, present: bool) -> None:
    (tmp_path / "chats").mkdir()
    if present:
        Image.fromarray(np.full((16, 16, 3), 90, dtype=np.uint8)).save(tmp_path / "chats" / "p.png")
    record = {"messages": [{"role": "user", "content": [{"type": "image", "path": "p.png"},
                                                        {"type": "text", "text": "what is it"}]},
                           {"role": "assistant", "content": "grey"}]}
    (tmp_path / "chats" / "c.jsonl").write_text(json.dumps(GOOD) + "\n" + json.dumps(record) + "\n")


def test_a_missing_image_skips_its_conversation_and_lists_it(tmp_path, capsys):
    _chat_with_image(tmp_path, present=False)
    assert _write(tmp_path) == 0
    manifest = read_raw_manifest(tmp_path / "raw")
    assert manifest["conversations"] == 1 and manifest["skipped_count"] == 1
    assert manifest["skipped"][0]["key"] == "c_2" and "p.png" in manifest["skipped"][0]["reason"]


def test_a_missing_image_under_strict_refuses_and_writes_nothing(tmp_path, capsys):
    _chat_with_image(tmp_path, present=False)
    assert _write(tmp_path, "--strict") == 2
    assert "c_2" in _one_line(capsys)
    assert not (tmp_path / "raw").exists()


def test_an_image_in_a_conversation_without_an_image_tokenizer_names_shard_and_key(tmp_path, capsys):
    _chat_with_image(tmp_path, present=True)
    assert _write(tmp_path) == 0
    vocab = train_unified_vocab(["hello world grey what is it"] * 50, vocab_size=512, image_codes=16)
    path = vocab.save(tmp_path / "tokenizer.json")
    capsys.readouterr()
    assert cli.main(["shards", "tokenize", str(tmp_path / "raw"), "--out", str(tmp_path / "tok"), "--vocab",
                     str(path), "--workers", "1", "--no-progress"]) == 2
    err = _one_line(capsys)
    assert "shard-000000.tar" in err and "'c_2'" in err and "image tokenizer" in err, err
    assert not (tmp_path / "tok").exists()


def test_an_unknown_train_role_is_refused_before_anything_is_written(tmp_path, capsys):
    (tmp_path / "chats").mkdir()
    (tmp_path / "chats" / "a.jsonl").write_text(json.dumps(GOOD) + "\n")
    assert _write(tmp_path) == 0
    path = train_unified_vocab(["hello world"] * 50, vocab_size=512, image_codes=16).save(tmp_path / "v.json")
    capsys.readouterr()
    assert cli.main(["shards", "tokenize", str(tmp_path / "raw"), "--out", str(tmp_path / "tok"), "--vocab",
                     str(path), "--workers", "1", "--no-progress", "--train-roles", "assistant,robot"]) == 2
    assert "robot" in _one_line(capsys)
    assert not (tmp_path / "tok").exists()


def test_conversations_for_a_model_without_an_answer_only_loss_are_refused_in_one_sentence(tmp_path, capsys):
    (tmp_path / "chats").mkdir()
    (tmp_path / "chats" / "a.jsonl").write_text(json.dumps(GOOD) + "\n")
    assert _write(tmp_path) == 0
    path = train_unified_vocab(["hello world"] * 50, vocab_size=512, image_codes=16).save(tmp_path / "v.json")
    assert cli.main(["shards", "tokenize", str(tmp_path / "raw"), "--out", str(tmp_path / "tok"), "--vocab",
                     str(path), "--workers", "1", "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    with pytest.raises(ValueError, match=r"holds 1 conversations.*the late family's objective has no answer-only"):
        check_conversations(str(tmp_path / "tok"), manifest, ("image_features",), "late")
    check_conversations(str(tmp_path / "tok"), manifest, ("target_mask",), "chameleon")  # accepted
    module = FusionDataModule(train_dir=str(tmp_path / "tok"), seq_len=16)
    with pytest.raises(ValueError, match="this model's objective has no answer-only loss") as refused:
        module.check(None, ("image_features",))
    assert "\n" not in str(refused.value)
