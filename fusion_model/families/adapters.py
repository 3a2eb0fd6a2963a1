"""Parameter-efficient fine-tuning of the decoder: LoRA through peft (its targets chosen by parameter role), the
base's fingerprint, an adapter checkpoint's base put back under it, and the adapter merged into plain weights.

Rank 6 beside the loader (`loading.py`), which reads adapter checkpoints; the trainer (`fusion_model.training`)
injects the adapter. peft is imported only when an adapter is made or merged (`pip install -e ".[peft]"`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fusion_model.checkpoint import (
    architecture_differences,
    architecture_refusal,
    can_upcycle,
    load_model_and_hparams,
    upcycle_weights,
)
from fusion_model.layers import roles
from fusion_model.model import FusionModel

PEFT_MISSING = 'LoRA (--model.peft) needs the peft library: pip install -e ".[peft]"'
# which projections each `targets` choice adapts, by the role their weight declares (fusion_model.layers.roles)
TARGET_ROLES = {
    "attention": frozenset({roles.ATTENTION, roles.ATTENTION_OUTPUT}),
    "mlp": frozenset({roles.MLP, roles.MLP_OUTPUT}),
    "all": frozenset({roles.ATTENTION, roles.ATTENTION_OUTPUT, roles.MLP, roles.MLP_OUTPUT}),
}
ADAPTER_KEY = "adapter"  # the checkpoint entry recording the base: {"base": path, "fingerprint": sha256}


@dataclass(frozen=True)
class LoraOptions:
    """LoRA's settings (`--model.peft '{rank: 8, alpha: 16, dropout: 0.0, targets: attention}'`)."""

    rank: int = 8  # r: the rank of each update B @ A
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapter's input
    targets: str = "attention"  # attention (qkv, out), mlp (gate_up, down) or all; never the output head

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LoraOptions:
        """The options in `values`; an unknown key or a value out of range is refused in one sentence."""
        if not isinstance(values, Mapping):
            raise ValueError(f"--model.peft={values!r} is invalid: give a mapping such as '{{rank: 8, alpha: 16, "
                             "dropout: 0.0, targets: attention}'")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"--model.peft has no option {unknown}: its options are {known}")
        options = cls(**values)
        number = (int, float)
        rules = [("rank", isinstance(options.rank, int) and not isinstance(options.rank, bool) and options.rank > 0,
                  "a positive integer"),
                 ("alpha", isinstance(options.alpha, number) and not isinstance(options.alpha, bool)
                  and options.alpha > 0, "a number > 0"),
                 ("dropout", isinstance(options.dropout, number) and 0 <= options.dropout < 1, "a number in [0, 1)"),
                 ("targets", options.targets in TARGET_ROLES, f"one of {sorted(TARGET_ROLES)}")]
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(f"--model.peft {name}={getattr(options, name)!r} is invalid: it must be {rule}")
        return dataclasses.replace(options, alpha=float(options.alpha), dropout=float(options.dropout))

    def to_dict(self) -> dict[str, Any]:
        """Plain values, as checkpoint hparams store them."""
        return dataclasses.asdict(self)


def lora_targets(model: nn.Module, targets: str) -> list[str]:
    """Names of the nn.Linear modules whose weight has one of `targets`' roles (each modality's copy of an MoT
    block included); the output head is never one."""
    wanted = TARGET_ROLES[targets]
    found = []
    for name, _, role in roles.parameter_roles(model):
        module_name, _, leaf = name.rpartition(".")
        if role in wanted and leaf == "weight" and isinstance(model.get_submodule(module_name), nn.Linear):
            found.append(module_name)
    return found


def _peft():
    """The peft module, or a one-line ValueError naming the extra that installs it."""
    try:
        import peft
    except ImportError as error:
        raise ValueError(PEFT_MISSING) from error
    return peft


