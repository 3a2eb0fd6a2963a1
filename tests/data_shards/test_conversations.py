"""Conversations (chat SFT data) from jsonl to batches: ingest with images, ids and the stored target mask, trained
roles, no pair flip, `shards verify` of the mask against the markers, never-cut packing, the stream's target_mask and
an exact mid-epoch resume."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from data_shards.plan import load_row_counts, plan_shard, read_index, shard_rows
from data_shards.pretokenize import pretokenize
from data_shards.raw import Conversation, iter_raw_shard, read_raw_manifest
from data_shards.stream import PackedTokenStream, make_dataloader
from data_shards.token_shards import (
    CONVERSATION,
    TARGET,
    TokenShard,
    read_manifest,
    verify_token_dir,
    write_manifest,
    write_token_shard,
)
from fusion_model import cli
from tokenizer.chat import Turn, encode_conversation
from tokenizer.image.preprocess import open_image

CHATS = [
    {"messages": [{"role": "system", "content": "a photo of a cat"},
                  {"role": "user", "content": [{"type": "image", "path": "img/a.png"},
                                               {"type": "text", "text": "the digit one"}]},
                  {"role": "assistant", "content": "the digit two"}]},
    # an answer that is an image, and a [text, image] pair of turns that a flip must never touch
    {"messages": [{"role": "user", "content": "a photo of a cat"},
                  {"role": "assistant", "content": [{"type": "image", "path": "img/b.png"}]}]},
    {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
                  {"role": "user", "content": "cat"}, {"role": "assistant", "content": "here"}]},
]


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """A folder with chats.jsonl (the CHATS), its images and a text corpus beside it."""
    root = tmp_path_factory.mktemp("chat")
    (root / "img").mkdir()
    _image(1).save(root / "img" / "a.png")
    _image(2).save(root / "img" / "b.png")
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CHATS) + "\n")
    (root / "corpus.txt").write_text("some interleaved text here")
    return root


@pytest.fixture(scope="module")
def raw(chat_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("raw") / "raw"
    assert cli.main(["shards", "write", "--out", str(out), "--chat", str(chat_dir / "chats.jsonl"),
                     "--text", str(chat_dir / "corpus.txt")]) == 0
    return out


def _turns(chat: dict, root: Path) -> list[Turn]:
    """A CHATS record as turns whose images are opened PIL images."""
    turns = []
    for message in chat["messages"]:
        content = message["content"]
        parts = [content] if isinstance(content, str) else [
            open_image(root / p["path"]) if p["type"] == "image" else p["text"] for p in content]
        turns.append(Turn(message["role"], tuple(parts)))
    return turns


def _expected(vocab, image_tokenizer, turns: list[Turn], roles=("assistant",)) -> tuple[list[int], list[int]]:
    images = [p for t in turns for p in t.parts if isinstance(p, Image.Image)]
    grids = iter(image_tokenizer.encode(images)) if images else iter(())
    coded = [Turn(t.role, tuple(next(grids) if isinstance(p, Image.Image) else p for p in t.parts)) for t in turns]
    return encode_conversation(vocab, coded, roles)


def _shard_documents(token_dir: Path) -> dict[str, tuple[list[int], list[int] | None]]:
    manifest = read_manifest(token_dir)
    out = {}
    for entry in manifest["shards"]:
        shard = TokenShard(token_dir, entry["name"], manifest["vocab_size"])
        for i, key in enumerate(shard.keys):
            a, b = int(shard.offsets[i]), int(shard.offsets[i + 1])
            marks = None if shard.targets is None else shard.targets[a:b].tolist()
            out[key] = (shard.ids[a:b].astype(np.int64).tolist(), marks)
    return out


def test_raw_conversations_keep_their_turns_and_images(raw):
    manifest = read_raw_manifest(raw)
    assert (manifest["conversations"], manifest["documents"], manifest["images"]) == (3, 4, 2)
    samples = dict(iter_raw_shard(raw / manifest["shards"][0]["name"]))
    chat = samples["chats_1"]
    assert isinstance(chat, Conversation) and [t.role for t in chat.turns] == ["system", "user", "assistant"]
    assert chat.turns[1].parts[0][0] == "image" and chat.turns[1].parts[1] == "the digit one"
    assert samples["corpus"] == ["some interleaved text here"]


@pytest.mark.parametrize("flip", [0.0, 1.0])
def test_tokenized_conversations_are_the_chat_template_with_answers_as_targets(tmp_path, raw, chat_dir, vocab,
                                                                              image_tokenizer, flip):
    manifest = pretokenize(raw, tmp_path / "tok", vocab, image_tokenizer, flip_probability=flip, batch_size=2,
                           progress=False)
    assert manifest["conversations"] == 3 and manifest["target_roles"] == ["assistant"]
    assert manifest["sep_id"] == vocab.sep_id
    docs = _shard_documents(tmp_path / "tok")
    for line, chat in enumerate(CHATS, 1):
        ids, targets = _expected(vocab, image_tokenizer, _turns(chat, chat_dir))
        got_ids, marks = docs[f"chats_{line}"]
        assert got_ids == ids  # the same with flip probability 1: a conversation is never flipped
        assert marks == [CONVERSATION | (TARGET * t) for t in targets]
        # prompt positions (<s>, system and user turns with their <sep>) are 2, each answer with its </s> is 3
        assert marks[0] == CONVERSATION and marks[-1] == CONVERSATION | TARGET and got_ids[-1] == vocab.eos_id
    assert docs["corpus"][1] == [TARGET] * len(docs["corpus"][0])  # a plain document beside them: all targets
    entry = manifest["shards"][0]
    assert f"{entry['name']}.targets.npy" in entry["files"]
    assert verify_token_dir(tmp_path / "tok")[1] == []


def test_train_roles_user_and_assistant_mark_user_turns_too(tmp_path, chat_dir, capsys):
    from tokenizer.vocab import train_unified_vocab

    (tmp_path / "text.jsonl").write_text(json.dumps(CHATS[2]) + "\n" + json.dumps(
        {"messages": [{"role": "system", "content": "cat"}, *CHATS[2]["messages"]]}) + "\n")
    assert cli.main(["shards", "write", "--out", str(tmp_path / "raw"), "--chat", str(tmp_path)]) == 0
    vocab = train_unified_vocab(["one two cat here"] * 50, vocab_size=512, image_codes=16)
    vocab_path = vocab.save(tmp_path / "tokenizer.json")
    assert cli.main(["shards", "tokenize", str(tmp_path / "raw"), "--out", str(tmp_path / "tok"), "--vocab",
                     str(vocab_path), "--workers", "1", "--no-progress", "--train-roles", "user,assistant"]) == 0
    assert "2 conversations" in capsys.readouterr().out
    assert read_manifest(tmp_path / "tok")["target_roles"] == ["user", "assistant"]
    docs = _shard_documents(tmp_path / "tok")
    for key in ("text_1", "text_2"):
        ids, marks = docs[key]
        turns = [Turn(m["role"], (m["content"],)) for m in json.loads(
            (tmp_path / "text.jsonl").read_text().splitlines()[int(key[-1]) - 1])["messages"]]
        expected = encode_conversation(vocab, turns, ("user", "assistant"))
        assert (ids, marks) == (expected[0], [CONVERSATION | (TARGET * t) for t in expected[1]])
    # the system turn of text_2 is context: <s>, then 2 for "cat" and its <sep>, then user and answers all 3
    marks = docs["text_2"][1]
    assert marks[0] == CONVERSATION and marks[1] == CONVERSATION and set(marks[3:]) == {CONVERSATION | TARGET}
    assert cli.main(["shards", "verify", str(tmp_path / "tok")]) == 0


def _rehash(token_dir: Path, name: str, suffix: str) -> None:
    """Record a rewritten file's size and sha256 in its shard's meta and the manifest, as if written so."""
    path = token_dir / f"{name}{suffix}"
    data = path.read_bytes()
    checked = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    for file in (token_dir / f"{name}.meta.json", token_dir / "manifest.json"):
        text = json.loads(file.read_text())
        entries = [text] if "files" in text else [s for s in text["shards"] if s["name"] == name]
        for entry in entries:
            entry["files"][path.name] = checked
        file.write_text(json.dumps(text))


@pytest.mark.parametrize("position", ["bos", "prompt", "answer_end"])
def test_verify_names_a_target_mask_that_disagrees_with_the_markers(tmp_path, raw, vocab, image_tokenizer, capsys,
                                                                   position):
    pretokenize(raw, tmp_path / "tok", vocab, image_tokenizer, progress=False)
    name = read_manifest(tmp_path / "tok")["shards"][0]["name"]
    shard = TokenShard(tmp_path / "tok", name, vocab.vocab_size)
    document = shard.keys.index("chats_1")
    start, stop = int(shard.offsets[document]), int(shard.offsets[document + 1])
    marks = np.array(shard.targets)
    at = {"bos": start, "prompt": start + 2, "answer_end": stop - 1}[position]
    marks[at] ^= TARGET  # the checksums stay right: only the markers can tell
    np.save(tmp_path / "tok" / f"{name}.targets.npy", marks, allow_pickle=False)
    _rehash(tmp_path / "tok", name, ".targets.npy")
    _, problems = verify_token_dir(tmp_path / "tok")
    assert len(problems) == 1 and f"document {document} (key 'chats_1')" in problems[0][1], problems
    assert cli.main(["shards", "verify", str(tmp_path / "tok")]) == 2
    assert "BAD " in capsys.readouterr().out


def _conversation(length: int, first: int) -> tuple[list[int], np.ndarray]:
    """A synthetic conversation of `length` ids (no markers needed by the packer) and its mask."""
    ids = [1 + (first + i) % 900 for i in range(length)]
    marks = np.full(length, CONVERSATION, dtype=np.uint8)
    marks[length // 2 :] |= TARGET
    return ids, marks


def _mixed_dir(path: Path, tok, seed: int = 0, shards: int = 3) -> tuple[Path, dict[str, int]]:
    """Token shards mixing plain documents and conversations of lengths 3..40; {key: length} of the conversations."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    info = {"vocab_fingerprint": "test-vocab", "image_tokenizer_fingerprint": "none", "vocab_size": tok.VOCAB_SIZE,
            "target_roles": ["assistant"]}
    metas, conversations = [], {}
    for n in range(shards):
        keys, documents, targets = [], [], []
        for i in range(12):
            key = f"s{n}-d{i}"
            length = int(rng.integers(3, 41))
            if i % 3:
                ids, marks = _conversation(length, 100 * n + i)
                conversations[key] = length
            else:
                ids, marks = tok.make_documents(1, seed=100 * n + i, min_len=length, max_len=length)[0], None
                marks = np.full(length, TARGET, dtype=np.uint8)
            keys.append(key)
            documents.append(ids)
            targets.append(marks)
        metas.append(write_token_shard(path, f"shard-{n:06d}", keys, documents,
                                       {**info, "images": 0, "conversations": 8}, targets=targets))
    write_manifest(path, {**info, "pad_id": tok.PAD_ID}, metas)
    return path, conversations


