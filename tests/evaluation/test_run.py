"""`train.py eval` end to end on a real `fit` checkpoint (the old tiny fixture) with a suite of the user's own package
(`--suite module:Class`, no registry line): results.json and the page are written, a rerun writes the same file,
and a vocabulary, suite or path that does not belong is one line on stderr."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from evaluation import BUILTIN_SUITES, suite_class
from experiments.commands import main

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoints" / "tiny-d9f92c4"
CHECKPOINT = FIXTURE / "chameleon-dense" / "last.ckpt"

# A suite of "the user's own package": two prompts sampled through the family's generate, one figure each.
OWN_SUITE = '''
from evaluation.base import EvalSettings, PageSample, Suite, SuiteResult, first_image, text_of
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Options:
    prompt: str = field(default="the digit", metadata={"help": "the text every sample continues"})


class EchoSuite(Suite):
    name = "echo"
    description = "continues one prompt in text and in image mode"
    Options = Options

    def run(self, context):
        text, _ = context.sample([[self.options.prompt]] * 2, context.sampling("text", max_new_tokens=4))
        images, ids = context.sample([[self.options.prompt]] * 2, context.sampling("image", seed=1))
        made = [first_image(out) is not None for out in images]
        samples = [PageSample("image", self.options.prompt, first_image(out)) for out in images]
        return SuiteResult({"texts": [text_of(out) for out in text], "ids": ids, "made": made,
                            "text_loss": context.text_loss(["the digit one"])}, samples)
'''


@pytest.fixture
def own_suite(tmp_path, monkeypatch):
    (tmp_path / "my_suites.py").write_text(textwrap.dedent(OWN_SUITE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_suites:EchoSuite"


def _eval(out: Path, suite: str, *extra: str) -> int:
    return main(["eval", "--checkpoint", str(CHECKPOINT), "--suite", suite, "--vocab",
                 str(FIXTURE / "vocab" / "tokenizer.json"), "--media-tokenizer", str(FIXTURE / "vq"), "--out", str(out),
                 "--cfg-scale", "1", "--batch-size", "2", *extra])


def test_eval_writes_results_and_page_and_repeats_itself(tmp_path, own_suite, capsys):
    assert _eval(tmp_path / "a", own_suite, "--prompt", "the digit two") == 0
    assert _eval(tmp_path / "b", own_suite, "--prompt", "the digit two") == 0
    first = (tmp_path / "a" / "results.json").read_text()
    results = json.loads(first)
    assert results["suite"] == "echo" and results["family"] == "chameleon"
    assert results["options"] == {"prompt": "the digit two"} and results["settings"]["seed"] == 0
    assert set(results["fingerprints"]) == {"checkpoint", "vocab", "media_tokenizer"}
    assert all(len(v) >= 16 for v in results["fingerprints"].values())
    assert len(results["figures"]["ids"]) == 2 and results["figures"]["text_loss"] > 0
    assert "<img" in (tmp_path / "a" / "index.html").read_text() or not any(results["figures"]["made"])
    assert (tmp_path / "b" / "results.json").read_text() == first
    assert _eval(tmp_path / "c", own_suite, "--prompt", "the digit two", "--seed", "5") == 0
    assert json.loads((tmp_path / "c" / "results.json").read_text())["figures"]["ids"] != results["figures"]["ids"]
    assert "wrote" in capsys.readouterr().out


def test_a_vocabulary_the_checkpoint_was_not_trained_with_is_one_line(tmp_path, own_suite, capsys):
    from tokenizer.vocab import train_unified_vocab

    other = tmp_path / "other.json"
    train_unified_vocab(["another corpus altogether"] * 20, vocab_size=320, image_codes=16).save(other)
    code = main(["eval", "--checkpoint", str(CHECKPOINT), "--suite", own_suite, "--vocab", str(other),
                 "--media-tokenizer", str(FIXTURE / "vq"), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "trained with another vocab" in err and not (tmp_path / "x" / "results.json").exists()


@pytest.mark.parametrize("suite, message", [("nosuch", "unknown suite 'nosuch'"),
                                            ("no_module_here:Suite", "cannot import no_module_here")])
def test_an_unknown_suite_is_one_line(tmp_path, suite, message, capsys):
    assert _eval(tmp_path, suite) == 2
    assert message in capsys.readouterr().err


def test_a_missing_checkpoint_is_one_line(tmp_path, own_suite, capsys):
    code = main(["eval", "--checkpoint", str(tmp_path / "none.ckpt"), "--suite", own_suite, "--vocab",
                 str(FIXTURE / "vocab" / "tokenizer.json")])
    assert code == 2 and "--checkpoint" in capsys.readouterr().err


def test_the_scenes_suite_refuses_the_digits_tokenizer_in_one_sentence(tmp_path, capsys):
    assert _eval(tmp_path, "scenes") == 2
    assert "64-px scenes but --media-tokenizer makes 8-px images" in capsys.readouterr().err


def test_every_builtin_suite_is_importable_and_named():
    for name in BUILTIN_SUITES:
        assert suite_class(name).name == name
