"""The chat template: a conversation as one id sequence and its target mask, the ids transformers' Chameleon makes.

    <s> [system] <sep> [user] <sep> [assistant] </s> [user] <sep> [assistant] </s> ...

Every turn that is not the assistant's is followed by `<sep>` (the `sep_token` of the exported tokenizer), every
assistant turn by `</s>`. So the prompt of a one-turn chat, `<s>` + the user's parts + `<sep>`, is exactly what
`ChameleonProcessor` builds in its default (chat) mode, and `CHAT_TEMPLATE` renders the same ids through
`tokenizer.apply_chat_template`. A turn's parts are text and images (image codes, `<boi>` codes `<eoi>`, as in any
document). The target mask marks the tokens a fine-tune is trained to predict: every token of the turns whose role
is trained (default: the assistant's), including the `</s>` that ends each answer, so the model learns to stop.

The same prompt ids through transformers, from a `train.py convert export --vocab --image-tokenizer` folder after
`from_pretrained` (`UnifiedVocab.to_transformers` puts `CHAT_TEMPLATE` on the tokenizer, which keeps it on reload;
a processor's own template is dropped then):
- `processor(text="... <image> ...", images=[...])`: one user turn; the default (chat) mode appends `<sep>`;
- `tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`: any conversation of text
  (an image part renders as `<image>`, one placeholder id, which only the processor expands);
- `processor.apply_chat_template(messages, chat_template=processor.tokenizer.chat_template,
  add_generation_prompt=True, tokenize=True, return_dict=True, processor_kwargs={"return_for_text_completion":
  True})`: any conversation with images (`{"type": "image", "image": PIL}`); without return_for_text_completion
  the processor appends a second `<sep>`; the same as `processor(text=tokenizer.apply_chat_template(messages,
  add_generation_prompt=True, tokenize=False), images=[...], return_for_text_completion=True,
  add_special_tokens=False)`.
Where our ids hold an image's codes, the processor's hold `<boi>`, image_seq_length `<image>` placeholders and
`<eoi>`; the model's `get_image_tokens(pixel_values)` gives the codes that replace them.

Chat generation (`train.py generate --chat`) hands a family the conversation as one prompt's segments
(`prompt_segments`: each turn's parts, its end of turn as `Ids`), so every family's prompt encoder reads it through
`encode_segments`; the model's answer comes back into the chat as its own ids (`answer_turn`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")
DEFAULT_TARGET_ROLES = ("assistant",)

# Jinja for transformers' `apply_chat_template` (kept on the tokenizer: a processor's template is dropped on
# reload). It writes the tokenizer's own special tokens, never literals, so it follows the exported names.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}<image>{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ sep_token }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class Turn:
    """One message: its role and its parts in order (str text; an image as its path, a PIL image or a code grid)."""

    role: str
    parts: tuple[Any, ...]


def parse_roles(roles: str | Sequence[str]) -> tuple[str, ...]:
    """Trained roles from "assistant" / "user,assistant" / a sequence; refuses an unknown or empty set."""
    names = [r.strip() for r in roles.split(",")] if isinstance(roles, str) else [str(r) for r in roles]
    names = [r for r in names if r]
    unknown = [r for r in names if r not in ROLES]
    if unknown or not names:
        raise ValueError(f"trained roles {roles!r}: each must be one of {', '.join(ROLES)} (comma-separated), "
                         "e.g. 'assistant'")
    return tuple(r for r in ROLES if r in names)


def parse_messages(record: Any, where: str, *, need_answer: bool = True) -> list[Turn]:
    """The turns of one chat record `{"messages": [{"role": ..., "content": str | [parts]}]}` (the convention of
    transformers, TRL and LLaVA datasets); an image part is `{"type": "image", "path": ...}` (paths as given).
    Raises ValueError naming `where` (file and line) for anything else, or a record with no assistant turn."""
    if not isinstance(record, Mapping) or not isinstance(record.get("messages"), list) or not record["messages"]:
        raise ValueError(f"{where}: a chat record is {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}} "
                         "with at least one message")
    turns = []
    for number, message in enumerate(record["messages"]):
        at = f"{where}, message {number}"
        if not isinstance(message, Mapping):
            raise ValueError(f"{at}: a message is an object with \"role\" and \"content\"")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{at}: unknown role {role!r} (roles: {', '.join(ROLES)})")
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise ValueError(f"{at}: content must be a string or a list of parts")
        parts: list[Any] = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                if part["text"]:
                    parts.append(part["text"])
            elif kind == "image" and isinstance(part.get("path") or part.get("image"), str):
                parts.append(part.get("path") or part.get("image"))
            else:
                raise ValueError(f"{at}: a part is {{\"type\": \"text\", \"text\": ...}} or {{\"type\": \"image\", "
                                 f"\"path\": ...}}; got {part!r:.80}")
        turns.append(Turn(role, tuple(parts)))
    if need_answer and not any(t.role == "assistant" for t in turns):
        raise ValueError(f"{where}: the conversation has no assistant turn, so nothing would be trained")
    return turns


def end_of_turn(vocab: Any, role: str) -> int:
    """The id after a turn: `</s>` after the assistant's, `<sep>` after any other."""
    return int(vocab.eos_id) if role == "assistant" else int(vocab.sep_id)


def encode_conversation(vocab: Any, turns: Sequence[Turn], target_roles: Sequence[str] = DEFAULT_TARGET_ROLES,
                        **grids: Any) -> tuple[list[int], list[int]]:
    """(ids, targets) of a conversation whose image parts are already code grids: `<s>`, each turn's parts and its
    end of turn; targets[i] = 1 where token i is trained (every token of a trained role's turn, its end included).
    `grids`: `grid_shape` / `video_grid` as `UnifiedVocab.encode_document` takes them."""
    ids, targets = [int(vocab.bos_id)], [0]
    for turn in turns:
        body = [int(i) for i in vocab.encode_document(list(turn.parts), bos=False, eos=False, **grids)]
        body.append(end_of_turn(vocab, turn.role))
        ids += body
        targets += [int(turn.role in target_roles)] * len(body)
    return ids, targets


