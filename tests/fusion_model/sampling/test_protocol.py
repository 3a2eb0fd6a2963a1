"""DecodableModel: what the sampler needs of a model, checked once before sampling, and `supports_kv_cache`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fusion_model.model import FusionModel
from fusion_model.sampling import SamplingConfig, check_decodable, generate_ids
from fusion_model.sampling.protocol import CONFIG_MEMBERS, MODEL_MEMBERS
from tokenizer.vocab import train_unified_vocab

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling_helpers import CORPUS, greedy, prompts_of, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def vocab():
    return train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)


def test_the_protocol_names_exactly_what_the_sampler_uses():
    assert MODEL_MEMBERS == ("config", "head", "supports_kv_cache", "training", "forward_hidden", "decode_hidden",
                             "new_kv_cache", "parameters", "train", "eval")
    assert CONFIG_MEMBERS == ("max_seq_len", "vocab_size", "image_offset", "image_codes", "image_bidirectional")


def test_fusion_model_is_a_decodable_model_with_a_kv_cache(vocab):
    check_decodable(tiny_model(vocab))
    assert FusionModel.supports_kv_cache is True


class Headless(torch.nn.Module):
    """A model with a config and weights but none of the decode interface."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.proj = torch.nn.Linear(2, 2)


def test_a_model_without_the_interface_is_refused_naming_what_it_lacks(vocab):
    model = Headless(tiny_model(vocab).config)
    with pytest.raises(TypeError, match="Headless cannot be sampled: it lacks head, supports_kv_cache, forward_hidden, "
                                        "decode_hidden, new_kv_cache of the DecodableModel protocol"):
        generate_ids(model, vocab, [[vocab.bos_id]], SamplingConfig(mode="text"))


def test_a_config_without_the_fields_is_refused_naming_them(vocab):
    model = tiny_model(vocab)
    model.config = type("Partial", (), {"max_seq_len": 64, "vocab_size": vocab.vocab_size})()
    with pytest.raises(TypeError, match="config.image_offset, config.image_codes, config.image_bidirectional"):
        generate_ids(model, vocab, [[vocab.bos_id]], SamplingConfig(mode="text"))


class Uncached(FusionModel):
    """A model whose cached path does not work: it must be sampled by recomputation."""

    supports_kv_cache = False

    def decode_hidden(self, *args, **kwargs):
        raise NotImplementedError("no cached decode")

    def new_kv_cache(self, *args, **kwargs):
        raise NotImplementedError("no KV cache")


def test_a_model_without_a_kv_cache_is_sampled_only_by_recomputation(vocab):
    cached = tiny_model(vocab)
    uncached = Uncached(cached.config)
    uncached.load_state_dict(cached.state_dict())
    uncached.eval()
    with pytest.raises(ValueError, match="Uncached has supports_kv_cache=False: sample it with use_kv_cache=False"):
        generate_ids(uncached, vocab, prompts_of(vocab), greedy(mode="text", max_new_tokens=6))
    config = greedy(mode="text", max_new_tokens=6, use_kv_cache=False)
    assert generate_ids(uncached, vocab, prompts_of(vocab), config) == generate_ids(
        cached, vocab, prompts_of(vocab), greedy(mode="text", max_new_tokens=6))


def test_supports_kv_cache_must_be_a_bool(vocab):
    model = tiny_model(vocab)
    model.supports_kv_cache = "yes"
    with pytest.raises(TypeError, match="supports_kv_cache='yes' must be True or False"):
        check_decodable(model)
