"""The Mixture-of-Transformers block: dense when its copies are equal, each modality's weights reached only by its
tokens, closed-form sizes, and its options refused when wrong."""

import pytest
import torch

from fusion_model.blocks.mot import MODALITIES, MoTBlock
from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel, modality_groups

IMAGE_OFFSET, IMAGE_CODES = 100, 64
ABLATION = [{"attention": False, "norms": False}, {"norms": False}, {}]  # FFN; FFN + attention; all three


def tiny(**overrides) -> FusionConfig:
    return FusionConfig.from_preset("tiny", image_offset=IMAGE_OFFSET, image_codes=IMAGE_CODES, **overrides)


def mixed_ids(seed: int = 0) -> torch.Tensor:
    """Two rows of text ids with an image run in each (and a <boi>/<eoi>-like special before and after it)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, IMAGE_OFFSET, (2, 24), generator=generator)
    ids[0, 5:13] = torch.randint(IMAGE_OFFSET, IMAGE_OFFSET + IMAGE_CODES, (8,), generator=generator)
    ids[1, 12:20] = torch.randint(IMAGE_OFFSET, IMAGE_OFFSET + IMAGE_CODES, (8,), generator=generator)
    return ids


def dense_model(**overrides) -> FusionModel:
    torch.manual_seed(0)
    model = FusionModel(tiny(**overrides))
    with torch.no_grad():  # norms away from the identity, so a norm copied to the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def mot_copy_of(dense: FusionModel, block_options: dict) -> FusionModel:
    """A MoT model whose every modality copy holds the dense model's weight."""
    import dataclasses

    mot = FusionModel(dataclasses.replace(dense.config, block="mot", block_options=block_options))
    dense_weights = dense.state_dict()
    mot.load_state_dict({name: dense_weights[MoTBlock.dense_name(name)] for name in mot.state_dict()})
    return mot


@pytest.mark.parametrize("placement", ["pre", "swin"])
@pytest.mark.parametrize("block_options", ABLATION)
def test_mot_with_equal_copies_computes_the_dense_model(placement, block_options):
    dense = dense_model(norm_placement=placement).eval()
    mot = mot_copy_of(dense, block_options).eval()
    ids = mixed_ids()
    torch.testing.assert_close(mot(ids), dense(ids))


def test_mot_with_equal_copies_matches_dense_on_packed_documents_and_in_the_kv_cache():
    dense = dense_model().eval()
    mot = mot_copy_of(dense, {}).eval()
    ids = mixed_ids()
    documents = torch.tensor([[0] * 10 + [1] * 14, [0] * 20 + [-1] * 4])
    torch.testing.assert_close(mot(ids, document_ids=documents), dense(ids, document_ids=documents))
    cache = mot.new_kv_cache(2, max_len=32)
    chunks = [mot(ids[:, :7], kv_cache=cache), mot(ids[:, 7:8], kv_cache=cache), mot(ids[:, 8:], kv_cache=cache)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), dense(ids))


def test_each_modality_runs_its_own_weights_only():
    """Changing the image copy changes image tokens' outputs and leaves a text-only row's exactly unchanged."""
    dense = dense_model().eval()
    mot = mot_copy_of(dense, {}).eval()
    text_only = torch.randint(0, IMAGE_OFFSET, (1, 24))
    ids = torch.cat([text_only, mixed_ids()[:1]])
    before = mot(ids)
    with torch.no_grad():
        for name, p in mot.named_parameters():
            if ".image." in name:
                p.mul_(1.5)
    after = mot(ids)
    assert torch.equal(after[0], before[0])
    assert not torch.allclose(after[1], before[1])


