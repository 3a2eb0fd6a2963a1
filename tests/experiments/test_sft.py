"""`train.py experiment sft` in its smoke mode, end to end on a cut-down demo, and its scoring rules."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from evaluation import chat_data
from experiments import sft as experiment

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the fixtures are in conftest.py


@pytest.fixture(scope="module")
def demo_with_decoder(finished_demo, tmp_path_factory):
    """The shared cut-down demo's outputs (linked, never written) plus an untrained decoder as its train stage's
    `model.ckpt` (the fixture skips the demo's training): the SFT arms start from it."""
    from fusion_model.checkpoint import save_model
    from fusion_model.config import FusionConfig
    from fusion_model.model import FusionModel
    from tokenizer.vocab import UnifiedVocab

    demo, source = finished_demo
    folder = tmp_path_factory.mktemp("demo_with_decoder")
    for name in ("tokenizer", "vocab", "shards", "generate"):
        (folder / name).symlink_to(source / name, target_is_directory=True)
    vocab = UnifiedVocab.load(source / "vocab" / "tokenizer.json")
    torch.manual_seed(0)
    config = FusionConfig.from_preset("demo", vocab_size=vocab.vocab_size, image_offset=vocab.image_offset,
                                      image_codes=vocab.image_codes)
    save_model(FusionModel(config), folder / "train" / "model.ckpt")
    return replace(demo, out_dir=str(folder)), folder


@pytest.fixture(scope="module")
def smoke(demo_with_decoder, tmp_path_factory):
    """The smoke mode's record, smaller still (run once for the tests below)."""
    demo, folder = demo_with_decoder
    settings = replace(experiment.smoke_config(str(folder), str(tmp_path_factory.mktemp("sft"))), steps=4,
                       train_conversations=80, held_out_per_category=3, held_out_documents=8)
    return settings, experiment.run(settings, log=lambda message: None, demo=demo)


def test_every_arm_trains_the_same_steps_and_the_same_data_order(smoke):
    settings, record = smoke
    training, results = record["training"], record["results"]
    assert set(results) == set(experiment.ARMS) and set(training) == set(experiment.ARMS) - {"pretrained"}
    for name, t in training.items():
        assert t["steps"] == settings.steps, name
        assert 0 < t["loss_targets"] <= t["tokens"] <= t["decoder_positions"]
        assert t["flops"] == t["flops_per_token"] * t["decoder_positions"] > 0
    answer_only, all_tokens = training["answer_only"], training["all_tokens"]
    # the same shards and seed: the same batches, so the same tokens and FLOPs; only the loss targets differ
    assert answer_only["tokens"] == all_tokens["tokens"] and answer_only["flops"] == all_tokens["flops"]
    assert all_tokens["loss_targets"] == all_tokens["tokens"] > answer_only["loss_targets"]
    assert not all_tokens["answer_only"] and answer_only["answer_only"]
    # the unbalanced mix has mostly text answers: a smaller share of its tokens are answer targets
    unbalanced = training["unbalanced"]
    assert unbalanced["loss_targets"] / unbalanced["tokens"] < answer_only["loss_targets"] / answer_only["tokens"]
    assert any("--data.answer_only=false" == o for o in all_tokens["options"])
    assert any(o.startswith("--model.init_weights=") for o in answer_only["options"])


def test_peft_arms_train_fewer_parameters_on_the_same_batches(smoke, demo_with_decoder):
    from fusion_model.checkpoint import load_model

    settings, record = smoke
    training = record["training"]
    full = training["answer_only"]["cost"]
    lora4, lora16, head = (training[name]["cost"] for name in ("lora_r4", "lora_r16", "head_only"))
    # the same shards and seed as answer_only: the same batches in the same order
    for name in ("lora_r4", "lora_r16", "head_only"):
        assert training[name]["tokens"] == training["answer_only"]["tokens"], name
        assert training[name]["loss_targets"] == training["answer_only"]["loss_targets"], name
    assert full["method"] == "full" and full["trainable_parameters"] == full["total_parameters"]
    assert (lora4["method"], lora4["peft"]["rank"], lora4["peft"]["alpha"]) == ("lora", 4, 8)
    assert 0 < lora4["trainable_parameters"] < lora16["trainable_parameters"] < full["trainable_parameters"]
    assert lora4["lr"] == lora16["lr"] == settings.lora_lr and full["lr"] == settings.lr
    # head-only: the image-code rows of the head, image_codes x dim
    model = load_model(demo_with_decoder[1] / "train" / "model.ckpt")
    config = model.config
    assert head["method"] == "head" and head["trainable_parameters"] == config.image_codes * config.dim
    # AdamW: 2 x 4 B per parameter it holds (the head-only arm's whole head matrix), plus a step count per tensor
    for name, cost in training.items():
        cost = cost["cost"]
        assert cost["optimizer_bytes"] == 8 * cost["optimizer_parameters"], name
        assert cost["optimizer_bytes"] <= cost["optimizer_state_bytes"] < cost["optimizer_bytes"] + 4096, name
        assert cost["peak_bytes"] >= cost["parameter_bytes"] + cost["optimizer_state_bytes"] > 0, name
        assert cost["seconds_per_step"] > 0 and len(cost["timed_step_seconds"]) == experiment.PEAK_STEPS - 2
    assert head["optimizer_parameters"] == config.vocab_size * config.dim
    # the frozen decoder's optimizer state and gradients are what the PEFT arms save
    assert all(full["peak_bytes"] > c["peak_bytes"] for c in (lora4, lora16, head))
    # head-only moved the head's image-code rows and nothing else (the LoRA arms' saved decoders are merged)
    tuned = load_model(training["head_only"]["checkpoint"]).state_dict()
    for key, before in model.state_dict().items():
        rows = slice(config.image_offset, config.image_offset + config.image_codes)
        if key == "head.weight":
            assert torch.equal(tuned[key][: config.image_offset], before[: config.image_offset])
            assert torch.equal(tuned[key][rows.stop :], before[rows.stop :])
            assert not torch.equal(tuned[key][rows], before[rows])
        else:
            assert torch.equal(tuned[key], before), key
    merged = load_model(training["lora_r4"]["checkpoint"]).state_dict()
    assert set(merged) == set(model.state_dict())
    assert not torch.equal(merged["layers.0.attn.qkv.weight"], model.state_dict()["layers.0.attn.qkv.weight"])


def test_scores_cover_every_category_and_forgetting_is_measured(smoke):
    settings, record = smoke
    for name, r in record["results"].items():
        assert set(r["categories"]) == set(chat_data.CATEGORIES), name
        for category, c in r["categories"].items():
            assert c["count"] == settings.held_out_per_category, category
            assert 0.0 <= c["accuracy"] <= 1.0
        for key in ("image_when_none_asked", "text_only_when_image_asked", "mean_accuracy"):
            assert 0.0 <= r[key] <= 1.0
        loss = r["held_out_pretraining_loss"]
        assert loss["targets"] == loss["text_targets"] + loss["image_targets"] > 0
        assert all(np.isfinite(loss[k]) and loss[k] > 0 for k in ("all", "text", "image"))
        assert r["generated_tokens"] > 0
        assert len(r["answers"]) == len(chat_data.CATEGORIES) * settings.held_out_per_category
    # the SFT arms start from the pretrained decoder and move away from it
    before = record["results"]["pretrained"]["held_out_pretraining_loss"]["all"]
    assert all(record["results"][arm]["held_out_pretraining_loss"]["all"] != before for arm in record["training"])


def test_outputs_are_written(smoke):
    settings, record = smoke
    out = settings.out_dir
    saved = json.loads(open(f"{out}/results.json").read())
    assert saved["results"]["answer_only"]["categories"] == record["results"]["answer_only"]["categories"]
    table = open(f"{out}/results.md").read()
    assert all(f"| {arm} |" in table for arm in experiment.ARMS)
    page = open(record["samples"]).read()
    assert page.startswith("<!doctype html>") and all(c in page for c in chat_data.CATEGORIES)
    shown = min(settings.samples_shown, settings.held_out_per_category)
    assert page.count("<img") >= shown * 2  # the prompts' images (visual chat and interleaved)
    assert saved["data"]["held_out"] == dict.fromkeys(chat_data.CATEGORIES, settings.held_out_per_category)
    for arm, r in record["results"].items():  # every arm was scored by `train.py eval --suite chat`, page and all
        scored = json.loads((experiment.Path(r["page"]).parent / "results.json").read_text())
        assert scored["suite"] == "chat" and scored["figures"]["categories"] == r["categories"], arm
        assert f'href="{arm}/eval/index.html"' in page


def test_the_suite_answers_the_written_held_out_conversations_in_the_chat_template(smoke, demo_with_decoder):
    from evaluation.base import EvalSettings
    from evaluation.chat import ChatOptions, ChatSuite
    from evaluation.digits import pixels
    from evaluation.run import load_context
    from tokenizer.chat import Turn, encode_segments, prompt_segments

    settings, record = smoke
    _, folder = demo_with_decoder
    chat = experiment.Path(settings.out_dir) / "chat"
    conversations = chat_data.read_labels(chat, "held_out")
    assert {c.split for c in conversations} == {"held_out"}
    context = load_context(folder / "train" / "model.ckpt", folder / "vocab" / "tokenizer.json",
                           folder / "tokenizer" / "model", EvalSettings())
    suite = ChatSuite(ChatOptions(demo_dir=str(folder), conversations=str(chat / "held_out.jsonl")))
    read, user_parts = suite.conversations(context)
    assert read == conversations
    vocab, tokenizer = context.vocab, context.media_tokenizer
    for c, parts in zip(conversations, user_parts):
        images = {id(p): tokenizer.encode(pixels([p]))[0] for p in parts if not isinstance(p, str)}
        coded = [images.get(id(p), p) for p in parts]
        ids = encode_segments(vocab, prompt_segments(vocab, [Turn("user", tuple(coded))]),
                              grid_shape=tuple(tokenizer.grid_shape))
        assert ids[0] == vocab.bos_id and ids[-1] == vocab.sep_id
        assert ids.count(vocab.boi_id) == (c.category in ("visual_chat", "interleaved"))


def test_command_line_options():
    parser = experiment.build_parser()
    smoke = experiment.config_from_args(parser.parse_args(["--smoke", "--steps", "3", "--lr", "1e-3"]))
    assert (smoke.demo, smoke.out_dir, smoke.steps, smoke.lr) == ("smoke", "runs/sft-smoke", 3, 1e-3)
    full = experiment.config_from_args(parser.parse_args([]))
    assert (full.demo, full.out_dir) == ("full", "runs/sft")
    assert (full.lr, full.lora_lr, full.head_lr) == (3e-4, 1e-3, None)
    assert full.arms is None
    lr = experiment.config_from_args(parser.parse_args(["--lora-lr", "5e-4", "--head-lr", "1e-3", "--arms",
                                                        "lora_r4, head_only"]))
    assert lr.arms == ["lora_r4", "head_only"]
    assert (experiment.arm_lr(lr, experiment.ARMS["lora_r16"]), experiment.arm_lr(lr, experiment.ARMS["head_only"]),
            experiment.arm_lr(lr, experiment.ARMS["answer_only"])) == (5e-4, 1e-3, 3e-4)
    from experiments.run import EXPERIMENTS

    assert EXPERIMENTS["sft"][0] == "experiments.sft"
