"""`python train.py`: one flag vocabulary across the subcommands, the shared-flag translation of the LightningCLI
commands, and the exit-code rule (bad input: one line, exit 2)."""

from __future__ import annotations

import argparse

import pytest

from fusion_model import cli
from fusion_model.cli import convert, generate, shards, tokenizer, vocab

# spellings the commands used before they shared one vocabulary; none may come back
RETIRED = {"--ckpt", "--ckpt-path", "--ckpt_path", "--output", "--text-field", "--tokenizer"}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every argparse parser the project declares, by command name."""
    found = {"vocab": vocab.build_parser(), "generate": generate.parser(), "tokenizer export": tokenizer.export_parser()}
    for name, parser in (("shards", shards.build_parser()), ("convert", convert.parser())):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        found.update({f"{name} {action}": subparser for action, subparser in sub.choices.items()})
    return found


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def test_every_declared_flag_is_hyphenated_and_none_is_a_retired_spelling():
    for name, parser in _parsers().items():
        for option in _options(parser):
            assert "_" not in option, f"{name}: {option} (use hyphens)"
            assert option not in RETIRED, f"{name}: {option}"


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("generate", {"--checkpoint", "--vocab", "--image-tokenizer", "--out"}),
        ("convert export", {"--checkpoint", "--vocab", "--image-tokenizer", "--out"}),
        ("convert import", {"--out"}),
        ("tokenizer export", {"--checkpoint", "--out"}),
        ("shards write", {"--out", "--text-key"}),
        ("shards tokenize", {"--vocab", "--image-tokenizer", "--out"}),
        ("shards inspect", {"--vocab"}),
        ("vocab", {"--out", "--text-key"}),
    ],
)
def test_the_same_things_have_the_same_flags(command, flags):
    assert flags <= _options(_parsers()[command])


@pytest.mark.parametrize("command", ["generate", "convert export", "shards tokenize", "vocab"])
def test_the_media_tokenizer_flag_is_also_spelled_image_tokenizer(command):
    parser = _parsers()[command]
    required = ["--checkpoint", "c.ckpt", "--out", "o"] if command in ("generate", "convert export") else []
    required = [*required, "raw", "--out", "o", "--vocab", "v.json"] if command == "shards tokenize" else required
    required = ["--out", "o"] if command == "vocab" else required
    for spelling in ("--media-tokenizer", "--image-tokenizer"):
        assert parser.parse_args([*required, spelling, "BUNDLE"]).image_tokenizer == "BUNDLE"
    assert cli.translate_shared_flags(["--media-tokenizer", "B"], cli.FIT_SHARED_FLAGS) == ["--data.image_tokenizer", "B"]


def test_translate_shared_flags_maps_both_spellings_and_leaves_everything_else():
    argv = ["--checkpoint", "a.ckpt", "--vocab=v.json", "--data.vocab_x", "--image-tokenizer", "B", "--", "--vocab"]
    assert cli.translate_shared_flags(argv, cli.FIT_SHARED_FLAGS) == [
        "--ckpt_path", "a.ckpt", "--data.vocab=v.json", "--data.vocab_x", "--data.image_tokenizer", "B", "--", "--vocab",
    ]
    assert cli.translate_shared_flags(["--vocab", "v"], cli.TOKENIZER_SHARED_FLAGS) == ["--vocab", "v"]


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["fit", "--help"], ["--checkpoint X = --ckpt_path X", "--vocab X = --data.vocab X",
                             "--image-tokenizer X = --data.image_tokenizer X"]),
        (["tokenizer", "fit", "--help"], ["--checkpoint X = --ckpt_path X"]),
        (["tokenizer", "--help"], ["--checkpoint X = --ckpt_path X", "export --checkpoint CKPT --out DIR"]),
        (["convert", "export", "--help"], ["--checkpoint CKPT", "--out DIR", "--vocab", "--image-tokenizer"]),
        (["shards", "tokenize", "--help"], ["--out TOKENS_DIR", "--vocab", "--image-tokenizer"]),
    ],
)
def test_help_shows_the_shared_flags(argv, shown, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in shown:
        assert flag in text


def test_bad_input_exits_2_with_one_line_naming_the_command(tmp_path, capsys):
    assert cli.main(["convert", "export", "--checkpoint", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("train.py convert: ") and "missing.ckpt does not exist" in err and err.count("\n") == 1
    assert cli.main(["no-such-command"]) == 2
    assert "choose one of" in capsys.readouterr().err


def test_a_run_that_fails_after_it_started_is_not_bad_input(monkeypatch):
    def crash(argv):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(vocab, "main", crash)
    with pytest.raises(RuntimeError, match="out of memory"):  # a traceback and exit 1, not a usage error
        cli.main(["vocab"])


def test_the_dispatcher_runs_the_table_its_caller_gives(capsys):
    """The cli layer names only its own commands; a higher layer passes a larger table (see experiments.commands)."""
    assert all(module.startswith("fusion_model.cli.") for module, _ in cli.SUBCOMMANDS.values())
    table = {**cli.SUBCOMMANDS, "extra": ("fusion_model.cli.vocab", "vocab under another name")}
    assert cli.main(["--help"], commands=table) == 0
    assert "  extra  " in capsys.readouterr().out
    assert cli.main(["vocab"], commands={"extra": ("fusion_model.cli.convert", "x")}) == 2
    assert "choose one of: extra" in capsys.readouterr().err
