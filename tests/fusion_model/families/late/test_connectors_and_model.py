"""Late-fusion connectors: closed gates keep the decoder exact, media masks, stages freeze the right parts, loss."""

import pytest
import torch

from fusion_model.config import FusionConfig
from fusion_model.families.late.connectors import (
    GatedCrossAttention,
    LlavaProjector,
    PerceiverResampler,
    QFormer,
    media_index,
    media_mask,
)
from fusion_model.families.late.model import LateFusionModel, frozen_image_features, set_stage
from fusion_model.model import FusionModel
from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.image.image_tokenizer import ImageTokenizer

VOCAB = 64
IMAGE = 63  # the placeholder / marker id
FEATURE_DIM = 12


def tiny_decoder() -> FusionModel:
    return FusionModel(FusionConfig.from_preset("tiny", vocab_size=VOCAB))


def tiny_tokenizer() -> ImageTokenizer:
    # photos-64's network at 32 px: 8 px per code, so a 4x4 grid of 32-d features
    return ImageTokenizer(ImageTokenizerConfig.from_preset("photos-64", image_size=32))


def late_model(kind: str, **kwargs) -> LateFusionModel:
    defaults = dict(feature_dim=FEATURE_DIM, patches_per_image=5, num_latents=3, num_queries=4, connector_dim=32)
    return LateFusionModel(tiny_decoder(), kind, IMAGE, **{**defaults, **kwargs})


def interleaved_ids(model: LateFusionModel, layout: list[list[int | str]]) -> torch.Tensor:
    """Rows of token ids where "img" expands to one image's positions (a run, or Flamingo's single marker)."""
    per_image = max(model.image_tokens_in_context, 1)
    rows = [[t for item in row for t in ([IMAGE] * per_image if item == "img" else [item])] for row in layout]
    return torch.tensor(rows)


LAYOUT = [[1, 2, "img", 3, 4, 5, "img", 6, 7], [8, "img", 9, 10, 11, 12, 13, "img", 14]]  # 4 images in all


def open_gates(model: LateFusionModel, value: float = 0.5) -> None:
    with torch.no_grad():
        for layer in model.connector.gated:
            layer.alpha_attn.fill_(value)
            layer.alpha_ff.fill_(value)


def test_flamingo_with_closed_gates_returns_exactly_the_frozen_decoders_logits():
    model = late_model("flamingo")
    set_stage(model, 1)
    input_ids = interleaved_ids(model, LAYOUT)
    features = torch.randn(4, 5, FEATURE_DIM)
    with torch.no_grad():
        expected = model.decoder(input_ids)
        fused = model(input_ids, features=features)
        torch.testing.assert_close(fused, expected, rtol=0, atol=0)
        open_gates(model)  # the gated layers are really in the path: opening them changes the logits
        assert not torch.allclose(model(input_ids, features=features), expected, atol=1e-4)


@pytest.mark.parametrize("num_features", [1, 7, 64])
def test_perceiver_resampler_returns_k_latents_for_any_number_of_features(num_features):
    resampler = PerceiverResampler(FEATURE_DIM, 32, num_latents=6, depth=2, heads=4)
    out = resampler(torch.randn(3, num_features, FEATURE_DIM))
    assert out.shape == (3, 6, 32)
    assert torch.isfinite(out).all()


def test_perceiver_resampler_ignores_masked_padding_features():
    resampler = PerceiverResampler(FEATURE_DIM, 32, num_latents=6).eval()
    real = torch.randn(1, 7, FEATURE_DIM)
    padded = torch.cat([real, 100 * torch.randn(1, 5, FEATURE_DIM)], dim=1)
    mask = torch.arange(12)[None] < 7
    torch.testing.assert_close(resampler(padded, mask), resampler(real), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(resampler(padded), resampler(real), atol=1e-3)


def test_media_mask_lets_each_text_token_see_only_the_image_just_before_it():
    ids = torch.tensor([[1, 2, IMAGE, 3, 4, IMAGE, 5, 6]])
    index = media_index(ids, IMAGE)
    assert index.tolist() == [[-1, -1, 0, 0, 0, 1, 1, 1]]
    mask = media_mask(index, 2)
    assert mask.shape == (1, 8, 2)
    assert mask[0].tolist() == [[False, False], [False, False], [True, False], [True, False], [True, False],
                                [False, True], [False, True], [False, True]]


def test_media_index_does_not_carry_an_image_into_the_next_packed_document():
    ids = torch.tensor([[IMAGE, 1, 2, 3, IMAGE, 4, 5]])
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, -1]])
    assert media_index(ids, IMAGE, documents).tolist() == [[0, 0, 0, -1, 1, 1, -1]]


