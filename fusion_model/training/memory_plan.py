"""The memory plan of a training run, per device, before anything is allocated: what `train.py plan` prints and
`train.py fit` checks.

Parameters are counted exactly, on a meta-device copy of the family's parts (built by name through the registry:
no weight is allocated). Gradients, AdamW's two moments (in the parameters' dtype: fp32 under bf16-mixed) and
their step counters follow from the trainable parameters; FSDP2 divides all three by the data-parallel world size
(rank 0's shard, the largest: each dim-0 chunk rounded up). Activations are a closed form of the tensors the
decoder saves for backward, per token and layer, read off the code (norm inputs, the fused QKV output, QK-norm
outputs, RoPE outputs, the attention output and log-sum-exp, SwiGLU's input and output) and checked against measured
peaks in `bench/bench_memory.py`. The total is the largest of three moments of a step: the end of the forward
(activations and the loss chunk alive), the end of the backward with the optimizer step (all gradients and its
scratch), and, with activation checkpointing, a layer's recomputation in the backward.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fusion_model.config import FusionConfig
from fusion_model.layers import roles

GIB = 2**30
PEFT_TARGETS = {"attention": (roles.ATTENTION, roles.ATTENTION_OUTPUT), "mlp": (roles.MLP, roles.MLP_OUTPUT)}
PEFT_TARGETS["all"] = PEFT_TARGETS["attention"] + PEFT_TARGETS["mlp"]
# what --model.train_only may name: the image codes' rows of the output head (a head-only tune, Anole's recipe)
TRAIN_ONLY = ("image_head_rows",)
PRECISIONS = {"32-true": (4, 4), "32": (4, 4), "bf16-mixed": (4, 2), "16-mixed": (4, 2), "bf16-true": (2, 2),
              "16-true": (2, 2)}  # precision -> (bytes of a parameter, bytes of a matmul's output)


@dataclass(frozen=True)
class PlanInputs:
    """What the plan reads: the decoder and family, the step's shape and how it runs (fit's options)."""

    config: FusionConfig
    family: str = "chameleon"
    family_options: Mapping[str, Any] | None = None
    micro_batch: int = 1  # data.batch_size
    seq_len: int | None = None  # data.seq_len (None: config.max_seq_len)
    accumulation: int = 1  # trainer.accumulate_grad_batches
    world_size: int = 1  # devices x nodes
    strategy: str = "single"  # "single", "ddp" or "fsdp2"
    precision: str = "32-true"
    activation_checkpointing: bool = False
    loss_chunk_size: int = 4096
    peft: Mapping[str, Any] | None = None  # {rank, alpha, dropout, targets: attention|mlp|all}
    train_only: str | None = None  # None or "image_head_rows"
    device: str = "cpu"  # "cpu" or "cuda": which attention kernel runs (sdpa on CPU, flex on CUDA)
    sample_batch: int = 1  # rows of the KV cache the sampler would decode


@dataclass
class PlanLine:
    """One line of the plan: what it is, its bytes per device, and how it was counted."""

    name: str
    bytes: int
    note: str = ""


@dataclass
class MemoryPlan:
    """The plan per device: its lines, the peak total, the device's memory and what to change when it does not fit."""

    inputs: PlanInputs
    lines: list[PlanLine]
    total: int
    moment: str  # the moment of the step the total is at
    parameters: int  # all parameters (elements)
    trainable: int  # trainable elements (whole model, before sharding)
    device_memory: int | None = None
    advice: str = ""
    extra: dict[str, int] = field(default_factory=dict)

    def line(self, name: str) -> int:
        """The bytes of the line called `name` (0 when the plan has none)."""
        return next((line.bytes for line in self.lines if line.name == name), 0)

    @property
    def fits(self) -> bool:
        """Whether the total is within the device's memory (True when that is unknown)."""
        return self.device_memory is None or self.total <= self.device_memory

    def table(self) -> str:
        """The plan as text: one line per item in GiB, the total against the device, and the advice."""
        i = self.inputs
        width = max(len(line.name) for line in self.lines)
        head = (f"memory plan per device: {i.family} {i.config.block} d{i.config.dim} x {i.config.n_layers} layers, "
                f"{self.parameters / 1e6:,.2f}M parameters ({self.trainable / 1e6:,.3f}M trainable); "
                f"{i.strategy} over {i.world_size} device(s), {i.precision}, micro-batch {i.micro_batch} x "
                f"{seq_len(i)} tokens, accumulation {i.accumulation}, activation checkpointing "
                f"{'on' if i.activation_checkpointing else 'off'}")
        rows = [head] + [f"  {line.name:<{width}}  {human(line.bytes)}  {line.note}" for line in self.lines]
        rows.append(f"  {'total (peak)':<{width}}  {human(self.total)}  at {self.moment}")
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            rows.append(f"  {'device memory':<{width}}  {human(self.device_memory)}  {verdict} "
                        f"({100 * self.total / self.device_memory:.1f}% used)")
        if self.advice:
            rows.append(self.advice)
        return "\n".join(rows)


