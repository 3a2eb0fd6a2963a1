"""BLIP-2 stage 1 for the Q-Former: the three masks, no leaks, gradient reach, hard negatives, learning, stage 2."""

import copy

import pytest
import torch

from fusion_model.families.late.connectors import QFormer
from fusion_model.families.late.qformer_pretraining import (
    QFormerPretrainer,
    bidirectional_mask,
    multimodal_causal_mask,
    sample_hard_negatives,
    train_stage1,
    unimodal_mask,
)

FEATURE_DIM, DIM, QUERIES, OUT_DIM, VOCAB, TEXT_LEN = 12, 16, 3, 24, 20, 5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


def tiny_pretrainer(seed: int = 0) -> QFormerPretrainer:
    torch.manual_seed(seed)
    qformer = QFormer(FEATURE_DIM, DIM, num_queries=QUERIES, depth=2, heads=2, out_dim=OUT_DIM)
    return QFormerPretrainer(qformer, VOCAB, max_text_len=TEXT_LEN, embed_dim=8)


def tiny_batch(batch: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(batch, 7, FEATURE_DIM, generator=generator)
    text_ids = torch.randint(0, VOCAB, (batch, TEXT_LEN), generator=generator)
    text_mask = torch.ones(batch, TEXT_LEN, dtype=torch.bool)
    text_mask[0, -2:] = False  # one padded caption
    return features, text_ids, text_mask


# ---- masks -------------------------------------------------------------------------------------------------------
# M = 2 queries (q0, q1) then L = 3 text tokens (t0, t1, t2); row = who attends, column = to whom
UNIMODAL = [[1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1]]
CAUSAL = [[1, 1, 0, 0, 0],
          [1, 1, 0, 0, 0],
          [1, 1, 1, 0, 0],
          [1, 1, 1, 1, 0],
          [1, 1, 1, 1, 1]]
BIDIRECTIONAL = [[1] * 5] * 5


@pytest.mark.parametrize("mask_function, expected", [(unimodal_mask, UNIMODAL), (multimodal_causal_mask, CAUSAL),
                                                     (bidirectional_mask, BIDIRECTIONAL)])
def test_masks_have_the_exact_blip2_patterns_and_never_attend_to_padding(mask_function, expected):
    expected = torch.tensor(expected, dtype=torch.bool)
    assert torch.equal(mask_function(2, 3), expected[None])
    assert torch.equal(mask_function(2, 3, torch.ones(1, 3, dtype=torch.bool)), expected[None])

    text_mask = torch.tensor([[True, True, True], [True, False, True]])  # row 1's t1 is padding
    padded = mask_function(2, 3, text_mask)
    assert padded.shape == (2, 5, 5)
    assert torch.equal(padded[0], expected)
    assert not padded[1, :, 3].any()  # nobody attends to the padded position
    keep = torch.tensor([0, 1, 2, 4])
    assert torch.equal(padded[1][:, keep], expected[:, keep])  # everything else is as without padding


# ---- no leaks ----------------------------------------------------------------------------------------------------
def test_itg_logits_see_only_earlier_tokens_and_the_image():
    model = tiny_pretrainer()
    features, text_ids, text_mask = tiny_batch()
    logits = model.itg_logits(features, text_ids, text_mask)
    assert logits.shape == (3, TEXT_LEN, VOCAB)
    for t in range(TEXT_LEN - 1):
        changed = text_ids.clone()
        changed[:, t:] = (changed[:, t:] + 1) % VOCAB
        after = model.itg_logits(features, changed, text_mask)
        # logits[:, p] predicts token p from tokens < p: changing tokens t.. leaves positions <= t as they were
        torch.testing.assert_close(after[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-6)
        assert (after[1:, t + 1] - logits[1:, t + 1]).abs().max() > 1e-3  # ...and the next position does see t

    other_image = model.itg_logits(features + torch.randn_like(features), text_ids, text_mask)
    assert (other_image - logits).abs().amax(dim=(0, 2)).min() > 1e-3  # every position reads the image


def test_itc_text_ignores_the_image_and_image_ignores_the_text():
    model = tiny_pretrainer()
    features, text_ids, text_mask = tiny_batch()
    image, text = model.itc_embeddings(features, text_ids, text_mask)
    assert image.shape == (3, QUERIES, 8) and text.shape == (3, 8)
    torch.testing.assert_close(image.norm(dim=-1), torch.ones(3, QUERIES))

    image_other, text_same = model.itc_embeddings(features + torch.randn_like(features), text_ids, text_mask)
    torch.testing.assert_close(text_same, text, rtol=0, atol=1e-6)
    assert (image_other - image).abs().max() > 1e-3

    other_ids = (text_ids + 1) % VOCAB
    image_same, text_other = model.itc_embeddings(features, other_ids, text_mask)
    torch.testing.assert_close(image_same, image, rtol=0, atol=1e-6)
    assert (text_other - text).abs().max() > 1e-3

    pad_changed = text_ids.clone()
    pad_changed[0, -2:] = (pad_changed[0, -2:] + 1) % VOCAB  # only caption 0's padded positions
    torch.testing.assert_close(model.itc_embeddings(features, pad_changed, text_mask)[1], text, rtol=0, atol=1e-6)

    feature_mask = torch.ones(3, 7, dtype=torch.bool)
    feature_mask[:, -2:] = False
    masked_image, _ = model.itc_embeddings(features, text_ids, text_mask, feature_mask)
    masked_changed = features.clone()
    masked_changed[:, -2:] += 5.0
    torch.testing.assert_close(model.itc_embeddings(masked_changed, text_ids, text_mask, feature_mask)[0],
                               masked_image, rtol=0, atol=1e-6)


# ---- gradients ---------------------------------------------------------------------------------------------------
STAGE_2_ONLY = ("qformer.to_language_model.",)  # BLIP-2's language projection: only stage 2 trains it


def test_one_backward_reaches_every_stage1_parameter_and_no_stage2_one():
    model = tiny_pretrainer()
    features, text_ids, text_mask = tiny_batch(batch=4)
    out = model(features, text_ids, text_mask)
    assert set(out) == {"itc", "itm", "itg", "loss", "itc_accuracy"}
    torch.testing.assert_close(out["loss"], out["itc"] + out["itm"] + out["itg"])
    out["loss"].backward()
    for name, parameter in model.named_parameters():
        if name.startswith(STAGE_2_ONLY):
            assert parameter.grad is None, name
        else:
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert any(name.startswith("qformer.layers.1.cross_attn") for name, _ in model.named_parameters())


# ---- hard negatives ----------------------------------------------------------------------------------------------
def test_hard_negatives_are_never_positive_and_follow_the_similarity():
    generator = torch.Generator().manual_seed(0)
    # the positives are by far the most similar: a sampler that ignored the exclusion would pick them
    similarity = torch.randn(5, 5, generator=generator) + 50 * torch.eye(5)
    pair_ids = torch.tensor([0, 0, 1, 1, 2])
    positive = pair_ids[:, None] == pair_ids[None, :]
    for _ in range(200):
        indices, has_negative = sample_hard_negatives(similarity, positive, generator)
        assert has_negative.all()
        assert not positive[torch.arange(5), indices].any()

    hard = torch.zeros(2, 4)
    hard[:, 3] = 4.0  # column 3 is the hardest negative of both rows
    picks = torch.stack([sample_hard_negatives(hard, torch.eye(2, 4, dtype=torch.bool), generator)[0]
                         for _ in range(400)])
    assert (picks == 3).float().mean() > 0.85  # softmax weight e^4 / (e^4 + 2) = 0.96

    _, has_negative = sample_hard_negatives(torch.randn(3, 3), torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]]).bool())
    assert has_negative.tolist() == [False, True, False]