def test_text_only_rows_give_image_weights_exactly_zero_gradients():
    model = FusionModel(tiny(block="mot"))
    model(torch.randint(0, IMAGE_OFFSET, (2, 24))).logsumexp(-1).sum().backward()
    image = {name: p.grad for name, p in model.named_parameters() if ".image." in name}
    assert image and all(grad is not None and torch.count_nonzero(grad) == 0 for grad in image.values())
    text = {name: p.grad for name, p in model.named_parameters() if ".text." in name}
    assert all(torch.count_nonzero(grad) > 0 for grad in text.values())


def test_mixed_rows_reach_every_parameter():
    model = FusionModel(tiny(block="mot"))
    model(mixed_ids()).logsumexp(-1).sum().backward()
    unreached = [name for name, p in model.named_parameters() if p.grad is None or torch.count_nonzero(p.grad) == 0]
    assert unreached == []


def test_boi_eoi_and_specials_count_as_text():
    config = tiny(block="mot")
    ids = torch.tensor([[0, 1, 2, IMAGE_OFFSET - 1, IMAGE_OFFSET, IMAGE_OFFSET + IMAGE_CODES - 1, IMAGE_OFFSET + IMAGE_CODES]])
    text, image = modality_groups(ids, config)
    assert text.tolist() == [0, 1, 2, 3, 6] and image.tolist() == [4, 5]


@pytest.mark.parametrize("block_options", ABLATION + [{"ffn": False, "attention": False, "norms": False}])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_parameter_formula_counts_the_module(block_options, qk_norm):
    config = tiny(block="mot", block_options=block_options, qk_norm=qk_norm)
    dense = tiny(qk_norm=qk_norm)
    assert FusionModel(config).num_parameters() == config.num_parameters()
    parts = dense.layer_part_parameters()
    separate = {"attention": block_options.get("attention", True), "ffn": block_options.get("ffn", True),
                "norms": block_options.get("norms", True), "qk_norm": block_options.get("norms", True)}
    extra = sum(size for part, size in parts.items() if separate[part])  # one more copy of each separate part
    assert config.num_parameters() == dense.num_parameters() + config.n_layers * extra


def test_active_parameters_and_flops_per_token_equal_the_dense_models():
    config, dense = tiny(block="mot"), tiny()
    assert config.active_parameters() == dense.num_parameters()
    assert config.flops_per_token(64) == dense.flops_per_token(64)
    assert config.num_parameters() > dense.num_parameters()


def test_chameleon_7b_mot_sizes_in_closed_form():
    """At 7B every layer's weights double except the embeddings, head and final norm (checked on the meta device)."""
    config = FusionConfig.from_preset("chameleon-7b", image_offset=4, image_codes=8192, block="mot")
    with torch.device("meta"):
        model = FusionModel(config)
    assert model.num_parameters() == config.num_parameters()
    dense = FusionConfig.from_preset("chameleon-7b")
    assert config.num_parameters() - dense.num_parameters() == dense.num_parameters(embeddings=False) - dense.dim


def test_dense_name_strips_the_modality():
    assert MoTBlock.dense_name("layers.3.mlp.image.down.weight") == "layers.3.mlp.down.weight"
    assert MoTBlock.dense_name("layers.0.attn.q_norm.text.bias") == "layers.0.attn.q_norm.bias"
    assert MoTBlock.dense_name("layers.0.attn.qkv.weight") == "layers.0.attn.qkv.weight"
    assert MODALITIES == ("text", "image")


def test_bad_options_are_refused_with_their_names():
    with pytest.raises(ValueError, match=r"no option \['mlp'\].*block_options"):
        tiny(block="mot", block_options={"mlp": True})
    with pytest.raises(ValueError, match="block_options.ffn"):
        tiny(block="mot", block_options={"ffn": "yes"})
    with pytest.raises(ValueError, match="image block"):
        FusionConfig.from_preset("tiny", block="mot")
    with pytest.raises(ValueError, match="takes no block_options"):
        tiny(block_options={"ffn": False})


def test_config_round_trips_through_a_dict():
    config = tiny(block="mot", block_options={"norms": False})
    assert FusionConfig.from_dict(config.to_dict()) == config
