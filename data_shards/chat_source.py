"""The chat source: conversations from chat JSON Lines files (`chat_jsonl`, `shards write --chat`), checked first."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from PIL import Image

from data_shards.raw import safe_key
from data_shards.sample import Sample, _image_or_skip
from tokenizer.chat import Turn, parse_messages


def chat_files(paths: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """(jsonl file, key prefix) for each of `paths`: a file as it is, a folder as every `*.jsonl` inside it
    (recursive, sorted); a missing path or a folder without any is refused."""
    files: list[tuple[Path, str]] = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
            if not found:
                raise ValueError(f"--chat {path}: no .jsonl file inside; give chat JSON Lines files or folders of them")
            files += [(p, str(p.relative_to(path).with_suffix(""))) for p in found]
        elif path.is_file():
            files.append((path, path.stem))
        else:
            raise FileNotFoundError(f"--chat {path}: no such file or folder")
    return files


def _chat_records(path: Path) -> Iterator[tuple[int, list[Turn], list[list[bool]]]]:
    """(line number, turns, which parts are images) of each non-empty line of a chat jsonl (`parse_messages` gives
    image parts as their path strings); the first structural error (not UTF-8, invalid JSON, unknown role, a bad
    part, no assistant turn) raises ValueError naming the file and line."""
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, 1):
            where = f"{path} line {line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 text (byte {err.start}); re-save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: invalid JSON ({err.msg} at column {err.colno}); fix or remove the "
                                 "line") from None
            turns = parse_messages(record, where)
            # parse_messages accepted the record: every content is a string or a list of text / image parts, and it
            # kept the parts in order, dropping only empty texts
            kinds = []
            for message in record["messages"]:
                content = message["content"]
                parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
                kinds.append([part["type"] == "image" for part in parts
                              if part["type"] == "image" or part["text"]])
            yield line_no, turns, kinds


def chat_jsonl(paths: Iterable[str | Path]) -> Iterator[Sample]:
    """Conversations from chat JSON Lines files (folders: every `*.jsonl` inside, sorted), one per line:
    `{"messages": [{"role": "system"|"user"|"assistant", "content": str | [{"type": "text", "text": ...},
    {"type": "image", "path": ...}]}]}`; relative image paths resolve against the jsonl's folder.

    Every file's structure is checked here, at the call, so a structural error refuses the whole run with one line
    naming file and line before anything is written; a missing or undecodable image makes its conversation a skip.
    """
    files = chat_files(paths)
    for path, _ in files:
        for _ in _chat_records(path):
            pass
    return _chat_samples(files)


def _chat_samples(files: list[tuple[Path, str]]) -> Iterator[Sample]:
    """The conversations (or skips) of `chat_jsonl`'s files, one at a time, their images decoded once."""
    for path, prefix in files:
        for line_no, turns, kinds in _chat_records(path):
            key = safe_key(f"{prefix}_{line_no}")
            opened: list[Turn] = []
            skip = None
            for turn, images in zip(turns, kinds):
                parts: list[str | Image.Image] = []
                for part, is_image in zip(turn.parts, images):
                    if is_image:
                        image = _image_or_skip(key, path.parent / part, f"{path} line {line_no} image {part}")
                        if isinstance(image, Sample):
                            skip = image
                            break
                        part = image
                    parts.append(part)
                if skip is not None:
                    break
                opened.append(Turn(turn.role, tuple(parts)))
            yield skip if skip is not None else Sample(key, turns=opened)
