"""SamplingConfig: every setting is checked when the config is made, non-finite numbers and wrong types included."""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, fields

import numpy as np
import pytest

from fusion_model.sampling import SamplingConfig


def _float_fields() -> list[str]:
    hints = typing.get_type_hints(SamplingConfig)
    return [f.name for f in fields(SamplingConfig) if float in (hints[f.name], *typing.get_args(hints[f.name]))]


FLOAT_FIELDS = _float_fields()
PAIRED = {"cfg_image_scale": "cfg_text_scale", "cfg_text_scale": "cfg_image_scale"}  # three-stream: both or neither


def test_the_float_fields_are_the_sampling_numbers():
    assert FLOAT_FIELDS == ["text_temperature", "text_top_p", "image_temperature", "image_top_p", "repetition_penalty",
                            "cfg_scale", "cfg_image_scale", "cfg_text_scale"]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_every_non_finite_number_is_refused_naming_the_field_and_the_flag(field, value):
    values = {field: value, **({PAIRED[field]: 1.0} if field in PAIRED else {})}
    message = f"SamplingConfig.{field}={value!r} must be a finite number (--{field.replace('_', '-')})"
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingConfig(**values)
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingConfig.chameleon(**values)


@pytest.mark.parametrize("field, value, message", [
    ("stop_at_eos", 1, "must be True or False"),
    ("use_kv_cache", "no", "must be True or False"),
    ("compile", None, "must be True or False"),
    ("text_top_k", 2.5, "must be a whole number (--text-top-k)"),
    ("image_top_k", True, "must be a whole number (--image-top-k)"),
    ("speculative_window", "4", "must be a whole number (--speculative-window)"),
    ("max_new_tokens", 8.0, "must be a whole number (--max-new-tokens)"),
    ("seed", 1.5, "must be a whole number (--seed)"),
    ("cfg_scale", "2", "must be a number (--cfg-scale)"),
    ("text_temperature", False, "must be a number (--text-temperature)"),
    ("mode", 3, "must be a string (--mode)"),
    ("image_grid", (2, 2.5), "must be 2 whole numbers"),
    ("image_grid", (2, 2, 2), "must be 2 whole numbers"),
    ("image_grid", "22", "must be 2 whole numbers"),
])
def test_a_value_of_the_wrong_type_is_refused(field, value, message):
    with pytest.raises(ValueError, match=re.escape(f"SamplingConfig.{field}={value!r} {message}")):
        SamplingConfig(**{field: value})


def test_numbers_of_other_numeric_types_are_accepted():
    config = SamplingConfig(text_top_k=np.int64(5), text_temperature=np.float32(0.5), cfg_scale=2, seed=np.int32(3),
                            image_grid=[np.int64(2), 3])
    assert (config.text_top_k, config.cfg_scale, config.image_grid) == (5, 2, (2, 3))
    assert SamplingConfig(cfg_image_scale=None, cfg_text_scale=None, max_new_tokens=None, seed=None).seed is None


@pytest.mark.parametrize("values, message", [
    ({"text_temperature": -0.1}, "text_temperature=-0.1 must be >= 0"),
    ({"image_top_p": 0.0}, "image_top_p=0.0 must be in (0, 1]"),
    ({"text_top_p": 1.5}, "text_top_p=1.5 must be in (0, 1]"),
    ({"image_top_k": -1}, "image_top_k=-1 must be >= 0"),
    ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 must be > 0"),
    ({"max_new_tokens": 0}, "max_new_tokens=0 must be >= 1"),
    ({"image_grid": (0, 2)}, "image_grid=(0, 2) must be positive"),
    ({"cfg_text_scale": 3.0}, "needs both cfg_image_scale and cfg_text_scale"),
])
def test_the_range_checks_still_hold(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingConfig(**values)


def test_a_subclass_field_is_checked_too():
    @dataclass
    class Extended(SamplingConfig):
        min_p: float = 0.0

    assert Extended(min_p=0.1).min_p == 0.1
    with pytest.raises(ValueError, match=re.escape("SamplingConfig.min_p=nan must be a finite number (--min-p)")):
        Extended(min_p=math.nan)
