"""The sampler tests' tiny world: a test vocabulary, a random 2-layer decoder, a head steered towards images,
and three prompts. Imported by the sampling test modules (put this folder on sys.path first)."""

from __future__ import annotations

import torch

from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel
from fusion_model.sampling import SamplingConfig

CORPUS = ["the cat sat on the mat", "a dog ran far away", "one two three four five six seven"] * 10


def tiny_model(vocab, seed: int = 0, context: int = 64, **overrides) -> FusionModel:
    """A random 2-layer decoder over the test vocabulary (GQA, so the cache path covers kv heads)."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=vocab.vocab_size, image_offset=vocab.image_offset, image_codes=vocab.image_codes)
    config = FusionConfig.from_preset("tiny", **{**fields, "max_seq_len": context, **overrides})
    return FusionModel(config).eval()


def steer(model: FusionModel, vocab, strength: float, generator: torch.Generator) -> FusionModel:
    """Give the head a random bias, pushed towards <boi>, <eoi>, </s> and image ids, so the sampler is pushed to
    break the modality rules and interleaved output mixes text and images."""
    head = torch.nn.Linear(model.config.dim, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.head.weight)
        head.bias.copy_(torch.randn(model.config.vocab_size, generator=generator))
        for token in (vocab.boi_id, vocab.eoi_id, vocab.pad_id, vocab.image_placeholder_id):
            head.bias[token] += strength
        head.bias[vocab.eos_id] += strength / 3  # weaker, or </s> would end most samples before any image
        head.bias[vocab.image_offset : vocab.image_offset + vocab.image_codes] += strength / 2
    model.head = head
    return model


def greedy(**kwargs) -> SamplingConfig:
    """Temperature 0 for text and images."""
    return SamplingConfig(text_temperature=0.0, image_temperature=0.0, **kwargs)


def prompts_of(vocab) -> list[list[int]]:
    """Three prompts of different lengths (left padding matters), one with an image in it."""
    grid = torch.arange(4).view(2, 2)
    return [
        vocab.encode_document(["the cat"], eos=False),
        vocab.encode_document(["a dog ran far", grid, "one two"], eos=False),
        [vocab.bos_id],
    ]
