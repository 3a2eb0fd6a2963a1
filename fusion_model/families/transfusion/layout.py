"""Where a packed batch's continuous images are (runs of the `<image>` placeholder inside a document), the batch's
keyed diffusion draws, and which keys an unconditional image may attend to."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusion_model.layers import attention_backends as attn_lib


@dataclass
class ImageLayout:
    """Where a batch's continuous images are. Flat indices are row * T + column; images are numbered in that
    order."""

    is_patch: torch.Tensor  # (B, T) bool: placeholder positions inside a document
    image_of: torch.Tensor  # (B, T) long: each patch position's image, -1 elsewhere
    start: torch.Tensor  # (N,) flat index of each image's first patch
    opener: torch.Tensor  # (N,) flat index of the position before it in its document (<boi>), or its start
    patches: torch.Tensor  # (N,) patches per image
    image_first: torch.Tensor  # (N,) whether it opens its document (only <s> before its <boi>) and text follows

    @property
    def count(self) -> int:
        """Number of images."""
        return int(self.start.numel())

    def patch_image(self) -> torch.Tensor:
        """(P,) the image of each patch position, in row-major order."""
        return self.image_of[self.is_patch]


def image_layout(input_ids: torch.Tensor, document_ids: torch.Tensor, placeholder_id: int) -> ImageLayout:
    """The images of a packed batch: runs of `placeholder_id` inside one document each."""
    batch, length = input_ids.shape
    is_patch = (input_ids == placeholder_id) & (document_ids >= 0)
    same_document = torch.zeros_like(is_patch)
    same_document[:, 1:] = document_ids[:, 1:] == document_ids[:, :-1]
    continues = torch.zeros_like(is_patch)
    continues[:, 1:] = is_patch[:, :-1] & same_document[:, 1:]
    starts = (is_patch & ~continues).reshape(-1)
    start = starts.nonzero().squeeze(1)
    number = starts.long().cumsum(0) - 1
    image_of = torch.where(is_patch.reshape(-1), number, -1).view(batch, length)
    patches = torch.bincount(image_of[is_patch], minlength=start.numel())
    opener = torch.where(same_document.reshape(-1)[start], start - 1, start)
    before = attn_lib.positions_from_documents(document_ids).reshape(-1)  # tokens before each in its document
    after = attn_lib.positions_from_documents(document_ids.flip(1)).flip(1).reshape(-1)  # and after it
    end = start + patches - 1
    # <s> <boi> patches <eoi> and at least two more tokens (a caption and </s>, not just </s>)
    image_first = (opener != start) & (before[opener] <= 1) & (after[end] >= 3)
    return ImageLayout(is_patch=is_patch, image_of=image_of, start=start, opener=opener, patches=patches,
                       image_first=image_first)


@dataclass
class DiffusionDraws:
    """One batch's keyed diffusion inputs: per image its step and caption-dropout decision, per patch (row-major
    order) its clean latent, its noise and the noisy latent the decoder reads."""

    layout: ImageLayout
    timesteps: torch.Tensor  # (N,) long
    dropped: torch.Tensor  # (N,) bool: trained without its caption
    clean: torch.Tensor  # (P, C*k*k)
    noise: torch.Tensor  # (P, C*k*k)
    noisy: torch.Tensor  # (P, C*k*k)


def visible_from(layout: ImageLayout, unconditional: torch.Tensor, shape: torch.Size, offset: int = 0) -> torch.Tensor:
    """(B, T) key index each query may attend from (`FusionModel.forward_hidden(visible_from=)`): an unconditional
    image's `<boi>` and patches from its `<boi>` on (offset + column: cache indices under a KV cache), every
    other position from 0 (its document limits it)."""
    batch, length = shape
    result = torch.zeros(batch * length, dtype=torch.long, device=layout.is_patch.device)
    column = layout.opener % length + offset
    patch_positions = layout.is_patch.reshape(-1).nonzero().squeeze(1)
    image = layout.patch_image()
    result[patch_positions] = torch.where(unconditional[image], column[image], 0)
    result[layout.opener] = torch.where(unconditional, column, result[layout.opener])
    return result.view(batch, length)