def human(size: int) -> str:
    """Bytes as a fixed-width figure: GiB from 0.1 GiB up, MiB below."""
    return f"{size / GIB:10.3f} GiB" if size >= GIB / 10 else f"{size / 2**20:10.3f} MiB"


def seq_len(inputs: PlanInputs) -> int:
    """The rows' length: data.seq_len, else the decoder's max_seq_len."""
    return int(inputs.seq_len or inputs.config.max_seq_len)


def meta_parameters(inputs: PlanInputs) -> tuple[list[tuple[str, tuple[int, ...], str]], FusionConfig]:
    """(name, shape, role) of every parameter of the family's parts, built on the meta device (nothing allocated),
    and the decoder config the family runs (a family may set fields, e.g. Transfusion's placeholder id)."""
    from fusion_model.families import family_class, resolve_family
    from fusion_model.families.base import LossSettings

    name, options = resolve_family(inputs.family, dict(inputs.family_options or {}) or None, None)
    with torch.device("meta"):
        family = family_class(name)(inputs.config, options, LossSettings(chunk_size=inputs.loss_chunk_size))
        parts = family.build()
    table = [(f"{part_name}.{p.name}", tuple(p.parameter.shape), p.role)
             for part_name, part in parts.items() for p in roles.parameter_roles(part)]
    return table, getattr(family, "config", inputs.config)


def check_peft(peft: Mapping[str, Any] | None) -> tuple[int, tuple[str, ...]] | None:
    """(rank, the roles of the adapted projections) of a LoRA setting, or None without one."""
    if not peft:
        return None
    rank, targets = peft.get("rank", 8), peft.get("targets", "attention")  # adapters.LoraOptions' defaults
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"--model.peft rank={rank!r} is invalid: it must be a positive integer")
    if targets not in PEFT_TARGETS:
        raise ValueError(f"--model.peft targets={targets!r} is invalid: choose one of {sorted(PEFT_TARGETS)}")
    return rank, PEFT_TARGETS[targets]


def shard_elements(shape: tuple[int, ...], world: int) -> int:
    """Elements of rank 0's FSDP2 shard of a parameter: dim 0 cut into `world` chunks, the first rounded up."""
    if not shape:
        return 1 if world == 1 else 1
    rest = math.prod(shape[1:])
    return math.ceil(shape[0] / world) * rest


def _trainable(shape: tuple[int, ...], role: str, inputs: PlanInputs, config: FusionConfig) -> int:
    """Trainable elements of one base parameter (0 when frozen by LoRA or a head-only tune)."""
    if inputs.peft:
        return 0
    if inputs.train_only == "image_head_rows":
        # the whole head weight trains with its text rows' gradient zeroed by a hook (the Lightning module's
        # _narrow_training): their gradient and AdamW moments are allocated, as zeros
        return math.prod(shape) if role == roles.OUTPUT_HEAD else 0
    return math.prod(shape)


def layer_activation_bytes(config: FusionConfig, tokens: int, precision: str) -> int:
    """Bytes one decoder layer saves for backward over `tokens` tokens (the attention mask aside).

    Per token, read off the dense block's code and checked by bench_memory: the layer's input and its residual
    midpoint (kept by the two RMSNorms, in the residual dtype), the inputs of the QKV and gate/up projections, the
    fused QKV output (Q and K and V are views of it), QK-norm's two outputs, RoPE's two outputs, the attention output
    (also the output projection's input) and SwiGLU's gate/up output (2 x ffn) and down input; plus fp32 statistics
    (RMSNorm's rstd, QK-norm's mean and rstd, attention's log-sum-exp). A block with weights per modality (mot)
    also keeps its gathered copies (about one more width and one more V per token).
    """
    d, hd, heads, kv, f = config.dim, config.head_dim, config.n_heads, config.kv_heads, config.hidden_dim
    param_bytes, act = PRECISIONS[precision]
    residual = param_bytes  # the residual stream stays in the parameters' dtype under autocast
    autocast = act != param_bytes
    qk = (heads + kv) * hd
    qk_norm = qk * (4 if autocast else act) if config.qk_norm else 0  # layer_norm runs in fp32 under autocast
    # fp32: RoPE's rotated Q and K (V stays a view of the QKV output); autocast: SDPA's bf16 casts of Q, K and V
    rotated = 2 * (heads + 2 * kv) * hd if autocast else act * qk
    per_token = (2 * residual * d + 2 * act * d + act * (heads + 2 * kv) * hd + qk_norm + rotated
                 + act * heads * hd + act * 3 * f
                 + 4 * (2 + heads + (2 * (heads + kv) if config.qk_norm else 0)))
    if config.dropout > 0:
        per_token += 2 * d  # dropout's two boolean masks
    if block_name(config) == "mot":
        per_token += act * (d + kv * hd)
    return per_token * tokens


