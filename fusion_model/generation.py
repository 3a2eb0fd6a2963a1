"""Text and images in, text and PIL images out: prompts are encoded with the vocabulary and the image
tokenizer, sampled with fusion_model.sampling, and the new ids decoded back into strings and PIL images."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fusion_model.sampling import SamplingConfig, generate_ids
from tokenizer.compat import check_compatible

if TYPE_CHECKING:  # only for type hints; PIL is imported where images are opened
    from PIL import Image


def load_prompt_image(item: Any) -> Image.Image:
    """Open a prompt image (PIL image or path) fully now, so a bad file fails here with its name."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        return item
    path = Path(item)
    if not path.is_file():
        raise FileNotFoundError(f"prompt image {str(path)!r} does not exist: check the path")
    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(
            f"prompt image {str(path)!r} cannot be read as an image ({error}); pass a PNG/JPEG file"
        ) from error


def encode_prompt(segments: list[Any], vocab: Any, image_tokenizer: Any) -> list[int]:
    """`<s>` + the segments in order (text as BPE, images as `<boi>` codes `<eoi>`), without `</s>`."""
    parts: list[Any] = []
    for item in segments:
        if isinstance(item, str):
            parts.append(item)
        elif isinstance(item, (os.PathLike, bytes)) or hasattr(item, "convert"):
            if image_tokenizer is None:
                raise ValueError("the prompt contains an image but no image tokenizer was given")
            codes = image_tokenizer.encode([load_prompt_image(item)])[0]
            parts.append(codes.cpu())
        else:
            raise TypeError(
                f"prompt segment of type {type(item).__name__}: "
                "use str (text), a PIL image, or a pathlib.Path"
            )
    return list(vocab.encode_document(parts, bos=True, eos=False))


def split_segments(ids: list[int], vocab: Any, grid: tuple[int, int] | None) -> list[str | torch.Tensor]:
    """Generated ids → text strings and (h, w) code grids in order; `</s>` and unfinished images dropped."""
    segments: list[str | torch.Tensor] = []
    for span in vocab.spans(ids):
        body = ids[span.body]
        if not span.is_image:
            text = [token for token in body if token not in (vocab.eos_id, vocab.pad_id, vocab.bos_id)]
            if text:
                segments.append(vocab.decode_text(text))
        elif span.closed and grid is not None and len(body) == grid[0] * grid[1]:
            segments.append(torch.tensor(body).view(*grid) - vocab.image_offset)
    return segments


def decode_outputs(
    rows: list[list[int]], vocab: Any, image_tokenizer: Any, grid: tuple[int, int] | None
) -> list[list[Any]]:
    """Generated ids of each prompt → segments, image grids decoded to PIL images (all in one batch)."""
    from tokenizer.image import to_pil

    split = [split_segments(row, vocab, grid) for row in rows]
    grids = [seg for segments in split for seg in segments if not isinstance(seg, str)]
    if grids and image_tokenizer is None:
        raise ValueError("the output contains images but no image tokenizer was given to decode them")
    pixels = image_tokenizer.decode(torch.stack(grids)) if grids else None
    results, k = [], 0
    for segments in split:
        out: list[Any] = []
        for seg in segments:
            if isinstance(seg, str):
                out.append(seg)
            else:
                out.append(to_pil(pixels[k]))
                k += 1
        results.append(out)
    return results


def generate(
    model: torch.nn.Module,
    vocab: Any,
    image_tokenizer: Any,
    prompts: list[list[str | Image.Image | os.PathLike]],
    config: SamplingConfig,
    *,
    return_ids: bool = False,
) -> list[list[str | Image.Image]] | tuple[list[list[str | Image.Image]], list[list[int]]]:
    """Sample a continuation of each prompt (text, PIL images or pathlib.Path images) as text and PIL images.

    With return_ids, also returns the generated ids of each prompt.
    """
    if getattr(image_tokenizer, "kind", "vq") != "vq":
        raise ValueError("the image tokenizer is a continuous one (latents, for a transfusion checkpoint); this "
                         "model samples image codes: pass the VQ image tokenizer bundle its token shards were made "
                         "with (--image-tokenizer)")
    check_compatible(model=model.config, vocab=vocab, image_tokenizer=image_tokenizer)
    if image_tokenizer is not None:
        grid = tuple(image_tokenizer.grid_shape)
        if config.image_grid is not None and tuple(config.image_grid) != grid:
            raise ValueError(
                f"SamplingConfig.image_grid={config.image_grid} but the image tokenizer makes {grid} grids"
            )
        config = replace(config, image_grid=grid)
    elif config.mode != "text":
        raise ValueError(
            f"mode {config.mode!r} can produce images: "
            "give an image tokenizer to decode them (or use mode 'text')"
        )
    ids = [encode_prompt(p, vocab, image_tokenizer) for p in prompts]
    new_ids = generate_ids(model, vocab, ids, config)
    samples = decode_outputs(new_ids, vocab, image_tokenizer, config.image_grid)
    return (samples, new_ids) if return_ids else samples
