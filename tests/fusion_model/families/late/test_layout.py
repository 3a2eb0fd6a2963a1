"""late_layout: an early-fusion packed batch as each late-fusion connector sees it; the loss that ignores image
placeholders; LateFusionConfig's option checks."""

from __future__ import annotations

import pytest
import torch

from fusion_model.config import FusionConfig
from fusion_model.families.late.model import LateFusionConfig, LateFusionModel, late_layout
from fusion_model.layers.loss import fusion_loss_from_hidden
from fusion_model.model import FusionModel

# A small vocabulary: special ids, text 6..15, then 16 image codes (a 2x2 grid: 4 codes per image).
PAD, BOS, EOS, BOI, EOI, IMAGE = 0, 1, 2, 3, 4, 5
IMAGE_OFFSET, IMAGE_CODES = 16, 16
FEATURE_DIM = 3
VOCAB = 32

# Row 0: a caption -> image document, an image -> caption document, padding.
# Row 1: the end of a document whose image the row boundary cut (codes without their <boi>), then a document
# cut by the row's end in the middle of its image (a <boi> and 2 of the 4 codes).
ROWS = [
    [BOS, 6, 7, BOI, 16, 17, 18, 19, EOI, EOS, BOS, BOI, 20, 21, 22, 23, EOI, 8, 9, EOS, PAD, PAD],
    [24, 25, EOI, 10, EOS, BOS, 11, BOI, 26, 27] + [PAD] * 12,
]
DOCUMENTS = [[0] * 10 + [1] * 10 + [-1] * 2, [0] * 5 + [1] * 5 + [-1] * 12]
# (row, positions) of each image's codes in the early layout, in row-major order
IMAGES = [(0, [4, 5, 6, 7]), (0, [12, 13, 14, 15]), (1, [0, 1]), (1, [8, 9])]


def early_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, document_ids and image_features (B, T, C): each code position's feature names its (row, position)."""
    input_ids, document_ids = torch.tensor(ROWS), torch.tensor(DOCUMENTS)
    features = torch.zeros(*input_ids.shape, FEATURE_DIM)
    for row, positions in IMAGES:
        for position in positions:
            features[row, position] = torch.tensor([1.0 + row, 1.0 + position, float(input_ids[row, position])])
    return input_ids, document_ids, features


def config(kind: str, **options) -> LateFusionConfig:
    """The options train.py fit would give: the kind's first stage, this vocabulary's ids."""
    stage = 2 if kind == "qformer" else 1
    return LateFusionConfig(kind=kind, stage=stage, feature_dim=FEATURE_DIM, image_token_id=IMAGE, boi_id=BOI,
                            eoi_id=EOI, **options)


def layout(kind: str, **options) -> dict:
    """late_layout of the early batch above for one kind."""
    input_ids, document_ids, features = early_batch()
    return late_layout(input_ids, document_ids, features, config=config(kind, **options), image_offset=IMAGE_OFFSET,
                       image_codes=IMAGE_CODES, pad_id=PAD)


def late_model(kind: str, **options) -> LateFusionModel:
    """A tiny decoder behind a connector of `kind` reading FEATURE_DIM features."""
    decoder = FusionModel(FusionConfig.from_preset("tiny", vocab_size=VOCAB))
    return LateFusionModel(decoder, kind, IMAGE, feature_dim=FEATURE_DIM, connector_dim=32, **options)


def packed(rows: list[list[list[int]]], length: int) -> dict[str, list[list[int]]]:
    """Rows of documents -> input_ids, document_ids, position_ids padded to `length` (positions per document)."""
    ids, documents, positions = [], [], []
    for row in rows:
        ids.append([t for doc in row for t in doc] + [PAD] * (length - sum(map(len, row))))
        documents.append([d for d, doc in enumerate(row) for _ in doc] + [-1] * (length - sum(map(len, row))))
        positions.append([p for doc in row for p in range(len(doc))] + [0] * (length - sum(map(len, row))))
    return {"input_ids": ids, "document_ids": documents, "position_ids": positions}


