"""Parameter roles: what each parameter is, as the module that owns it declares it.

The one rule that the decoder's initialisation (`FusionModel.reset_parameters`), the weight-decay split
(`fusion_model.training.optim.param_groups`) and the stability monitor's parameter groups read, instead of
each matching names. A module class declares `PARAMETER_ROLES`: {name relative to the module: role} for the
parameters it owns, directly or through plain torch layers (`Attention` declares `"out.weight"`, its output
projection's weight). torch's own norm layers are norms by their type; any other parameter (a connector, the
Q-Former, a wrapper's extra weight) is `MATRIX` (two or more dimensions) or `VECTOR` (fewer). A module that wraps
a layer as its `base_layer` (peft's LoRA layers) keeps the layer's declared roles one level down, and its own
weights (LoRA's A and B) are `ADAPTER`.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

EMBEDDING = "embedding"  # the token embedding table
OUTPUT_HEAD = "output_head"  # the projection from the last hidden state to the vocabulary
ATTENTION = "attention"  # attention's input projection (fused q, k, v)
ATTENTION_OUTPUT = "attention_output"  # attention's output projection, added to the residual stream
MLP = "mlp"  # the feed-forward's input projection (fused gate and up)
MLP_OUTPUT = "mlp_output"  # the feed-forward's output projection, added to the residual stream
NORM = "norm"  # a normalisation's gain or bias (RMSNorm, QK-norm, torch's norm layers)
MATRIX = "matrix"  # undeclared, two or more dimensions
VECTOR = "vector"  # undeclared, fewer than two dimensions (biases, scalar gates)
ADAPTER = "adapter"  # a wrapper's own weights around a layer it adapts (LoRA's A and B; the layer keeps its role)

# projections whose output is added to the residual stream (GPT-2 scales their initialisation by 1/sqrt(2 L))
RESIDUAL_OUTPUTS = frozenset({ATTENTION_OUTPUT, MLP_OUTPUT})
TORCH_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


class ParameterRole(NamedTuple):
    """One parameter: its name (as `named_parameters` gives it), the parameter and its role."""

    name: str
    parameter: nn.Parameter
    role: str


def declared_roles(module: nn.Module) -> dict[str, str]:
    """The roles `module` declares for its own parameters (relative names); a name it does not have raises."""
    declared = getattr(type(module), "PARAMETER_ROLES", None)
    if declared is None:
        if isinstance(module, TORCH_NORMS):
            return {name: NORM for name, _ in module.named_parameters(recurse=False)}
        return {}
    present = dict(module.named_parameters())
    resolved = {_through_wrappers(module, name, present): role for name, role in declared.items()}
    missing = sorted(set(resolved) - set(present))
    if missing:
        raise ValueError(f"{type(module).__name__}.PARAMETER_ROLES names {missing}, which it does not hold")
    return resolved


def _through_wrappers(module: nn.Module, name: str, present: dict[str, nn.Parameter]) -> str:
    """`name` as `module` holds it now: a layer wrapped by an adapter (peft's LoRA keeps it as `base_layer`) holds
    its weight one level down (`qkv.weight` -> `qkv.base_layer.weight`)."""
    if name in present:
        return name
    *path, leaf = name.split(".")
    found, sub = [], module
    for part in path:
        sub = getattr(sub, part, None)
        if not isinstance(sub, nn.Module):
            return name
        found.append(part)
        while isinstance(getattr(sub, "base_layer", None), nn.Module):
            sub = sub.base_layer
            found.append("base_layer")
    return ".".join([*found, leaf])


def parameter_roles(module: nn.Module) -> list[ParameterRole]:
    """(name, parameter, role) of every parameter of `module`, in `named_parameters` order.

    Names carry whatever wraps the modules (`_orig_mod.` under torch.compile, a Lightning module's attribute):
    the roles are looked up module by module. Where two modules declare one parameter, the inner one wins.
    """
    roles: dict[str, str] = {}
    for prefix, sub in module.named_modules():  # outer modules first
        if isinstance(getattr(sub, "base_layer", None), nn.Module):
            # an adapter around a layer (peft's LoRA): its own weights are the adapter's, the layer keeps its roles
            for name, _ in sub.named_parameters():
                if not name.startswith("base_layer."):
                    roles[f"{prefix}.{name}" if prefix else name] = ADAPTER
        for name, role in declared_roles(sub).items():
            roles[f"{prefix}.{name}" if prefix else name] = role
    return [ParameterRole(name, p, roles.get(name, MATRIX if p.dim() >= 2 else VECTOR))
            for name, p in module.named_parameters()]
