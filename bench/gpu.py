"""GPU benchmark (`bench/gpu.sh`): bf16 train-step MFU at a ~1B config (flex attention + torch.compile), the same
step in transformers' Chameleon side by side, and seconds per 512x512 image (1,024 tokens) at the chameleon-7b
shape; `--dry-run` does all of it tiny on CPU."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.harness import write_result
from bench.limits import copy_bandwidth, decode_seconds_bound, matmul_peak_flops, model_flops_utilization
from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel
from fusion_model.training.flops import sync

# Dense bf16 tensor-core peaks from the vendors' data sheets (no sparsity); matched against the device name.
SPEC_PEAK_BF16 = {"H200": 989.4e12, "H100 PCIe": 756.0e12, "H100": 989.4e12, "A100": 312.0e12, "L40S": 362.0e12}
IMAGE_OFFSET = 4  # Chameleon's image block starts after 4 special tokens; any offset decodes at the same speed
CFG_TEXT, CFG_IMAGE = 3.0, 1.2  # Chameleon's three-stream guidance: u + 1.2 (img - u) + 3.0 (full - img)


def spec_peak(device: torch.device) -> float | None:
    """Data-sheet dense bf16 FLOP/s of this GPU, if known."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in SPEC_PEAK_BF16.items() if key in name), None)


def train_config(dry_run: bool) -> FusionConfig:
    """~1.1B parameters (d 2048, 16 layers, vocab 65,536, context 4,096) on GPU; a toy on CPU."""
    if dry_run:
        # flex attention has no backward on CPU, so the dry run trains through SDPA
        return FusionConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=64,
                            dropout=0.0, attention_backend="sdpa")
    return FusionConfig(dim=2048, n_layers=16, n_heads=16, max_seq_len=4096, dropout=0.0, attention_backend="flex")


def image_config(dry_run: bool) -> FusionConfig:
    """chameleon-7b's shape with an 8,192-code image block; a toy on CPU."""
    if dry_run:
        return FusionConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=64,
                            dropout=0.0, image_offset=IMAGE_OFFSET, image_codes=128)
    return FusionConfig.from_preset("chameleon-7b", dropout=0.0, image_offset=IMAGE_OFFSET, image_codes=8192)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def packed_batch(batch: int, seq_len: int, vocab_size: int, docs_per_row: int, device: torch.device,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token rows packed with `docs_per_row` documents of random lengths (as the stream yields them)."""
    input_ids = torch.randint(0, vocab_size, (batch, seq_len), generator=generator)
    document_ids = torch.empty(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        cuts = torch.randperm(seq_len - 1, generator=generator)[: docs_per_row - 1].add(1).sort().values.tolist()
        bounds = [0, *cuts, seq_len]
        for doc, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            document_ids[row, begin:end] = doc
    return input_ids.to(device), document_ids.to(device)


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def _time_steps(step, *, steps: int, warmup: int, device: torch.device) -> tuple[list[float], float, torch.Tensor]:
    """Run `warmup` untimed calls of `step`, then time `steps` calls (synced); return the times, the warm-up
    seconds (compilation included) and the last call's loss."""
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    sync(device)
    warmup_s = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        sync(device)
        times.append(time.perf_counter() - start)
    return times, warmup_s, loss


def _step_figures(times: list[float], tokens: int) -> dict:
    """tokens/s and seconds per step (median with quartiles) from step times."""
    q1, median, q3 = _quartiles(times)
    return {"tokens_per_s": {"value": tokens / median, "unit": "tok/s", "q25": tokens / q3, "q75": tokens / q1},
            "step_s": {"value": median, "unit": "s", "q25": q1, "q75": q3, "pairs": len(times)}}


def bench_train_step(config: FusionConfig, *, batch: int, steps: int, warmup: int, device: torch.device,
                     dtype: torch.dtype, compile_blocks: bool, peak_measured: float) -> dict:
    """Time forward + chunked CE/z-loss + backward + clip + fused AdamW; return tokens/s, MFU and step spread."""
    seq_len = config.max_seq_len
    _free(device)  # whatever an earlier, failed attempt left behind
    torch.manual_seed(0)
    model = FusionModel(config).to(device=device, dtype=dtype)  # bf16 "true" precision: params and activations
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1,
                                  fused=device.type == "cuda")
    if compile_blocks:
        # regional compilation: every block shares one graph, so compiling is quick and the mask logic stays eager
        for block in model.layers:
            block.compile(dynamic=False)
    generator = torch.Generator().manual_seed(0)
    input_ids, document_ids = packed_batch(batch, seq_len, config.vocab_size, 4, device, generator)

    def step() -> torch.Tensor:
        loss = model.loss(input_ids, document_ids)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()  # no .item() here: a host sync per step would hide launch overhead

    times, warmup_s, loss = _time_steps(step, steps=steps, warmup=warmup, device=device)
    if not torch.isfinite(loss):
        raise RuntimeError(f"train step gave a non-finite loss {float(loss)}; the benchmark config is broken")
    tokens = batch * seq_len
    median = statistics.median(times)
    flops_per_s = config.flops_per_token(seq_len) * tokens / median
    peak_spec = spec_peak(device)
    figures = {
        **_step_figures(times, tokens),
        "model_flops_per_s": {"value": flops_per_s, "unit": "FLOP/s"},
        "mfu_vs_measured_matmul": {"value": model_flops_utilization(flops_per_s, peak_measured), "unit": "of peak"},
        "warmup_and_compile_s": {"value": warmup_s, "unit": "s"},
    }
    if peak_spec is not None:
        figures["mfu_vs_spec_sheet"] = {"value": model_flops_utilization(flops_per_s, peak_spec), "unit": "of peak"}
    if device.type == "cuda":
        figures["peak_memory"] = {"value": torch.cuda.max_memory_allocated(device), "unit": "B"}
    config_out = {"model": config.to_dict(), "parameters": config.num_parameters(), "batch": batch,
                  "seq_len": seq_len, "docs_per_row": 4, "dtype": str(dtype), "compile": compile_blocks,
                  "flops_per_token": config.flops_per_token(seq_len), "loss": float(loss),
                  "data": "one random packed batch reused every step: a throughput figure; the loss falls by "
                          "memorisation (on an H200 a fresh batch still scored chance, 11.5, after 8 steps)"}
    return {"figures": figures, "config": config_out}


