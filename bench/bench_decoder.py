"""Decoder training step (forward + backward + AdamW) tokens/s: ours vs transformers' Chameleon, eager and
compiled, side by side, with the CPU MFU of each."""

from __future__ import annotations

import statistics
import time

import torch

from bench.harness import paired_result, time_rounds, write_result
from bench.limits import matmul_peak_flops
from fusion_model.config import FusionConfig
from fusion_model.hf_convert import from_transformers

# "compiled" = torch.compile on every decoder layer, as the trainer's `compile: true` does (the loss stays eager)
MODES = ("eager", "compiled")
# label: (preset, batch, seq_len, config overrides, modes); the smoke size only proves the bench runs
SIZES = {
    "small": ("small", 4, 256, {}, MODES),
    "medium": ("medium", 2, 512, {}, MODES),
    # Chameleon's 65,536-entry vocabulary at the medium width: the head and loss (outside the compiled
    # layers, so eager only) are then half the FLOPs
    "medium_vocab65k": ("medium", 2, 512, {"vocab_size": 65536}, ("eager",)),
}
SMOKE_SIZES = {"small": ("tiny", 2, 32, {}, MODES)}


def _peak_flops() -> float:
    """This machine's fp32 matmul peak (the MFU denominator)."""
    return matmul_peak_flops(torch.float32, "cpu")


def _reference(config: FusionConfig):
    """transformers' ChameleonForConditionalGeneration at the same shape (small placeholder VQ encoder)."""
    from transformers import ChameleonForConditionalGeneration

    from fusion_model.hf_convert import to_transformers_config

    hf_config = to_transformers_config(config, vocabulary_map={})
    hf_config._attn_implementation = "sdpa"  # the reference's fastest CPU path
    return ChameleonForConditionalGeneration(hf_config).train()


def _train_step(model: torch.nn.Module, loss) -> callable:
    """One optimizer step: loss(model).backward(), then fused AdamW (the same settings on both sides)."""
    params = [p for n, p in model.named_parameters() if "vqmodel" not in n]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1, fused=True)

    def step():
        loss(model).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _steps(config: FusionConfig, batch: int, seq_len: int, modes: tuple[str, ...]) -> dict[str, callable]:
    """`ours_<mode>` and `transformers_<mode>` steps, all starting from the same weights, on the same batch."""
    torch._dynamo.reset()  # compiled kernels are specialised to the thread count: compile afresh for each phase
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    weights = _reference(config).state_dict()
    steps = {}
    for mode in modes:
        reference = _reference(config)
        reference.load_state_dict(weights)
        ours = from_transformers(reference).train()
        if mode == "compiled":
            for block in ours.layers:
                block.compile()
            for layer in reference.model.layers:
                layer.compile()
        steps[f"ours_{mode}"] = _train_step(ours, lambda m: m.loss(ids)["loss"])  # CE + z-loss, fused head
        # CE only: transformers has no z-loss
        steps[f"transformers_{mode}"] = _train_step(reference, lambda m: m(input_ids=ids, labels=ids).loss)
    return steps


def _summary(times: dict[str, list[float]], modes: tuple[str, ...], tokens: int, flops: float, peak: float) -> dict:
    """Per mode ours vs transformers (ratio = their time / ours, per round); tokens/s and MFU of every step."""
    figures = {mode: paired_result(times[f"ours_{mode}"], times[f"transformers_{mode}"]).as_dict() for mode in modes}
    if "eager" in modes and "compiled" in modes:
        # what switching on `compile: true` gains over the reference as users run it by default
        figures["ours_compiled_vs_transformers_eager"] = paired_result(
            times["ours_compiled"], times["transformers_eager"]).as_dict()
    for name, seconds in times.items():
        median = statistics.median(seconds)
        figures[f"{name}_tokens_per_s"] = tokens / median
        figures[f"{name}_mfu_vs_matmul_peak"] = flops / median / peak
    return figures


def _cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def _cpu_peak_flops(size: int = 1024) -> float:
    """Best matmul FLOP per CPU-second at the current thread count (the CPU-time counterpart of the peak)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    return 2 * size**3 / min(_cpu_seconds(lambda: a @ b) for _ in range(10))


def run(smoke: bool = False) -> dict:
    """Measure both sizes (or the smoke size), write bench/results/decoder.json, return the payload."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    peak = _peak_flops()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU-time figures need one thread: idle spinning of a 2nd would count as work
    cpu_peak = _cpu_peak_flops()
    torch.set_num_threads(threads)
    figures, configs = {}, {}
    for label, (preset, batch, seq_len, overrides, modes) in (SMOKE_SIZES if smoke else SIZES).items():
        config = FusionConfig.from_preset(preset, max_seq_len=seq_len, **overrides)
        # the smoke run compiles in one phase only (compiling costs CI tens of seconds per model)
        cpu_time_modes = ("eager",) if smoke else modes
        tokens = batch * seq_len
        flops = config.flops_per_token(seq_len) * tokens
        # wall clock at the machine's threads: the headline figures
        times = time_rounds(_steps(config, batch, seq_len, modes), warmup=2, min_rounds=1 if smoke else 4,
                            max_rounds=2 if smoke else 12, max_seconds=2.0 if smoke else 60.0)
        figures[label] = _summary(times, modes, tokens, flops, peak)
        # one thread, process CPU seconds: robust to other jobs on a shared machine
        torch.set_num_threads(1)
        try:
            times = time_rounds(_steps(config, batch, seq_len, cpu_time_modes), warmup=2,
                                min_rounds=1 if smoke else 4, max_rounds=2 if smoke else 8,
                                max_seconds=2.0 if smoke else 60.0, clock=time.process_time)
        finally:
            torch.set_num_threads(threads)
        figures[label]["cpu_time_1thread"] = _summary(times, cpu_time_modes, tokens, flops, cpu_peak)
        configs[label] = {"preset": preset, "batch": batch, "seq_len": seq_len, "overrides": overrides, "modes": modes,
                          "parameters": config.num_parameters(), "flops_per_token": config.flops_per_token(seq_len)}
    figures["matmul_peak_flops"] = peak
    figures["matmul_peak_flops_per_cpu_second_1thread"] = cpu_peak
    payload = {"figures": figures, "config": {
        "sizes": configs, "threads": threads, "dtype": "fp32",
        "step": "forward + backward + fused AdamW, same weights and batch; ours CE + z-loss, transformers CE only",
        "modes": {"eager": "as written", "compiled": "torch.compile on each decoder layer; loss and optimizer eager"},
        "ratio": "transformers seconds / ours, per round of timings in rotating order; IQR over rounds",
        "cpu_time_1thread": "the same at 1 thread in process CPU seconds; MFU against the 1-thread matmul peak "
                            "per CPU second"}}
    write_result("decoder", payload)
    return payload


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(smoke="--smoke" in sys.argv), indent=2))
