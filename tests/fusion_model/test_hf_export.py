"""`train.py convert export` writes a folder that transformers loads with one `from_pretrained` each (model,
processor) and that generates greedily exactly what our sampler does, for text and image-understanding prompts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is the reference")
from transformers import AutoProcessor, AutoTokenizer, ChameleonForConditionalGeneration  # noqa: E402

from fusion_model import cli  # noqa: E402
from fusion_model.checkpoint import save_model  # noqa: E402
from fusion_model.config import FusionConfig  # noqa: E402
from fusion_model.model import FusionModel  # noqa: E402
from fusion_model.sampling import SamplingConfig, generate_ids  # noqa: E402
from tokenizer.image import ImageTokenizer, ImageTokenizerConfig  # noqa: E402
from tokenizer.image.preprocess import preprocess  # noqa: E402
from tokenizer.vocab import text_mode_mask, train_unified_vocab  # noqa: E402

CORPUS = ["the cat sat on the mat", "a dog ran far away", "one two three four five six seven"] * 10
NEW_TOKENS = 20
TEXT_PROMPT = "the cat sat on"
IMAGE_PROMPT = ("a dog ", " ran far")  # text, <image>, text


def export_tiny(root):
    """A tiny vocabulary, a random decoder and a Chameleon-layout image tokenizer (4x4 codes of 16) in `root`,
    exported by `convert export --vocab --image-tokenizer` to root/hf; an 8 px photo (saved as root/photo.png)."""
    vocab = train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, num_specials=16)
    vocab.save(root / "tokenizer.json")
    torch.manual_seed(0)
    config = FusionConfig.from_preset("tiny", vocab_size=320, image_offset=vocab.image_offset, image_codes=16)
    model = FusionModel(config).eval()
    with torch.no_grad():  # a sharper random model: its greedy choices are far from ties
        model.head.weight.mul_(20)
    save_model(model, root / "model.ckpt")
    vq = ImageTokenizerConfig(image_size=8, base_channels=32, channel_multiplier=(1, 2), num_res_blocks=1,
                              latent_channels=32, norm_groups=32, codebook_size=16, quantizer="chameleon")
    image_tokenizer = ImageTokenizer(vq).eval()
    image_tokenizer.save_pretrained(root / "vq")
    argv = ["convert", "export", "--checkpoint", str(root / "model.ckpt"), "--out", str(root / "hf"),
            "--vocab", str(root / "tokenizer.json"), "--image-tokenizer", str(root / "vq")]
    assert cli.main(argv) == 0
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8))
    photo.save(root / "photo.png")
    return vocab, model, image_tokenizer, photo


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """`export_tiny` in a module-wide folder."""
    root = tmp_path_factory.mktemp("export")
    return (root, *export_tiny(root))


def ours_greedy(model, vocab, prompt: list[int]) -> list[int]:
    """Our sampler, text mode, greedy, NEW_TOKENS new ids."""
    config = SamplingConfig(mode="text", text_temperature=0.0, max_new_tokens=NEW_TOKENS)
    return generate_ids(model, vocab, [prompt], config)[0]


def test_the_folder_is_complete_and_names_the_special_ids(export):
    root, vocab, _, _, _ = export
    hf = root / "hf"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "processor_config.json", "preprocessor_config.json"):
        assert (hf / name).is_file(), name
    config = json.loads((hf / "config.json").read_text())
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (
        vocab.pad_id, vocab.bos_id, vocab.eos_id)
    assert config["dtype"] == "float32"
    generation = json.loads((hf / "generation_config.json").read_text())
    assert (generation["pad_token_id"], generation["bos_token_id"], generation["eos_token_id"]) == (
        vocab.pad_id, vocab.bos_id, vocab.eos_id)
    allowed = set(torch.nonzero(text_mode_mask(vocab)).flatten().tolist())
    image = set(range(vocab.image_offset, vocab.image_offset + vocab.image_codes))
    assert set(generation["suppress_tokens"]) == set(range(vocab.vocab_size)) - allowed - image
    assert vocab.boi_id in generation["suppress_tokens"] and vocab.sep_id not in generation["suppress_tokens"]
    tokenizer = AutoTokenizer.from_pretrained(hf, local_files_only=True)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.sep_token) == (
        "<s>", "</s>", "<pad>", "<sep>")
    processor = AutoProcessor.from_pretrained(hf, local_files_only=True)
    assert processor.image_seq_length == 16
    assert processor.image_processor.crop_size == {"height": 8, "width": 8}


def test_processor_ids_are_our_document_ids(export):
    root, vocab, _, image_tokenizer, photo = export
    processor = AutoProcessor.from_pretrained(root / "hf", local_files_only=True)
    model = ChameleonForConditionalGeneration.from_pretrained(root / "hf", local_files_only=True).eval()
    # ChameleonProcessor ends a prompt with <sep> (a chat turn) unless asked for text completion
    text = processor(text=TEXT_PROMPT)["input_ids"][0].tolist()
    assert text == vocab.encode_document([TEXT_PROMPT], eos=False) + [vocab.sep_id]
    completion = processor(text=TEXT_PROMPT, return_for_text_completion=True)["input_ids"][0].tolist()
    assert completion == vocab.encode_document([TEXT_PROMPT], eos=False)
    inputs = processor(text="<image>".join(IMAGE_PROMPT), images=[photo])
    torch.testing.assert_close(inputs["pixel_values"][0], preprocess(photo, 8))  # our preprocessing
    ids = inputs["input_ids"][0].clone()
    placeholders = ids == processor.image_token_id
    assert int(placeholders.sum()) == 16
    with torch.no_grad():  # the exported VQ encoder gives our image tokenizer's codes
        ids[placeholders] = model.get_image_tokens(inputs["pixel_values"]).flatten().long()
    codes = image_tokenizer.encode(photo)[0]
    expected = vocab.encode_document([IMAGE_PROMPT[0], codes, IMAGE_PROMPT[1]], eos=False) + [vocab.sep_id]
    assert ids.tolist() == expected


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image-understanding"])
def test_greedy_generate_equals_our_sampler(export, with_image):
    root, vocab, ours, image_tokenizer, photo = export
    processor = AutoProcessor.from_pretrained(root / "hf", local_files_only=True)
    model = ChameleonForConditionalGeneration.from_pretrained(root / "hf", local_files_only=True).eval()
    if with_image:
        inputs = processor(text="<image>".join(IMAGE_PROMPT), images=[photo])
        segments = [IMAGE_PROMPT[0], image_tokenizer.encode(photo)[0], IMAGE_PROMPT[1]]
    else:
        inputs = processor(text=TEXT_PROMPT)
        segments = [TEXT_PROMPT]
    prompt = vocab.encode_document(segments, eos=False) + [vocab.sep_id]
    with torch.no_grad():
        theirs = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    expected = ours_greedy(ours, vocab, prompt)
    assert len(expected) == NEW_TOKENS  # no early </s>: all 20 tokens are compared
    assert theirs.tolist() == expected


def test_an_image_tokenizer_without_a_transformers_layout_goes_to_a_side_folder(export, tmp_path, capsys):
    root, vocab, _, _, _ = export
    improved = ImageTokenizer(ImageTokenizerConfig(
        image_size=8, base_channels=8, channel_multiplier=(1, 1, 1), num_res_blocks=1, latent_channels=8,
        norm_groups=4, codebook_size=16, quantizer="improved")).eval()
    improved.save_pretrained(tmp_path / "vq")
    out = tmp_path / "hf"
    argv = ["convert", "export", "--checkpoint", str(root / "model.ckpt"), "--out", str(out),
            "--vocab", str(root / "tokenizer.json"), "--image-tokenizer", str(tmp_path / "vq"), "--dtype", "bfloat16"]
    assert cli.main(argv) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "no transformers layout" in line]
    assert len(said) == 1 and str(out / "image_tokenizer") in said[0]
    assert ImageTokenizer.from_pretrained(out / "image_tokenizer").fingerprint() == improved.fingerprint()
    model, info = ChameleonForConditionalGeneration.from_pretrained(out, local_files_only=True,
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]  # the placeholder VQ encoder is written
    assert model.dtype == torch.bfloat16
    processor = AutoProcessor.from_pretrained(out, local_files_only=True)
    assert processor.image_seq_length == 4  # the improved tokenizer's 2x2 grid
    # exporting again with a Chameleon-layout tokenizer removes the stale side folder
    argv[argv.index(str(tmp_path / "vq"))] = str(root / "vq")
    assert cli.main(argv) == 0
    assert not (out / "image_tokenizer").exists()


def test_import_of_a_save_pretrained_folder_writes_what_fit_needs(export, tmp_path, capsys):
    from transformers import ChameleonConfig

    from fusion_model.checkpoint import load_model
    from fusion_model.hf_convert import to_transformers_config
    from tokenizer.vocab import UnifiedVocab

    root, vocab, _, image_tokenizer, photo = export
    reference = ChameleonForConditionalGeneration.from_pretrained(root / "hf", local_files_only=True)
    hf_config = to_transformers_config(FusionConfig.from_preset("tiny", vocab_size=320, image_offset=vocab.image_offset,
                                                                image_codes=16),
                                       vocab.tokenizer.get_vocab(with_added_tokens=True),
                                       reference.config.vq_config.to_dict())
    assert isinstance(hf_config, ChameleonConfig)
    torch.manual_seed(1)
    hf = ChameleonForConditionalGeneration(hf_config).eval()  # random weights, VQ encoder included
    hf.save_pretrained(tmp_path / "hf")
    vocab.to_transformers().save_pretrained(tmp_path / "hf")
    assert cli.main(["convert", "import", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    said = capsys.readouterr().out
    assert "model.ckpt" in said and "tokenizer.json" in said and "image_tokenizer" in said
    imported = UnifiedVocab.load(tmp_path / "run" / "tokenizer.json")
    assert imported.fingerprint() == vocab.fingerprint()
    ours = load_model(tmp_path / "run" / "model.ckpt").eval()
    ids = torch.tensor([vocab.encode_document([TEXT_PROMPT], eos=False)])
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_hidden(ids), hf.model(input_ids=ids).last_hidden_state)
        pixels = preprocess(photo, 8)[None]
        codes = ImageTokenizer.from_pretrained(tmp_path / "run" / "image_tokenizer").encode(pixels).flatten()
        assert (codes + vocab.image_offset).tolist() == hf.get_image_tokens(pixels).flatten().tolist()
    # the .ckpt form keeps writing the decoder alone
    assert cli.main(["convert", "import", str(tmp_path / "hf"), "--out", str(tmp_path / "one.ckpt")]) == 0
    assert (tmp_path / "one.ckpt").is_file()


def test_import_of_our_export_brings_back_its_side_folder_image_tokenizer(export, tmp_path):
    root, _, _, _, _ = export
    improved = ImageTokenizer(ImageTokenizerConfig(
        image_size=8, base_channels=8, channel_multiplier=(1, 1, 1), num_res_blocks=1, latent_channels=8,
        norm_groups=4, codebook_size=16, quantizer="improved")).eval()
    improved.save_pretrained(tmp_path / "vq")
    assert cli.main(["convert", "export", "--checkpoint", str(root / "model.ckpt"), "--out", str(tmp_path / "hf"),
                     "--vocab", str(root / "tokenizer.json"), "--image-tokenizer", str(tmp_path / "vq")]) == 0
    assert cli.main(["convert", "import", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    assert ImageTokenizer.from_pretrained(tmp_path / "run" / "image_tokenizer").fingerprint() == improved.fingerprint()


def test_a_transformers_folder_imports_trains_with_fit_exports_and_reloads(export, tmp_path):
    """The whole loop a transformers user makes: import a folder, continue training with `train.py fit`, export,
    and load the result back with `from_pretrained`."""
    import sys
    from pathlib import Path

    from fusion_model.checkpoint import load_model
    from fusion_model.hf_convert import to_transformers_config

    sys.path.insert(0, str(Path(__file__).resolve().parent / "training"))
    import fit_worker as fw

    root, vocab, _, _, _ = export
    reference = ChameleonForConditionalGeneration.from_pretrained(root / "hf", local_files_only=True)
    config = FusionConfig.from_preset("tiny", vocab_size=320, image_offset=vocab.image_offset, image_codes=16)
    torch.manual_seed(2)
    hf = ChameleonForConditionalGeneration(to_transformers_config(
        config, vocab.tokenizer.get_vocab(with_added_tokens=True), reference.config.vq_config.to_dict())).eval()
    hf.save_pretrained(tmp_path / "hf")
    vocab.to_transformers().save_pretrained(tmp_path / "hf")
    run = tmp_path / "run"
    assert cli.main(["convert", "import", str(tmp_path / "hf"), "--out", str(run)]) == 0

    image_fingerprint = ImageTokenizer.from_pretrained(run / "image_tokenizer").fingerprint()
    tokens = fw.make_token_dir(tmp_path / "tokens", vocab_size=320, vocab_fingerprint=vocab.fingerprint(),
                               image_fingerprint=image_fingerprint)
    fit = fw.tiny_args(tokens, tmp_path / "fit", 3, extra=[
        "--model.config=null", f"--model.init_weights={run / 'model.ckpt'}", "--model.lr=1e-5",
        f"--vocab={run / 'tokenizer.json'}", f"--image-tokenizer={run / 'image_tokenizer'}"])
    assert cli.main(["fit", *fit]) == 0

    imported, trained = load_model(run / "model.ckpt"), load_model(tmp_path / "fit" / "ckpt" / "last.ckpt")
    assert trained.config == imported.config  # the decoder config came from the imported checkpoint
    moved = [float((a - b).abs().max()) for a, b in zip(imported.parameters(), trained.parameters())]
    assert 0 < max(moved) < 1e-3  # trained on from the imported weights (a fresh init would differ by ~1e-2)

    assert cli.main(["convert", "export", "--checkpoint", str(tmp_path / "fit" / "ckpt" / "last.ckpt"),
                     "--out", str(tmp_path / "again"), "--vocab", str(run / "tokenizer.json"),
                     "--image-tokenizer", str(run / "image_tokenizer")]) == 0
    again = ChameleonForConditionalGeneration.from_pretrained(tmp_path / "again", local_files_only=True).eval()
    ids = torch.tensor([vocab.encode_document([TEXT_PROMPT], eos=False)])
    with torch.no_grad():
        keep = ~vocab.is_image(torch.arange(320))  # transformers masks image ids out of the logits
        torch.testing.assert_close(again(input_ids=ids).logits[..., keep], trained.eval()(ids)[..., keep],
                                   rtol=1e-4, atol=1e-4)


def test_init_weights_of_another_architecture_is_refused_naming_the_field(export, tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "training"))
    import fit_worker as fw

    root, vocab, _, _, _ = export
    tokens = fw.make_token_dir(tmp_path / "tokens", vocab_size=256)
    fit = fw.tiny_args(tokens, tmp_path / "fit", 1, extra=[f"--model.init_weights={root / 'model.ckpt'}"])
    assert cli.main(["fit", *fit]) == 2
    err = capsys.readouterr().err
    assert "another architecture" in err and "vocab_size: 320 vs 256" in err and "--model.config null" in err
