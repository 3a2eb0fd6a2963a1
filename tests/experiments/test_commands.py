"""The whole command line: `train.py` runs the cli layer's commands, then the demo's, in one table; the installed
`early-fusion` script runs the pipeline commands alone (the experiments are not installed)."""

from __future__ import annotations

import re
from pathlib import Path

from experiments import commands
from fusion_model import cli

REPO = Path(__file__).resolve().parents[2]


def test_the_table_is_the_cli_layers_followed_by_eval_demo_and_experiment():
    assert list(commands.SUBCOMMANDS) == ["vocab", "tokenizer", "shards", "fit", "plan", "generate", "convert",
                                          "eval", "demo", "experiment"]
    assert commands.SUBCOMMANDS["eval"][0] == "evaluation.cli"  # the installed evaluation package's command
    assert {name: commands.SUBCOMMANDS[name] for name in cli.SUBCOMMANDS} == cli.SUBCOMMANDS
    assert all(module.startswith("fusion_model.cli.") for module, _ in cli.SUBCOMMANDS.values())


def test_help_lists_every_command_and_unknown_names_them_all(capsys):
    assert commands.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in commands.SUBCOMMANDS)
    assert out.index("  convert ") < out.index("  eval ") < out.index("  demo ") < out.index("  experiment ")
    assert commands.main(["nope"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("convert, eval, demo, experiment")


def test_train_py_runs_the_whole_table_and_the_console_script_the_pipeline():
    script = re.search(r'^early-fusion = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert script and script.group(1) == "fusion_model.cli:main"
    assert "from experiments.commands import main" in (REPO / "train.py").read_text()
    packages = re.search(r"^include = \[(.+)\]$", (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert "experiments" not in packages  # run from a checkout, never installed
