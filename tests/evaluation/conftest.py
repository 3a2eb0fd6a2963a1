"""The evaluation tests' shared world: a digits vocabulary, an untrained tokenizer, random decoders of two families
and an untrained classifier on disk (the suites' figures are checked for shape and repeatability, not quality)."""

from __future__ import annotations

import pytest
import torch

from evaluation import chat_data
from evaluation import digits_data as data
from evaluation.digit_classifier import DigitClassifier
from evaluation.digits import DigitOptions
from fusion_model.config import FusionConfig
from fusion_model.families import family_class
from fusion_model.families.loading import LoadedFamily
from tokenizer.image import ImageTokenizer
from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.vocab import train_unified_vocab


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The digits' and the chat conversations' words as a vocabulary, an untrained 4x4-code tokenizer for 64-px
    digits, a random chameleon decoder, a random llava (late-fusion) model, and an untrained classifier's state_dict
    on disk."""
    torch.manual_seed(0)
    texts = [data.caption(d, v) for d in range(10) for v in range(4)] + [data.CALCULATE, data.PLUS, data.EQUALS]
    texts += [chat_data.QUESTION, chat_data.HERE, chat_data.DRAW_NEXT, chat_data.AFTER.format(word="three")]
    vocab = train_unified_vocab(texts * 5, vocab_size=400, image_codes=32)
    tokenizer = ImageTokenizer(ImageTokenizerConfig(image_size=64, base_channels=8, channel_multiplier=(1, 1, 1, 1, 1),
                                                    num_res_blocks=1, latent_channels=8, norm_groups=4,
                                                    codebook_size=32)).eval()
    config = FusionConfig.from_preset("tiny", vocab_size=vocab.vocab_size, image_offset=vocab.image_offset,
                                      image_codes=vocab.image_codes, max_seq_len=128)
    families = {}
    for name, options in (("chameleon", {}),
                          ("llava", {"stage": 2, "feature_dim": tokenizer.config.embed_dim,
                                     "image_token_id": vocab.image_placeholder_id, "boi_id": vocab.boi_id,
                                     "eoi_id": vocab.eoi_id})):
        family = family_class(name)(config, options)
        built = family.build()
        for part in built.values():
            part.eval()
        families[name] = LoadedFamily(family, built)
    folder = tmp_path_factory.mktemp("demo")
    (folder / "generate").mkdir()
    torch.save(DigitClassifier().state_dict(), folder / "generate" / "classifier.pt")
    return vocab, tokenizer, families, DigitOptions(demo_dir=str(folder), held_out=60)
