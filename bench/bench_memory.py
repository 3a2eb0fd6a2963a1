"""The memory plan (`train.py plan`, fusion_model/training/memory_plan.py) against measured peaks on CPU.

For each configuration: the plan's parameter, gradient and optimizer bytes against the bytes of those tensors after a
step (equal, byte for byte), and the plan's total against the measured peak of live tensor bytes over a few training
steps after a warm-up (compile off; goal: within 15%).

How the peak is measured. torch keeps no allocator statistics on CPU and tracemalloc does not see tensor memory, so
`LivePeak` (below) is a TorchDispatchMode that sees every tensor every op returns, in the forward, the backward and
the optimizer step, and holds a weak reference to its storage: the live bytes are the storages alive (the parameters,
gradients and AdamW states registered up front), their maximum is the peak. It counts what torch allocates for
tensors; not the allocator's rounding, kernels' private scratch or the interpreter. Two independent instruments check
it on some configurations: torch's MemTracker (`torch.distributed._tools.mem_tracker`, a private API built the same
way, which fails on frozen modules: it hooks module outputs that need no gradient) and, on one configuration,
`torch.profiler.profile(profile_memory=True)`'s memory timeline, which records the allocator's own allocations and
frees, kernels' scratch included.

    python -m bench.bench_memory [--smoke]
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import dataclass

import torch
from torch import nn

from bench.harness import write_result
from fusion_model.config import FusionConfig
from fusion_model.families.base import ObjectiveContext
from fusion_model.training.live_memory import LivePeak, storage_bytes
from fusion_model.training.memory_plan import PlanInputs, plan_memory

GOAL = 0.15  # |plan / measured - 1| at most this
STEPS = 3  # measured steps, after one warm-up step


@dataclass(frozen=True)
class Case:
    """One configuration: decoder preset, block, family, step shape, what trains and how many gloo ranks."""

    name: str
    preset: str
    batch: int
    seq_len: int
    block: str = "dense"
    family: str = "chameleon"
    checkpointing: bool = False
    train: str = "full"  # "full", "lora" (rank 8, all projections) or "head" (image_head_rows)
    ranks: int = 1  # 2: FSDP2 over two gloo processes (rank 0 measured)
    chunk: int = 4096


FULL = [
    Case("tiny", "tiny", 2, 128),
    Case("tiny, checkpointing", "tiny", 2, 128, checkpointing=True),
    Case("small", "small", 2, 512),
    Case("small, checkpointing", "small", 2, 512, checkpointing=True),
    Case("small, loss chunks of 256", "small", 2, 512, chunk=256),
    Case("small, LoRA r8 all", "small", 2, 512, train="lora"),
    Case("small, head-only", "small", 2, 512, train="head"),
    Case("small, mot", "small", 2, 512, block="mot"),
    Case("small, transfusion", "small", 2, 512, family="transfusion"),
    Case("demo", "demo", 4, 256),
    Case("demo, mot, checkpointing", "demo", 4, 256, block="mot", checkpointing=True),
    Case("small, FSDP2 x 2 gloo", "small", 2, 512, ranks=2),
    Case("small, FSDP2 x 2 gloo, checkpointing", "small", 2, 512, ranks=2, checkpointing=True),
]
SMOKE = [Case("tiny", "tiny", 2, 64), Case("tiny, head-only", "tiny", 2, 64, train="head"),
         Case("tiny, FSDP2 x 2 gloo", "tiny", 2, 64, ranks=2)]


def build(case: Case):
    """(the family, its parts, one batch, the PlanInputs) of a case, on CPU in fp32 from seed 0."""
    from bench.bench_transfusion import _vocab, batches
    from fusion_model.families import family_class

    size = dict(vocab_size=max(FusionConfig.from_preset(case.preset).vocab_size, 512), image_codes=128,
                batch=case.batch, seq_len=case.seq_len, doc_len=case.seq_len // 2, grid=(4, 4), latent_channels=4,
                patch_size=2)
    vocab = _vocab(size)
    config = FusionConfig.from_preset(case.preset, vocab_size=vocab.vocab_size, image_offset=vocab.image_offset,
                                      image_codes=vocab.image_codes, block=case.block,
                                      max_seq_len=max(case.seq_len, FusionConfig.from_preset(case.preset).max_seq_len),
                                      gradient_checkpointing=case.checkpointing)
    options = ({"latent_channels": 4, "patch_size": 2, "image_placeholder_id": vocab.image_placeholder_id}
               if case.family == "transfusion" else {})
    from fusion_model.families.base import LossSettings

    family = family_class(case.family)(config, options or None, LossSettings(chunk_size=case.chunk))
    torch.manual_seed(0)
    parts = family.build()
    batch = batches(size, vocab, 16, torch.Generator().manual_seed(0))[case.family]
    inputs = PlanInputs(config, family=case.family, family_options=options, micro_batch=case.batch,
                        seq_len=case.seq_len, world_size=case.ranks, strategy="fsdp2" if case.ranks > 1 else "single",
                        activation_checkpointing=case.checkpointing, loss_chunk_size=case.chunk,
                        peft={"rank": 8, "targets": "all"} if case.train == "lora" else None,
                        train_only="image_head_rows" if case.train == "head" else None)
    return family, parts, batch, inputs


def narrow(case: Case, parts: dict[str, nn.Module]) -> None:
    """LoRA or head-only as the Lightning module does it (fusion_model.families.adapters; the head's text rows'
    gradient zeroed by a hook)."""
    from tokenizer.layout import image_code_mask

    model = parts["model"]
    if case.train == "lora":
        from fusion_model.families import adapters

        for part in parts.values():
            part.requires_grad_(False)
        adapters.inject_lora(model, adapters.LoraOptions(rank=8, targets="all"))
    elif case.train == "head":
        for part in parts.values():
            part.requires_grad_(False)
        head = model.head.weight
        head.requires_grad_(True)
        text = ~image_code_mask(torch.arange(head.shape[0]), model.config.image_offset, model.config.image_codes)
        head.register_hook(lambda grad: grad.masked_fill(text[:, None], 0.0))


def measure(case: Case, rank: int = 0, profile: bool = False, tracker: bool = False) -> dict:
    """The case's measured bytes (parameters, gradients, optimizer states, peak) and its plan, in this process."""
    family, parts, batch, inputs = build(case)
    narrow(case, parts)
    if case.ranks > 1:
        from torch.distributed.device_mesh import init_device_mesh

        family.parallelize(parts, init_device_mesh("cpu", (case.ranks,)))
        batch = {key: value.clone() for key, value in batch.items()}
    family.set_mode(parts, True)
    params = [p for part in parts.values() for p in part.parameters()]
    optimizer = torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-4, weight_decay=0.1)
    counts = family.denominators(batch)

    def step(index: int, update: bool = True) -> None:
        objective = family.objective(parts, batch, ObjectiveContext(step=index))
        objective.loss(torch.stack([counts[name] for name in objective.terms])).backward()
        if update:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    step(0, update=False)  # the gradients' bytes, then the warm-up step
    grads = storage_bytes(p.grad for p in params if p.grad is not None)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    result = {"parameters": storage_bytes(params), "gradients": grads, "optimizer states": storage_bytes(states)}
    peak = LivePeak()
    for tensor in [*params, *states]:
        peak.register(tensor)
    peak.measure()
    with peak:
        for index in range(1, STEPS + 1):
            step(index)
    result["peak"] = peak.peak
    if tracker:  # torch's own dispatch-mode tracker, where it runs (not on frozen modules)
        from torch.distributed._tools.mem_tracker import MemTracker

        mem = MemTracker()
        mem.track_external(*parts.values(), optimizer)
        with mem:
            for index in range(STEPS):
                mem.reset_mod_stats()
                step(10 + index)
        result["memtracker_peak"] = int(mem.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    if profile:  # the allocator's own record: allocations and frees, in order
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler
        from torch.profiler._memory_profiler import Action

        before = storage_bytes([*params, *states])
        with profiler(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                      with_stack=True) as prof:
            for index in range(STEPS):
                step(20 + index)
        current = top = 0
        for _, action, _, size in prof._memory_profile().timeline:
            if action in (Action.PREEXISTING, Action.CREATE):
                current += size
            elif action == Action.DESTROY:
                current -= size
            top = max(top, current)
        result["profiler_peak"] = int(max(top, before))
    plan = plan_memory(inputs)
    result["plan"] = {name: plan.line(name) for name in ("parameters", "gradients", "optimizer states")}
    result["plan"]["total"] = plan.total
    return result


def _rank_main(rank: int, case: Case, port: int, out: str) -> None:
    """One gloo rank of a sharded case; rank 0 writes its measurement."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=case.ranks)
    try:
        result = measure(case, rank)
        if rank == 0:
            with open(out, "w") as handle:
                json.dump(result, handle)
    finally:
        dist.destroy_process_group()


def measure_sharded(case: Case) -> dict:
    """A sharded case over `case.ranks` gloo processes; rank 0's figures (the plan's rank)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "rank0.json")
        mp.start_processes(_rank_main, args=(case, port, out), nprocs=case.ranks, start_method="spawn", join=True)
        with open(out) as handle:
            return json.load(handle)