def bench_reference_train_step(config: FusionConfig, *, batch: int, steps: int, warmup: int, device: torch.device,
                               dtype: torch.dtype) -> dict:
    """transformers' Chameleon at the same shape, batch and dtype (SDPA, eager, as its users run it): tokens/s.

    It gets one whole document per row (plain causal attention, the cheapest mask) and CE without z-loss,
    so the ratio against our packed, z-loss step is conservative.
    """
    from transformers import ChameleonForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from fusion_model.hf_convert import to_transformers_config

    hf_logging.set_verbosity_error()
    _free(device)
    torch.manual_seed(0)
    hf_config = to_transformers_config(config, vocabulary_map={})
    hf_config._attn_implementation = "sdpa"
    with torch.device(device):  # initialise on the GPU: a 1B model's init on the host takes tens of seconds
        model = ChameleonForConditionalGeneration(hf_config).to(dtype=dtype).train()
    params = [p for n, p in model.named_parameters() if "vqmodel" not in n]  # the VQ encoder takes no part
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1,
                                  fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (batch, config.max_seq_len), generator=generator).to(device)

    def step() -> torch.Tensor:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    times, _, _ = _time_steps(step, steps=steps, warmup=warmup, device=device)
    return _step_figures(times, batch * config.max_seq_len)


def _train_with_fallback(config: FusionConfig, batch: int, **kwargs) -> dict:
    """Halve the batch on out-of-memory, down to one row."""
    while True:
        try:
            result = bench_train_step(config, batch=batch, **kwargs)
            _free(kwargs["device"])  # the 1B model and its optimizer state go before the 7B model arrives
            return result
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
            print(f"gpu bench: out of memory at batch {batch}; retrying with {batch // 2}", flush=True)
            batch //= 2
            _free(kwargs["device"])


@torch.no_grad()
def generate_image(model: FusionModel, prompt: torch.Tensor, n_tokens: int, streams: int,
                   generator: torch.Generator) -> torch.Tensor:
    """Sample `n_tokens` image codes after `prompt` with the KV cache; 3 streams = Chameleon's CFG."""
    config = model.config
    device = prompt.device
    rows = prompt.expand(streams, -1).clone()
    if streams == 3:
        # stream 0: full prompt, stream 1: image-only condition, stream 2: unconditional (Chameleon's CFG)
        rows[1, :-1] = 0
        rows[2, 1:-1] = 0
    documents = torch.zeros_like(rows)
    cache = model.new_kv_cache(streams, prompt.shape[1] + n_tokens)
    logits = model(rows, document_ids=documents, kv_cache=cache)[:, -1]
    codes = torch.empty(n_tokens, dtype=torch.long, device=device)
    block = slice(config.image_offset, config.image_offset + config.image_codes)
    for i in range(n_tokens):
        image_logits = logits[:, block]
        if streams == 3:
            full, image_only, uncond = image_logits
            image_logits = (uncond + CFG_IMAGE * (image_only - uncond) + CFG_TEXT * (full - image_only))[None]
        probs = torch.softmax(image_logits[0] / 0.7, dim=-1)
        codes[i] = torch.multinomial(probs, 1, generator=generator)[0]
        token = (codes[i] + config.image_offset).view(1, 1).expand(streams, 1)
        logits = model(token, document_ids=torch.zeros_like(token), kv_cache=cache)[:, -1]
    return codes


