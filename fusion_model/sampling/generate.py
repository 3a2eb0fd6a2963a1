"""Text and images in, text, PIL images and clips out: prompts are encoded with the vocabulary and the image
tokenizer, sampled with fusion_model.sampling, and the new ids decoded back into strings, PIL images and (with a
video tokenizer) `Clip`s of frames."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from common.compat import check_compatible
from fusion_model.sampling.config import SamplingConfig
from fusion_model.sampling.decode import generate_ids

if TYPE_CHECKING:  # only for type hints; PIL is imported where images are opened
    from PIL import Image

# The image tokenizer kinds whose codes a decoder of image codes samples: a VQ image tokenizer, or a video
# tokenizer (its images are a frame repeated, its clips t x h x w codes).
CODE_KINDS = ("vq", "video")


@dataclass
class Clip:
    """A generated clip: uint8 frames (T, H, W, 3) and the (t, h, w) codes they were decoded from."""

    frames: np.ndarray
    codes: torch.Tensor


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
    """`<s>` + the segments in order (text as BPE, images as `<boi>` codes `<eoi>`, `tokenizer.chat.Ids` as they
    are: a chat's ends of turn and earlier answers), without `</s>`."""
    from tokenizer.chat import encode_segments, is_ids

    parts: list[Any] = []
    for item in segments:
        if isinstance(item, str) or is_ids(item):
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
    return encode_segments(vocab, parts)


def split_segments(ids: list[int], vocab: Any, grid: tuple[int, int] | None,
                   video_grid: tuple[int, int, int] | None = None) -> list[str | torch.Tensor]:
    """Generated ids → text strings, (h, w) image code grids and (t, h, w) clip code grids in order; `</s>` and
    unfinished images or clips dropped (a clip's markers and any separators inside it are not codes)."""
    from tokenizer.layout import image_code_mask

    segments: list[str | torch.Tensor] = []
    for span in vocab.spans(ids):
        body = ids[span.body]
        if span.is_video:
            codes = torch.tensor(body, dtype=torch.long)
            codes = codes[image_code_mask(codes, vocab.image_offset, vocab.image_codes)]
            if span.closed and video_grid is not None and len(codes) == int(np.prod(video_grid)):
                segments.append(codes.view(*video_grid) - vocab.image_offset)
        elif not span.is_image:
            text = [token for token in body if token not in (vocab.eos_id, vocab.pad_id, vocab.bos_id)]
            if text:
                segments.append(vocab.decode_text(text))
        elif span.closed and grid is not None and len(body) == grid[0] * grid[1]:
            segments.append(torch.tensor(body).view(*grid) - vocab.image_offset)
    return segments


def clip_frames(pixels: torch.Tensor) -> np.ndarray:
    """float (T, 3, H, W) in [-1, 1] → uint8 (T, H, W, 3)."""
    scaled = ((pixels.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return scaled.permute(0, 2, 3, 1).cpu().numpy()


def decode_outputs(
    rows: list[list[int]], vocab: Any, image_tokenizer: Any, grid: tuple[int, int] | None,
    video_grid: tuple[int, int, int] | None = None,
) -> list[list[Any]]:
    """Generated ids of each prompt → segments: image grids decoded to PIL images, clip grids to `Clip`s (each
    kind in one batch)."""
    from tokenizer.image import to_pil

    split = [split_segments(row, vocab, grid, video_grid) for row in rows]
    grids = [seg for segments in split for seg in segments if isinstance(seg, torch.Tensor) and seg.dim() == 2]
    clips = [seg for segments in split for seg in segments if isinstance(seg, torch.Tensor) and seg.dim() == 3]
    if (grids or clips) and image_tokenizer is None:
        raise ValueError("the output contains images but no image tokenizer was given to decode them")
    pixels = image_tokenizer.decode(torch.stack(grids)) if grids else None
    frames = image_tokenizer.decode_clips(torch.stack(clips)) if clips else None
    results, k, c = [], 0, 0
    for segments in split:
        out: list[Any] = []
        for seg in segments:
            if isinstance(seg, str):
                out.append(seg)
            elif seg.dim() == 3:
                out.append(Clip(clip_frames(frames[c]), seg))
                c += 1
            else:
                out.append(to_pil(pixels[k]))
                k += 1
        results.append(out)
    return results


def video_grid_setting(config: SamplingConfig, image_tokenizer: Any) -> dict[str, tuple[int, int, int]]:
    """`{"video_grid": (t, h, w)}` from a video tokenizer (a given SamplingConfig.video_grid must agree); `{}` for
    an image tokenizer, which makes no clips (mode "video" is then refused)."""
    has_field = "video_grid" in {f.name for f in dataclasses.fields(config)}
    tokenizer_grid = getattr(image_tokenizer, "video_grid", None)
    if tokenizer_grid is None:
        if config.mode == "video":
            raise ValueError("mode 'video' needs a video tokenizer bundle (--image-tokenizer) to size and decode the "
                             f"clips; this one is a {getattr(image_tokenizer, 'kind', 'vq')!r} image tokenizer")
        return {}
    tokenizer_grid = tuple(int(n) for n in tokenizer_grid)
    if not has_field:
        return {}
    if config.video_grid is not None and tuple(config.video_grid) != tokenizer_grid:
        raise ValueError(f"SamplingConfig.video_grid={config.video_grid} but the video tokenizer makes "
                         f"{tokenizer_grid} clips")
    return {"video_grid": tokenizer_grid}


def generate(
    model: torch.nn.Module,
    vocab: Any,
    image_tokenizer: Any,
    prompts: list[list[str | Image.Image | os.PathLike]],
    config: SamplingConfig,
    *,
    return_ids: bool = False,
) -> list[list[str | Image.Image]] | tuple[list[list[str | Image.Image]], list[list[int]]]:
    """Sample a continuation of each prompt (text, PIL images or pathlib.Path images) as text, PIL images and,
    with a video tokenizer, `Clip`s (mode "video": one clip right after the prompt).

    With return_ids, also returns the generated ids of each prompt.
    """
    if getattr(image_tokenizer, "kind", "vq") not in CODE_KINDS:
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
        config = replace(config, image_grid=grid, **video_grid_setting(config, image_tokenizer))
    elif config.mode != "text":
        raise ValueError(
            f"mode {config.mode!r} can produce images: "
            "give an image tokenizer to decode them (or use mode 'text')"
        )
    ids = [encode_prompt(p, vocab, image_tokenizer) for p in prompts]
    new_ids = generate_ids(model, vocab, ids, config)
    samples = decode_outputs(new_ids, vocab, image_tokenizer, config.image_grid, getattr(config, "video_grid", None))
    return (samples, new_ids) if return_ids else samples
