"""The id layout's image rule, written once for every layer: image code k is id image_offset + k, k < image_codes.

It imports neither `tokenizers` nor torch nor numpy (the rule is the same expression for tensors and arrays), so
the decoder, the loss and the data stream use it without loading the vocabulary's machinery. The layout of a
continuous image (Transfusion: one `<image>` placeholder id per latent patch, `patchify`) is written here too, so
the data stream and the decoder read one rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

Ids = TypeVar("Ids", "torch.Tensor", "np.ndarray")
Array = TypeVar("Array", "torch.Tensor", "np.ndarray")


def image_code_mask(ids: Ids, image_offset: int, image_codes: int) -> Ids:
    """Boolean mask (a tensor for a tensor, an array for an array) of the ids that are image codes."""
    return (ids >= image_offset) & (ids < image_offset + image_codes)


def image_position_mask(ids: Ids, image_offset: int | None, image_codes: int | None,
                        placeholder_id: int | None = None) -> Ids:
    """Which positions hold an image: an image code, or (when given) the placeholder id that stands for one patch
    of a continuous image (Transfusion). Without a placeholder id this is `image_code_mask`, bit for bit."""
    if image_offset is None:
        if placeholder_id is None:
            raise ValueError("image_position_mask needs the image block (image_offset, image_codes) or a "
                             "placeholder id")
        return ids == placeholder_id
    is_image = image_code_mask(ids, image_offset, image_codes)
    return is_image if placeholder_id is None else is_image | (ids == placeholder_id)


def _permute(x: Array, order: tuple[int, ...]) -> Array:
    # torch's transpose swaps two dimensions; numpy's takes the whole order (torch calls that permute)
    return x.permute(*order) if hasattr(x, "permute") else x.transpose(order)


def patchify(latents: Array, patch_size: int) -> Array:
    """(N, C, h, w) latents -> (N, P, C*k*k) patch vectors, P = (h/k)*(w/k) patches in row-major order.

    Inside a patch the vector is channel-major: element c*k*k + i*k + j is channel c at row i, column j of the
    patch (k = patch_size). Works on tensors and arrays alike.
    """
    n, c, h, w = latents.shape
    k = patch_size
    if h % k or w % k:
        raise ValueError(f"patchify: latent grid {h}x{w} is not a multiple of patch_size {k}")
    x = _permute(latents.reshape(n, c, h // k, k, w // k, k), (0, 2, 4, 1, 3, 5))
    return x.reshape(n, (h // k) * (w // k), c * k * k)


def unpatchify(patches: Array, patch_size: int, height: int, width: int) -> Array:
    """The inverse of `patchify`: (N, P, C*k*k) patch vectors of an height x width latent grid -> (N, C, h, w)."""
    n, p, d = patches.shape
    k = patch_size
    if height % k or width % k or p != (height // k) * (width // k) or d % (k * k):
        raise ValueError(f"unpatchify: {p} patches of {d} values do not tile a {height}x{width} grid with "
                         f"patch_size {k}")
    c = d // (k * k)
    x = _permute(patches.reshape(n, height // k, width // k, c, k, k), (0, 3, 1, 4, 2, 5))
    return x.reshape(n, c, height, width)
