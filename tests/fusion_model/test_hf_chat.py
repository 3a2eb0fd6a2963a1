"""The chat template round trip with transformers, after a save and reload of a `convert export` folder: the
processor's default (chat) call, `tokenizer.apply_chat_template` and `processor.apply_chat_template` (with the
tokenizer's template, as text completion) give `tokenizer.chat.generation_prompt`'s ids; greedy answers equal
`train.py generate --chat`'s, with and without an image; teacher-forced logits over a conversation whose answer
holds an image equal ours."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is the reference")
from transformers import AutoProcessor, AutoTokenizer, ChameleonForConditionalGeneration  # noqa: E402

from fusion_model import cli  # noqa: E402
from fusion_model.config import FusionConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_hf_export as hf_export  # noqa: E402  (its export_tiny; its tests stay collected in their own file)

from tokenizer.chat import Turn, encode_conversation, generation_prompt  # noqa: E402

NEW_TOKENS = 12
USER = "the cat sat on"
IMAGE_USER = ("a dog ", " ran far")  # text, image, text


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """test_hf_export's tiny exported decoder, vocabulary and Chameleon-layout image tokenizer; root/photo.png."""
    root = tmp_path_factory.mktemp("chat_export")
    vocab, model, image_tokenizer, _ = hf_export.export_tiny(root)
    return root, vocab, model, image_tokenizer


def reloaded(root):
    """The exported folder as a transformers user loads it: processor, tokenizer, model."""
    processor = AutoProcessor.from_pretrained(root / "hf", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(root / "hf", local_files_only=True)
    model = ChameleonForConditionalGeneration.from_pretrained(root / "hf", local_files_only=True).eval()
    return processor, tokenizer, model


def with_codes(model, inputs) -> list[int]:
    """The processor's ids with its image placeholders replaced by the exported VQ encoder's codes (what our ids
    hold in their place)."""
    ids = inputs["input_ids"][0].clone()
    if "pixel_values" in inputs:
        with torch.no_grad():
            ids[ids == model.config.image_token_id] = model.get_image_tokens(inputs["pixel_values"]).flatten().long()
    return ids.tolist()


def test_the_template_is_saved_on_the_tokenizer(export):
    root, _, _, _ = export
    _, tokenizer, _ = reloaded(root)
    assert tokenizer.chat_template and "sep_token" in tokenizer.chat_template
    assert (root / "hf" / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (root / "hf" / "tokenizer_config.json").read_text())


def test_every_transformers_route_gives_our_generation_prompt(export):
    root, vocab, _, image_tokenizer = export
    processor, tokenizer, model = reloaded(root)
    photo = Image.open(root / "photo.png")
    codes = image_tokenizer.encode(photo)[0]
    single = [{"role": "user", "content": USER}]
    assert processor(text=USER)["input_ids"][0].tolist() == generation_prompt(vocab, [Turn("user", (USER,))])
    # a system turn and an answered turn before the question: the template writes <sep> / </s> after each
    turns = [Turn("system", ("one two",)), Turn("user", ("a dog",)), Turn("assistant", ("ran far",)),
             Turn("user", (USER,))]
    messages = [{"role": t.role, "content": t.parts[0]} for t in turns]
    for chat, ours in ((single, [Turn("user", (USER,))]), (messages, turns)):
        expected = generation_prompt(vocab, ours)
        got = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert list(got) == expected
        got = processor.apply_chat_template(chat, chat_template=tokenizer.chat_template, add_generation_prompt=True,
                                            tokenize=True, return_dict=True,
                                            processor_kwargs={"return_for_text_completion": True})
        assert got["input_ids"][0].tolist() == expected
    # a whole conversation (an answer last) is encode_conversation's ids, </s> last
    whole = [*messages, {"role": "assistant", "content": "away"}]
    got = tokenizer.apply_chat_template(whole, tokenize=True)["input_ids"]
    assert list(got) == encode_conversation(vocab, [*turns, Turn("assistant", ("away",))])[0]
    # with an image: the same ids once the processor's placeholders hold the exported VQ encoder's codes
    expected = generation_prompt(vocab, [Turn("user", (IMAGE_USER[0], codes, IMAGE_USER[1]))])
    assert with_codes(model, processor(text="<image>".join(IMAGE_USER), images=[photo])) == expected
    content = [{"type": "text", "text": IMAGE_USER[0]}, {"type": "image", "image": photo},
               {"type": "text", "text": IMAGE_USER[1]}]
    inputs = processor.apply_chat_template([{"role": "user", "content": content}], chat_template=tokenizer.chat_template,
                                           add_generation_prompt=True, tokenize=True, return_dict=True,
                                           processor_kwargs={"return_for_text_completion": True})
    assert with_codes(model, inputs) == expected


def ours_chat(root, tmp_path, with_image: bool) -> list[int]:
    """`train.py generate --chat` greedy, text mode: the answer's ids."""
    image = ["--image", str(root / "photo.png")] if with_image else []
    prompt = ["--prompt", IMAGE_USER[0], *image, "--prompt", IMAGE_USER[1]] if with_image else ["--prompt", USER]
    out = tmp_path / ("image" if with_image else "text")
    assert cli.main(["generate", "--checkpoint", str(root / "model.ckpt"), "--vocab", str(root / "tokenizer.json"),
                     "--image-tokenizer", str(root / "vq"), "--chat", *prompt, "--mode", "text",
                     "--text-temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--out", str(out)]) == 0
    return json.loads((out / "samples.json").read_text())["samples"][0]["ids"]


@pytest.mark.parametrize("with_image", [False, True], ids=["text", "image"])
def test_greedy_chat_answers_equal_generate_chat(export, tmp_path, with_image):
    root, vocab, _, _ = export
    processor, tokenizer, model = reloaded(root)
    expected = ours_chat(root, tmp_path, with_image)
    assert len(expected) == NEW_TOKENS  # no early </s>: every token is compared
    if with_image:
        photo = Image.open(root / "photo.png")
        content = [{"type": "text", "text": IMAGE_USER[0]}, {"type": "image", "image": photo},
                   {"type": "text", "text": IMAGE_USER[1]}]
        # the tokenizer renders the chat as text with `<image>`; the processor expands it (no second <s> or <sep>)
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        routes = [processor(text="<image>".join(IMAGE_USER), images=[photo], return_tensors="pt"),
                  processor(text=text, images=[photo], return_for_text_completion=True, add_special_tokens=False,
                            return_tensors="pt"),
                  processor.apply_chat_template([{"role": "user", "content": content}],
                                                chat_template=tokenizer.chat_template, add_generation_prompt=True,
                                                tokenize=True, return_dict=True,
                                                processor_kwargs={"return_for_text_completion": True})]
    else:
        chat = [{"role": "user", "content": USER}]
        routes = [processor(text=USER, return_tensors="pt"),
                  tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                return_tensors="pt")]
    for inputs in routes:
        with torch.no_grad():
            theirs = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert theirs[0, inputs["input_ids"].shape[1]:].tolist() == expected