def test_batches_without_negatives_raise_or_skip_itm():
    model = tiny_pretrainer()
    features, text_ids, text_mask = tiny_batch(batch=3)
    with pytest.raises(ValueError, match="at least 2 pairs"):
        model(features[:1], text_ids[:1], text_mask[:1])
    out = model(features, text_ids, text_mask, pair_ids=torch.zeros(3, dtype=torch.long))  # all the same pair
    assert out["itm"].item() == 0.0 and out["itc_accuracy"].item() == 1.0


# ---- training ----------------------------------------------------------------------------------------------------
CLASSES, PAD, A, PHOTO, OF = 10, 0, 1, 2, 3  # class c's word is token 4 + c


def synthetic_captions(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features = class prototype + noise (count, 16, 32); caption "a photo of <class>" or "a <class>" (padded)."""
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(CLASSES, 16, 32, generator=generator)
    labels = torch.randint(0, CLASSES, (count,), generator=generator)
    features = prototypes[labels] + torch.randn(count, 16, 32, generator=generator)
    short = torch.rand(count, generator=generator) < 0.5
    words = 4 + labels
    long_ids = torch.stack([torch.full_like(words, A), torch.full_like(words, PHOTO), torch.full_like(words, OF),
                            words], dim=1)
    short_ids = torch.stack([torch.full_like(words, A), words, torch.full_like(words, PAD),
                             torch.full_like(words, PAD)], dim=1)
    text_ids = torch.where(short[:, None], short_ids, long_ids)
    return features, text_ids, text_ids != PAD, labels


def test_stage1_learns_a_synthetic_captioning_task():
    features, text_ids, text_mask, labels = synthetic_captions(300, seed=0)
    torch.manual_seed(0)
    qformer = QFormer(32, 32, num_queries=4, depth=2, heads=2, out_dim=OUT_DIM)
    # pair_ids = the class: two images of one class with the same caption are not each other's negatives
    result = train_stage1(qformer, features, text_ids, text_mask, steps=200, batch_size=32, lr=5e-3, seed=0,
                          vocab_size=4 + CLASSES, pair_ids=labels, embed_dim=32)
    start, end = result["start"], result["end"]
    assert start["itc_accuracy"] < 0.25  # chance: about one in ten
    assert end["itc_accuracy"] > 0.8
    for name in ("itc", "itm", "itg"):
        assert end[name] < start[name], (name, start[name], end[name])
    # one positive per two negatives: predicting that frequency alone scores ln 3 - (2/3) ln 2 = 0.64
    assert end["itm"] < 0.45
    assert end["itg"] < 0.6 * start["itg"]
    assert result["steps"] == 200 and result["seconds"] > 0


def test_train_stage1_is_deterministic_and_leaves_a_stage2_ready_qformer():
    features, text_ids, text_mask, _ = synthetic_captions(24, seed=1)
    torch.manual_seed(0)
    qformer = QFormer(32, 16, num_queries=3, depth=1, heads=2, out_dim=OUT_DIM)
    twin = copy.deepcopy(qformer)
    before = copy.deepcopy(qformer.state_dict())
    logged: list[int] = []
    kwargs = dict(steps=3, batch_size=8, lr=1e-3, seed=5, vocab_size=4 + CLASSES, embed_dim=16)
    first = train_stage1(qformer, features, text_ids, text_mask, log=lambda step, _: logged.append(step), **kwargs)
    second = train_stage1(twin, features, text_ids, text_mask, **kwargs)
    assert logged == [0, 1, 2]
    assert first["start"] == second["start"] and first["end"] == second["end"]
    for name, tensor in qformer.state_dict().items():
        assert torch.equal(tensor, twin.state_dict()[name]), name

    assert first["pretrainer"].qformer is qformer  # the very module: stage 2 reads the trained weights
    assert not torch.equal(qformer.queries, before["queries"])
    assert qformer(features[:5]).shape == (5, 3, OUT_DIM)


def test_caption_pairs_take_one_image_documents_and_their_text_and_share_ids_between_equal_captions():
    from fusion_model.families.late.qformer_pretraining import caption_pairs

    bos, eos, boi, eoi = 1, 2, 3, 4
    row = [bos, 10, 11, boi, 20, 21, eoi, eos,  # caption -> image
           bos, boi, 22, 23, eoi, 10, 11, eos,  # image -> the same caption
           bos, boi, 24, 25, eoi, 12, boi, 26, 27, eoi, eos,  # two images: not a pair
           bos, 13, eos]  # no image
    documents = [0] * 8 + [1] * 8 + [2] * 11 + [3] * 3
    ids, docs = torch.tensor([row]), torch.tensor([documents])
    features = torch.zeros(1, len(row), 2)
    features[0, :, 0] = torch.arange(len(row)).float()  # each position's feature names the position
    pairs = caption_pairs(ids, docs, features, image_offset=20, image_codes=10, special_ids=[0, bos, eos, boi, eoi],
                          pad_id=0, max_text_len=8)
    assert pairs["text_ids"].tolist() == [[10, 11], [10, 11]]
    assert pairs["features"][:, :, 0].tolist() == [[4.0, 5.0], [10.0, 11.0]]
    assert pairs["feature_mask"].all() and pairs["text_mask"].all()
    assert pairs["pair_ids"].tolist() == [0, 0]  # the same caption: never each other's negative
    assert caption_pairs(ids[:, :8], docs[:, :8], features[:, :8], image_offset=20, image_codes=10,
                         special_ids=[0, bos, eos, boi, eoi], pad_id=0, max_text_len=8) is None  # one pair: none
