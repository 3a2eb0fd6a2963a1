"""Model families by name: `train.py fit --model.family NAME` and every checkpoint loader look them up here.

A family is a `fusion_model.families.base.Family` subclass. The built-in ones are listed below and imported when
first asked for; one defined elsewhere is named by dotted path (`package.module:Class`, or `package.module.Class`),
or registered under a short name with `register_family`.
"""

from __future__ import annotations

import importlib

from fusion_model.families.base import Family

DEFAULT_FAMILY = "chameleon"
BUILTIN_FAMILIES: dict[str, str] = {
    "chameleon": "fusion_model.families.chameleon:ChameleonFamily",
    "llava": "fusion_model.families.late:LlavaFamily",
    "qformer": "fusion_model.families.late:QFormerFamily",
    "blip2-stage1": "fusion_model.families.late:Blip2Stage1Family",
    "flamingo": "fusion_model.families.late:FlamingoFamily",
    "transfusion": "fusion_model.families.transfusion:TransfusionFamily",
}
_REGISTERED: dict[str, type[Family]] = {}


def register_family(cls: type[Family]) -> type[Family]:
    """Make `cls` available under `cls.name` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Family)) or not cls.name:
        raise ValueError(f"register_family: {cls!r} is not a Family subclass with a name")
    _REGISTERED[cls.name] = cls
    return cls


def family_names() -> list[str]:
    """Every name `family_class` knows without a dotted path."""
    return sorted({*BUILTIN_FAMILIES, *_REGISTERED})


def family_class(name: str) -> type[Family]:
    """The family class for a registered name or a dotted path; a sentence naming the choices otherwise."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    path = BUILTIN_FAMILIES.get(name, name)
    module_name, sep, attribute = path.partition(":")
    if not sep:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"model.family {name!r} is not a known family ({', '.join(family_names())}) nor a dotted "
                         "path such as my_package.my_module:MyFamily")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"model.family {name!r}: cannot import {module_name} ({error}); known families: "
                         f"{', '.join(family_names())}") from error
    cls = getattr(module, attribute, None)
    if not (isinstance(cls, type) and issubclass(cls, Family)):
        raise ValueError(f"model.family {name!r}: {module_name} has no Family subclass {attribute!r}")
    return cls


# (kind, stage) of the older spelling `model.late_fusion: {kind, stage}` -> the family it names
LATE_FUSION_FAMILIES = {("llava", 1): "llava", ("llava", 2): "llava", ("qformer", 1): "blip2-stage1",
                        ("qformer", 2): "qformer", ("flamingo", 1): "flamingo"}


def resolve_family(family: str | None, family_options: dict | None,
                   late_fusion: dict | None) -> tuple[str, dict]:
    """(family name, options) from the model options, the older `late_fusion` spelling included.

    `late_fusion: {kind, stage, ...}` names the family of its kind and stage (qformer stage 1: blip2-stage1) and
    gives its options; it may stand beside `family` only when that is the default or the same family, and
    `family_options` then win key by key.
    """
    name, options = family or DEFAULT_FAMILY, dict(family_options or {})
    if late_fusion is None:
        return name, options
    late = dict(late_fusion)
    key = (late.get("kind"), int(late.get("stage", 1)))
    if key not in LATE_FUSION_FAMILIES:
        raise ValueError(f"model.late_fusion {{kind: {key[0]}, stage: {key[1]}}} names no family; kinds and stages: "
                         f"{sorted(LATE_FUSION_FAMILIES)}")
    implied = LATE_FUSION_FAMILIES[key]
    if name not in (DEFAULT_FAMILY, implied):
        raise ValueError(f"model.family {name!r} and model.late_fusion (which names {implied!r}) disagree: give one")
    return implied, {**late, **options}


__all__ = ["BUILTIN_FAMILIES", "DEFAULT_FAMILY", "Family", "family_class", "family_names", "register_family",
           "resolve_family"]
