"""fit's parsed options as a memory plan (`fusion_model.training.memory_plan`): read by `train.py plan` and by
`train.py fit` before it builds the model, which refuses a start the plan says does not fit (`--plan.force true`
starts anyway)."""

from __future__ import annotations

import sys
from typing import Any

import torch

from fusion_model.training.memory_plan import MemoryPlan, PlanInputs, device_memory_bytes, plan_memory

PLAN_HELP = (
    "Before building the model, fit plans its memory per device (parameters, gradients, AdamW states, activations, "
    "the loss chunk; `train.py plan` prints it) and stops with exit 2, writing nothing, when the plan exceeds the "
    "device: --plan.device_memory GiB (or --device-memory GiB; default: the GPU's memory, on CPU the host's RAM) "
    "sets the device's size, --plan.force true starts anyway."
)


def add_plan_arguments(parser) -> None:
    """The `plan` section of fit's options: the device's memory and the switch that starts a run the plan refuses."""
    parser.add_argument("--plan.device_memory", type=float | None, default=None,
                        help="the memory of one device in GiB (default: the GPU's, or the host's RAM on CPU)")
    parser.add_argument("--plan.force", type=bool, default=False,
                        help="start even when the memory plan says the run does not fit")


def take_device_memory(argv: list[str]) -> list[str]:
    """`--device-memory GiB` (the plan command's spelling) as fit's `--plan.device_memory GiB`."""
    from fusion_model.cli.lightning_options import take_option

    memory, argv = take_option(argv, "--device-memory", None)
    return argv if memory is None else [*argv, f"--plan.device_memory={memory}"]


def _get(section: Any, key: str, default: Any = None) -> Any:
    """A key of a jsonargparse Namespace or dict section (default when absent or None)."""
    if section is None:
        return default
    value = section.get(key) if hasattr(section, "get") else getattr(section, key, None)
    return default if value is None else value


def class_path(value: Any) -> str:
    """A strategy's name or class path, lower-cased ('' for none)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value.lower()
    return str(_get(value, "class_path", type(value).__name__)).lower()


def device_kind(trainer: Any) -> str:
    """'cuda' when the trainer will run on GPUs (asked for, or 'auto' with one present), else 'cpu'."""
    accelerator = str(_get(trainer, "accelerator", "auto")).lower()
    if accelerator in ("gpu", "cuda"):
        return "cuda"
    return "cuda" if accelerator == "auto" and torch.cuda.is_available() else "cpu"


def device_count(trainer: Any, device: str) -> int:
    """Devices per node as Lightning counts `trainer.devices` (an int, 'auto', '0,1' or a list)."""
    devices = _get(trainer, "devices", "auto")
    if isinstance(devices, (list, tuple)):
        return len(devices)
    text = str(devices).strip()
    if text in ("auto", "-1"):
        return max(torch.cuda.device_count(), 1) if device == "cuda" else 1
    if "," in text:
        return len([part for part in text.split(",") if part.strip()])
    return max(int(text), 1)


def plan_inputs(config: Any) -> PlanInputs:
    """The PlanInputs of fit's parsed config (after fit derived the vocabulary layout, family and precision)."""
    from fusion_model.config import FusionConfig

    trainer, model, data = config.trainer, config.model, config.data
    model_config = _get(model, "config")
    if model_config is None:  # the config of model.init_weights
        from fusion_model.checkpoint import checkpoint_config

        init = _get(model, "init_weights")
        model_config = checkpoint_config(init) if init else FusionConfig.from_preset("tiny")
    if not isinstance(model_config, FusionConfig):
        model_config = FusionConfig.from_dict(dict(model_config))
    device = device_kind(trainer)
    world = device_count(trainer, device) * int(_get(trainer, "num_nodes", 1))
    name = class_path(_get(trainer, "strategy", "auto"))
    if "modelparallel" in name or "fsdp" in name:
        strategy = "fsdp2"
    elif "ddp" in name or world > 1:
        strategy = "ddp"
    else:
        strategy = "single"
    peft = _get(model, "peft")
    return PlanInputs(
        config=model_config, family=str(_get(model, "family", "chameleon")),
        family_options=dict(_get(model, "family_options", {}) or {}),
        micro_batch=int(_get(data, "batch_size", 1)), seq_len=_get(data, "seq_len"),
        accumulation=int(_get(trainer, "accumulate_grad_batches", 1)), world_size=world, strategy=strategy,
        precision=str(_get(trainer, "precision", "32-true")),
        activation_checkpointing=bool(_get(model, "activation_checkpointing", False)
                                      or model_config.gradient_checkpointing),
        loss_chunk_size=int(_get(model, "loss_chunk_size", 4096)),
        peft=dict(peft) if peft else None, train_only=_get(model, "train_only"), device=device,
    )


def plan_of(config: Any, device_memory_gib: float | None = None) -> tuple[MemoryPlan, str]:
    """The memory plan of fit's parsed config against the device's memory, and where that figure came from."""
    gigabytes = device_memory_gib if device_memory_gib is not None else _get(_get(config, "plan"), "device_memory")
    memory, source = device_memory_bytes(device_kind(config.trainer), gigabytes)  # a bad size is refused first
    return plan_memory(plan_inputs(config), memory), source


def check_before_fit(config: Any) -> MemoryPlan | None:
    """Refuse (ValueError, one sentence) a run whose plan exceeds the device, unless --plan.force true; a config the
    plan cannot read (a family whose parts do not build on the meta device) starts unplanned, saying so."""
    gigabytes = _get(_get(config, "plan"), "device_memory")
    device_memory_bytes(device_kind(config.trainer), gigabytes)  # a bad --plan.device_memory is bad input
    try:
        plan, source = plan_of(config)
    except ValueError:  # a config the module refuses too (e.g. a family's check): that refusal is the one line
        return None
    except Exception as error:  # noqa: BLE001 - the plan is advice: it never stops a run the module itself accepts
        print(f"fit: no memory plan for this config ({type(error).__name__}: {error})", file=sys.stderr, flush=True)
        return None
    if not plan.fits and not _get(_get(config, "plan"), "force", False):
        raise ValueError(f"memory plan ({source}): {plan.advice}")
    return plan
