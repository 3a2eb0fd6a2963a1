"""The decoder on disk: one loader for every command (a Lightning `.ckpt`, a `convert import` file, or a
transformers Chameleon directory) and one writer, both through the project's safe file rules."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from common.files import atomic_torch_save, load_checkpoint_file
from fusion_model.blocks import block_class
from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel


def load_model(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> FusionModel:
    """A FusionModel from a checkpoint file (`state_dict` with a `model.` prefix and hyper_parameters['config'],
    as Lightning writes them; loaded with weights_only=True) or a transformers Chameleon directory."""
    return load_model_and_hparams(path, map_location)[0]


def load_model_and_hparams(path: str | os.PathLike,
                           map_location: str | torch.device = "cpu") -> tuple[FusionModel, dict]:
    """`load_model`'s decoder and the hyper_parameters it was saved with (a `train.py fit` checkpoint names its
    family there; {} for a transformers directory), from one read of the file."""
    path = Path(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a directory without config.json; give a .ckpt file or a directory "
                                    "written by `train.py convert export`")
        from fusion_model.hf_convert import from_transformers, load_transformers_folder

        return from_transformers(load_transformers_folder(path)).to(map_location), {}
    checkpoint = read_checkpoint(path, map_location)
    if "adapter" in checkpoint:  # fusion_model.families.adapters.ADAPTER_KEY: LoRA weights without their base
        raise ValueError(f"{path} is a LoRA adapter checkpoint (no base weights): merge it into its base first with "
                         "`train.py convert export`, then `convert import` the folder, or load it with `train.py "
                         "generate`")
    model = FusionModel(FusionConfig.from_dict(checkpoint["hyper_parameters"]["config"]))
    model.load_state_dict(part_weights(checkpoint["state_dict"], "model"))
    return model, dict(checkpoint["hyper_parameters"])


def read_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict:
    """A checkpoint file's contents (weights_only), refused with a sentence unless it holds `state_dict` and
    hyper_parameters['config'] (what `fit` and `save_model` write)."""
    checkpoint = load_checkpoint_file(path, map_location=map_location)
    config = (checkpoint.get("hyper_parameters") or {}).get("config")
    if not isinstance(config, dict) or "state_dict" not in checkpoint:
        raise ValueError(f"{path} is not a fusion checkpoint (expected 'state_dict' and hyper_parameters['config'])")
    return checkpoint


def part_weights(state_dict: dict[str, torch.Tensor], part: str) -> dict[str, torch.Tensor]:
    """The weights saved under `<part>.` (e.g. `model`, `connector`), without that prefix; a torch.compile'd part
    saved its weights under "_orig_mod.", which is dropped too."""
    prefix = part + "."
    return {key[len(prefix):].replace("_orig_mod.", ""): value for key, value in state_dict.items()
            if key.startswith(prefix)}


def save_model(model: FusionModel, path: str | os.PathLike) -> Path:
    """Write a weights-only checkpoint in the layout `load_model`, `train.py fit --checkpoint` and the sampler read."""
    body = {
        "state_dict": {"model." + k: v.detach().cpu() for k, v in model.state_dict().items()},
        "hyper_parameters": {"config": model.config.to_dict()},
    }
    return atomic_torch_save(body, path)


# Fields that decide the shapes and the function of the weights; the rest (dropout, attention backend, z-loss,
# max_seq_len for RoPE, gradient checkpointing) may change when training continues from a checkpoint.
BLOCK_FIELDS = ("block", "block_options")  # which layer class, and its settings: the parameter names follow
ARCHITECTURE_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "hidden_dim", "qk_norm",
                       "norm_placement", "norm_eps", "rope_theta", "image_offset", "image_codes", *BLOCK_FIELDS)


def architecture_differences(have: FusionConfig, want: FusionConfig) -> list[str]:
    """`field: have vs want` for every architecture field on which two decoder configs disagree."""
    return [f"{name}: {getattr(have, name)} vs {getattr(want, name)}" for name in ARCHITECTURE_FIELDS
            if getattr(have, name) != getattr(want, name)]


def can_upcycle(have: FusionConfig, want: FusionConfig) -> bool:
    """Whether dense weights (`have`) can start a model of `want`: the one architecture difference allowed is the
    block, from the dense one to a block class that names each of its parameters' dense source (`dense_name`)."""
    if any(getattr(have, name) != getattr(want, name) for name in ARCHITECTURE_FIELDS if name not in BLOCK_FIELDS):
        return False
    return upcycles_block(have, want)