def row(case: Case, measured: dict) -> dict:
    """One table row: plan and measurement side by side, their ratio, and whether the exact lines are exact."""
    plan = measured["plan"]
    exact = {name: plan[name] == measured[name] for name in ("parameters", "gradients", "optimizer states")}
    out = {"case": dataclasses.asdict(case), "predicted_bytes": plan["total"], "measured_bytes": measured["peak"],
           "ratio": plan["total"] / measured["peak"], "exact": exact,
           "measured": {k: v for k, v in measured.items() if k != "plan"}, "plan": plan}
    for key in ("memtracker_peak", "profiler_peak"):
        if key in measured:
            out[f"ratio_vs_{key}"] = plan["total"] / measured[key]
    return out


def run(smoke: bool = False) -> dict:
    """Measure every case, write bench/results/memory.json, return the payload."""
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = {}
    for index, case in enumerate(SMOKE if smoke else FULL):
        if case.ranks > 1:
            measured = measure_sharded(case)
        else:
            measured = measure(case, tracker=case.train == "full", profile=index == 2 or smoke and index == 0)
        rows[case.name] = row(case, measured)
        r = rows[case.name]
        print(f"bench memory: {case.name}: plan {r['predicted_bytes'] / 2**20:.2f} MiB, measured "
              f"{r['measured_bytes'] / 2**20:.2f} MiB, ratio {r['ratio']:.3f}, exact {all(r['exact'].values())}",
              flush=True)
    ratios = [r["ratio"] for r in rows.values()]
    figures = {
        "worst_ratio_off": max(abs(r - 1) for r in ratios),
        "within_goal": all(abs(r - 1) <= GOAL for r in ratios),
        "all_exact": all(all(r["exact"].values()) for r in rows.values()),
        "cases": len(rows),
    }
    payload = {"figures": figures, "cases": rows,
               "config": {"goal": f"|plan / measured - 1| <= {GOAL:g}", "steps": STEPS,
                          "threads": torch.get_num_threads()}, "smoke": smoke}
    write_result("memory", payload)
    return payload