def block_name(config: FusionConfig) -> str:
    """The block's short name (the last part of a class path)."""
    return str(config.block).rsplit(":", 1)[-1].rsplit(".", 1)[-1].lower()


def plan_memory(inputs: PlanInputs, device_memory: int | None = None) -> MemoryPlan:
    """The memory plan of one device for `inputs`; `device_memory` in bytes (None: the plan only, no verdict)."""
    if inputs.precision not in PRECISIONS:
        raise ValueError(f"--trainer.precision {inputs.precision!r}: the memory plan knows {sorted(PRECISIONS)}")
    if inputs.train_only is not None and inputs.train_only not in TRAIN_ONLY:
        raise ValueError(f"--model.train_only {inputs.train_only!r} is invalid: choose one of {list(TRAIN_ONLY)}")
    if inputs.peft and inputs.train_only:
        raise ValueError("--model.peft and --model.train_only exclude each other: choose one")
    lora = check_peft(inputs.peft)
    table, config = meta_parameters(inputs)
    param_bytes, act_bytes = PRECISIONS[inputs.precision]
    world = inputs.world_size if inputs.strategy == "fsdp2" else 1

    def held(shape: tuple[int, ...]) -> int:  # elements of a tensor shaped like this parameter that one rank holds
        return shard_elements(shape, world) if world > 1 else math.prod(shape)

    n_params = sum(math.prod(shape) for _, shape, _ in table)
    params_held = sum(held(shape) for _, shape, _ in table)
    trainable_full, trainable_held, trainable_tensors, adapter_rows, largest = 0, 0, 0, [], 0
    for _, shape, role in table:
        count = _trainable(shape, role, inputs, config)
        if count:
            trainable_full += count
            trainable_held += held(shape)
            trainable_tensors += 1
            largest = max(largest, held(shape))
        if lora and role in lora[1] and len(shape) == 2:
            out_features, in_features = shape
            adapter_rows += [(lora[0], in_features), (out_features, lora[0])]  # A (r, in) and B (out, r)
    adapter_full = sum(a * b for a, b in adapter_rows)
    adapter_held = sum(held(shape) for shape in adapter_rows)
    largest = max([largest, *(held(shape) for shape in adapter_rows)])
    trainable_full += adapter_full
    trainable_held += adapter_held
    trainable_tensors += len(adapter_rows)

    T, B = seq_len(inputs), inputs.micro_batch
    tokens = B * T
    targets = B * (T - 1)  # packed rows: at most every position but the last predicts a token
    d, V, L = config.dim, config.vocab_size, config.n_layers
    lines: list[PlanLine] = []
    P = (params_held + adapter_held) * param_bytes
    sharding = f" (rank 0's FSDP2 shard of {inputs.world_size})" if world > 1 else ""
    lines.append(PlanLine("parameters", P, f"{n_params + adapter_full:,} x {param_bytes} B{sharding}"
                          + (f", LoRA adapters {adapter_full:,} included" if adapter_full else "")))
    G = trainable_held * param_bytes
    lines.append(PlanLine("gradients", G, f"{trainable_full:,} trainable x {param_bytes} B{sharding}" + (
        f" (image_head_rows: the whole head; {(config.image_codes or 0) * d:,} of it learn, the text rows' gradient "
        "is zeroed)" if inputs.train_only else "")))
    OPT = trainable_held * 2 * param_bytes + 4 * trainable_tensors
    lines.append(PlanLine("optimizer states", OPT, f"AdamW: 2 x {param_bytes} B per trainable parameter + a step "
                          f"counter per tensor{sharding}"))
    master_note = {4: "none beyond the parameters: 32-true trains fp32 weights" if act_bytes == 4 else
                   "none beyond the parameters: Lightning's bf16-mixed is autocast over fp32 parameters, which are "
                   "the master copy (matmuls see bf16 casts)",
                   2: "none: bf16-true steps bf16 weights (no fp32 master copy)"}[param_bytes]
    lines.append(PlanLine("master weights", 0, master_note))
    casts = 0
    blocks_train = bool(lora) or (trainable_full and not inputs.train_only)
    if act_bytes == 2 and param_bytes == 4:
        # autocast caches the bf16 cast of a weight that requires grad until the forward ends (FSDP2's gathered
        # weights too: leaves that require grad); without checkpointing every matmul in the graph also saves its
        # weight's cast for the input's gradient, frozen ones included
        matmul = [(shape, role) for _, shape, role in table if len(shape) == 2 and role != roles.EMBEDDING]
        cached = sum(math.prod(shape) for shape, role in matmul if _trainable(shape, role, inputs, config))
        cached += adapter_full
        if blocks_train and not inputs.activation_checkpointing:
            cached = sum(math.prod(shape) for shape, _ in matmul) + adapter_full
        casts = 2 * cached
        lines.append(PlanLine("autocast weight casts", casts, "bf16 copies of the matmul weights: autocast's cache "
                              "(weights that learn) and the casts saved for the backward; derived, not measured (no GPU)"))
    gathered = 0
    if world > 1:
        layer = sum(math.prod(shape) for name, shape, _ in table if ".layers.0." in name)
        root = sum(math.prod(shape) for name, shape, _ in table if ".layers." not in name)
        gathered = (2 * layer + root) * param_bytes - sum(
            held(shape) for name, shape, _ in table if ".layers." not in name) * param_bytes
        lines.append(PlanLine("FSDP2 gathered weights", gathered, "two blocks unsharded at a time (one prefetched) "
                              "and the root's (embedding, head, final norm) for the whole step"))
    buckets = trainable_full * param_bytes if inputs.strategy == "ddp" else 0
    if buckets:
        lines.append(PlanLine("DDP gradient buckets", buckets, "DDP's flat copy of the gradients for all-reduce"))

    # activations: what the forward keeps for the backward
    layer_acts = layer_activation_bytes(config, tokens, inputs.precision)
    masked = inputs.device != "cuda"  # sdpa over packed rows on CPU: a boolean mask, made additive per layer
    mask_per_layer = B * T * T * act_bytes if masked else 0
    final = tokens * (param_bytes * d + 4) + targets * act_bytes * d  # the final norm's input, the loss's hidden rows
    if lora:
        layer_acts += sum(tokens * a for a, _ in adapter_rows[0::2]) // L * act_bytes  # each adapter's r-wide middle
        if float((inputs.peft or {}).get("dropout", 0.0)) > 0:  # a dropped copy of each adapter's input and its mask
            layer_acts += sum(tokens * n_in * (act_bytes + 1) for _, n_in in adapter_rows[0::2]) // L
    if not blocks_train:
        # nothing before the head learns: the blocks run as in inference and keep nothing for the backward (their
        # passing working set comes before the loss's, which is larger)
        saved_blocks = 0
        working = 0
        note = "the blocks keep nothing (nothing before the head learns)"
    elif inputs.activation_checkpointing:
        saved_blocks = L * tokens * param_bytes * d
        working = layer_acts + mask_per_layer
        note = "each block's input only; one block recomputed at a time in the backward"
    else:
        saved_blocks = L * (layer_acts + mask_per_layer)
        working = 0
        note = f"{L} blocks x {layer_acts / tokens:,.0f} B per token" + (
            f" + an additive mask of {human(mask_per_layer).strip()} each" if mask_per_layer else "")
    acts = saved_blocks + final
    lines.append(PlanLine("activations", acts, note))
    if inputs.activation_checkpointing and blocks_train:
        lines.append(PlanLine("activations without checkpointing", L * (layer_acts + mask_per_layer) + final,
                              "what-if: not part of the total"))
    elif blocks_train:
        lines.append(PlanLine("activations with checkpointing", L * tokens * param_bytes * d + final + layer_acts
                              + mask_per_layer, "what-if: not part of the total"))
    chunk = min(inputs.loss_chunk_size, targets)
    one_chunk = targets <= inputs.loss_chunk_size
    # one chunk keeps its fp32 logits until the backward; more recompute theirs, and logsumexp makes a same-size temp
    logits = chunk * V * 4 * (1 if one_chunk else 2)
    lines.append(PlanLine("logits / loss chunk", logits, f"fp32 logits of {chunk:,} targets x {V:,} ids "
                          f"(--model.loss_chunk_size {inputs.loss_chunk_size})"
                          + ("" if one_chunk else ", recomputed in the backward, plus logsumexp's scratch")))
    scratch = B * T * T if masked else 0
    lines.append(PlanLine("attention scratch", scratch, "the boolean document mask (sdpa on packed rows)" if masked
                          else "flex attention: block mask only (negligible)"))
    grads_held = G if inputs.accumulation > 1 else 0
    # the loss's backward makes the head's whole (unsharded) gradient while every activation is still alive; a
    # head-only tune's hook makes a masked copy of it
    head = sum(math.prod(shape) for _, shape, role in table if role == roles.OUTPUT_HEAD)
    head_grad = 0 if lora or not trainable_full else head * param_bytes * (2 if inputs.train_only else 1)
    persistent = P + OPT + buckets
    forward_end = persistent + grads_held + casts + gathered + acts + logits + scratch + working + head_grad
    # the optimizer step: CPU's AdamW goes tensor by tensor (a temporary the size of the largest); CUDA's is fused
    step_scratch = 0 if inputs.device == "cuda" else largest * param_bytes
    step_end = persistent + G + gathered + step_scratch
    recompute = 0
    if inputs.activation_checkpointing and blocks_train:
        recompute = persistent + G + gathered + acts + layer_acts + mask_per_layer + logits * 0 + scratch
    moments = {"the end of the forward": forward_end, "the optimizer step": step_end,
               "a block's recomputation in the backward": recompute}
    moment = max(moments, key=moments.get)
    total = moments[moment]
    kv_dtype = act_bytes
    kv = 2 * L * inputs.sample_batch * config.kv_heads * config.max_seq_len * config.head_dim * kv_dtype
    lines.append(PlanLine("KV cache for sampling", kv, f"not in the training total: {inputs.sample_batch} row(s) x "
                          f"{config.max_seq_len:,} positions, keys and values of {L} layers"))
    plan = MemoryPlan(inputs, lines, total, moment, n_params, trainable_full, device_memory,
                      extra={"persistent": persistent, "forward_end": forward_end, "step_end": step_end,
                             "recompute": recompute})
    if device_memory is not None and not plan.fits:
        plan.advice = advice(inputs, plan, device_memory)
    return plan


