"""The `Sample` every ingest source yields, and the decode-once-or-skip of an image (`_image_or_skip`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from data_shards.raw import VideoFile
from tokenizer.chat import Turn
from tokenizer.image.preprocess import ImageLoadError, open_image


@dataclass
class Sample:
    """One document (`segments`: str, RGB PIL image, or a clip: `VideoFile` / uint8 (T, H, W, 3) frames), a
    conversation (`turns`: `tokenizer.chat.Turn`s whose parts are str and PIL images) or, when `skip_reason` is set,
    a rejected one."""

    key: str
    segments: list[str | Image.Image | VideoFile | np.ndarray] = field(default_factory=list)
    skip_reason: str | None = None
    turns: list[Turn] | None = None


def _image_or_skip(key: str, source: object, label: str) -> Image.Image | Sample:
    try:
        return open_image(source, name=label)
    except ImageLoadError as err:
        return Sample(key, skip_reason=str(err))
