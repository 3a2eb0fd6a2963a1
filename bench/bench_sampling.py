"""Sampling tokens/s: text vs transformers' `generate` (same weights, greedy, KV cache) side by side, one image
(h·w tokens, with and without CFG), at batch 1 and 8, each against the memory-bandwidth bound of a decode step."""

from __future__ import annotations

import torch

from bench.harness import compare, write_result
from fusion_model.config import FusionConfig
from fusion_model.flops import best_seconds
from fusion_model.model import FusionModel
from fusion_model.sampling import SamplingConfig, generate_ids
from tokenizer.vocab import train_unified_vocab

FULL = dict(preset="small", vocab_size=4096, image_codes=1024, prompt_len=16, text_tokens=32, grid=(8, 8), batches=(1, 8))
SMOKE = dict(preset="tiny", vocab_size=512, image_codes=64, prompt_len=8, text_tokens=8, grid=(2, 2), batches=(1, 2))
CORPUS = ["In the beginning God created the heaven and the earth.", "And the earth was without form, and void."] * 20


def _bandwidth() -> float:
    """Copy bandwidth in bytes/s (bench.limits; read + write bytes, STREAM's convention)."""
    from bench.limits import copy_bandwidth

    return copy_bandwidth("cpu")


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


def run(smoke: bool = False) -> dict:
    """Measure, write bench/results/sampling.json, return the payload."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    size = SMOKE if smoke else FULL
    torch.manual_seed(0)
    vocab = train_unified_vocab(CORPUS, vocab_size=size["vocab_size"], image_codes=size["image_codes"])
    config = FusionConfig.from_preset(size["preset"], vocab_size=vocab.vocab_size, image_offset=vocab.image_offset,
                                      image_codes=vocab.image_codes)
    reference, ours = _models(config)
    bandwidth = _bandwidth()
    weight_bytes = _weight_bytes(ours)
    step_bound_s = weight_bytes / bandwidth
    text_ids = torch.nonzero(vocab.is_text(torch.arange(vocab.vocab_size))).flatten()
    # the same rule for transformers: text mode allows text ids, <sep> and </s> only
    allowed = vocab.is_text(torch.arange(vocab.vocab_size))
    allowed[[vocab.eos_id, vocab.sep_id]] = True
    suppress = torch.nonzero(~allowed).flatten().tolist()
    n_text, grid = size["text_tokens"], size["grid"]
    n_image = grid[0] * grid[1] + 2  # <boi>, codes, <eoi>
    limits = dict(warmup=1, min_pairs=1 if smoke else 3, max_pairs=2 if smoke else 6, max_seconds=2.0 if smoke else 10.0)
    figures: dict = {}
    agreement = []
    for batch in size["batches"]:
        prompt = torch.cat([torch.full((batch, 1), vocab.bos_id),
                            text_ids[torch.randint(len(text_ids), (batch, size["prompt_len"] - 1))]], dim=1)
        prompts = prompt.tolist()
        greedy_text = SamplingConfig(mode="text", max_new_tokens=n_text, text_temperature=0.0, stop_at_eos=False)

        def ours_text(prompts=prompts, greedy_text=greedy_text):
            return generate_ids(ours, vocab, prompts, greedy_text)

        def reference_text(prompt=prompt):
            with torch.inference_mode():
                return reference.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_text,
                                          min_new_tokens=n_text, do_sample=False, use_cache=True,
                                          pad_token_id=vocab.pad_id, eos_token_id=None, suppress_tokens=suppress)

        result = compare(ours_text, reference_text, **limits)
        ours_out = torch.tensor(ours_text())
        ref_out = reference_text()[:, prompt.shape[1]:]
        agreement.append(float((ours_out == ref_out).float().mean()))
        tokens = batch * n_text
        figures[f"text_batch{batch}"] = {
            "speedup_vs_transformers": result.speedup_median,
            "speedup_q25": result.speedup_q25,
            "speedup_q75": result.speedup_q75,
            "pairs": result.pairs,
            "ours_median_s": result.ours_median_s,
            "reference_median_s": result.reference_median_s,
            "ours_tokens_per_s": tokens / result.ours_median_s,
            "transformers_tokens_per_s": tokens / result.reference_median_s,
            "bandwidth_bound_tokens_per_s": batch / step_bound_s,
            "ours_fraction_of_bound": (tokens / result.ours_median_s) / (batch / step_bound_s),
        }
        for label, cfg_scale in (("image", 1.0), ("image_cfg", 3.0)):
            image = SamplingConfig(mode="image", image_grid=grid, image_temperature=1.0, image_top_k=50,
                                   cfg_scale=cfg_scale, seed=0)
            # ours only (transformers cannot emit image tokens); the text comparison before has warmed the model up
            seconds = best_seconds(lambda image=image, prompts=prompts: generate_ids(ours, vocab, prompts, image),
                                   torch.device("cpu"), repeats=1, warmup=0)
            rows = batch * (2 if cfg_scale != 1.0 else 1)  # CFG doubles the rows each step reads the weights for
            figures[f"{label}_batch{batch}"] = {
                "ours_seconds_per_batch": seconds,
                "ours_tokens_per_s": batch * n_image / seconds,
                "ours_seconds_per_image": seconds / batch,
                "bandwidth_bound_tokens_per_s": batch / step_bound_s,
                "ours_fraction_of_bound": (batch * n_image / seconds) / (batch / step_bound_s),
                "rows_per_step": rows,
            }
    figures["greedy_text_agreement_with_transformers"] = min(agreement)
    figures["copy_bandwidth_bytes_per_s"] = bandwidth
    payload = {
        "figures": figures,
        "config": {
            "preset": size["preset"], "parameters": ours.num_parameters(), "weight_bytes_per_step": weight_bytes,
            "prompt_len": size["prompt_len"], "text_new_tokens": n_text, "image_grid": list(grid),
            "image_tokens": n_image, "threads": torch.get_num_threads(), "dtype": "fp32",
            "text": "greedy, KV cache, no eos stop; transformers generate(do_sample=False, use_cache=True)",
            "image": "temperature 1, top-k 50; image_cfg: two-stream scale 3 (2 rows per prompt in one forward)",
            "bound": "batch / (weight bytes per step / copy bandwidth): weights read once per step, KV reads ignored",
        },
    }
    write_result("sampling", payload)
    return payload


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(smoke="--smoke" in sys.argv), indent=2))
