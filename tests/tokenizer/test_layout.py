"""The one image-id rule: [image_offset, image_offset + image_codes), for tensors and arrays alike."""

import numpy as np
import pytest
import torch

from tokenizer.layout import image_code_mask
from tokenizer.vocab import train_unified_vocab

OFFSET, CODES = 16, 512
EDGES = [0, OFFSET - 1, OFFSET, OFFSET + 1, OFFSET + CODES - 1, OFFSET + CODES, OFFSET + CODES + 1]
EXPECTED = [False, False, True, True, True, False, False]


def test_a_tensor_gives_a_boolean_tensor_true_exactly_inside_the_block():
    mask = image_code_mask(torch.tensor(EDGES), OFFSET, CODES)
    assert isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
    assert mask.tolist() == EXPECTED


@pytest.mark.parametrize("dtype", [np.int64, np.uint16, np.uint32])  # uint16 / uint32: the token shards' ids
def test_an_array_gives_a_boolean_array_true_exactly_inside_the_block(dtype):
    mask = image_code_mask(np.array(EDGES, dtype=dtype), OFFSET, CODES)
    assert isinstance(mask, np.ndarray) and mask.dtype == np.bool_
    assert mask.tolist() == EXPECTED


def test_any_shape_is_kept():
    ids = torch.tensor(EDGES[:6]).view(2, 3)
    assert image_code_mask(ids, OFFSET, CODES).tolist() == [EXPECTED[:3], EXPECTED[3:6]]
    assert image_code_mask(ids.numpy(), OFFSET, CODES).shape == (2, 3)


def test_the_vocabulary_uses_the_same_rule():
    vocab = train_unified_vocab(["a small corpus for a small vocabulary"] * 4, vocab_size=600, image_codes=64)
    ids = torch.arange(vocab.vocab_size)
    assert torch.equal(vocab.is_image(ids), image_code_mask(ids, vocab.image_offset, vocab.image_codes))
    assert vocab.is_image(ids).tolist().count(True) == 64
