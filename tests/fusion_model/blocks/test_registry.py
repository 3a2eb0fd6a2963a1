"""Blocks by name: the built-in names, a block of one's own named as package.module:Class, and clear refusals."""

import sys
import textwrap

import pytest
import torch

from fusion_model.blocks import BUILTIN_BLOCKS, block_class
from fusion_model.blocks.dense import DenseBlock
from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel


def test_builtin_names():
    assert set(BUILTIN_BLOCKS) == {"dense", "mot"}
    assert block_class("dense") is DenseBlock
    assert block_class("mot").__name__ == "MoTBlock"


def test_a_block_of_ones_own_is_built_from_its_own_file(tmp_path, monkeypatch):
    """A new block lives in its own file: nothing in the package names it."""
    (tmp_path / "scaled_block.py").write_text(textwrap.dedent('''
        from fusion_model.blocks.dense import DenseBlock as Block

        class ScaledBlock(Block):
            """The dense block with its residual update halved."""

            def forward(self, x, cos, sin, ctx):
                return x + 0.5 * (super().forward(x, cos, sin, ctx) - x)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        config = FusionConfig.from_preset("tiny", block="scaled_block:ScaledBlock")
        model = FusionModel(config)
        assert type(model.layers[0]).__name__ == "ScaledBlock"
        assert model.num_parameters() == config.num_parameters()
        assert model(torch.randint(0, 256, (1, 8))).shape == (1, 8, 256)
    finally:
        sys.modules.pop("scaled_block", None)


@pytest.mark.parametrize("name, message", [
    ("moe", "unknown block 'moe'"),
    ("no_such_module:Block", "cannot import 'no_such_module'"),
    ("fusion_model.model:NoSuchBlock", "has no class 'NoSuchBlock'"),
])
def test_unknown_blocks_are_refused_with_a_sentence(name, message):
    with pytest.raises(ValueError, match=message):
        FusionConfig.from_preset("tiny", block=name)
