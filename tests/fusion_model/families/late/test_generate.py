"""`train.py generate` samples a late-fusion checkpoint: the picture goes through the frozen image tokenizer and the
trained connector, text comes out; the KV-cached path equals the full recompute; another image tokenizer is
refused."""

from __future__ import annotations

import pytest
import torch

from fusion_model import cli
from fusion_model.config import FusionConfig
from fusion_model.families.loading import load_family
from fusion_model.sampling import SamplingConfig
from fusion_model.training.lightning_module import FusionLightningModule
from tokenizer.image import ImageTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


@pytest.fixture(scope="module")
def files(tiny_tokenizers, tiny_vq_config):
    """The shared tiny vocabulary, image tokenizer and photo (tests/fusion_model/conftest.py), and a second image
    tokenizer with other weights."""
    torch.manual_seed(1)
    ImageTokenizer(tiny_vq_config).save_pretrained(tiny_tokenizers / "other-vq")
    return tiny_tokenizers


def late_checkpoint(files, family: str, **options) -> str:
    """A freshly initialised late-fusion checkpoint of `family`, recording the tokenizers' fingerprints."""
    from tokenizer.vocab import UnifiedVocab

    vocab = UnifiedVocab.load(files / "tokenizer.json")
    tokenizer = ImageTokenizer.from_pretrained(files / "vq")
    config = FusionConfig.from_preset("tiny", vocab_size=320, image_offset=vocab.image_offset, image_codes=16,
                                      max_seq_len=64)
    ids = {"feature_dim": tokenizer.config.embed_dim, "image_token_id": vocab.image_placeholder_id,
           "boi_id": vocab.boi_id, "eoi_id": vocab.eoi_id}
    torch.manual_seed(0)
    module = FusionLightningModule(config, family=family, family_options={**ids, **options},
                                   tokenizers={"vocab": vocab.fingerprint(), "image_tokenizer": tokenizer.fingerprint()})
    path = files / f"{family}.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return str(path)


@pytest.mark.parametrize("family, options", [("llava", {"stage": 2}), ("qformer", {"stage": 2, "num_queries": 3,
                                                                                     "depth": 1}),
                                              ("flamingo", {"num_latents": 2, "depth": 1})])
def test_generate_captions_a_picture_with_a_late_fusion_checkpoint(files, tmp_path, capsys, family, options):
    checkpoint = late_checkpoint(files, family, **options)
    out = tmp_path / "captions"
    argv = ["generate", "--checkpoint", checkpoint, "--vocab", str(files / "tokenizer.json"), "--image-tokenizer",
            str(files / "vq"), "--image", str(files / "photo.png"), "--prompt", "the cat", "--max-new-tokens", "6",
            "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "prompt: <image:" in printed and "the cat" in printed and "output: " in printed
    assert "1 samples, 0 generated image files" in printed
    assert (out / "samples.json").is_file() and (out / "index.html").is_file()


def test_the_cached_prefill_and_decode_give_the_full_recomputes_tokens(files):
    from tokenizer.vocab import UnifiedVocab

    vocab = UnifiedVocab.load(files / "tokenizer.json")
    tokenizer = ImageTokenizer.from_pretrained(files / "vq")
    for family, options in (("llava", {"stage": 2}), ("qformer", {"stage": 2, "num_queries": 3, "depth": 1})):
        loaded = load_family(late_checkpoint(files, family, **options))
        prompts = [[files / "photo.png", "the cat"], ["a dog", files / "photo.png"]]
        results = []
        for cache in (True, False):
            config = SamplingConfig(mode="text", max_new_tokens=8, text_temperature=0, use_kv_cache=cache)
            results.append(loaded.family.generate(loaded.parts, vocab, tokenizer, prompts, config)[1])
        assert results[0] == results[1], family
        assert all(len(ids) > 0 for ids in results[0])


@pytest.mark.parametrize("family, options", [("llava", {"stage": 2}), ("flamingo", {"num_latents": 2, "depth": 1})])
def test_a_batch_of_prompts_with_and_without_images_answers_each_as_alone(files, family, options):
    from tokenizer.vocab import UnifiedVocab

    vocab = UnifiedVocab.load(files / "tokenizer.json")
    tokenizer = ImageTokenizer.from_pretrained(files / "vq")
    loaded = load_family(late_checkpoint(files, family, **options))
    prompts = [["what comes after three?"], [files / "photo.png", "the cat"]]
    config = SamplingConfig(mode="text", max_new_tokens=6, text_temperature=0)
    together = loaded.family.generate(loaded.parts, vocab, tokenizer, prompts, config)[1]
    alone = [loaded.family.generate(loaded.parts, vocab, tokenizer, [prompt], config)[1][0] for prompt in prompts]
    assert together == alone


def test_another_image_tokenizer_or_an_image_mode_is_refused_in_one_line(files, tmp_path, capsys):
    checkpoint = late_checkpoint(files, "llava", stage=1)
    base = ["generate", "--checkpoint", checkpoint, "--vocab", str(files / "tokenizer.json"), "--image",
            str(files / "photo.png"), "--out", str(tmp_path / "x")]
    assert cli.main([*base, "--image-tokenizer", str(files / "other-vq")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "another image tokenizer" in err and "--image-tokenizer" in err
    assert cli.main([*base, "--image-tokenizer", str(files / "vq"), "--mode", "image"]) == 2
    assert "writes text only" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