@pytest.mark.parametrize("seq_len", [4, 7, 16, 25, 40])
def test_packing_never_cuts_a_conversation_and_drops_the_longer_ones(tmp_path, tok, capsys, seq_len):
    token_dir, conversations = _mixed_dir(tmp_path / "tok", tok)
    manifest = read_manifest(token_dir)
    assert manifest["conversations"] == 24
    index = read_index(token_dir)
    planned = 0
    for entry in manifest["shards"]:
        shard = TokenShard(token_dir, entry["name"], tok.VOCAB_SIZE)
        rows = plan_shard(shard, index.header, seq_len)
        whole = shard.conversation_documents()
        assert sorted(rows.dropped.tolist()) == [d for d in range(len(shard)) if whole[d] and
                                                 shard.lengths[d] > seq_len]
        for d in range(len(shard)):
            pieces = np.flatnonzero((rows.piece_start >= shard.offsets[d]) & (rows.piece_start < shard.offsets[d + 1]))
            if whole[d] and shard.lengths[d] <= seq_len:  # one piece: the whole conversation
                assert rows.piece_len[pieces].tolist() == [shard.lengths[d]]
            elif not whole[d]:  # a plain document is cut as before
                assert rows.piece_len[pieces].sum() == shard.lengths[d]
        planned += rows.num_rows
        # the same packing as a shard without the conversation rule, less the dropped documents
        assert rows.num_rows == shard_rows(shard.offsets, seq_len, whole=whole).num_rows
    assert int(load_row_counts(index, seq_len).sum()) == planned
    stream = PackedTokenStream(token_dir, seq_len, 2, seed=3, target_mask=True)
    batches = list(make_dataloader(stream))
    rows = sum(int((b["document_ids"] >= 0).any(dim=1).sum()) for b in batches)
    assert rows == planned  # the plan's count is the stream's
    too_long = sorted(k for k, n in conversations.items() if n > seq_len)
    assert stream.dropped_conversations == len(too_long)
    err = capsys.readouterr().err
    if too_long:
        assert f"longer than seq_len {seq_len}" in err and too_long[0].split("-")[0] in err
    # every conversation that fits is in one row, whole: its ids appear contiguously with one document id
    seen = []
    for batch in batches:
        for ids, docs in zip(batch["input_ids"].tolist(), batch["document_ids"].tolist()):
            for d in set(docs) - {-1}:
                seen.append(tuple(i for i, x in zip(ids, docs) if x == d))
    for key, length in conversations.items():
        if length <= seq_len:
            n, i = (int(x) for x in key[1:].replace("-d", " ").split())
            assert tuple(_conversation(length, 100 * n + i)[0]) in seen, key


