"""Decode speed on the small and medium presets, batch 1 and 8: text against transformers' `generate` (same weights,
greedy, KV cache) and images with two-stream guidance, each for the eager step, the compiled step and (images)
speculative Jacobi decoding, eager and compiled, timed side by side in rounds, each against the memory-bandwidth
bound of a step."""

from __future__ import annotations

import time
from functools import partial

import torch

from bench.harness import paired_result, time_rounds, write_result
from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel
from fusion_model.sampling import SamplingConfig, generate_ids
from tokenizer.vocab import train_unified_vocab

FULL = dict(presets={"small": 4096, "medium": 8192}, image_codes=1024, prompt_len=16, text_tokens=32, grid=(8, 8),
            batches=(1, 8), window=4)
SMOKE = dict(presets={"tiny": 512}, image_codes=64, prompt_len=8, text_tokens=8, grid=(2, 2), batches=(1,), window=2)
CORPUS = ["In the beginning God created the heaven and the earth.", "And the earth was without form, and void."] * 20
CFG_SCALE = 3.0


def _dram_copy_bandwidth() -> float:
    """Copy bandwidth in bytes/s with buffers larger than the last-level cache (read + write, STREAM's convention)."""
    from bench.limits import copy_bandwidth

    return copy_bandwidth("cpu")


def _weight_read_bandwidth(nbytes: int) -> float:
    """Read-only bandwidth in bytes/s over a buffer as large as the weights: the speed a decode step streams them."""
    from bench.limits import read_bandwidth

    return read_bandwidth("cpu", nbytes=nbytes)


def _weight_bytes(model: FusionModel) -> int:
    """Bytes of weights one decode step reads: every matrix except the embedding table (one row is read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - model.embed.weight.numel() * model.embed.weight.element_size()


def _models(config: FusionConfig):
    """transformers' Chameleon and ours with the same weights (ours imported from it)."""
    from transformers import ChameleonForConditionalGeneration

    from fusion_model.hf_convert import from_transformers, to_transformers_config

    hf_config = to_transformers_config(config, vocabulary_map={})
    hf_config._attn_implementation = "sdpa"
    reference = ChameleonForConditionalGeneration(hf_config).eval()
    ours = from_transformers(reference, image_offset=config.image_offset, image_codes=config.image_codes)
    return reference, ours.eval()


