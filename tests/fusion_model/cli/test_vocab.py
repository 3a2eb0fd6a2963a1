"""`python train.py vocab`: help for every option, a small run end to end, and clear errors."""

from __future__ import annotations

import pytest

from fusion_model import cli
from fusion_model.cli.vocab import build_parser, main
from tokenizer.vocab import UnifiedVocab


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["vocab", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for action in build_parser()._actions:
        assert action.help, action.dest
        for option in action.option_strings:
            assert option in text
    assert "kjv" in text and "runs/vocab/tokenizer.json" in text
    flat = " ".join(text.split())
    assert "(default: 65536)" in flat and "merged (default: 2)" in flat and "(default: None)" not in flat


def test_small_run_writes_a_loadable_vocabulary(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a tiny corpus of words\nwords and more words\n" * 50, encoding="utf-8")
    out = tmp_path / "vocab" / "tokenizer.json"
    args = [
        "--corpus",
        str(corpus),
        "--out",
        str(out),
        "--vocab-size",
        "800",
        "--image-codes",
        "256",
        "--no-progress",
    ]
    assert main(args) == 0
    vocab = UnifiedVocab.load(out, expected_vocab_size=800, expected_image_codes=256)
    assert vocab.decode_text(vocab.encode_text("more words")) == "more words"
    report = capsys.readouterr().out
    assert "800 ids = 16 specials + 256 image codes" in report and vocab.fingerprint()[:16] in report


def test_max_mb_limits_the_builtin_corpus(tmp_path, capsys):
    out = tmp_path / "tokenizer.json"
    assert (
        main(
            [
                "--max-mb",
                "0.05",
                "--out",
                str(out),
                "--vocab-size",
                "2000",
                "--image-codes",
                "512",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "from 1 file(s)" in capsys.readouterr().out
    assert UnifiedVocab.load(out).vocab_size == 2000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--corpus", "does/not/exist.txt"], "does not exist"),
        (["--vocab-size", "1000", "--image-codes", "900", "--max-mb", "0.01"], "short"),
    ],
)
def test_errors_exit_2_with_a_message_and_write_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "tokenizer.json"
    assert cli.main(["vocab", *args, "--out", str(out), "--no-progress"]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_only_unreadable_files_is_an_empty_corpus_that_counts_them(tmp_path, capsys):
    (tmp_path / "utf16.txt").write_text("not utf-8", encoding="utf-16")
    args = ["--corpus", str(tmp_path), "--skip-bad-files", "--out", str(tmp_path / "t.json"), "--no-progress"]
    assert cli.main(["vocab", *args]) == 2
    error = capsys.readouterr().err
    assert "corpus is empty" in error and "1 non-UTF-8 file(s) were skipped" in error


def test_the_image_codes_come_from_the_image_tokenizer_bundle(tmp_path):
    from fusion_model.cli.vocab import image_codes
    from tokenizer.image import ImageTokenizer, ImageTokenizerConfig

    bundle = tmp_path / "bundle"
    ImageTokenizer(ImageTokenizerConfig.from_preset("demo-64")).save_pretrained(bundle)
    assert image_codes(None, str(bundle)) == 512
    assert image_codes(512, str(bundle)) == 512
    with pytest.raises(ValueError, match="--image-codes 256 but the image tokenizer .* has 512 codes"):
        image_codes(256, str(bundle))
    with pytest.raises(FileNotFoundError, match="--image-tokenizer .*: no config.json"):
        image_codes(None, str(tmp_path))
    assert image_codes(None, None) == 8192 and image_codes(64, None) == 64
