"""Decoder training step (forward + backward + AdamW) tokens/s: ours vs transformers' Chameleon, and CPU MFU."""

from __future__ import annotations

import statistics
import time

import torch

from bench.harness import compare, write_result
from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel

# (preset, batch, seq_len); the smoke sizes only prove the bench runs
SIZES = {"small": ("small", 4, 256), "medium": ("medium", 2, 512)}
SMOKE_SIZES = {"small": ("tiny", 2, 32)}


def _peak_flops() -> float:
    """This machine's fp32 matmul peak (bench.limits when present, else a 1024^3 matmul measured here)."""
    try:
        from bench.limits import matmul_peak_flops

        return matmul_peak_flops(torch.float32, "cpu")
    except ImportError:
        import time

        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        return 2 * 1024**3 / best


def _reference(config: FusionConfig):
    """transformers' ChameleonForConditionalGeneration at the same shape (small placeholder VQ encoder)."""
    from transformers import ChameleonForConditionalGeneration

    from fusion_model.hf_convert import to_transformers_config

    hf_config = to_transformers_config(config, vocabulary_map={})
    hf_config._attn_implementation = "sdpa"  # the reference's fastest CPU path
    return ChameleonForConditionalGeneration(hf_config).train()


def _steps(config: FusionConfig, batch: int, seq_len: int):
    """Two closures doing one optimizer step each, on the same weights and the same batch."""
    reference = _reference(config)
    ours = FusionModel.from_transformers(reference).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))
    ref_params = [p for n, p in reference.named_parameters() if "vqmodel" not in n]
    # the same fused AdamW for both, so the optimizer step (identical work) does not dilute the model ratio
    adamw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1, fused=True)
    opt_ref = torch.optim.AdamW(ref_params, **adamw)
    opt_ours = torch.optim.AdamW(ours.parameters(), **adamw)

    def ours_step():
        ours.loss(ids)["loss"].backward()  # CE + z-loss, chunked head
        opt_ours.step()
        opt_ours.zero_grad(set_to_none=True)

    def reference_step():
        reference(input_ids=ids, labels=ids).loss.backward()  # CE only (transformers has no z-loss)
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)

    return ours_step, reference_step


def _cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def cpu_time_compare(ours, reference, pairs: int) -> dict:
    """Alternate the two like harness.compare but time process CPU seconds, which other jobs on a shared,
    oversubscribed machine inflate far less than wall time (meaningful at one thread)."""
    ratios, ours_s, ref_s = [], [], []
    for i in range(pairs):
        if i % 2 == 0:
            a, b = _cpu_seconds(ours), _cpu_seconds(reference)
        else:
            b, a = _cpu_seconds(reference), _cpu_seconds(ours)
        ours_s.append(a)
        ref_s.append(b)
        ratios.append(b / a)
    return {"speedup_median": statistics.median(ratios), "speedup_min": min(ratios), "speedup_max": max(ratios),
            "ours_median_s": statistics.median(ours_s), "reference_median_s": statistics.median(ref_s)}


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
    for label, (preset, batch, seq_len) in (SMOKE_SIZES if smoke else SIZES).items():
        config = FusionConfig.from_preset(preset, max_seq_len=seq_len)
        ours_step, reference_step = _steps(config, batch, seq_len)
        result = compare(ours_step, reference_step, warmup=1, min_pairs=1 if smoke else 3,
                         max_pairs=2 if smoke else 10, max_seconds=2.0 if smoke else 30.0)
        torch.set_num_threads(1)
        cpu = cpu_time_compare(ours_step, reference_step, pairs=2 if smoke else 6)
        torch.set_num_threads(threads)
        tokens = batch * seq_len
        flops = config.flops_per_token(seq_len) * tokens
        figures[label] = {
            "speedup_vs_transformers": result.speedup_median,
            "speedup_q25": result.speedup_q25,
            "speedup_q75": result.speedup_q75,
            "pairs": result.pairs,
            "ours_tokens_per_s": tokens / result.ours_median_s,
            "transformers_tokens_per_s": tokens / result.reference_median_s,
            "ours_flops_per_s": flops / result.ours_median_s,
            "ours_mfu_vs_matmul_peak": flops / result.ours_median_s / peak,
            "transformers_mfu_vs_matmul_peak": flops / result.reference_median_s / peak,
            # one thread, CPU seconds: robust to other jobs on the machine
            "cpu_time_speedup_vs_transformers": cpu["speedup_median"],
            "cpu_time_speedup_min": cpu["speedup_min"],
            "cpu_time_speedup_max": cpu["speedup_max"],
            "ours_mfu_cpu_time_1thread": flops / cpu["ours_median_s"] / cpu_peak,
            "transformers_mfu_cpu_time_1thread": flops / cpu["reference_median_s"] / cpu_peak,
        }
        configs[label] = {"preset": preset, "batch": batch, "seq_len": seq_len,
                          "parameters": config.num_parameters(), "flops_per_token": config.flops_per_token(seq_len)}
    figures["matmul_peak_flops"] = peak
    figures["matmul_peak_flops_per_cpu_second_1thread"] = cpu_peak
    payload = {"figures": figures, "config": {"sizes": configs, "threads": threads, "dtype": "fp32",
                                              "step": "forward + backward + fused AdamW, same weights and batch"}}
    write_result("decoder", payload)
    return payload


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(smoke="--smoke" in sys.argv), indent=2))