def _first_call_seconds(fn) -> float:
    """Seconds of one call: the compile time of a compiled path (its first call)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rows(times: dict[str, list[float]], tokens: int, bound_tokens_per_s: float) -> dict:
    """Median tokens/s and fraction of the bound of every timed path."""
    out = {}
    for name, seconds in times.items():
        rate = tokens / sorted(seconds)[len(seconds) // 2]
        out[f"{name}_tokens_per_s"] = rate
        out[f"{name}_fraction_of_bound"] = rate / bound_tokens_per_s
    return out


def _preset(preset: str, vocab_size: int, size: dict, limits: dict) -> tuple[dict, dict]:
    """(figures, config) of one preset."""
    torch.manual_seed(0)
    vocab = train_unified_vocab(CORPUS, vocab_size=vocab_size, image_codes=size["image_codes"])
    config = FusionConfig.from_preset(preset, vocab_size=vocab.vocab_size, image_offset=vocab.image_offset,
                                      image_codes=vocab.image_codes)
    reference, ours = _models(config)
    weight_bytes = _weight_bytes(ours)
    # the weights are read from wherever they fit (a medium model's 126 MB sit in a 300 MiB last-level cache), and
    # only read: a sum over a buffer of their size is the bound's bandwidth (a DRAM-sized copy gave one it beat)
    bandwidth = _weight_read_bandwidth(weight_bytes)
    step_bound_s = weight_bytes / bandwidth
    text_ids = torch.nonzero(vocab.is_text(torch.arange(vocab.vocab_size))).flatten()
    # the same rule for transformers: text mode allows text ids, <sep> and </s> only
    allowed = vocab.is_text(torch.arange(vocab.vocab_size))
    allowed[[vocab.eos_id, vocab.sep_id]] = True
    suppress = torch.nonzero(~allowed).flatten().tolist()
    n_text, grid = size["text_tokens"], size["grid"]
    n_image = grid[0] * grid[1] + 2  # <boi>, codes, <eoi>
    figures: dict = {"read_bandwidth_at_weight_size_bytes_per_s": bandwidth}
    for batch in size["batches"]:
        prompt = torch.cat([torch.full((batch, 1), vocab.bos_id),
                            text_ids[torch.randint(len(text_ids), (batch, size["prompt_len"] - 1))]], dim=1)
        prompts = prompt.tolist()
        text = SamplingConfig(mode="text", max_new_tokens=n_text, text_temperature=0.0, stop_at_eos=False)
        text_compiled = SamplingConfig(**{**text.__dict__, "compile": True})

        def reference_text(prompt=prompt):
            with torch.inference_mode():
                return reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_text,
                                          min_new_tokens=n_text, do_sample=False, use_cache=True,
                                          pad_token_id=vocab.pad_id, eos_token_id=None, suppress_tokens=suppress)

        compile_text_s = _first_call_seconds(partial(generate_ids, ours, vocab, prompts, text_compiled))
        eager_ids = generate_ids(ours, vocab, prompts, text)
        times = time_rounds({
            "eager": partial(generate_ids, ours, vocab, prompts, text),
            "compiled": partial(generate_ids, ours, vocab, prompts, text_compiled),
            "transformers": reference_text,
        }, **limits)
        bound = batch / step_bound_s
        figures[f"text_batch{batch}"] = {
            "eager_vs_transformers": paired_result(times["eager"], times["transformers"]),
            "compiled_vs_transformers": paired_result(times["compiled"], times["transformers"]),
            **_rows(times, batch * n_text, bound),
            "bandwidth_bound_tokens_per_s": bound,
            "compile_s": compile_text_s,
            "greedy_agreement_with_transformers": float(
                (torch.tensor(eager_ids) == reference_text()[:, prompt.shape[1]:]).float().mean()),
            "compiled_equals_eager": float(generate_ids(ours, vocab, prompts, text_compiled) == eager_ids),
        }

        image = SamplingConfig(mode="image", image_grid=grid, image_temperature=1.0, image_top_k=50,
                               cfg_scale=CFG_SCALE, seed=0)
        image_compiled = SamplingConfig(**{**image.__dict__, "compile": True})
        image_sjd = SamplingConfig(**{**image.__dict__, "speculative_window": size["window"]})
        image_compiled_sjd = SamplingConfig(**{**image_sjd.__dict__, "compile": True})
        compile_image_s = _first_call_seconds(partial(generate_ids, ours, vocab, prompts, image_compiled))
        compile_sjd_s = _first_call_seconds(partial(generate_ids, ours, vocab, prompts, image_compiled_sjd))
        sjd_stats: dict = {}
        sjd_ids = generate_ids(ours, vocab, prompts, image_sjd, stats=sjd_stats)
        times = time_rounds({
            "eager": partial(generate_ids, ours, vocab, prompts, image),
            "compiled": partial(generate_ids, ours, vocab, prompts, image_compiled),
            "speculative": partial(generate_ids, ours, vocab, prompts, image_sjd),
            "compiled_speculative": partial(generate_ids, ours, vocab, prompts, image_compiled_sjd),
        }, **limits)
        # the bound of a step reads the weights once for all rows (2 guidance streams per prompt)
        figures[f"image_cfg_batch{batch}"] = {
            "compiled_vs_eager": paired_result(times["compiled"], times["eager"]),
            "speculative_vs_eager": paired_result(times["speculative"], times["eager"]),
            "compiled_speculative_vs_eager": paired_result(times["compiled_speculative"], times["eager"]),
            "compiled_speculative_vs_compiled": paired_result(times["compiled_speculative"], times["compiled"]),
            **_rows(times, batch * n_image, bound),
            "bandwidth_bound_tokens_per_s": bound,
            "compile_s": compile_image_s,
            "compiled_speculative_compile_s": compile_sjd_s,
            "compiled_seconds_per_image": sorted(times["compiled"])[len(times["compiled"]) // 2] / batch,
            # one forward advances every prompt of the batch
            "speculative_forwards_per_batch": sjd_stats["forwards"],
            "plain_forwards_per_batch": n_image,
            "compiled_equals_eager": float(generate_ids(ours, vocab, prompts, image_compiled)
                                           == generate_ids(ours, vocab, prompts, image)),
            "compiled_speculative_equals_eager_speculative": float(
                generate_ids(ours, vocab, prompts, image_compiled_sjd) == sjd_ids),
        }
    details = {"parameters": ours.num_parameters(), "weight_bytes_per_step": weight_bytes}
    return figures, details


def run(smoke: bool = False) -> dict:
    """Measure, write bench/results/sampling.json, return the payload."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # compile_s is what a first use costs: no compiled kernels reused from an earlier run's on-disk cache
    torch._inductor.config.fx_graph_cache = False
    size = SMOKE if smoke else FULL
    limits = dict(warmup=1, min_rounds=1 if smoke else 3, max_rounds=2 if smoke else 6,
                  max_seconds=2.0 if smoke else 10.0)
    figures: dict = {"copy_bandwidth_dram_bytes_per_s": _dram_copy_bandwidth()}
    presets = {}
    for preset, vocab_size in size["presets"].items():
        figures[preset], presets[preset] = _preset(preset, vocab_size, size, limits)
    payload = {
        "figures": figures,
        "config": {
            "presets": presets, "prompt_len": size["prompt_len"], "text_new_tokens": size["text_tokens"],
            "image_grid": list(size["grid"]), "threads": torch.get_num_threads(), "dtype": "fp32",
            "text": "greedy, KV cache, no eos stop; transformers generate(do_sample=False, use_cache=True)",
            "image": f"temperature 1, top-k 50, two-stream guidance scale {CFG_SCALE} (2 rows per prompt in one "
                     f"forward); speculative: window {size['window']} on random weights (few drafts accepted: "
                     "the trained demo model's acceptance is bench speculative)",
            "compiled": "SamplingConfig(compile=True): torch.compile of the static decode step; compile_s is its "
                        "first call (compile + one generation), without inductor's on-disk cache",
            "bound": "batch / (weight bytes per step / read bandwidth of a buffer of the weights' size): weights "
                     "read once per step from the memory level they fit in, KV reads ignored",
        },
    }
    write_result("sampling", payload)
    return payload


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(smoke="--smoke" in sys.argv), indent=2, default=str))