def generation_prompt(vocab: Any, turns: Sequence[Turn], **grids: Any) -> list[int]:
    """The ids a model continues to answer: the conversation so far, whose last turn is not the assistant's, so the
    ids end with `<sep>` (ChameleonProcessor's chat mode for a single user turn)."""
    if not turns or turns[-1].role == "assistant":
        raise ValueError("a chat prompt ends with a user (or system) turn, which the model answers")
    return encode_conversation(vocab, turns, (), **grids)[0]


def assistant_mask(ids: Sequence[int], sep_id: int, eos_id: int) -> list[int]:
    """The assistant positions of a conversation's ids (`<s>` first), read from the markers alone: a turn ends at
    `<sep>` or `</s>`, and the turns that end at `</s>` are the assistant's, their `</s>` included; `<s>` and anything
    after the last end of turn are not. A reference for tests: `shards verify` checks stored masks with the
    vectorised rule of `data_shards.target_mask.first_mismatch`, which also covers other trained roles."""
    mask = [0] * len(ids)
    start = 1
    for index in range(1, len(ids)):
        if ids[index] in (sep_id, eos_id):
            if ids[index] == eos_id:
                mask[start : index + 1] = [1] * (index + 1 - start)
            start = index + 1
    return mask


# ---- chat generation: a conversation as a family's prompt, and the model's answers back into it -----------------
@dataclass(frozen=True)
class Ids:
    """A prompt segment written as it is: an end of turn, or an answer the model already gave (its own ids)."""

    ids: tuple[int, ...]


def is_ids(segment: Any) -> bool:
    """Whether a prompt segment is verbatim ids (`Ids`) rather than text or an image."""
    return isinstance(segment, Ids)


def encode_segments(vocab: Any, segments: Sequence[Any], *, bos: bool = True, **grids: Any) -> list[int]:
    """`vocab.encode_document(segments, eos=False)` where a segment may also be `Ids`, written as they are (each
    text is encoded on its own either way, so cutting the document at `Ids` changes no id)."""
    ids = [int(vocab.bos_id)] if bos else []
    run: list[Any] = []
    for segment in [*segments, None]:
        if segment is None or is_ids(segment):
            ids += [int(i) for i in vocab.encode_document(run, bos=False, eos=False, **grids)] if run else []
            ids += [int(i) for i in segment.ids] if segment is not None else []
            run = []
        else:
            run.append(segment)
    return ids


def prompt_segments(vocab: Any, turns: Sequence[Turn]) -> list[Any]:
    """A conversation that ends with a turn the model answers, as one prompt's segments: each turn's parts (text,
    images, `Ids`) and its end of turn as `Ids`, so `encode_segments` gives `generation_prompt`'s ids and every
    family's prompt encoder reads it as any prompt."""
    if not turns or turns[-1].role == "assistant":
        raise ValueError("a chat prompt ends with a user (or system) turn, which the model answers")
    segments: list[Any] = []
    for turn in turns:
        segments += [*turn.parts, Ids((end_of_turn(vocab, turn.role),))]
    return segments


def pending_turns(turns: Sequence[Turn]) -> list[int]:
    """The indices of the user turns the model answers: those the next turn does not answer (an assistant turn
    right after), in order."""
    return [i for i, turn in enumerate(turns)
            if turn.role == "user" and (i + 1 == len(turns) or turns[i + 1].role != "assistant")]


def answer_turn(vocab: Any, new_ids: Sequence[int], outputs: Sequence[Any]) -> Turn:
    """The model's answer as an assistant turn for the next prompt: its text and its code images as the ids it
    sampled (`Ids`, exact), an image that is not codes (a family that makes images whole) as the picture it
    decoded (the next of `outputs` that is not text), an unfinished image and its `</s>` left out."""
    pictures = iter([out for out in outputs if not isinstance(out, str)])
    ids = [int(i) for i in new_ids]
    if ids and ids[-1] == int(vocab.eos_id):
        ids = ids[:-1]
    codes = range(int(vocab.image_offset), int(vocab.image_offset) + int(vocab.image_codes))
    parts: list[Any] = []
    for span in vocab.spans(ids):
        body = ids[span.body]
        if not span.is_visual or (span.closed and (span.is_video or all(i in codes for i in body))):
            parts.append(Ids(tuple(ids[span.start : span.end])))  # text, codes: exactly what the model wrote
        elif span.closed:
            parts.append(next(pictures))
    return Turn("assistant", tuple(parts))


def load_conversation(path: str | os.PathLike) -> list[Turn]:
    """The turns of a conversation file, `{"messages": [...]}` as a .json or as the first line of a .jsonl, its
    image paths made relative to the file (as `Path`s); a bad file raises ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"conversation file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        text = next((line for line in text.splitlines() if line.strip()), "")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error.msg} at line {error.lineno} column {error.colno}); write "
                         "{\"messages\": [{\"role\": \"user\", \"content\": \"...\"}]}") from error
    parse_messages(record, str(path), need_answer=False)  # checked; its turns hold image paths as str, like text
    turns = []
    for message in record["messages"]:
        content = message["content"]
        content = [{"type": "text", "text": content}] if isinstance(content, str) else content
        parts = [part["text"] if part["type"] == "text" else path.parent / (part.get("path") or part.get("image"))
                 for part in content if part["type"] != "text" or part["text"]]
        turns.append(Turn(message["role"], tuple(parts)))
    return turns