def test_teacher_forced_logits_over_an_image_answer_equal_ours(export):
    root, vocab, ours, image_tokenizer = export
    _, _, model = reloaded(root)
    codes = image_tokenizer.encode(Image.open(root / "photo.png"))[0]
    turns = [Turn("user", ("draw a dog",)), Turn("assistant", ("here ", codes, " it is")), Turn("user", ("thanks",)),
             Turn("assistant", ("one",))]
    ids, targets = encode_conversation(vocab, turns)
    assert sum(targets) > codes.numel()  # the image answer is trained
    ids = torch.tensor([ids])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        # transformers masks image ids out of its logits while generating; the head itself scores them all
        torch.testing.assert_close(model.lm_head(hidden), ours(ids), rtol=1e-4, atol=1e-4)
        keep = ~vocab.is_image(torch.arange(vocab.vocab_size))
        torch.testing.assert_close(model(input_ids=ids).logits[..., keep], ours(ids)[..., keep], rtol=1e-4, atol=1e-4)


def test_a_released_chameleon_tokenizer_is_named_in_one_line_and_the_decoder_still_imports(tmp_path, capsys):
    """A folder laid out like the released Chameleon (`<s>` `<pad>` `</s>` `<unk>`, the IMGIMG block, then
    `<eoss>`, `<racm3:break>`, `<reserved08706>`, `<image>` and text) imports its decoder and says in one line why
    no tokenizer.json is written."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from fusion_model.checkpoint import load_model
    from fusion_model.hf_convert import to_transformers_config
    from tokenizer.token_names import image_token_name

    names = ["<s>", "<pad>", "</s>", "<unk>", *[image_token_name(k) for k in range(16)], "<eoss>", "<racm3:break>",
             "<reserved08706>", "<image>", *hf_export.CORPUS[0].split(), *hf_export.CORPUS[1].split()]
    names = list(dict.fromkeys(names))
    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "released"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    vocabulary_map = {name: i for i, name in enumerate(names)}
    config = FusionConfig.from_preset("tiny", vocab_size=len(names), image_offset=4, image_codes=16)
    torch.manual_seed(0)
    ChameleonForConditionalGeneration(to_transformers_config(config, vocabulary_map)).save_pretrained(folder)
    assert cli.main(["convert", "import", str(folder), "--out", str(tmp_path / "run")]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "tokenizer.json" in line]
    assert len(said) == 1 and "released Chameleon layout" in said[0] and "<reserved08706>" in said[0]
    assert not (tmp_path / "run" / "tokenizer.json").exists()
    imported = load_model(tmp_path / "run" / "model.ckpt")
    assert (imported.config.image_offset, imported.config.image_codes) == (4, 16)
