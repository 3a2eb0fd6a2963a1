"""The chat template (tokenizer/chat.py): a conversation's ids and targets, the generation prompt as a family's
prompt segments, the pending turns, an answer back into the chat, the conversation file, and `CHAT_TEMPLATE` on
the transformers tokenizer giving the same ids."""

from __future__ import annotations

import json

import pytest
import torch

from tokenizer.chat import (
    CHAT_TEMPLATE,
    Ids,
    Turn,
    answer_turn,
    assistant_mask,
    encode_conversation,
    encode_segments,
    generation_prompt,
    load_conversation,
    pending_turns,
    prompt_segments,
)
from tokenizer.vocab import LatentImage, train_unified_vocab

CORPUS = ["the cat sat on the mat", "a dog ran far away", "one two three four five six seven"] * 10


@pytest.fixture(scope="module")
def vocab():
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)


def grid(*codes: int) -> torch.Tensor:
    return torch.tensor(codes).view(2, 2)


def test_a_conversation_ends_each_turn_and_trains_the_answers(vocab):
    turns = [Turn("system", ("one",)), Turn("user", ("the cat", grid(1, 2, 3, 4))), Turn("assistant", ("sat",)),
             Turn("user", ("a dog",)), Turn("assistant", (grid(5, 6, 7, 8), "ran"))]
    ids, targets = encode_conversation(vocab, turns)
    expected = [vocab.bos_id, *vocab.encode_text("one"), vocab.sep_id,
                *vocab.encode_document(["the cat", grid(1, 2, 3, 4)], bos=False, eos=False), vocab.sep_id,
                *vocab.encode_text("sat"), vocab.eos_id, *vocab.encode_text("a dog"), vocab.sep_id,
                *vocab.encode_document([grid(5, 6, 7, 8), "ran"], bos=False, eos=False), vocab.eos_id]
    assert ids == expected
    assert targets == assistant_mask(ids, vocab.sep_id, vocab.eos_id)
    last_sep = len(ids) - 1 - ids[::-1].index(vocab.sep_id)
    assert generation_prompt(vocab, turns[:4]) == ids[: last_sep + 1]


def test_prompt_segments_encode_to_the_generation_prompt(vocab):
    turns = [Turn("system", ("one",)), Turn("user", ("the cat", grid(1, 2, 3, 4), " sat")),
             Turn("assistant", ("on",)), Turn("user", ("a dog",))]
    segments = prompt_segments(vocab, turns)
    assert encode_segments(vocab, segments) == generation_prompt(vocab, turns)
    assert [s for s in segments if isinstance(s, Ids)] == [Ids((vocab.sep_id,)), Ids((vocab.sep_id,)),
                                                           Ids((vocab.eos_id,)), Ids((vocab.sep_id,))]
    # without Ids it is encode_document; continuous images pass through too
    plain = ["the cat", LatentImage(3), "sat"]
    assert encode_segments(vocab, plain) == vocab.encode_document(plain, eos=False)
    with pytest.raises(ValueError, match="ends with a user"):
        prompt_segments(vocab, turns[:3])


def test_pending_turns_are_the_user_turns_no_answer_follows():
    user, answer, system = Turn("user", ("a",)), Turn("assistant", ("b",)), Turn("system", ("c",))
    assert pending_turns([system, user]) == [1]
    assert pending_turns([user, answer, user, user]) == [2, 3]
    assert pending_turns([user, answer]) == [] and pending_turns([system]) == []


def test_an_answer_comes_back_as_its_own_ids_without_its_end(vocab):
    text = vocab.encode_text("sat on")
    image = [vocab.boi_id, *[vocab.image_offset + c for c in (1, 2, 3, 4)], vocab.eoi_id]
    new = [*text, *image, *text, vocab.eos_id]
    picture = object()  # what a family decoded (a PIL image)
    turn = answer_turn(vocab, new, ["sat on", picture, "sat on"])
    assert turn.role == "assistant" and turn.parts == (Ids(tuple(text)), Ids(tuple(image)), Ids(tuple(text)))
    # an image the family made whole (placeholders) comes back as its picture; an unfinished one is dropped
    whole = [vocab.boi_id, vocab.image_placeholder_id, vocab.image_placeholder_id, vocab.eoi_id]
    turn = answer_turn(vocab, [*text, *whole, *image[:3]], ["sat on", picture])
    assert turn.parts == (Ids(tuple(text)), picture)
    follow = prompt_segments(vocab, [Turn("user", ("a",)), answer_turn(vocab, new, []), Turn("user", ("b",))])
    assert encode_segments(vocab, follow) == [vocab.bos_id, *vocab.encode_text("a"), vocab.sep_id, *new,
                                              *vocab.encode_text("b"), vocab.sep_id]


def test_a_conversation_file_gives_image_paths_relative_to_it(tmp_path):
    messages = [{"role": "user", "content": [{"type": "text", "text": "the cat"}, {"type": "image", "path": "a.png"},
                                             {"type": "text", "text": ""}]},
                {"role": "assistant", "content": "sat"}]
    (tmp_path / "c.json").write_text(json.dumps({"messages": messages}))
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": messages}) + "\nnot read\n")
    for name in ("c.json", "c.jsonl"):
        assert load_conversation(tmp_path / name) == [Turn("user", ("the cat", tmp_path / "a.png")),
                                                       Turn("assistant", ("sat",))]
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_conversation(tmp_path / "bad.json")
    (tmp_path / "role.json").write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}))
    with pytest.raises(ValueError, match="unknown role"):
        load_conversation(tmp_path / "role.json")
    with pytest.raises(FileNotFoundError):
        load_conversation(tmp_path / "missing.json")


def test_the_transformers_tokenizer_renders_the_same_ids(vocab):
    pytest.importorskip("transformers")
    tokenizer = vocab.to_transformers()
    assert tokenizer.chat_template == CHAT_TEMPLATE
    turns = [Turn("system", ("one two",)), Turn("user", ("the cat",)), Turn("assistant", ("sat on",)),
             Turn("user", ("a dog",))]
    messages = [{"role": t.role, "content": [{"type": "text", "text": t.parts[0]}]} for t in turns]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert list(rendered) == generation_prompt(vocab, turns)
    answered = [*messages, {"role": "assistant", "content": "ran"}]
    rendered = tokenizer.apply_chat_template(answered, tokenize=True)["input_ids"]
    assert list(rendered) == encode_conversation(vocab, [*turns, Turn("assistant", ("ran",))])[0]
    # an image part renders as the processor's <image>, which ChameleonProcessor expands into <boi> ... <eoi>
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "image"}]}], tokenize=False)
    assert text == "<s>a<image><sep>"