def _decoding_model(config: FusionConfig, device: torch.device, dtype: torch.dtype) -> tuple[FusionModel, int, int]:
    """(model with random weights made directly on the device in `dtype`, weight bytes, bytes a decode step reads)."""
    _free(device)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = FusionModel(config).eval()
    finally:
        torch.set_default_dtype(previous)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # per decoding step every matrix is read once; the input embedding only one row per stream
    streamed_bytes = weight_bytes - model.embed.weight.numel() * model.embed.weight.element_size()
    return model, weight_bytes, streamed_bytes


def bench_image(config: FusionConfig, *, n_tokens: int, stream_counts: list[int], repeats: int,
                device: torch.device, dtype: torch.dtype, bandwidth: float, deadline: float = float("inf")) -> dict:
    """Seconds per image and per token with a KV cache, and the fraction of the weight-bandwidth bound."""
    model, weight_bytes, streamed_bytes = _decoding_model(config, device, dtype)
    bound = decode_seconds_bound(streamed_bytes, bandwidth)
    generator = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(config.image_offset + config.image_codes, config.vocab_size, (1, 32), device=device)
    prompt[0, 0] = 1  # <s>
    prompt = torch.cat([prompt, torch.full((1, 1), 2, device=device)], dim=1)  # ends with begin-image
    figures: dict[str, dict] = {}
    for streams in stream_counts:
        generate_image(model, prompt, min(8, n_tokens), streams, generator)  # warm-up: kernels, allocator
        sync(device)
        times = []
        for _ in range(repeats):
            if times and time.perf_counter() > deadline:
                break  # one timed image is a figure; running past the script's budget loses all of them
            start = time.perf_counter()
            codes = generate_image(model, prompt, n_tokens, streams, generator)
            sync(device)
            times.append(time.perf_counter() - start)
        if codes.numel() != n_tokens or int(codes.max()) >= config.image_codes:
            raise RuntimeError(f"generated {codes.numel()} codes, max {int(codes.max())}: the sampler is broken")
        seconds = min(times)
        per_token = seconds / (n_tokens + 1)  # n_tokens decoding steps plus the prefill
        label = "cfg_3_streams" if streams == 3 else f"batch_{streams}"
        figures[label] = {
            "seconds_per_image": {"value": seconds, "unit": "s", "runs": len(times)},
            "ms_per_token": {"value": per_token * 1e3, "unit": "ms"},
            "bandwidth_bound_fraction": {"value": bound / per_token, "unit": "of bound",
                                         "bound_ms": round(bound * 1e3, 4)},
        }
    config_out = {"model": config.to_dict(), "parameters": config.num_parameters(), "image_tokens": n_tokens,
                  "prompt_tokens": prompt.shape[1], "dtype": str(dtype), "weight_bytes": weight_bytes,
                  "sampling": "temperature 0.7 over the image block; 3 streams use Chameleon's CFG (1.2, 3.0)",
                  "bound": "bytes of all matrices but the input embedding / copy bandwidth (read + write)"}
    del model
    _free(device)
    return {"figures": figures, "config": config_out}


SPECULATIVE_WINDOW = 4  # the sampler's compiled speculative row


