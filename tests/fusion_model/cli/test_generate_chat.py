"""`train.py generate --chat`: a user turn or a conversation file in, the assistant's answers out, its prompt ids
the chat template's (`tokenizer.chat.generation_prompt`), each answer kept for the next turn; every family that
samples reads the chat through the same prompt segments; bad conversation files are one line and exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from fusion_model import cli
from fusion_model.checkpoint import save_model
from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel
from fusion_model.sampling import SamplingConfig
from tokenizer.chat import Turn, generation_prompt
from tokenizer.image import ContinuousImageTokenizer, ImageTokenizer, ImageTokenizerConfig
from tokenizer.vocab import UnifiedVocab

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after

# 16 px images, downsampling 4: 4x4 latents of 4 channels (a transfusion checkpoint's continuous tokenizer)
TINY_KL = ImageTokenizerConfig(image_size=16, base_channels=8, channel_multiplier=(1, 1, 1), num_res_blocks=1,
                               latent_channels=8, norm_groups=4, bottleneck="kl", embed_dim=4)


@pytest.fixture(scope="module")
def files(tiny_tokenizers):
    """The shared tiny vocabulary, VQ bundle (2x2 codes) and photo, a chameleon checkpoint and a KL bundle."""
    vocab = UnifiedVocab.load(tiny_tokenizers / "tokenizer.json")
    torch.manual_seed(0)
    config = FusionConfig.from_preset("tiny", vocab_size=320, image_offset=vocab.image_offset, image_codes=16,
                                      max_seq_len=96)
    model = FusionModel(config)
    with torch.no_grad():  # a sharper random model: its greedy choices are far from ties
        model.head.weight.mul_(20)
    save_model(model, tiny_tokenizers / "chat.ckpt")
    torch.manual_seed(3)
    ContinuousImageTokenizer(TINY_KL).save_pretrained(tiny_tokenizers / "kl")
    return tiny_tokenizers


@pytest.fixture
def prompts_seen(monkeypatch):
    """The id prompts every family hands the one decode loop, in call order."""
    import fusion_model.families.transfusion.sampling as transfusion_sampling
    import fusion_model.sampling as sampling
    import fusion_model.sampling.generate as generate_module

    seen: list[list[int]] = []
    original = sampling.generate_ids

    def spy(model, vocab, prompts, config, **kwargs):
        seen.extend(list(p) for p in prompts)
        return original(model, vocab, prompts, config, **kwargs)

    for module in (sampling, generate_module, transfusion_sampling):
        monkeypatch.setattr(module, "generate_ids", spy)
    return seen


def base(files, checkpoint: str = "chat.ckpt", tokenizer: str = "vq") -> list[str]:
    return ["generate", "--checkpoint", str(files / checkpoint), "--vocab", str(files / "tokenizer.json"),
            "--image-tokenizer", str(files / tokenizer), "--text-temperature", "0", "--image-temperature", "0"]


def test_one_user_turn_is_the_generation_prompt_and_the_answer_our_greedy_tokens(files, tmp_path, prompts_seen):
    from fusion_model.checkpoint import load_model
    from fusion_model.sampling import generate_ids

    vocab = UnifiedVocab.load(files / "tokenizer.json")
    out = tmp_path / "one"
    argv = [*base(files), "--chat", "--prompt", "the cat", "--mode", "text", "--max-new-tokens", "8",
            "--out", str(out)]
    assert cli.main(argv) == 0
    prompt = generation_prompt(vocab, [Turn("user", ("the cat",))])
    assert prompt[-1] == vocab.sep_id and prompts_seen == [prompt]
    written = json.loads((out / "samples.json").read_text())
    config = SamplingConfig(mode="text", text_temperature=0.0, max_new_tokens=8)
    expected = generate_ids(load_model(files / "chat.ckpt").eval(), vocab, [prompt], config)[0]
    assert written["samples"][0]["ids"] == expected
    assert written["settings"]["chat"] is True
    messages = written["conversations"][0]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[0]["content"] == [{"type": "text", "text": "the cat"}]
    assert written["samples"][0]["message"] == 1


def test_a_conversation_file_answers_each_pending_user_turn_keeping_its_answers(files, tmp_path, prompts_seen):
    vocab = UnifiedVocab.load(files / "tokenizer.json")
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "photo.png").write_bytes((files / "photo.png").read_bytes())
    chat = {"messages": [
        {"role": "system", "content": "one two"},
        {"role": "user", "content": [{"type": "image", "path": "pics/photo.png"}, {"type": "text", "text": "a dog"}]},
        {"role": "assistant", "content": "ran far"},
        {"role": "user", "content": "the cat"},
        {"role": "user", "content": "sat on"},
    ]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(chat) + "\n{\"ignored\": true}\n")
    out = tmp_path / "two"
    assert cli.main([*base(files), "--conversation", str(path), "--max-new-tokens", "10", "--num-samples", "2",
                     "--batch-size", "1", "--out", str(out)]) == 0
    codes = ImageTokenizer.from_pretrained(files / "vq").encode([str(tmp_path / "pics" / "photo.png")])[0]
    turns = [Turn("system", ("one two",)), Turn("user", (codes, "a dog")), Turn("assistant", ("ran far",)),
             Turn("user", ("the cat",))]
    first = generation_prompt(vocab, turns)
    written = json.loads((out / "samples.json").read_text())
    assert len(written["samples"]) == 4  # 2 samples x 2 pending user turns
    assert prompts_seen[0] == first and prompts_seen[1] == first  # batch 1 and batch 2 (seed + 1), first turn
    for sample in (0, 1):
        answer = written["samples"][2 * sample]["ids"]
        kept = answer if answer[-1] == vocab.eos_id else [*answer, vocab.eos_id]  # the answer's end of turn
        assert prompts_seen[2 + sample] == [*first, *kept, *vocab.encode_text("sat on"), vocab.sep_id]
        messages = written["conversations"][sample]["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user",
                                                 "assistant"]
        assert messages[1]["content"][0] == {"type": "image", "path": str(tmp_path / "pics" / "photo.png")}
    for record in written["samples"]:
        assert [e for e in record["output"] if "image" in e] == [] or (out / record["output"][0]["image"]).is_file()


@pytest.mark.parametrize("family", ["llava", "transfusion"])
def test_every_family_that_samples_answers_a_chat_through_the_same_prompt(files, tmp_path, prompts_seen, family):
    from fusion_model.training.lightning_module import FusionLightningModule

    vocab = UnifiedVocab.load(files / "tokenizer.json")
    config = FusionConfig.from_preset("tiny", vocab_size=320, image_offset=vocab.image_offset, image_codes=16,
                                      max_seq_len=64)
    if family == "llava":
        tokenizer, folder = ImageTokenizer.from_pretrained(files / "vq"), "vq"
        options = {"feature_dim": tokenizer.config.embed_dim, "image_token_id": vocab.image_placeholder_id,
                   "boi_id": vocab.boi_id, "eoi_id": vocab.eoi_id, "stage": 2}
    else:
        tokenizer, folder = ContinuousImageTokenizer.from_pretrained(files / "kl"), "kl"
        options = {"latent_channels": 4, "patch_size": 2, "image_placeholder_id": vocab.image_placeholder_id}
    torch.manual_seed(0)
    module = FusionLightningModule(config, family=family, family_options=options,
                                   tokenizers={"vocab": vocab.fingerprint(), "image_tokenizer": tokenizer.fingerprint()})
    checkpoint = files / f"{family}.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, checkpoint)
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "the cat"}, {"type": "image", "path": str(files / "photo.png")}]},
        {"role": "assistant", "content": "sat"},
        {"role": "user", "content": "a dog"}]}))
    argv = [*base(files, checkpoint.name, folder), "--conversation", str(path), "--max-new-tokens", "4",
            "--out", str(tmp_path / "out")]
    if family == "transfusion":
        argv += ["--denoising-steps", "2"]
    assert cli.main(argv) == 0
    (prompt,) = prompts_seen
    sep, eos = vocab.sep_id, vocab.eos_id
    assert prompt[0] == vocab.bos_id and prompt[-1] == sep  # ... <sep> "sat" </s> "a dog" <sep>
    tail = [*vocab.encode_text("sat"), eos, *vocab.encode_text("a dog"), sep]
    assert prompt[-len(tail):] == tail and prompt.count(sep) == 2
    written = json.loads((tmp_path / "out" / "samples.json").read_text())
    assert [m["role"] for m in written["conversations"][0]["messages"]] == ["user", "assistant", "user", "assistant"]


@pytest.mark.parametrize("content, said", [
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "unknown role 'robot'"),
    ('{"messages": [{"role": "user", "content": "hi"', "not JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
     "no user turn is left to answer"),
    ('{"messages": [{"role": "user", "content": [{"type": "image", "path": "gone.png"}]}]}', "gone.png"),
])
def test_a_bad_conversation_is_one_line_and_exit_2(files, tmp_path, capsys, content, said):
    path = tmp_path / "chat.json"
    path.write_text(content)
    assert cli.main([*base(files), "--conversation", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
    assert not (tmp_path / "out").exists()


def test_chat_needs_a_user_turn_and_takes_no_prompts_file(files, tmp_path, capsys):
    assert cli.main([*base(files), "--chat", "--out", str(tmp_path / "out")]) == 2
    assert "--chat needs a user turn" in capsys.readouterr().err
    (tmp_path / "p.jsonl").write_text('{"text": "the cat"}\n')
    assert cli.main([*base(files), "--chat", "--prompts-file", str(tmp_path / "p.jsonl"), "--out",
                     str(tmp_path / "out")]) == 2
    assert "not --prompts-file" in capsys.readouterr().err
