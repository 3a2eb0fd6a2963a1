"""Equivalence with transformers' Chameleon at equal weights; parameter counts; import/export round trips."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is the parity reference")
from transformers import ChameleonConfig, ChameleonForConditionalGeneration, ChameleonModel  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from fusion_model.cli.convert import main as convert_main  # noqa: E402
from fusion_model.config import FusionConfig  # noqa: E402
from fusion_model.hf_convert import (  # noqa: E402
    PLACEHOLDER_VQ_CONFIG,
    from_transformers,
    image_block,
    to_transformers,
)
from fusion_model.model import FusionModel  # noqa: E402
from tokenizer.vocab import image_token_name  # noqa: E402

hf_logging.set_verbosity_error()  # exports without an image tokenizer leave the VQ encoder uninitialised

VOCAB, OFFSET, CODES = 256, 100, 64
VOCABULARY_MAP = {"<pad>": 0, "<s>": 1, "</s>": 2, "<image>": 3, **{image_token_name(k): OFFSET + k for k in range(CODES)}}


def hf_model(swin: bool, kv_heads: int, cls=ChameleonForConditionalGeneration):
    config = ChameleonConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=64, swin_norm=swin, vocabulary_map=VOCABULARY_MAP,
        vq_config=PLACEHOLDER_VQ_CONFIG,
    )
    model = cls(config).eval()
    with torch.no_grad():  # norms start at 1/0: perturb them so a mis-mapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def mixed_ids(batch=2, length=24):
    """Text, then an image block of codes, then text."""
    ids = torch.randint(4, OFFSET, (batch, length))
    ids[:, 6:18] = torch.randint(OFFSET, OFFSET + CODES, (batch, 12))
    return ids


def meta_count(module) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if "vqmodel" not in n)


@pytest.mark.parametrize("preset", ["chameleon-7b", "chameleon-34b"])
def test_parameter_count_closed_form_ours_and_transformers_agree(preset):
    config = FusionConfig.from_preset(preset)
    hf_config = ChameleonConfig(
        hidden_size=config.dim, intermediate_size=config.hidden_dim, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.kv_heads, vocabulary_map={},
    )
    with torch.device("meta"):
        ours = FusionModel(config)
        theirs = ChameleonForConditionalGeneration(hf_config)
    assert config.num_parameters() == ours.num_parameters() == meta_count(theirs)
    if preset == "chameleon-7b":
        assert config.num_parameters() == 7_013_666_816


def test_image_block_is_read_from_the_vocabulary_map():
    assert image_block(VOCABULARY_MAP) == (OFFSET, CODES)
    assert image_block({"<s>": 1}) == (None, None)
    assert image_token_name(123) == "IMGIMGBCDZ"


@pytest.mark.parametrize("swin", [False, True], ids=["pre", "swin"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_same_function_as_transformers_at_equal_weights(swin, kv_heads):
    reference = hf_model(swin, kv_heads)
    ours = from_transformers(reference).eval()
    assert ours.config.norm_placement == ("swin" if swin else "pre") and ours.config.kv_heads == kv_heads
    assert (ours.config.image_offset, ours.config.image_codes) == (OFFSET, CODES)
    ids = mixed_ids()
    with torch.no_grad():
        expected_hidden = reference.model(input_ids=ids).last_hidden_state
        expected_logits = reference(input_ids=ids).logits
        hidden, logits = ours.forward_hidden(ids), ours(ids)
    torch.testing.assert_close(hidden, expected_hidden)
    # transformers forces image-code logits to the dtype minimum; every other column must match
    text_columns = torch.ones(VOCAB, dtype=torch.bool)
    text_columns[OFFSET : OFFSET + CODES] = False
    torch.testing.assert_close(logits[..., text_columns], expected_logits[..., text_columns])


def test_bare_chameleon_model_imports_with_equal_hidden_states():
    reference = hf_model(False, 2, cls=ChameleonModel)
    ours = from_transformers(reference).eval()
    ids = mixed_ids(1, 20)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_hidden(ids), reference(input_ids=ids).last_hidden_state)


def test_packed_row_equals_transformers_on_each_document():
    reference = hf_model(True, 2)
    ours = from_transformers(reference).eval()
    a, b = mixed_ids(1, 20), mixed_ids(1, 24)
    docs = torch.tensor([[0] * 20 + [1] * 24])
    with torch.no_grad():
        packed = ours.forward_hidden(torch.cat([a, b], dim=1), document_ids=docs)
        torch.testing.assert_close(packed[:, :20], reference.model(input_ids=a).last_hidden_state)
        torch.testing.assert_close(packed[:, 20:], reference.model(input_ids=b).last_hidden_state)


def test_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    ours = FusionModel(FusionConfig.from_preset("tiny", image_offset=OFFSET, image_codes=CODES)).eval()
    to_transformers(ours, tmp_path)
    loaded = ChameleonForConditionalGeneration.from_pretrained(tmp_path, local_files_only=True).eval()
    ids = mixed_ids()
    with torch.no_grad():
        expected, got = ours(ids), loaded(input_ids=ids).logits
        torch.testing.assert_close(ours.forward_hidden(ids), loaded.model(input_ids=ids).last_hidden_state)
    torch.testing.assert_close(got[..., :OFFSET], expected[..., :OFFSET])
    assert (got[..., OFFSET : OFFSET + CODES] == torch.finfo(got.dtype).min).all()  # the map names our image block


def test_import_then_export_is_exact(tmp_path):
    reference = hf_model(False, 2)
    to_transformers(from_transformers(reference), tmp_path)
    from safetensors.torch import load_file

    written = load_file(tmp_path / "model.safetensors")
    expected = {k: v for k, v in reference.state_dict().items() if "vqmodel" not in k}
    assert set(written) == set(expected)
    for key, value in expected.items():
        assert torch.equal(written[key], value), key


def test_export_includes_the_vq_encoder_of_a_chameleon_vqvae(tmp_path):
    reference = hf_model(False, 4)
    ours = from_transformers(reference)
    to_transformers(ours, tmp_path, image_tokenizer=reference.model.vqmodel)
    loaded = ChameleonForConditionalGeneration.from_pretrained(tmp_path, local_files_only=True)
    for key, value in reference.model.vqmodel.state_dict().items():
        assert torch.equal(loaded.model.vqmodel.state_dict()[key], value), key


def test_export_rejects_an_image_tokenizer_it_cannot_map(tmp_path):
    ours = FusionModel(FusionConfig.from_preset("tiny"))
    with pytest.raises(TypeError, match="Chameleon-layout"):
        to_transformers(ours, tmp_path, image_tokenizer=torch.nn.Linear(2, 2))


def test_convert_cli_import_and_export_round_trip(tmp_path, capsys):
    reference = hf_model(True, 2)
    reference.save_pretrained(tmp_path / "hf")
    assert convert_main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "model.ckpt")]) == 0
    assert convert_main(["export", "--checkpoint", str(tmp_path / "model.ckpt"), "--out", str(tmp_path / "out")]) == 0
    loaded = ChameleonForConditionalGeneration.from_pretrained(tmp_path / "out", local_files_only=True).eval()
    ids = mixed_ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, reference(input_ids=ids).logits)
    from fusion_model import cli  # through the dispatcher: bad input exits 2

    assert cli.main(["convert", "export", "--checkpoint", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_export_includes_the_vq_encoder_of_our_chameleon_layout_image_tokenizer(tmp_path):
    from tokenizer.image import ImageTokenizer

    reference = hf_model(False, 2)
    image_tokenizer = ImageTokenizer.from_transformers(reference.model.vqmodel)
    to_transformers(from_transformers(reference), tmp_path, image_tokenizer=image_tokenizer)
    loaded = ChameleonForConditionalGeneration.from_pretrained(tmp_path, local_files_only=True)
    exported = loaded.model.vqmodel.state_dict()
    for key, value in reference.model.vqmodel.state_dict().items():
        torch.testing.assert_close(exported[key], value, msg=key)


def test_export_with_the_unified_vocabulary_names_every_token(tmp_path):
    from tokenizer.vocab import train_unified_vocab

    vocab = train_unified_vocab(["a small gray cat sat on the mat"] * 20, vocab_size=512, image_codes=128)
    config = FusionConfig.from_preset("tiny", vocab_size=vocab.vocab_size, image_offset=vocab.image_offset,
                                      image_codes=vocab.image_codes)
    to_transformers(FusionModel(config), tmp_path, vocab=vocab)
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = ChameleonForConditionalGeneration.from_pretrained(tmp_path, local_files_only=True)
    assert len(loaded.config.vocabulary_map) == vocab.vocab_size
    assert loaded.model.vocabulary_mapping.image_tokens == list(range(vocab.image_offset, vocab.image_offset + 128))
    assert loaded.config.image_token_id == vocab.image_placeholder_id
