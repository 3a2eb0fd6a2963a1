"""One loader for every family's checkpoint: the family, its parts with their weights, and the tokenizer
fingerprints it was trained with."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion_model.checkpoint import load_model, part_weights, read_checkpoint
from fusion_model.config import FusionConfig
from fusion_model.families import DEFAULT_FAMILY, adapters, family_class, resolve_family
from fusion_model.families.base import Family, LossSettings


@dataclass
class LoadedFamily:
    """A checkpoint's family, its parts (weights loaded, eval mode) and the fingerprints it recorded."""

    family: Family
    parts: dict[str, nn.Module]
    tokenizers: dict[str, str] = field(default_factory=dict)

    def check_tokenizers(self, vocab: Any = None, image_tokenizer: Any = None, where: str = "") -> None:
        """Refuse a vocabulary or image tokenizer other than the ones the checkpoint was trained with (when it
        recorded them): their ids or features would mean something else to the model."""
        given = {"vocab": (vocab, "--vocab"), "image_tokenizer": (image_tokenizer, "--image-tokenizer")}
        for key, (tokenizer, flag) in given.items():
            expected = self.tokenizers.get(key)
            if tokenizer is None or not expected or tokenizer.fingerprint() == expected:
                continue
            raise ValueError(f"{where}: the checkpoint was trained with another {key.replace('_', ' ')} (fingerprint "
                             f"{expected}; {flag} has {tokenizer.fingerprint()}): pass the one its token shards "
                             "were made with")


def checkpoint_family(path: str | os.PathLike) -> type[Family]:
    """The family class a checkpoint names, read from its hparams without its weights (a transformers Chameleon
    directory: the default family); what `train.py generate` builds its sampling options from."""
    path = Path(path)
    if path.is_dir():
        return family_class(DEFAULT_FAMILY)
    hparams = read_checkpoint(path, map_location="meta")["hyper_parameters"]
    name, _ = resolve_family(hparams.get("family"), hparams.get("family_options"), hparams.get("late_fusion"))
    return family_class(name)


def load_family(path: str | os.PathLike, map_location: str | torch.device = "cpu",
                base: str | os.PathLike | None = None) -> LoadedFamily:
    """Any family's checkpoint: a `train.py fit` checkpoint (its hparams name the family, or the older
    `late_fusion`; none: chameleon), a `convert import` file, or a transformers Chameleon directory. A LoRA adapter
    checkpoint (`--model.peft`) comes back merged into its base: read from `base`, else the recorded path, and
    refused unless its fingerprint is the recorded one."""
    path = Path(path)
    if path.is_dir():
        model = load_model(path, map_location=map_location).eval()
        # a transformers Chameleon directory holds the decoder alone: the default (chameleon) family's one part
        return LoadedFamily(family_class(DEFAULT_FAMILY)(model.config), {"model": model})
    checkpoint = read_checkpoint(path, map_location)
    hparams = checkpoint["hyper_parameters"]
    config = FusionConfig.from_dict(hparams["config"])
    name, options = resolve_family(hparams.get("family"), hparams.get("family_options"), hparams.get("late_fusion"))
    losses = LossSettings(text_weight=hparams.get("text_weight", 1.0), image_weight=hparams.get("image_weight", 1.0))
    family = family_class(name)(config, options, losses)
    parts = family.build()
    record = checkpoint.get(adapters.ADAPTER_KEY)
    for part_name, part in parts.items():
        if record is not None and part_name == "model":
            options = adapters.LoraOptions.from_dict(hparams.get("peft") or {})
            adapters.load_adapter(part, part_weights(checkpoint["state_dict"], part_name), record, options, base,
                                  str(path)).to(map_location).eval()
            continue
        try:
            part.load_state_dict(part_weights(checkpoint["state_dict"], part_name))
        except RuntimeError as error:
            raise ValueError(f"{path}: the {name} family's {part_name} does not match the checkpoint's weights "
                             f"({str(error).splitlines()[0]})") from error
        part.eval()
    family.set_mode(parts, False)
    tokenizers = {k: str(v) for k, v in (hparams.get("tokenizers") or {}).items() if v}
    return LoadedFamily(family, parts, tokenizers)
