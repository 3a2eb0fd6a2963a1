"""Evaluation suites every checkpoint can be scored by (`train.py eval`): the registry of suites by name, the
scene world's checker, the digits' classifier, the clip world and its checker (the `clips` suite: text-to-video,
read back for colour, shape and direction) and the distribution figures."""

from __future__ import annotations

import importlib
from typing import Any

# name -> "module:Class" of a `evaluation.base.Suite`; a suite of your own package needs no line here:
# `train.py eval --suite my_package.module:MySuite`
BUILTIN_SUITES: dict[str, str] = {
    "scenes": "evaluation.scenes:SceneSuite",
    "digits": "evaluation.digits:DigitSuite",
    "chat": "evaluation.chat:ChatSuite",
    "clips": "evaluation.clips:ClipSuite",
}


def suite_class(name: str) -> Any:
    """The Suite class registered as `name`, or named by `package.module:Class`."""
    path = BUILTIN_SUITES.get(name, name)
    if ":" not in path:
        raise ValueError(f"unknown suite {name!r}: choose one of {sorted(BUILTIN_SUITES)} or name a class as "
                         "package.module:Class")
    module_name, class_name = path.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"suite {name!r}: cannot import {module_name} ({error})") from error
    suite = getattr(module, class_name, None)
    if suite is None:
        raise ValueError(f"suite {name!r}: {module_name} has no {class_name}")
    return suite
