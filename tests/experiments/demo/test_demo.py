"""The end-to-end demo at its reduced `smoke` size: the report exists, its images load, its figures beat chance."""

from __future__ import annotations

import base64
import io
import json
import re
import shlex
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from experiments.demo import bookkeeping, pipeline
from experiments.demo.datasets import (
    arithmetic_pairs,
    caption,
    caption_texts,
    load_digits,
    parse_digit,
    pick_by_label,
    worded_sum,
)
from experiments.demo.settings import FIT_CONFIG, load_config

CHANCE = 0.10  # ten digits


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Run every stage once at the smoke size; the tests below read what it left behind.

    Step counts, not minutes, bound the training here (the smoke preset's time budgets reach about these counts on
    one idle core): on a loaded machine a time budget trains less and the figures fall to chance.
    """
    out = tmp_path_factory.mktemp("demo")
    steps = ["tokenizer.max_steps=240", "tokenizer.max_minutes=10", "train.max_steps=260", "train.max_minutes=15"]
    config = replace(load_config("smoke", None, steps), out_dir=str(out))
    records = pipeline.run(config, progress=False, log=lambda message: None)
    return config, out, records


def test_report_exists_and_every_image_loads(demo):
    _, out, records = demo
    report = out / "report.html"
    assert records["report"]["path"] == str(report)
    text = report.read_text(encoding="utf-8")
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    # tokenizer pairs, 2 loss plots, 10 caption rows, held-out captions, 3 images per arithmetic row
    assert len(images) >= 12 + 2 + 10 + 12
    for data in images:
        with Image.open(io.BytesIO(base64.b64decode(data))) as image:
            image.load()
            assert min(image.size) >= 16
    assert "src=\"http" not in text and "<script" not in text  # self-contained: nothing to fetch
    for heading in ("Evaluation", "Image tokenizer", "Training losses", "Images generated from captions",
                    "Captions written for held-out images", "Interleaved arithmetic", "Configuration and timings"):
        assert heading in text
    for name in ("understanding_accuracy", "generation_accuracy", "interleaved_accuracy"):
        assert f"{records['generate'][name]:.1%}" in text  # the report states the measured figures


def test_figures_are_above_chance(demo):
    _, _, records = demo
    generate = records["generate"]
    # The classifier that judges generated images must itself read real digits well.
    assert generate["classifier_accuracy_real"] > 0.8
    assert generate["understanding_accuracy"] > 2 * CHANCE, generate
    assert generate["generation_accuracy"] > 2 * CHANCE, generate
    distribution = ("frechet_distance", "frechet_distance_t1_cfg1", "diversity", "diversity_t1_cfg1", "diversity_real")
    assert all(np.isfinite(generate[key]) for key in distribution), {key: generate.get(key) for key in distribution}
    tokenizer = records["tokenizer"]
    assert tokenizer["psnr_db"] > 13.0  # the mean digit image scores 12.8 dB on every held-out digit
    assert tokenizer["codebook_used"] > 32
    train = records["train"]
    assert train["tokens"] > 0 and train["steps"] > 0


def test_losses_fall_and_are_recorded_per_modality(demo):
    _, out, _ = demo
    losses = json.loads((out / "train" / "losses.json").read_text())
    assert len(losses["step"]) >= 2
    for name in ("text", "image"):
        assert np.isfinite(losses[name]).all()
        assert losses[name][-1] < losses[name][0], name


def test_train_stage_records_the_equivalent_fit_command(demo):
    from fusion_model.checkpoint import load_model
    from fusion_model.cli.fit import fit_from_config

    _, out, records = demo
    argv = shlex.split(records["train"]["command"])
    assert argv[:5] == ["python", "train.py", "fit", "--config", records["train"]["fit_config"]]
    cli = fit_from_config(None, argv[3:], run=False)
    assert cli.model.model_config == load_model(out / "train" / "model.ckpt").config


def test_fusion_experiment_compares_early_and_each_late_fusion_model_on_the_demo_outputs(demo, tmp_path):
    from experiments import fusion as experiment

    config, out, _ = demo
    settings = experiment.ExperimentConfig(demo="smoke", demo_dir=str(out), out_dir=str(tmp_path), steps=12,
                                           blind_lm_steps=12, llava_stage1_steps=4, qformer_stage1_steps=6,
                                           albums=40, examples=40, few_shot_examples=16)
    record = experiment.run(settings, log=lambda message: None)
    results = record["results"]
    assert list(results) == ["early", "early_text_loss", "early_from_lm", "llava_stage1", "llava", "qformer", "flamingo"]
    # image positions in the decoder's context: every patch (early, LLaVA), M queries, none (Flamingo cross-attends)
    assert [results[k]["image_positions_per_image"] for k in results] == [16, 16, 16, 16, 16, settings.num_queries, 0]
    assert results["early"]["parameters_added"] == 0 and all(results[k]["parameters_added"] > 0 for k in
                                                             ("llava", "qformer", "flamingo"))
    # frozen decoders (LLaVA stage 1, Q-Former, Flamingo) train only their connector; LLaVA's stage 2 trains the
    # decoder as well
    for kind in ("llava_stage1", "qformer", "flamingo"):
        assert results[kind]["trainable_parameters"] == results[kind]["parameters_added"]
    assert results["llava"]["trainable_parameters"] == results["llava"]["parameters_added"] + \
        results["llava"]["decoder_parameters"]
    assert results["llava"]["steps"] == settings.steps == results["early"]["steps"]
    # the same documents: a Flamingo image costs one marker, so it trains on the fewest decoder positions
    assert results["flamingo"]["decoder_positions"] < results["qformer"]["decoder_positions"] < \
        results["early"]["decoder_positions"]
    for r in results.values():
        assert 0.0 <= r["understanding_accuracy"] <= 1.0 and set(r["few_shot_accuracy"]) == {"0", "1", "4"}
    assert all(0.0 <= results[k]["generation_accuracy"] <= 1.0 for k in experiment.EARLY)
    table = (tmp_path / "results.md").read_text()
    assert all(f"| {kind} |" in table for kind in results)
    assert json.loads((tmp_path / "results.json").read_text())["results"] == results


def test_greedy_captions_of_the_early_model_are_the_samplers_greedy_captions(demo):
    from experiments import fusion as experiment
    from experiments.demo.stages import digits_for, load_decoder, load_image_tokenizer, load_vocab
    from fusion_model.sampling import SamplingConfig, generate_ids

    config, out, _ = demo
    digits = digits_for(config)
    tokenizer, vocab, model = load_image_tokenizer(out), load_vocab(out), load_decoder(out)
    from experiments.demo.datasets import to_model_images

    with torch.no_grad():
        codes, features = tokenizer.encode_with_features(to_model_images(digits.test_images[:24], 64))
        prompts = [vocab.encode_document([grid], bos=True, eos=False) for grid in codes]  # <s> <boi> codes <eoi>
        greedy_text = SamplingConfig(mode="text", text_temperature=0.0, max_new_tokens=16,
                                     image_grid=tuple(codes.shape[1:]))
        sampled = [vocab.decode_text([t for t in ids if t != vocab.eos_id]).strip()
                   for ids in generate_ids(model, vocab, prompts, greedy_text)]
        ids, per_position = experiment.prompts_with_features(vocab, [[c] for c in codes], [[f] for f in features],
                                                             features.shape[-1])
        greedy = experiment.greedy_captions(experiment.early_decodable(model), ids, per_position, vocab)
    assert greedy == sampled


def test_fusion_experiment_needs_a_finished_demo_and_names_the_command(tmp_path, capsys):
    from experiments.commands import main

    assert main(["experiment", "fusion", "--demo", "smoke", "--demo-dir", str(tmp_path), "--out",
                 str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "python train.py demo --preset smoke" in error and len(error.strip().splitlines()) == 1
    assert main(["experiment", "nothing"]) == 2


def test_the_generate_stage_is_the_digits_suite_and_its_recorded_eval_command_repeats_it(demo, tmp_path):
    from experiments.commands import main

    config, out, records = demo
    generate = records["generate"]
    figures = generate["figures"]
    assert generate["understanding_accuracy"] == figures["understanding"]["accuracy"]
    assert generate["generation_accuracy_t1_cfg1"] == figures["distribution"]["plain"]["accuracy"]
    assert generate["understanding_count"] == config.generate.understanding_examples
    assert generate["generation_count"] == 10 * config.generate.images_per_caption
    assert generate["interleaved_count"] == config.generate.arithmetic_examples
    assert generate["text_loss"] > 0
    argv = shlex.split(generate["command"])
    assert argv[:3] == ["python", "train.py", "eval"]
    eval_out = tmp_path / "eval"
    assert main([*argv[2:argv.index("--out")], *argv[argv.index("--out") + 2:], "--out", str(eval_out)]) == 0
    assert json.loads((eval_out / "results.json").read_text())["figures"] == json.loads(
        (out / "generate" / "stage.json").read_text())["figures"]  # both read back from JSON (tuples as lists)


def test_the_suite_scores_the_held_out_digits_of_the_demos_split(tmp_path):
    from experiments.demo.stages import digits_for, eval_setup

    config = load_config("smoke")
    assert config.data.train_limit is not None  # a limited training part: the split must still agree
    _, options = eval_setup(config, tmp_path)
    suite_split = load_digits(held_out=options.held_out, seed=options.split_seed)  # what DigitSuite.run draws
    demo_split = digits_for(config)
    assert np.array_equal(suite_split.test_images, demo_split.test_images)
    assert np.array_equal(suite_split.test_labels, demo_split.test_labels)


def test_rerun_reuses_every_finished_stage(demo):
    config, out, records = demo
    messages: list[str] = []
    again = pipeline.run(config, progress=False, log=messages.append)
    assert all("reusing" in m for m in messages) and len(messages) == len(bookkeeping.STAGES)
    assert again["generate"]["generation_accuracy"] == records["generate"]["generation_accuracy"]


def test_changed_setting_reruns_that_stage_and_those_after_it():
    config = load_config("smoke")
    changed = replace(config, generate=replace(config.generate, cfg_scale=1.0))
    keys = {stage: bookkeeping.stage_key(config, stage) for stage in bookkeeping.STAGES}
    new_keys = {stage: bookkeeping.stage_key(changed, stage) for stage in bookkeeping.STAGES}
    assert [s for s in bookkeeping.STAGES if keys[s] != new_keys[s]] == ["generate", "report"]


def test_a_rerun_upstream_stage_makes_every_later_stage_stale(tmp_path):
    config = load_config("smoke")
    for stage in bookkeeping.STAGES:  # markers as a finished run leaves them
        inputs = {up: f"run-{up}" for up in bookkeeping.UPSTREAM[stage]}
        bookkeeping.write_marker(tmp_path, stage, {
            "key": bookkeeping.stage_key(config, stage), "run_id": f"run-{stage}", "inputs": inputs,
            "seconds": 1.0})
    assert all(bookkeeping.is_fresh(tmp_path, config, stage) for stage in bookkeeping.STAGES)
    marker = bookkeeping.read_marker(tmp_path, "shards")
    bookkeeping.write_marker(tmp_path, "shards", {**marker, "run_id": "run-shards-again"})  # --force shards
    stale = [stage for stage in bookkeeping.STAGES if not bookkeeping.is_fresh(tmp_path, config, stage)]
    assert stale == ["train", "generate", "report"]


def test_partial_outputs_survive_only_under_the_same_configuration(tmp_path):
    folder = tmp_path / "train"
    bookkeeping.prepare_folder(folder, "key-a")
    (folder / "last.ckpt").write_text("partial")
    bookkeeping.prepare_folder(folder, "key-a")
    assert (folder / "last.ckpt").exists()  # an interrupted stage resumes from what it left
    bookkeeping.prepare_folder(folder, "key-b")
    assert not (folder / "last.ckpt").exists()  # another configuration starts over
    (folder / "last.ckpt").write_text("partial")
    bookkeeping.prepare_folder(folder, "key-b", fresh=True)  # --force
    assert not (folder / "last.ckpt").exists()


def test_a_stage_alone_needs_its_upstream_stages(tmp_path):
    config = replace(load_config("smoke"), out_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="needs stage 'tokenizer'"):
        pipeline.run(config, stages=["shards"], progress=False, log=lambda message: None)


def test_cli_rejects_unknown_override_with_a_clear_message(capsys):
    assert pipeline.main(["--preset", "smoke", "--set", "train.no_such_key=1"]) == 2
    assert "unknown key 'no_such_key'" in capsys.readouterr().err


def test_overrides_are_typed_by_the_config_dataclasses(tmp_path, capsys):
    config = load_config("smoke", overrides=["train.lr=0.01", "data.train_limit=null",
                                             "tokenizer.overrides={base_channels: 16}"])
    assert config.train.lr == 0.01 and config.data.train_limit is None
    assert config.tokenizer.overrides == {"base_channels": 16}
    assert pipeline.main(["--preset", "smoke", "--set", "train.max_steps=many"]) == 2
    assert '"train.max_steps"' in capsys.readouterr().err
    assert pipeline.main(["--preset", "smoke", "--set", "nosection.key=1"]) == 2
    assert "no config section 'nosection'" in capsys.readouterr().err
    typo = tmp_path / "typo.yaml"
    smoke = FIT_CONFIG.parents[1] / "demo" / "smoke.yaml"
    typo.write_text(smoke.read_text().replace("held_out:", "hold_out:"))
    assert pipeline.main(["--config", str(typo)]) == 2
    assert "hold_out" in capsys.readouterr().err


def test_train_stage_composes_the_fit_config_with_the_demo_overrides(tmp_path):
    from experiments.demo.recorder import LossRecorder
    from experiments.demo.stages import fit_overrides
    from fusion_model.cli.fit import fit_from_config
    from fusion_model.config import FusionConfig
    from fusion_model.training.callbacks import TimeBudget

    vocab = SimpleNamespace(vocab_size=1000, image_offset=16, image_codes=512)
    overrides = fit_overrides(load_config("smoke"), tmp_path, vocab, progress=False)
    cli = fit_from_config(FIT_CONFIG, overrides, run=False)
    # the demo preset with the vocabulary's sizes and the smoke section's dropout, lr and warmup
    assert cli.model.model_config == FusionConfig.from_preset("demo", vocab_size=1000, image_offset=16,
                                                              image_codes=512, dropout=0.0)
    hparams = cli.model.hparams
    assert (hparams.lr, hparams.warmup_steps, hparams.weight_decay) == (3e-3, 20, 0.1)
    assert hparams.lr_schedule == "cosine"
    data = cli.datamodule
    assert (data.seq_len, data.batch_size, data.train_dir) == (256, 8, str(tmp_path / "shards" / "tokens"))
    assert data.vocab == str(tmp_path / "vocab" / "tokenizer.json")
    trainer = cli.trainer
    assert trainer.log_every_n_steps == 5 and trainer.max_steps == 1_000_000
    assert trainer.default_root_dir == str(tmp_path / "train")
    assert [c.seconds for c in trainer.callbacks if isinstance(c, TimeBudget)] == [75.0]  # max_minutes 1.25
    recorders = [c.path for c in trainer.callbacks if isinstance(c, LossRecorder)]
    assert recorders == [tmp_path / "train" / "losses.json"]


def test_held_out_split_is_disjoint_and_shuffled():
    split = load_digits(held_out=500)
    assert len(split.test_labels) == 500 and len(split.train_labels) == 4500
    assert set(np.bincount(split.test_labels, minlength=10) > 20) == {True}  # every digit is held out
    train = {img.tobytes() for img in split.train_images}
    assert not any(img.tobytes() in train for img in split.test_images)


def test_captions_name_their_digit_and_arithmetic_keeps_the_whole_sum():
    for digit in range(10):
        for variant in range(4):
            assert parse_digit(caption(digit, variant)) == digit
    assert parse_digit("nothing here") is None
    rng = np.random.default_rng(0)
    pairs = arithmetic_pairs(rng, 1000)
    assert pairs.min() >= 0 and pairs.sum(axis=1).max() <= 9  # the answer is one whole digit image
    labels = np.arange(100) % 10
    assert (labels[pick_by_label(labels, pairs[:, 0], rng)] == pairs[:, 0]).all()


def test_arithmetic_documents_word_the_sum_before_the_answer_image():
    assert worded_sum(3, 4) == ": three plus four is seven"
    assert parse_digit(worded_sum(2, 5)) == 7  # the last number word is the answer
    texts = caption_texts()
    assert all(worded_sum(a, b) in texts for a in range(10) for b in range(10 - a))  # the BPE sees every sum