def upcycles_block(have: FusionConfig, want: FusionConfig) -> bool:
    """Whether `want`'s block can start from `have`'s by upcycling: from the dense block to a block class that
    names each of its parameters' dense source (`dense_name`); the other fields are not looked at."""
    dense = block_class("dense")
    target = block_class(want.block)
    return block_class(have.block) is dense and target is not dense and callable(getattr(target, "dense_name", None))


# The --model.config option of each architecture field that is a derived property of FusionConfig
OPTION_OF_FIELD = {"kv_heads": "n_kv_heads", "hidden_dim": "ffn_dim"}


def option_value(value: object) -> str:
    """A config value as a command-line option takes it (null, true/false, the number or text)."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def architecture_refusal(path: str | os.PathLike, have: FusionConfig, want: FusionConfig) -> str:
    """One line refusing weights of architecture `have` (the checkpoint at `path`) for a model of `want`: the
    differences that matter and what to pass instead. When the block alone could be upcycled, the block is no
    difference, and the advice keeps it (the checkpoint's sizes as options), since `--model.config null` would
    train the checkpoint's dense block instead."""
    upcycle = upcycles_block(have, want)
    differences = [line for line in architecture_differences(have, want)
                   if not (upcycle and line.split(":", 1)[0] in BLOCK_FIELDS)]
    text = f"model.init_weights {path} holds another architecture ({'; '.join(differences)}; checkpoint vs model.config)"
    if not upcycle:
        return f"{text}: pass --model.config null to take the checkpoint's config"
    options = " ".join(f"--model.config.{OPTION_OF_FIELD.get(name, name)}={option_value(getattr(have, name))}"
                       for name in ARCHITECTURE_FIELDS
                       if name not in BLOCK_FIELDS and getattr(have, name) != getattr(want, name))
    return (f"{text}: pass the checkpoint's values ({options}) to upcycle it into the {want.block} block, or "
            f"--model.config null to train the checkpoint's {have.block} decoder as it is")


def upcycle_weights(dense: dict[str, torch.Tensor], model: FusionModel) -> dict[str, torch.Tensor]:
    """A state dict for `model` (a block with `dense_name`) from a dense model's: each block parameter takes the
    dense weight its block's `dense_name` names (so every modality's copy starts as the dense one), every other
    parameter (embedding, final norm, head) the dense weight of its own name. The modalities' entries share one
    tensor (no copy of a large model held twice): `load_state_dict` copies each into its own parameter."""
    rename = block_class(model.config.block).dense_name
    layer = re.compile(r"(layers\.\d+\.)(.+)")
    weights = {}
    for name in model.state_dict():
        match = layer.fullmatch(name)
        source = match.group(1) + rename(match.group(2)) if match else name
        if source not in dense:
            raise ValueError(f"upcycling: the dense checkpoint has no {source} for the {model.config.block} "
                             f"block's {name}")
        weights[name] = dense[source]
    return weights


def checkpoint_config(path: str | os.PathLike) -> FusionConfig:
    """The decoder config stored in a checkpoint file or transformers directory (what `load_model` would build)."""
    path = Path(path)
    if path.is_dir():
        return load_model(path).config
    config = (load_checkpoint_file(path, map_location="meta").get("hyper_parameters") or {}).get("config")
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a fusion checkpoint (no hyper_parameters['config'])")
    return FusionConfig.from_dict(config)


def connector_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The late-fusion connector's weights in a `train.py fit` checkpoint of an earlier stage (`connector.*`)."""
    weights = part_weights(load_checkpoint_file(path).get("state_dict") or {}, "connector")
    if not weights:
        raise ValueError(f"{path} holds no late-fusion connector (no connector.* weights): give a checkpoint written "
                         "by `train.py fit` with --model.late_fusion (e.g. the last.ckpt of stage 1)")
    return weights