def bench_sampler(*, dry_run: bool, batches: list[int], device: torch.device, dtype: torch.dtype, bandwidth: float,
                  deadline: float = float("inf")) -> dict:
    """The real sampler (`generate_ids`, image mode, Chameleon's three-stream guidance) at the image shape: seconds
    per image for the eager and the compiled decode step (a CUDA graph on GPU), the compiled step with speculative
    Jacobi decoding, and the fraction of the bound per forward."""
    from fusion_model.sampling import SamplingConfig, generate_ids
    from tokenizer.vocab import train_unified_vocab

    shape = image_config(dry_run)
    if dry_run:  # byte-level BPE needs 256 text ids besides the specials and image codes
        shape = dataclasses.replace(shape, vocab_size=512)
    vocab = train_unified_vocab(["a picture of a red circle on a blue square"] * 20, vocab_size=shape.vocab_size,
                                image_codes=shape.image_codes)
    config = dataclasses.replace(shape, image_offset=vocab.image_offset)
    model, _, streamed_bytes = _decoding_model(config, device, dtype)
    bound = decode_seconds_bound(streamed_bytes, bandwidth)
    grid = (4, 4) if dry_run else (32, 32)
    n_steps = grid[0] * grid[1] + 2  # <boi>, codes, <eoi>
    prompt = [vocab.bos_id] + vocab.encode_text("a picture of a red circle on a blue square")
    figures: dict = {}
    for batch in batches:
        for label, compiled, window in (("eager", False, 0), ("compiled", True, 0),
                                        ("compiled_speculative", True, SPECULATIVE_WINDOW)):
            if time.perf_counter() > deadline:
                break
            sampling = SamplingConfig.chameleon(mode="image", image_grid=grid, seed=0, compile=compiled,
                                                speculative_window=window)
            # compiled: the first call compiles for these shapes; eager: a short warm-up (kernels, allocator)
            warm_up = sampling if compiled else dataclasses.replace(sampling, image_grid=(2, 2))
            start = time.perf_counter()
            generate_ids(model, vocab, [prompt] * batch, warm_up)
            sync(device)
            first = time.perf_counter() - start
            start = time.perf_counter()
            stats: dict = {}
            out = generate_ids(model, vocab, [prompt] * batch, sampling, stats=stats)
            sync(device)
            seconds = time.perf_counter() - start
            if any(len(row) != n_steps for row in out):
                raise RuntimeError(f"the sampler gave {[len(r) for r in out]} tokens, expected {n_steps} per image")
            forwards = stats["forwards"]  # <boi> and <eoi> are forced, so the plain sampler makes one per code
            figures[f"three_stream_batch{batch}_{label}"] = {
                "seconds_per_image": {"value": seconds / batch, "unit": "s"},
                "forwards": {"value": forwards, "unit": "forwards",
                             "note": "random weights: speculative acceptance here says nothing of a trained model"
                             if window else "one per code"},
                "ms_per_forward": {"value": seconds / forwards * 1e3, "unit": "ms"},
                # a speculative forward reads the weights once too, for window + 1 tokens per row
                "bandwidth_bound_fraction": {"value": bound / (seconds / forwards), "unit": "of bound",
                                             "bound_ms": round(bound * 1e3, 4)},
                "first_call_s": {"value": first, "unit": "s", "note": "compile + one generation" if compiled
                                 else "warm-up generation of 4 codes"},
            }
    config_out = {"model": config.to_dict(), "image_grid": list(grid), "dtype": str(dtype),
                  "sampling": "SamplingConfig.chameleon(mode='image'): T 0.7, top-p 0.9, three streams (1.2, 3.0), "
                              "3 rows per prompt in one forward",
                  "bound": "bytes of all matrices but the input embedding / copy bandwidth, per step"}
    del model
    _free(device)
    return {"figures": figures, "config": config_out}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options of `python -m bench.gpu`."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="tiny configs on CPU in fp32, no compile (seconds)")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where gpu.json goes (default bench/results; a temp dir with --dry-run)")
    parser.add_argument("--skip-train", action="store_true", help="skip the train-step MFU part")
    parser.add_argument("--skip-image", action="store_true", help="skip the image-generation part")
    parser.add_argument("--skip-sampler", action="store_true",
                        help="skip the real sampler's eager vs compiled (CUDA graph) part")
    parser.add_argument("--sampler-batches", default="1,8", help="prompts per batch for the sampler part (default 1,8)")
    parser.add_argument("--train-batch", type=int, default=None, help="rows of 4,096 tokens per step (default 4)")
    parser.add_argument("--train-steps", type=int, default=None, help="timed steps (default 10)")
    parser.add_argument("--no-compile", action="store_true", help="train eagerly (compile is on by default on GPU)")
    parser.add_argument("--streams", default="1,3", help="comma-separated batch sizes for image generation; "
                        "3 means Chameleon's three-stream CFG (default 1,3)")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="stop repeating image timings after this many seconds from the start (default 400)")
    return parser.parse_args(argv)


