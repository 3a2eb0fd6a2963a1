"""The end-to-end demo at its reduced `smoke` size: the report exists, its images load, its figures beat chance."""

from __future__ import annotations

import base64
import io
import json
import re

import numpy as np
import pytest
from PIL import Image

from fusion_model.demo import pipeline
from fusion_model.demo.datasets import (
    arithmetic_pairs,
    caption,
    caption_texts,
    load_digits,
    parse_digit,
    pick_by_label,
    worded_sum,
)

CHANCE = 0.10  # ten digits


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Run every stage once at the smoke size; the tests below read what it left behind."""
    out = tmp_path_factory.mktemp("demo")
    config = pipeline.load_config("smoke")
    config["out_dir"] = str(out)
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


def test_rerun_reuses_every_finished_stage(demo):
    config, out, records = demo
    messages: list[str] = []
    again = pipeline.run(config, progress=False, log=messages.append)
    assert all("reusing" in m for m in messages) and len(messages) == len(pipeline.STAGES)
    assert again["generate"]["generation_accuracy"] == records["generate"]["generation_accuracy"]


def test_changed_setting_reruns_that_stage_and_those_after_it():
    config = pipeline.load_config("smoke")
    changed = json.loads(json.dumps(config))
    changed["generate"]["cfg_scale"] = 1.0
    keys = {stage: pipeline.stage_key(config, stage) for stage in pipeline.STAGES}
    new_keys = {stage: pipeline.stage_key(changed, stage) for stage in pipeline.STAGES}
    assert [s for s in pipeline.STAGES if keys[s] != new_keys[s]] == ["generate", "report"]


def test_a_rerun_upstream_stage_makes_every_later_stage_stale(tmp_path):
    config = pipeline.load_config("smoke")
    for stage in pipeline.STAGES:  # markers as a finished run leaves them
        inputs = {up: f"run-{up}" for up in pipeline.UPSTREAM[stage]}
        pipeline.write_json(tmp_path / stage / "stage.json", {
            "key": pipeline.stage_key(config, stage), "run_id": f"run-{stage}", "inputs": inputs, "seconds": 1.0})
    assert all(pipeline.is_fresh(tmp_path, config, stage) for stage in pipeline.STAGES)
    marker = pipeline.read_marker(tmp_path, "shards")
    pipeline.write_json(tmp_path / "shards" / "stage.json", {**marker, "run_id": "run-shards-again"})  # --force shards
    stale = [stage for stage in pipeline.STAGES if not pipeline.is_fresh(tmp_path, config, stage)]
    assert stale == ["train", "generate", "report"]


def test_partial_outputs_survive_only_under_the_same_configuration(tmp_path):
    folder = tmp_path / "train"
    pipeline.prepare_folder(folder, "key-a")
    (folder / "last.ckpt").write_text("partial")
    pipeline.prepare_folder(folder, "key-a")
    assert (folder / "last.ckpt").exists()  # an interrupted stage resumes from what it left
    pipeline.prepare_folder(folder, "key-b")
    assert not (folder / "last.ckpt").exists()  # another configuration starts over
    (folder / "last.ckpt").write_text("partial")
    pipeline.prepare_folder(folder, "key-b", fresh=True)  # --force
    assert not (folder / "last.ckpt").exists()


def test_a_stage_alone_needs_its_upstream_stages(tmp_path):
    config = pipeline.load_config("smoke")
    config["out_dir"] = str(tmp_path)
    with pytest.raises(RuntimeError, match="needs stage 'tokenizer'"):
        pipeline.run(config, stages=["shards"], progress=False, log=lambda message: None)


def test_cli_rejects_unknown_override_with_a_clear_message(capsys):
    assert pipeline.main(["--preset", "smoke", "--set", "train.no_such_key=1"]) == 2
    assert "unknown key 'no_such_key'" in capsys.readouterr().err


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


def test_answer_image_is_read_after_the_generated_text():
    from types import SimpleNamespace

    from fusion_model.demo.evaluate import _image_codes, _text_before_image

    vocab = SimpleNamespace(boi_id=8, eoi_id=9, eos_id=2, image_offset=16, image_codes=4,
                            decode_text=lambda ids: " ".join(map(str, ids)))
    rows = [[100, 101, 8, 16, 17, 18, 19, 9, 2],  # text, then a whole image
            [8, 19, 18, 17, 16, 9],  # an image straight away
            [100, 8, 16, 17, 9],  # the image stops early
            [100, 101, 2]]  # no image at all
    codes, complete = _image_codes(vocab, rows, (2, 2))
    assert complete.tolist() == [True, True, False, False]
    assert codes[0].flatten().tolist() == [0, 1, 2, 3] and codes[1].flatten().tolist() == [3, 2, 1, 0]
    assert _text_before_image(vocab, rows[0]) == "100 101" and _text_before_image(vocab, rows[3]) == "100 101"


def test_free_cores_counts_idle_cores_only():
    import os

    assert 1 <= pipeline.free_cores(window=0.05) <= (os.cpu_count() or 1)
