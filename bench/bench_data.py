"""Data pipeline speed: packed streaming tokens/s vs what a small decoder trains through, and pre-tokenization images/s."""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import compare, write_result


def _make_token_shards(workdir: Path, digits: int) -> tuple[Path, float, int]:
    """Demo digits -> raw shards -> token shards (demo-64 image tokenizer, 1,024-id vocabulary); returns images/s."""
    from data_shards import sources
    from data_shards.pretokenize import pretokenize
    from tokenizer.image import ImageTokenizer, ImageTokenizerConfig
    from tokenizer.vocab import train_unified_vocab

    sources.write_raw(sources.demo_digits(digits), workdir / "raw", shard_max_docs=max(digits // 4, 1))
    captions = [f"the digit {w}" for w in sources.DIGIT_WORDS] * 20
    vocab = train_unified_vocab(captions, vocab_size=1024, image_codes=512)
    torch.manual_seed(0)
    image_tokenizer = ImageTokenizer(ImageTokenizerConfig.from_preset("demo-64")).eval()
    start = time.perf_counter()
    manifest = pretokenize(workdir / "raw", workdir / "tokens", vocab, image_tokenizer, batch_size=64, progress=False)
    seconds = time.perf_counter() - start
    return workdir / "tokens", manifest["images"] / seconds, manifest["tokens"]


def _chameleon_sized_stream(workdir: Path, smoke: bool):
    """Synthetic token shards shaped like Chameleon data (1,024-token images + captions, long text) at T=4,096."""
    import numpy as np

    from data_shards.stream import PackedTokenStream
    from data_shards.token_shards import write_manifest, write_token_shard

    rng = np.random.default_rng(0)
    info = {"vocab_size": 65_536, "vocab_fingerprint": "bench", "image_tokenizer_fingerprint": "bench", "images": 0}
    metas = []
    for shard in range(2 if smoke else 8):
        docs = [rng.integers(0, 65_536, size=int(n)).tolist()
                for n in np.where(rng.random(50) < 0.7, 1030 + rng.integers(0, 40, 50), rng.integers(200, 6000, 50))]
        metas.append(write_token_shard(workdir, f"shard-{shard:06d}", [f"s{shard}d{i}" for i in range(50)], docs, info))
    write_manifest(workdir, {**info, "pad_id": 0}, metas)
    return PackedTokenStream(workdir, 4096, 4, seed=0)


def _batches(stream, count: int) -> list[dict]:
    """`count` batches, running through as many epochs as needed."""
    out: list[dict] = []
    for epoch in itertools.count():
        stream.set_epoch(epoch)
        out.extend(itertools.islice(iter(stream), count - len(out)))
        if len(out) >= count:
            return out
    return out


def run(smoke: bool = False) -> dict:
    """Measure and write bench/results/data.json."""
    from data_shards.stream import PackedTokenStream
    from fusion_model.config import FusionConfig
    from fusion_model.layers.loss import fusion_loss
    from fusion_model.model import FusionModel

    torch.set_num_threads(1)
    digits = 128 if smoke else 1000
    seq_len, batch_size, steps = (128, 8, 2) if smoke else (256, 32, 3)
    with tempfile.TemporaryDirectory() as tmp:
        token_dir, images_per_s, tokens = _make_token_shards(Path(tmp), digits)
        start = time.perf_counter()
        stream = PackedTokenStream(token_dir, seq_len, batch_size, seed=0)
        setup_s = time.perf_counter() - start

        config = FusionConfig.from_preset("demo", max_seq_len=seq_len, dropout=0.0)
        model = FusionModel(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model_batches = _batches(stream, steps)

        def train_steps() -> None:
            for batch in model_batches:
                logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
                loss = fusion_loss(logits, batch["input_ids"], batch["document_ids"], image_offset=None,
                                   image_codes=None, z_loss_coef=1e-5)["loss"]
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()

        def stream_batches() -> None:
            _batches(stream, steps)

        result = compare(stream_batches, train_steps, min_pairs=3, max_pairs=5 if smoke else 10,
                         max_seconds=10 if smoke else 30)
        # one long streaming run for an absolute figure (many batches, epochs included)
        many = 20 if smoke else 200
        start = time.perf_counter()
        _batches(stream, many)
        stream_s = time.perf_counter() - start
        big = _chameleon_sized_stream(Path(tmp) / "chameleon", smoke)
        big_count = 5 if smoke else 40
        start = time.perf_counter()
        _batches(big, big_count)
        big_s = time.perf_counter() - start
    tokens_per_batch = seq_len * batch_size
    figures = {
        # speedup = model seconds / stream seconds for the same batches: how many times faster than the
        # decoder trains the stream delivers tokens (goal >= 100x)
        "stream_vs_demo_train_step": {**result.as_dict(), "goal": 100.0},
        "stream_tokens_per_s": {"value": many * tokens_per_batch / stream_s, "unit": "tokens/s",
                                "batches": many},
        "model_train_tokens_per_s": {"value": steps * tokens_per_batch / result.reference_median_s,
                                     "unit": "tokens/s"},
        "stream_tokens_per_s_chameleon_shaped": {"value": big_count * 4 * 4096 / big_s, "unit": "tokens/s"},
        "padding_fraction_chameleon_shaped": 1 - big.manifest["tokens"] / (len(big) * 4 * 4096),
        "pretokenize_images_per_s": {"value": images_per_s, "unit": "images/s"},
        "stream_setup_s": {"value": setup_s, "unit": "s"},
    }
    payload = {
        "figures": figures,
        "config": {
            "digits": digits, "dataset_tokens": tokens, "seq_len": seq_len, "batch_size": batch_size,
            "steps_per_timing": steps, "pairs": result.pairs, "stream_workers": 1,
            "model": "fusion_model FusionModel preset 'demo' (d128, 4 layers), fp32 AdamW step",
            "image_tokenizer": "demo-64 preset, untrained (speed only), batch 64", "smoke": smoke,
            "threads": 1,
            "chameleon_shaped": "T 4,096, batch 4, 70% image documents of ~1,030 tokens, 30% text of 200-6,000",
        },
    }
    write_result("data", payload)
    return payload


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
