"""The token names of the unified vocabulary's id blocks: Chameleon's image-token names and the reserved names."""

from __future__ import annotations

import re

IMAGE_PREFIX = "IMGIMG"
RESERVED = re.compile(r"<reserved_\d+>")
_DIGITS_AS_LETTERS = str.maketrans("0123456789", "ABCDEFGHIJ")
_LETTERS_AS_DIGITS = str.maketrans("ABCDEFGHIJ", "0123456789")
_IMAGE_NAME = re.compile(re.escape(IMAGE_PREFIX) + "([A-J]+)Z")


def image_token_name(code: int) -> str:
    """Chameleon's name for image code `code`: IMGIMG + digits as letters (0->A ... 9->J) + Z; 123 -> IMGIMGBCDZ."""
    return IMAGE_PREFIX + str(int(code)).translate(_DIGITS_AS_LETTERS) + "Z"


def image_code_of_name(name: str) -> int | None:
    """Inverse of image_token_name: the code an image token's name stands for, None for any other name."""
    match = _IMAGE_NAME.fullmatch(name)
    if match is None:
        return None
    code = int(match.group(1).translate(_LETTERS_AS_DIGITS))
    return code if image_token_name(code) == name else None  # "IMGIMGABZ" (a leading zero) names nothing


def reserved_name(index: int) -> str:
    """Name of the index-th reserved token (unused specials and the filler after BPE)."""
    return f"<reserved_{index}>"
