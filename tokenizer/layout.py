"""The id layout's image rule, written once for every layer: image code k is id image_offset + k, k < image_codes.

It imports neither `tokenizers` nor torch nor numpy (the rule is the same expression for tensors and arrays), so
the decoder, the loss and the data stream use it without loading the vocabulary's machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

Ids = TypeVar("Ids", "torch.Tensor", "np.ndarray")


def image_code_mask(ids: Ids, image_offset: int, image_codes: int) -> Ids:
    """Boolean mask (a tensor for a tensor, an array for an array) of the ids that are image codes."""
    return (ids >= image_offset) & (ids < image_offset + image_codes)