def section(body: dict) -> list[str]:
    """Markdown lines for BENCHMARKS.md: per configuration the plan's total, the measured peak and their ratio."""
    cases, machine = body.get("cases", {}), body.get("machine", {})
    if not cases:
        return []
    figures = body.get("figures", {})
    out = [
        "`train.py plan`'s total per device (fusion_model/training/memory_plan.py) against the measured peak of live "
        f"tensor bytes over {body.get('config', {}).get('steps', STEPS)} training steps after a warm-up (CPU, fp32, "
        "compile off; `LivePeak` in bench/bench_memory.py, a dispatch mode that sees every tensor's storage; MemTracker "
        "and the profiler's memory timeline as cross-checks). Exact: the plan's parameter, gradient and AdamW bytes "
        "equal those tensors' bytes after a step. Goal: the total within 15%. "
        f"Measured {body.get('measured_at', '?')} on {machine.get('processor', '?')}"
        + (" (smoke)" if body.get("smoke") else "") + f"; worst |ratio - 1| {figures.get('worst_ratio_off', 0):.3f}.",
        "",
        "| Configuration | Predicted MiB | Measured MiB | Ratio | Params, grads, AdamW exact | MemTracker ratio "
        "| Profiler ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in cases.items():
        def other(key: str, row: dict = row) -> str:
            return f"{row[key]:.3f}" if key in row else "—"

        out.append(f"| {name} | {row['predicted_bytes'] / 2**20:.2f} | {row['measured_bytes'] / 2**20:.2f} | "
                   f"{row['ratio']:.3f} | {'yes' if all(row['exact'].values()) else 'no'} | "
                   f"{other('ratio_vs_memtracker_peak')} | {other('ratio_vs_profiler_peak')} |")
    out += ["", "Batch x sequence: tiny 2 x 128, small 2 x 512, demo 4 x 256 (two documents per row). MemTracker fails "
            "on frozen modules (LoRA, head-only) and FSDP2 runs in two processes, so those rows have only LivePeak. "
            "The profiler counts the allocator's own allocations, kernels' scratch included, so it reads a little "
            "higher."]
    return out


if __name__ == "__main__":
    result = run(smoke="--smoke" in sys.argv)
    print(json.dumps(result["figures"], indent=2))
