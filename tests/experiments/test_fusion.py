"""The fusion experiment captions through the sampler users run (`generate_ids`, text mode, temperature 0): for an
early-fusion decoder and each late-fusion connector its captions are those of a greedy argmax over text-mode ids,
recomputed from scratch at every token."""

from __future__ import annotations

import pytest
import torch

from experiments import fusion as experiment
from fusion_model.config import FusionConfig
from fusion_model.families.late.model import LateFusionConfig, LateFusionModel, late_layout
from fusion_model.model import FusionModel
from tokenizer.vocab import text_mode_mask, train_unified_vocab

FEATURES = 8


@pytest.fixture(scope="module")
def vocab():
    return train_unified_vocab(["the cat sat on a mat one two three"] * 30, vocab_size=512, image_codes=16)


def greedy_by_hand(next_logits, prompts: torch.Tensor, features: torch.Tensor, vocab, tokens: int = 12) -> list[str]:
    """Argmax over the ids text mode may emit, the whole sequence recomputed for every token, until </s>."""
    banned = ~text_mode_mask(vocab)
    new = torch.zeros(len(prompts), 0, dtype=torch.long)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    for _ in range(tokens):
        grown = torch.cat([prompts, new], 1)
        grown_features = torch.cat([features, features.new_zeros(len(prompts), new.shape[1], FEATURES)], 1)
        token = next_logits(grown, grown_features).masked_fill(banned, float("-inf")).argmax(-1)
        new = torch.cat([new, torch.where(done, vocab.eos_id, token)[:, None]], 1)
        done |= token == vocab.eos_id
    texts = []
    for row in new.tolist():
        row = row[: row.index(vocab.eos_id)] if vocab.eos_id in row else row
        texts.append(vocab.decode_text(row).strip())
    return texts


def prompts(vocab) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, 16, (2, 2), generator=generator) for _ in range(4)]
    features = [torch.randn(4, FEATURES, generator=generator) for _ in range(4)]
    return experiment.prompts_with_features(vocab, [["a", c] for c in codes], [[f] for f in features], FEATURES)


def decoder(vocab) -> FusionModel:
    config = FusionConfig.from_preset("tiny", vocab_size=vocab.vocab_size, image_offset=vocab.image_offset,
                                      image_codes=vocab.image_codes, max_seq_len=96)
    model = FusionModel(config).eval()
    with torch.no_grad():  # logits of a few units, as a trained model's: the argmax is no near-tie
        model.head.weight.mul_(30)
    return model


@torch.no_grad()
def test_early_fusion_captions_are_the_greedy_ones(vocab):
    torch.manual_seed(0)
    model = decoder(vocab)
    ids, features = prompts(vocab)

    def next_logits(grown: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
        return model.head(model.forward_hidden(grown)[:, -1]).float()

    got = experiment.greedy_captions(experiment.early_decodable(model), ids, features, vocab, max_new_tokens=12)
    assert got == greedy_by_hand(next_logits, ids, features, vocab)


@pytest.mark.parametrize("kind", ["llava", "qformer", "flamingo"])
@torch.no_grad()
def test_late_fusion_captions_are_the_greedy_ones(vocab, kind):
    torch.manual_seed(1)
    options = LateFusionConfig(kind=kind, feature_dim=FEATURES, image_token_id=vocab.image_placeholder_id,
                               boi_id=vocab.boi_id, eoi_id=vocab.eoi_id,
                               special_ids=[vocab.bos_id, vocab.eos_id, vocab.pad_id, vocab.boi_id, vocab.eoi_id])
    late = LateFusionModel(decoder(vocab), kind, options.image_token_id, feature_dim=FEATURES,
                           connector_dim=options.connector_dim, num_latents=options.num_latents,
                           num_queries=options.num_queries, depth=options.depth, heads=options.heads).eval()
    ids, features = prompts(vocab)

    def next_logits(grown: torch.Tensor, grown_features: torch.Tensor) -> torch.Tensor:
        layout = late_layout(grown, torch.zeros_like(grown), grown_features, config=options,
                             image_offset=vocab.image_offset, image_codes=vocab.image_codes, pad_id=vocab.pad_id)
        hidden = late.hidden(layout["input_ids"], features=layout["features"], feature_mask=layout["feature_mask"],
                             document_ids=layout["document_ids"], position_ids=layout["position_ids"])
        return late.decoder.head(hidden[:, -1]).float()

    got = experiment.greedy_captions(experiment.late_decodable(late, options, vocab), ids, features, vocab,
                                     max_new_tokens=12)
    assert got == greedy_by_hand(next_logits, ids, features, vocab)
