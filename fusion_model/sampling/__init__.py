"""Sampling mixed text-and-image ids (ids in, ids out); this package's modules re-exported, one job each."""

# A KV-cached decode loop with Chameleon's modality rules, per-modality temperature / top-k / top-p, a text
# repetition penalty, classifier-free guidance and speculative Jacobi decoding; text and images in, text and PIL
# images out is fusion_model.sampling.generate. The modules, each importing only those above it:
#   config       SamplingConfig, MODES
#   protocol     DecodableModel: what the sampler needs of a model, and check_decodable
#   logits       guidance mixing, repetition penalty, top-k / top-p, the exponential noise, the token choice
#   streams      the guidance streams (conditional, unconditional, image-conditional rows)
#   modality     ModalityRules (the per-prompt state machine), SeenTextTokens (the repetition penalty's memory)
#   feeder       CacheFeeder: feeds tokens to the model, with or without a KV cache, and returns logits
#   step         PlainStep: one token per prompt per forward, on fixed shapes
#   speculative  SpeculativeStep: speculative Jacobi decoding of image codes
#   decode       generate_ids, the decode loop, compiled_step

from fusion_model.sampling.config import MODES, SamplingConfig
from fusion_model.sampling.decode import (
    CHECK_DONE_EVERY,
    COMPILED_CACHE_MULTIPLE,
    compiled_step,
    generate_ids,
)
from fusion_model.sampling.logits import (
    apply_repetition_penalty,
    choose_tokens,
    exponential_noise,
    mix_guidance,
    truncate_logits,
)
from fusion_model.sampling.modality import ModalityRules, SeenTextTokens
from fusion_model.sampling.protocol import DecodableConfig, DecodableModel, check_decodable
from fusion_model.sampling.streams import Streams, build_streams, image_only_prompt

__all__ = [
    "CHECK_DONE_EVERY",
    "COMPILED_CACHE_MULTIPLE",
    "MODES",
    "DecodableConfig",
    "DecodableModel",
    "ModalityRules",
    "SamplingConfig",
    "SeenTextTokens",
    "Streams",
    "apply_repetition_penalty",
    "build_streams",
    "check_decodable",
    "choose_tokens",
    "compiled_step",
    "exponential_noise",
    "generate_ids",
    "image_only_prompt",
    "mix_guidance",
    "truncate_logits",
]