def test_cross_attention_gives_text_before_the_first_image_exactly_zero_and_each_token_only_its_image():
    layer = GatedCrossAttention(dim=16, media_dim=8, heads=2)
    with torch.no_grad():
        layer.alpha_attn.fill_(1.0)  # attention path open, FFN path closed: x' - x is the cross-attention alone
    ids = torch.tensor([[1, 2, IMAGE, 3, 4, IMAGE, 5, 6]])
    mask = media_mask(media_index(ids, IMAGE), 2)
    x = torch.randn(1, 8, 16)
    media = torch.randn(1, 2, 3, 8)  # 2 images, 3 latents each
    with torch.no_grad():
        delta = layer(x, media, mask) - x
        changed_second = media.clone()
        changed_second[:, 1] += 1.0
        delta_changed = layer(x, changed_second, mask) - x
    assert torch.equal(delta[0, :2], torch.zeros(2, 16))  # exactly zero, not NaN
    assert (delta[0, 2:].abs().sum(-1) > 0).all()
    torch.testing.assert_close(delta_changed[0, :5], delta[0, :5], rtol=0, atol=0)  # tokens of image 0
    assert (delta_changed[0, 5:] - delta[0, 5:]).abs().sum(-1).min() > 0  # tokens of image 1


@pytest.mark.parametrize(("kind", "stage", "decoder_trains"),
                         [("llava", 1, False), ("llava", 2, True), ("qformer", 2, False), ("flamingo", 1, False)])
def test_one_step_in_a_stage_trains_the_connector_and_leaves_frozen_parts_untouched(kind, stage, decoder_trains):
    model = late_model(kind)
    trainable = set_stage(model, stage)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    input_ids = interleaved_ids(model, LAYOUT)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model.train()
    model(input_ids, features=torch.randn(4, 5, FEATURE_DIM), return_loss=True).backward()
    optimizer.step()
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        if name.startswith("connector."):
            assert p.grad is not None, name
        elif decoder_trains:
            assert p.requires_grad and p.grad is not None, name
        else:
            assert p.grad is None and not p.requires_grad and not changed, name
    connector_changed = [not torch.equal(p, before[f"connector.{n}"]) for n, p in model.connector.named_parameters()]
    assert any(connector_changed)
    decoder_changed = [not torch.equal(p, before[f"decoder.{n}"]) for n, p in model.decoder.named_parameters()]
    assert any(decoder_changed) == decoder_trains
    assert model.decoder.training == decoder_trains  # a frozen decoder runs in eval mode (no dropout)
    if kind == "flamingo":  # gates open first: with alpha 0 only the alphas get a non-zero gradient
        assert all(float(layer.alpha_attn.detach()) != 0 for layer in model.connector.gated)


def test_the_tokenizer_stays_frozen_in_every_stage():
    tokenizer = tiny_tokenizer()
    model = LateFusionModel(tiny_decoder(), "llava", IMAGE, tokenizer=tokenizer)
    set_stage(model, 2)
    model.train()
    assert not tokenizer.training and not any(p.requires_grad for p in tokenizer.parameters())


@pytest.mark.parametrize("kind", ["llava", "qformer", "flamingo"])
def test_loss_with_image_positions_ignored_equals_cross_entropy_over_text_targets_only(kind):
    model = late_model(kind)
    input_ids = interleaved_ids(model, LAYOUT)
    features = torch.randn(4, 5, FEATURE_DIM)
    if kind == "flamingo":
        open_gates(model)
    with torch.no_grad():
        logits = model(input_ids, features=features)
        loss = model(input_ids, features=features, return_loss=True)
    # by hand: every position t whose next token is text predicts it; nothing else counts
    log_probs = logits.log_softmax(-1)
    terms = [-log_probs[b, t, input_ids[b, t + 1]] for b in range(input_ids.shape[0])
             for t in range(input_ids.shape[1] - 1) if input_ids[b, t + 1] != IMAGE]
    assert len(terms) == sum(1 for row in LAYOUT for item in row[1:] if item != "img")
    torch.testing.assert_close(loss, torch.stack(terms).mean())


def test_loss_does_not_predict_across_packed_documents():
    model = late_model("llava")
    input_ids = interleaved_ids(model, [[1, "img", 2, 3, 4, 5]])  # 1, 5 image positions, 2, 3, 4, 5
    documents = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 1, 1]])
    features = torch.randn(1, 5, FEATURE_DIM)
    with torch.no_grad():
        log_probs = model(input_ids, features=features, document_ids=documents).log_softmax(-1)
        loss = model(input_ids, features=features, document_ids=documents, return_loss=True)
    # targets: 2 (from the last image position) and 3 in document 0, then 5 in document 1; 4 starts document 1
    expected = -(log_probs[0, 5, 2] + log_probs[0, 6, 3] + log_probs[0, 8, 5]) / 3
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize(("kind", "stage_one", "stage_two"), [("llava", 1, 2), ("qformer", 2, 2), ("flamingo", 1, 1)])
def test_stage_two_starts_from_the_stage_one_connector(kind, stage_one, stage_two):
    first = late_model(kind)
    optimizer = torch.optim.AdamW(set_stage(first, stage_one), lr=1e-2)
    input_ids = interleaved_ids(first, LAYOUT)
    first(input_ids, features=torch.randn(4, 5, FEATURE_DIM), return_loss=True).backward()
    optimizer.step()
    saved = first.connector_state_dict()

    second = late_model(kind)
    assert any(not torch.equal(v, second.connector.state_dict()[k]) for k, v in saved.items())
    second.load_connector_state_dict(saved)
    set_stage(second, stage_two)
    for name, tensor in second.connector.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    with torch.no_grad():  # the saved copy does not alias the first model's weights
        next(first.connector.parameters()).add_(1.0)
    assert all(torch.equal(v, second.connector.state_dict()[k]) for k, v in saved.items())