I4, I6 = [IMAGE] * 4, [IMAGE] * 6
EXPECTED = {
    # one placeholder per code; the cut images keep the 2 patches their row holds; <boi>/<eoi> stay text
    "llava": ({}, packed([[[BOS, 6, 7, BOI, *I4, EOI, EOS], [BOS, BOI, *I4, EOI, 8, 9, EOS]],
                          [[IMAGE, IMAGE, EOI, 10, EOS], [BOS, 11, BOI, IMAGE, IMAGE]]], 20)),
    # every image, whole or cut, costs num_queries placeholders: 6 queries for 4 patches grow row 0 to 24
    "qformer": ({"num_queries": 6}, packed([[[BOS, 6, 7, BOI, *I6, EOI, EOS], [BOS, BOI, *I6, EOI, 8, 9, EOS]],
                                            [[*I6, EOI, 10, EOS], [BOS, 11, BOI, *I6]]], 24)),
    # <boi> codes <eoi> -> one marker; an image cut at either end is still one marker
    "flamingo": ({}, packed([[[BOS, 6, 7, IMAGE, EOS], [BOS, IMAGE, 8, 9, EOS]],
                             [[IMAGE, 10, EOS], [BOS, 11, IMAGE]]], 10)),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_kind_sees_the_packed_documents_in_its_own_layout(kind):
    options, expected = EXPECTED[kind]
    out = layout(kind, **options)
    for name, value in expected.items():
        assert out[name].tolist() == value, f"{kind} {name}"


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_features_are_gathered_per_image_and_a_cut_image_keeps_the_patches_its_row_holds(kind):
    out = layout(kind, **EXPECTED[kind][0])
    _, _, early_features = early_batch()
    features, mask = out["features"], out["feature_mask"]
    assert features.shape == (len(IMAGES), 4, FEATURE_DIM) and mask.shape == (len(IMAGES), 4)
    for image, (row, positions) in enumerate(IMAGES):
        assert mask[image].tolist() == [patch < len(positions) for patch in range(4)], image
        torch.testing.assert_close(features[image, : len(positions)], early_features[row, positions])
        assert not features[image, len(positions) :].any(), "patches the row does not hold are zero"
    assert features[2, 0].tolist() == [2.0, 1.0, 24.0]  # row 1's first code, cut from its <boi>


def test_images_are_numbered_in_row_major_order_even_two_in_one_document():
    two_images = [BOS, BOI, 16, 17, 18, 19, EOI, 6, BOI, 20, 21, 22, 23, EOI, EOS]
    input_ids = torch.tensor([[BOS, 7, EOS] + [PAD] * 12, two_images])
    document_ids = torch.tensor([[0, 0, 0] + [-1] * 12, [0] * 15])
    features = torch.zeros(2, 15, FEATURE_DIM)
    features[..., 0] = input_ids.float()  # each code position's feature names its code
    out = late_layout(input_ids, document_ids, features, config=config("flamingo"), image_offset=IMAGE_OFFSET,
                      image_codes=IMAGE_CODES)
    assert out["input_ids"].tolist() == [[BOS, 7, EOS, PAD, PAD], [BOS, IMAGE, 6, IMAGE, EOS]]
    assert out["features"][..., 0].tolist() == [[16, 17, 18, 19], [20, 21, 22, 23]]


def test_a_batch_without_images_keeps_its_text_and_runs_through_every_connector():
    input_ids = torch.tensor([[BOS, 6, 7, EOS, BOS, 8, EOS]])
    document_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    for kind in EXPECTED:
        late = config(kind, num_queries=3, num_latents=2)
        out = late_layout(input_ids, document_ids, torch.zeros(1, 7, FEATURE_DIM), config=late,
                          image_offset=IMAGE_OFFSET, image_codes=IMAGE_CODES)
        assert out["input_ids"].equal(input_ids) and out["features"].shape[0] == 0, kind
        model = late_model(kind, num_queries=3, num_latents=2)
        hidden = model.hidden(out["input_ids"], features=out["features"], feature_mask=out["feature_mask"],
                              document_ids=out["document_ids"], position_ids=out["position_ids"])
        assert hidden.shape == (1, 7, model.decoder.config.dim) and torch.isfinite(hidden).all(), kind


def test_llava_with_cut_images_places_each_real_patch_at_its_placeholder():
    out = layout("llava")
    model = late_model("llava").eval()
    features = torch.randn_like(out["features"])  # any values: the mask alone decides which patches are real
    with torch.no_grad():
        hidden = model.hidden(out["input_ids"], features=features, feature_mask=out["feature_mask"],
                              document_ids=out["document_ids"], position_ids=out["position_ids"])
        # by hand: the placeholders of each image, in the late layout, take its real patches' projections
        embeds = model.decoder.embed(out["input_ids"])
        late_positions = [(0, [4, 5, 6, 7]), (0, [12, 13, 14, 15]), (1, [0, 1]), (1, [8, 9])]
        for image, (row, positions) in enumerate(late_positions):
            embeds[row, positions] = model.connector(features[image, : len(positions)])
        expected = model.decoder.forward_hidden(out["input_ids"], out["position_ids"], out["document_ids"],
                                                inputs_embeds=embeds)
    torch.testing.assert_close(hidden, expected)
    with pytest.raises(ValueError, match="12 placeholder positions, but 4 images"):
        model.hidden(out["input_ids"], features=features, document_ids=out["document_ids"])  # without the mask


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_every_kinds_layout_runs_through_its_connector_with_finite_loss_and_gradient(kind):
    options = {"num_queries": 6, "num_latents": 2} if kind != "llava" else {}
    out = layout(kind, **EXPECTED[kind][0])
    model = late_model(kind, **options)
    hidden = model.hidden(out["input_ids"], features=out["features"], feature_mask=out["feature_mask"],
                          document_ids=out["document_ids"], position_ids=out["position_ids"])
    loss = fusion_loss_from_hidden(hidden, model.decoder.head.weight, out["input_ids"], out["document_ids"],
                                   image_offset=IMAGE_OFFSET, image_codes=IMAGE_CODES, z_loss_coef=1e-4,
                                   ignore_id=IMAGE)
    loss["loss"].backward()
    assert torch.isfinite(loss["loss"]) and int(loss["n_image_targets"]) == 0
    grads = [p.grad for p in model.connector.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_loss_ignoring_placeholders_is_cross_entropy_over_the_other_targets_by_hand():
    out = layout("llava")
    input_ids, document_ids = out["input_ids"], out["document_ids"]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(*input_ids.shape, 8, generator=generator)
    head = torch.randn(VOCAB, 8, generator=generator)
    z_loss_coef = 1e-2
    # chunks of 5 targets: the chunked path must agree with one pass
    got = fusion_loss_from_hidden(hidden, head, input_ids, document_ids, image_offset=IMAGE_OFFSET,
                                  image_codes=IMAGE_CODES, z_loss_coef=z_loss_coef, chunk_size=5, ignore_id=IMAGE)
    logits = hidden @ head.T
    ce, lse = [], []
    for row in range(input_ids.shape[0]):
        for t in range(input_ids.shape[1] - 1):
            same_document = document_ids[row, t] >= 0 and document_ids[row, t] == document_ids[row, t + 1]
            if same_document and input_ids[row, t + 1] != IMAGE:
                target = input_ids[row, t + 1]
                ce.append(torch.logsumexp(logits[row, t], 0) - logits[row, t, target])
                lse.append(torch.logsumexp(logits[row, t], 0))
    # row 0: 9 + 9 targets, less 2 x 4 placeholders; row 1: 4 + 4, less 1 + 2 placeholders
    assert len(ce) == 10 + 5 == int(got["n_text_targets"]) and int(got["n_image_targets"]) == 0
    ce, lse = torch.stack(ce), torch.stack(lse)
    torch.testing.assert_close(got["ce"], ce.mean())
    torch.testing.assert_close(got["loss"], ce.mean() + z_loss_coef * lse.pow(2).mean())
    without = fusion_loss_from_hidden(hidden, head, input_ids, document_ids, image_offset=IMAGE_OFFSET,
                                      image_codes=IMAGE_CODES, z_loss_coef=z_loss_coef)
    assert int(without["n_text_targets"]) == 10 + 5 + 11  # the placeholders would count as text targets


def test_late_fusion_config_names_unknown_options_kinds_and_stages():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['num_querys'\]"):
        LateFusionConfig.from_dict({"kind": "qformer", "stage": 2, "num_querys": 8})
    with pytest.raises(ValueError, match="kind 'blip'"):
        LateFusionConfig.from_dict({"kind": "blip"})
    with pytest.raises(ValueError, match=r"stage 3: llava trains in stage\(s\) \[1, 2\]"):
        LateFusionConfig.from_dict({"kind": "llava", "stage": 3})
    with pytest.raises(ValueError, match=r"stage 2: flamingo trains in stage\(s\) \[1\]"):
        LateFusionConfig.from_dict({"kind": "flamingo", "stage": 2})
    assert LateFusionConfig.from_dict({"kind": "flamingo", "num_latents": 8}).per_image == 1