def _raise_recompile_limit(n_layers: int) -> None:
    """Let dynamo keep a graph per block if it specialises on each one (it falls back to eager past the limit)."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 2 * n_layers))


def main(argv: list[str] | None = None) -> int:
    """Run both GPU figures (or their tiny CPU versions) and write gpu.json after each part."""
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("gpu bench: no CUDA device; run with --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    out_dir = args.results_dir or (Path(tempfile.mkdtemp(prefix="bench-gpu-dry-")) if args.dry_run else None)
    started = time.perf_counter()
    peak = matmul_peak_flops(dtype, device, size=None if cuda else 128, repeats=5 if cuda else 2)
    bandwidth = copy_bandwidth(device, nbytes=None if cuda else 4 << 20, repeats=5 if cuda else 2)
    figures: dict = {
        "matmul_peak": {"value": peak, "unit": "FLOP/s", "dtype": str(dtype).removeprefix("torch.")},
        "copy_bandwidth": {"value": bandwidth, "unit": "B/s", "note": "read + write"},
    }
    if spec_peak(device) is not None:
        figures["spec_sheet_peak"] = {"value": spec_peak(device), "unit": "FLOP/s"}
    config: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu (dry run)",
                    "dry_run": args.dry_run, "torch": torch.__version__, "errors": {}}

    def save() -> Path:
        # after every part, so a run cut short by its time limit still leaves what it measured
        config["total_s"] = round(time.perf_counter() - started, 1)
        return write_result("gpu", {"figures": figures, "config": config}, out_dir)

    def attempt(label: str, part) -> dict | None:
        # on the GPU one broken part must not cost the other's figures; a dry run fails loudly instead
        try:
            return part()
        except Exception as error:
            if args.dry_run:
                raise
            traceback.print_exc()
            config["errors"][label] = f"{type(error).__name__}: {str(error)[:500]}"
            return None
        finally:
            print(f"gpu bench: {label} finished at {time.perf_counter() - started:.0f} s", flush=True)

    if not args.skip_train:
        train = train_config(args.dry_run)
        options = dict(steps=args.train_steps or (2 if args.dry_run else 10), warmup=1 if args.dry_run else 3,
                       device=device, dtype=dtype, peak_measured=peak)
        batch = args.train_batch or (2 if args.dry_run else 4)
        compile_blocks = cuda and not args.no_compile
        if compile_blocks:
            _raise_recompile_limit(train.n_layers)
        result = attempt("train_step_1b", lambda: _train_with_fallback(
            train, batch, compile_blocks=compile_blocks, **options))
        if result is None and train.attention_backend != "sdpa":
            # still a figure, clearly labelled: SDPA with a boolean mask, no compile
            fallback = dataclasses.replace(train, attention_backend="sdpa")
            result = attempt("train_step_1b_sdpa_eager", lambda: _train_with_fallback(
                fallback, batch, compile_blocks=False, **options))
            label = "train_step_1b_sdpa_eager"
        else:
            label = "train_step_1b"
        if result is not None:
            figures[label] = result["figures"]
            config[label] = result["config"]
            save()
            reference_options = {k: options[k] for k in ("steps", "warmup", "device", "dtype")}
            reference = attempt("train_step_1b_transformers", lambda: bench_reference_train_step(
                train, batch=result["config"]["batch"], **reference_options))
            if reference is not None:
                ours = result["figures"]["tokens_per_s"]["value"]
                reference["speedup_vs_transformers"] = {
                    "value": ours / reference["tokens_per_s"]["value"], "unit": "x",
                    "note": f"ours ({label}, packed, CE + z-loss) / transformers (eager SDPA, causal, CE)"}
                figures["train_step_1b_transformers"] = reference
            _free(device)  # the reference model is gone once its function returned; release its cache too
        save()
    if not args.skip_image:
        streams = [int(s) for s in args.streams.split(",") if s.strip()]
        result = attempt("image_512px_7b", lambda: bench_image(
            image_config(args.dry_run), n_tokens=16 if args.dry_run else 1024, stream_counts=streams,
            repeats=1, device=device, dtype=dtype, bandwidth=bandwidth,
            deadline=started + args.budget_s,
        ))
        if result is not None:
            figures["image_512px_7b"] = result["figures"]
            config["image_512px_7b"] = result["config"]
        save()
    if not args.skip_sampler:
        batches = [int(b) for b in args.sampler_batches.split(",") if b.strip()]
        result = attempt("sampler_512px_7b", lambda: bench_sampler(
            dry_run=args.dry_run, batches=[1] if args.dry_run else batches, device=device, dtype=dtype,
            bandwidth=bandwidth, deadline=started + args.budget_s + 120))
        if result is not None:
            figures["sampler_512px_7b"] = result["figures"]
            config["sampler_512px_7b"] = result["config"]
    path = save()
    print(json.dumps(figures, indent=1, default=str))
    print(f"gpu bench: wrote {path} in {config['total_s']} s; errors: {config['errors'] or 'none'}")
    return 1 if config["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