def test_llava_decoder_sees_h_times_w_projected_patches_per_image_and_the_projector_gets_gradient():
    tokenizer = tiny_tokenizer()
    model = LateFusionModel(tiny_decoder(), "llava", IMAGE, tokenizer=tokenizer)
    set_stage(model, 1)
    rows, columns = tokenizer.grid_shape
    assert model.image_tokens_in_context == rows * columns == 16
    input_ids = interleaved_ids(model, [[1, 2, "img", 3], [4, "img", 5, 6]])
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    seen = {}

    def record_first_block_input(module, args):
        seen["x"] = args[0].detach()

    model.decoder.layers[0].register_forward_pre_hook(record_first_block_input)
    model(input_ids, pixels, return_loss=True).backward()

    x = seen["x"]
    assert x.shape == (2, 3 + 16, model.decoder.config.dim)
    with torch.no_grad():
        projected = model.connector(frozen_image_features(tokenizer, pixels))  # (2, 16, dim)
    is_image = input_ids == IMAGE
    assert is_image.sum(1).tolist() == [16, 16]
    torch.testing.assert_close(x[is_image].view(2, 16, -1), projected)
    torch.testing.assert_close(x[~is_image], model.decoder.embed(input_ids[~is_image]).detach())
    grads = [p.grad for p in model.connector.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_frozen_image_features_are_the_encoder_grid_flattened_row_major_without_gradient():
    tokenizer = tiny_tokenizer()
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    features = frozen_image_features(tokenizer, pixels)
    latents = tokenizer.encode_latents(pixels)
    assert features.shape == (2, 16, tokenizer.config.embed_dim)
    assert not features.requires_grad
    torch.testing.assert_close(features[:, 1 * 4 + 2], latents[:, :, 1, 2].detach())


def test_qformer_returns_m_queries_at_the_language_model_width_for_any_feature_count():
    qformer = QFormer(FEATURE_DIM, 32, num_queries=5, depth=2, heads=4, out_dim=48)
    for num_features in (1, 16):
        assert qformer(torch.randn(2, num_features, FEATURE_DIM)).shape == (2, 5, 48)


def test_image_cost_in_context_and_added_parameters_per_kind():
    dim = FusionConfig.from_preset("tiny").dim
    llava, qformer, flamingo = late_model("llava"), late_model("qformer"), late_model("flamingo")
    assert (llava.image_tokens_in_context, qformer.image_tokens_in_context, flamingo.image_tokens_in_context) == (
        5, 4, 0)
    assert llava.parameters_added() == (FEATURE_DIM * dim + dim) + (dim * dim + dim)
    assert llava.parameters_added() == sum(p.numel() for p in LlavaProjector(FEATURE_DIM, dim).parameters())
    decoder_size = llava.decoder.num_parameters()
    for model in (llava, qformer, flamingo):
        assert sum(p.numel() for p in model.parameters()) == decoder_size + model.parameters_added()


def test_mismatched_images_and_placeholders_and_unknown_stages_are_errors():
    model = late_model("llava")
    input_ids = interleaved_ids(model, [[1, "img", 2]])
    with pytest.raises(ValueError, match="placeholder positions"):
        model(input_ids, features=torch.randn(2, 5, FEATURE_DIM))
    with pytest.raises(ValueError, match=r"flamingo has stages \[1\], not 2"):
        set_stage(late_model("flamingo"), 2)
    with pytest.raises(ValueError, match="kind"):
        late_model("blip3")


def test_flamingo_rows_with_different_image_counts_match_running_each_row_alone():
    model = late_model("flamingo")
    open_gates(model)
    input_ids = interleaved_ids(model, [[1, "img", 2, 3, "img", 4], [5, 6, 7, "img", 8, 9]])
    features = torch.randn(3, 5, FEATURE_DIM)
    with torch.no_grad():
        together = model(input_ids, features=features)
        first = model(input_ids[:1], features=features[:2])
        second = model(input_ids[1:], features=features[2:])
    # the second row's empty media slot (zero padding) must stay invisible, as if the row ran alone
    torch.testing.assert_close(together, torch.cat([first, second]), rtol=1e-5, atol=1e-5)