def advice(inputs: PlanInputs, plan: MemoryPlan, device_memory: int) -> str:
    """One sentence: the plan exceeds the device, and the settings that would make it fit, with their totals."""
    fixes = []
    smaller = [b for b in range(inputs.micro_batch - 1, 0, -1)
               if plan_memory(replace(inputs, micro_batch=b)).total <= device_memory][:1]
    if smaller:
        fixes.append(f"--data.batch_size {smaller[0]} (from {inputs.micro_batch}; raise "
                     f"--trainer.accumulate_grad_batches by {inputs.micro_batch / smaller[0]:g}x to keep the batch)")
    if not inputs.activation_checkpointing:
        total = plan_memory(replace(inputs, activation_checkpointing=True)).total
        fixes.append(f"--model.activation_checkpointing true ({total / GIB:.2f} GiB)")
    if inputs.strategy != "fsdp2" and inputs.world_size > 1:
        total = plan_memory(replace(inputs, strategy="fsdp2")).total
        fixes.append(f"FSDP2 over the {inputs.world_size} devices (--trainer.strategy "
                     f"fusion_model.training.checkpointing.AtomicModelParallelStrategy: {total / GIB:.2f} GiB)")
    if not inputs.peft and not inputs.train_only:
        total = plan_memory(replace(inputs, peft={"rank": 16, "targets": "all"})).total
        fixes.append(f"LoRA (--model.peft '{{rank: 16, targets: all}}': {total / GIB:.2f} GiB)")
    over = plan.total / device_memory
    return (f"the plan needs {plan.total / GIB:.2f} GiB per device, {over:.2f}x the {device_memory / GIB:.2f} GiB it "
            f"has; change {' or '.join(fixes) if fixes else 'the model size or the sequence length'}, or pass "
            "--plan.force true to start anyway")


def device_memory_bytes(device: str, gigabytes: float | None = None) -> tuple[int, str]:
    """(bytes, where the figure came from): `gigabytes` GiB when given, else the GPU's memory, else the host's RAM."""
    if gigabytes is not None:
        if not isinstance(gigabytes, (int, float)) or isinstance(gigabytes, bool) or not gigabytes > 0:
            raise ValueError(f"--device-memory {gigabytes!r} is invalid: give the device's memory in GiB, e.g. 80")
        return int(gigabytes * GIB), "--device-memory"
    if device == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory), torch.cuda.get_device_name(0)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "the host's RAM"
