"""Decoder blocks by name: `FusionConfig.block` picks the class each of the decoder's layers is built from.

A block is an `nn.Module` class built as `cls(config, layer)` and called as `block(x, cos, sin, ctx)` (see
`fusion_model.blocks.dense.DenseBlock`, the dense Chameleon layer, for the contract and its class-level methods). Built-in
names map to "module:Class" strings, imported on first use, so this registry imports no model code; any other
name in the same "package.module:Class" form is imported as given (a block of your own, in its own file).
"""

from __future__ import annotations

import importlib

BUILTIN_BLOCKS: dict[str, str] = {
    "dense": "fusion_model.blocks.dense:DenseBlock",  # Chameleon's layer: one set of weights for every token
    "mot": "fusion_model.blocks.mot:MoTBlock",  # Mixture-of-Transformers: weights per modality, global attention
}


def block_class(name: str) -> type:
    """The block class named `name`: a built-in name, or "package.module:Class"."""
    target = BUILTIN_BLOCKS.get(name, name)
    if ":" not in target:
        raise ValueError(
            f"FusionConfig: unknown block {name!r}; choose one of {sorted(BUILTIN_BLOCKS)} or name your own as "
            "'package.module:Class' (--model.config.block)"
        )
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"FusionConfig: block {name!r}: cannot import {module_name!r} ({error})") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"FusionConfig: block {name!r}: {module_name!r} has no class {class_name!r}")
    return cls
