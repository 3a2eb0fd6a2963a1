"""`python train.py convert`: --help without torch, and its dtype names are the converter's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

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


class Opaque:
    """An object a weights-only torch.load refuses (a pickled class, not a tensor)."""


@pytest.fixture
def tiny_hf_folder(tmp_path):
    """A transformers Chameleon folder of a one-layer decoder (save_pretrained: config.json + model.safetensors)."""
    transformers = pytest.importorskip("transformers", reason="transformers (dev extra) writes the folder")
    from fusion_model.hf_convert import PLACEHOLDER_VQ_CONFIG

    config = transformers.ChameleonConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32, vocabulary_map={"<image>": 3},
        vq_config=PLACEHOLDER_VQ_CONFIG)
    transformers.ChameleonForConditionalGeneration(config).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _without_vocabulary_map(folder):
    config = json.loads((folder / "config.json").read_text())
    del config["vocabulary_map"]
    (folder / "config.json").write_text(json.dumps(config))


def _with_a_pickled_object_as_weights(folder):
    (folder / "model.safetensors").unlink()
    torch.save({"x": Opaque()}, folder / "pytorch_model.bin")


@pytest.mark.parametrize(("spoil", "said"), [
    (_without_vocabulary_map, "config.json has no vocabulary_map"),
    (_with_a_pickled_object_as_weights, "pytorch_model.bin is not a plain tensor pickle; torch.load(weights_only=True) "
                                         "refused it: Unsupported global: GLOBAL "),
], ids=["no-vocabulary-map", "pickled-object"])
def test_import_of_a_folder_transformers_cannot_load_is_one_line_naming_it_and_the_fix(
        tiny_hf_folder, tmp_path, capsys, spoil, said):
    from fusion_model.checkpoint import load_model

    spoil(tiny_hf_folder)
    for out in (tmp_path / "run", tmp_path / "one.ckpt"):
        assert cli.main(["convert", "import", str(tiny_hf_folder), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"train.py convert: {tiny_hf_folder}: ") and said in err
        assert "`train.py convert export`" in err and "vocabulary_map" in err and "model.safetensors" in err
        assert not out.exists()
    with pytest.raises(ValueError, match="give a folder written by"):  # every directory load goes the same way
        load_model(tiny_hf_folder)


def test_a_good_tiny_folder_still_imports(tiny_hf_folder, tmp_path):
    assert cli.main(["convert", "import", str(tiny_hf_folder), "--out", str(tmp_path / "one.ckpt")]) == 0
    assert (tmp_path / "one.ckpt").is_file()