def test_stream_target_mask_follows_the_stored_bits_and_answer_only(tmp_path, tok):
    token_dir, _ = _mixed_dir(tmp_path / "tok", tok, shards=1)
    shard = TokenShard(token_dir, "shard-000000", tok.VOCAB_SIZE)
    for answer_only in (True, False):
        stream = PackedTokenStream(token_dir, 40, 4, shuffle=False, target_mask=True, answer_only=answer_only,
                                   token_keys=True)
        for batch in make_dataloader(stream):
            mask, keys = batch["target_mask"], batch["token_keys"]
            assert mask.dtype == torch.bool and mask.shape == keys.shape
            real = keys >= 0
            assert not mask[~real].any()  # padding is never a target
            offsets = keys[real] & ((1 << 40) - 1)
            expected = (shard.targets[offsets.numpy()] & TARGET) != 0 if answer_only else np.ones(len(offsets), bool)
            assert mask[real].numpy().tolist() == expected.tolist()
    plain = tok.make_token_dir(tmp_path / "plain", tok.make_documents(10))
    for batch in make_dataloader(PackedTokenStream(plain, 24, 2, target_mask=True)):
        assert torch.equal(batch["target_mask"], batch["document_ids"] >= 0)  # no targets file: every real token
    assert "target_mask" not in next(iter(make_dataloader(PackedTokenStream(plain, 24, 2))))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_is_exact_with_conversations(tmp_path, tok, workers):
    token_dir, _ = _mixed_dir(tmp_path / "tok", tok, shards=4)

    def loader():
        return make_dataloader(PackedTokenStream(token_dir, 16, 2, seed=5, target_mask=True, shuffle_window=8),
                               num_workers=workers)

    full = list(loader())
    n = len(full)
    assert n >= 6
    for cut in (1, n // 2, n - 1):
        _, rest = tok.resumed_rest(loader, cut)
        assert len(rest) == n - cut
        for got, want in zip(rest, full[cut:]):
            assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_an_answer_image_with_a_vocabulary_too_small_for_the_codes_names_shard_and_key(tmp_path, raw,
                                                                                        image_tokenizer):
    from data_shards.raw import ShardError
    from tokenizer.vocab import train_unified_vocab

    small = train_unified_vocab(["the digit one"] * 50, vocab_size=512, image_codes=16)  # the codebook has 64
    with pytest.raises(ShardError, match=r"shard shard-000000\.tar, key 'chats_1': cannot encode conversation"):
        pretokenize(raw, tmp_path / "tok", small, image_tokenizer, progress=False)
    assert not (tmp_path / "tok").exists()
