"""Builders shared by the data_shards tests (fixture `tok`): token shard directories with known documents, and a
small vocabulary and image tokenizer to pre-tokenize raw shards with (fixtures `vocab`, `image_tokenizer`), and raw
shards of the requesting test module's DOCS (fixture `raw_dir`)."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch

from data_shards.raw import RawShardWriter
from data_shards.token_shards import write_manifest, write_token_shard
from tokenizer.image import ImageTokenizer, ImageTokenizerConfig
from tokenizer.vocab import train_unified_vocab

VOCAB_SIZE = 1000
PAD_ID = 0


def make_documents(count: int, seed: int = 0, min_len: int = 2, max_len: int = 20) -> list[list[int]]:
    """Documents whose first token is unique (1 + index) so any document can be told apart."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(count):
        body = rng.integers(1, VOCAB_SIZE, size=int(rng.integers(min_len, max_len + 1)) - 1).tolist()
        docs.append([1 + i] + body)
    return docs


def make_token_dir(path: Path, documents: list[list[int]], per_shard: int = 7, vocab_size: int = VOCAB_SIZE,
                   header: dict | None = None, key: str = "doc-{}", shard: str = "shard-{:06d}",
                   vocab_fingerprint: str = "test-vocab") -> Path:
    """Write `documents` as token shards (keys `key` of the document index, names `shard` of the shard index) plus
    a manifest (pad id PAD_ID, and the fields of `header`), returning the directory."""
    path.mkdir(parents=True, exist_ok=True)
    info = {"vocab_fingerprint": vocab_fingerprint, "image_tokenizer_fingerprint": "none", "vocab_size": vocab_size}
    metas = []
    for n, start in enumerate(range(0, len(documents), per_shard)):
        chunk = documents[start : start + per_shard]
        keys = [key.format(start + i) for i in range(len(chunk))]
        metas.append(write_token_shard(path, shard.format(n), keys, chunk, {**info, "images": 0}))
    write_manifest(path, {**info, "pad_id": PAD_ID, **(header or {})}, metas)
    return path


def resumed_rest(loader, cut: int) -> tuple:
    """Stop a loader made by `loader()` at `cut` batches into an epoch, take its state_dict and restore a fresh
    loader from it: (the restored loader, what it yields for the rest of the epoch). Every resume test's step."""
    live = loader()
    it = iter(live)
    for _ in range(cut):
        next(it)
    state = live.state_dict()
    del it
    resumed = loader()
    resumed.load_state_dict(state)
    return resumed, list(resumed)


def rows_to_documents(batch: dict) -> list[tuple[int, ...]]:
    """Cut each row back into its documents (by document_ids); padding is dropped."""
    out = []
    for ids, docs in zip(batch["input_ids"].tolist(), batch["document_ids"].tolist()):
        current, last = [], None
        for token, doc in zip(ids, docs):
            if doc != last and current:
                out.append(tuple(current))
                current = []
            if doc >= 0:
                current.append(token)
            last = doc
        if current:
            out.append(tuple(current))
    return out


@pytest.fixture
def tok() -> types.SimpleNamespace:
    """The builders above, as one fixture (test modules cannot import conftest under importlib mode)."""
    return types.SimpleNamespace(
        make_documents=make_documents, make_token_dir=make_token_dir, rows_to_documents=rows_to_documents,
        resumed_rest=resumed_rest,
        VOCAB_SIZE=VOCAB_SIZE, PAD_ID=PAD_ID,
    )


CORPUS = ["the digit one", "the digit two", "a photo of a cat", "some interleaved text here"] * 50


@pytest.fixture(scope="module")
def vocab():
    """A 1,024-id unified vocabulary with 512 image codes, trained on a few phrases."""
    return train_unified_vocab(CORPUS, vocab_size=1024, image_codes=512)


@pytest.fixture(scope="module")
def image_tokenizer():
    """An untrained image tokenizer for 16-px images: 4x4 codes of 64, 8 feature channels per code."""
    torch.manual_seed(0)
    config = ImageTokenizerConfig(image_size=16, base_channels=8, channel_multiplier=(1, 1, 1), num_res_blocks=1,
                                  latent_channels=8, norm_groups=4, codebook_size=64)
    return ImageTokenizer(config).eval()


@pytest.fixture(scope="module")
def raw_dir(tmp_path_factory, request):
    """Raw shards (3 documents each) of the test module's `DOCS` ({key: segments})."""
    path = tmp_path_factory.mktemp("raw")
    with RawShardWriter(path, shard_max_docs=3) as writer:
        for key, segments in request.module.DOCS.items():
            writer.add(key, segments)
    return path
