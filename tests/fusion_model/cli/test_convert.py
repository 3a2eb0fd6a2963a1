"""`python train.py convert`: --help without torch, and its dtype names are the converter's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fusion_model import cli
from fusion_model.cli.convert import DTYPE_NAMES
from fusion_model.hf_convert import DTYPES


def test_dtype_choices_are_the_converters_dtypes():
    assert sorted(DTYPE_NAMES) == sorted(DTYPES)


def test_help_explains_the_defaults_and_imports_no_torch(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["convert", "export", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--dtype {bfloat16,float32}" in text and "(default: the checkpoint's)" in text
    assert "(default: None)" not in text
    code = ("import sys\nfrom fusion_model import cli\nfor action in ('import', 'export'):\n    try:\n"
            "        cli.main(['convert', action, '--help'])\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stderr.strip() == "False"