def inject_lora(model: nn.Module, options: LoraOptions, seed: int = 0) -> list[str]:
    """Wrap `model`'s target projections in peft LoRA layers, in place (A random, B zero: the model computes what it
    did); every other parameter of `model` is frozen. Returns the wrapped modules' names.

    A is drawn as peft draws it (Kaiming uniform, a = sqrt(5)) but from a generator keyed by `seed` and the layer's
    name, not the global RNG: one process and N ranks, a run and its resume, start from the same adapter."""
    peft = _peft()
    names = lora_targets(model, options.targets)
    if not names:
        raise ValueError(f"--model.peft targets={options.targets!r} finds no projection in the decoder")
    config = peft.LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=options.dropout,
                             target_modules=names, bias="none", init_lora_weights=True)
    peft.inject_adapter_in_model(config, model)  # freezes everything but the adapters
    with torch.no_grad():
        for name in names:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            for weight in model.get_submodule(name).lora_A.parameters():
                weight.copy_(nn.init.kaiming_uniform_(torch.empty_like(weight, device="cpu"), a=math.sqrt(5),
                                                      generator=generator))
    return names


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA update into its base weight (W + alpha/r B A) and put the plain layer back; in place."""
    peft = _peft()
    for name, module in list(model.named_modules()):
        if isinstance(module, peft.tuners.tuners_utils.BaseTunerLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    for param in model.parameters():
        param.requires_grad_(True)  # a plain model again, as load_model gives one
    return model


def count_parameters(module: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of `module`."""
    params = list(module.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def weights_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 of a state dict: every tensor's name, dtype, shape and bytes, in name order (the weights, not the file
    that held them: the same base as a fit checkpoint, a `convert import` file or a transformers folder agrees)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def base_weights(path: str | os.PathLike, model: FusionModel) -> dict[str, torch.Tensor]:
    """The decoder weights `model` starts from when `path` is its `init_weights` (upcycled when a dense checkpoint
    starts a block with weights per modality), as `FusionLightningModule.setup` loads them."""
    loaded, _ = load_model_and_hparams(path)
    weights = loaded.state_dict()
    if architecture_differences(loaded.config, model.config):
        if not can_upcycle(loaded.config, model.config):
            raise ValueError(architecture_refusal(path, loaded.config, model.config))
        with torch.device("meta"):  # the plain decoder's names (the model may hold an adapter already)
            plain = FusionModel(model.config)
        weights = upcycle_weights(weights, plain)
    return weights


def adapter_record(path: str | os.PathLike, weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """What an adapter checkpoint records of its base: the absolute path and the weights' fingerprint."""
    return {"base": str(Path(path).resolve()), "fingerprint": weights_fingerprint(weights)}


def checked_base(record: Mapping[str, str], model: FusionModel, base: str | os.PathLike | None,
                 where: str) -> dict[str, torch.Tensor]:
    """The base weights of an adapter checkpoint (`record`: its path and fingerprint), read from `base` when given,
    else from the recorded path; a missing base or one with other weights is refused in one sentence."""
    path = Path(base) if base else Path(record["base"])
    if not path.exists():
        raise FileNotFoundError(f"{where} is a LoRA adapter and holds no base weights: its base {record['base']} is "
                                "missing (a LoRA resume or load needs its base; put it back there or give its path "
                                "with --model.init_weights / --base)")
    weights = base_weights(path, model)
    found = weights_fingerprint(weights)
    if found != record["fingerprint"]:
        raise ValueError(f"{where} is a LoRA adapter trained on the base {record['base']} (fingerprint "
                         f"{record['fingerprint'][:16]}), but {path} holds other weights (fingerprint {found[:16]}): "
                         "give the base it was trained on")
    return weights


def wrapped_names(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (a plain decoder's names) renamed for `model` with LoRA injected (`qkv.weight` lives at
    `qkv.base_layer.weight` there)."""
    present = set(model.state_dict())
    renamed = {}
    for name, value in weights.items():
        if name not in present:
            module_name, _, leaf = name.rpartition(".")
            if hasattr(model.get_submodule(module_name), "base_layer"):
                name = f"{module_name}.base_layer.{leaf}"
        renamed[name] = value
    return renamed


def load_adapter(model: FusionModel, adapter: Mapping[str, torch.Tensor], record: Mapping[str, str],
                 options: LoraOptions, base: str | os.PathLike | None, where: str) -> FusionModel:
    """A plain decoder from an adapter checkpoint: its base (checked against the fingerprint), the adapter
    (`adapter`: the checkpoint's LoRA weights, names relative to the decoder) loaded over it and merged in."""
    model.load_state_dict(checked_base(record, model, base, where))
    inject_lora(model, options)
    missing, unexpected = model.load_state_dict(dict(adapter), strict=False)
    lora_missing = [name for name in missing if ".lora_" in name]
    if unexpected or lora_missing:
        raise ValueError(f"{where}: the adapter does not match its --model.peft {options.to_dict()} (missing "
                         f"{lora_missing[:3]}, unexpected {list(unexpected)[:3]})")
    return merge_lora(model)
