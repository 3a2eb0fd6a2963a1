"""configs/tokenizer/*.yaml name a tokenizer preset (image or video) and add only the fields they change."""

from pathlib import Path

import pytest
import yaml

from tokenizer.image import PRESETS, ImageTokenizerConfig
from tokenizer.video import VIDEO_PRESETS, VideoTokenizerConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tokenizer"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_tokenizer_config_is_a_preset_plus_changed_fields_only(path):
    model = yaml.safe_load(path.read_text())["model"]
    known = {**dict.fromkeys(PRESETS, ImageTokenizerConfig), **dict.fromkeys(VIDEO_PRESETS, VideoTokenizerConfig)}
    assert model["preset"] in known, f"{path.name} names no preset of tokenizer/image or tokenizer/video"
    config_class = known[model["preset"]]
    preset = config_class.from_preset(model["preset"])
    overrides = model.get("overrides") or {}
    resolved = config_class.from_preset(model["preset"], **overrides)
    restated = sorted(k for k in overrides if getattr(resolved, k) == getattr(preset, k))
    assert not restated, f"{path.name} restates the {model['preset']} preset's {restated}"


def test_small_128_is_the_demo_64_network_at_twice_the_side():
    demo, small = ImageTokenizerConfig.from_preset("demo-64"), ImageTokenizerConfig.from_preset("small-128")
    changed = {k for k, v in demo.to_dict().items() if small.to_dict()[k] != v}
    assert changed == {"image_size", "codebook_size", "name"}
    assert small.grid_shape == (8, 8) and demo.grid_shape == (4, 4)
