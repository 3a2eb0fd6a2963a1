"""`train.py experiment mot` in its smoke mode, on a demo cut down to the stages it reuses: structure and sanity."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from experiments import mot as experiment

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the fixtures are in conftest.py


@pytest.fixture(scope="module")
def smoke(finished_demo, tmp_path_factory):
    """The smoke mode's record (run once for the tests below)."""
    demo, out = finished_demo
    settings = replace(experiment.smoke_config(str(out), str(tmp_path_factory.mktemp("mot"))),
                       understanding_examples=10)
    return settings, experiment.run(settings, log=lambda message: None, demo=demo)


def test_every_size_trains_a_dense_and_a_mot_run_with_the_same_flops_per_token(smoke):
    settings, record = smoke
    runs = record["runs"]
    expected = {experiment.run_name(s, a) for s in settings.sizes for a in ("dense", "mot")}
    expected |= {experiment.run_name(settings.ablation_size, a) for a in experiment.ABLATION}
    assert set(runs) == expected and record["complete"]
    for size, steps in zip(settings.sizes, settings.steps):
        dense, mot = runs[experiment.run_name(size, "dense")], runs[experiment.run_name(size, "mot")]
        assert dense["block"] == "dense" and mot["block"] == "mot"
        assert dense["steps"] == mot["steps"] == steps
        assert dense["decoder_positions"] == mot["decoder_positions"]  # the same batches
        assert dense["flops_per_token"] == mot["flops_per_token"] and dense["flops"] == mot["flops"]
        assert mot["active_parameters"] == dense["active_parameters"] == dense["parameters"]
        assert mot["parameters"] > dense["parameters"]
        assert mot["module_parameters"] == mot["parameters"]  # the closed form counts the module
    # the ablation arms keep some parts shared: fewer parameters than full MoT, more than dense
    ablation = [runs[experiment.run_name(settings.ablation_size, a)]["parameters"] for a in
                ("dense", *experiment.ABLATION)]
    assert ablation == sorted(ablation) and len(set(ablation)) == len(ablation)


def test_curves_are_per_modality_and_finite(smoke):
    settings, record = smoke
    for name, r in record["runs"].items():
        train, val = r["curves"]["train"], r["curves"]["val"]
        assert train["step"] == list(range(1, r["steps"] + 1)), name  # every step's training loss
        assert val["step"][-1] == r["steps"] and len(val["step"]) == r["steps"] // r["eval_every"]
        for modality in experiment.MODALITIES:
            assert np.isfinite(train[modality]).all() and np.isfinite(val[modality]).all()
            assert 0.0 < r["final_held_out"][modality] < 2 * np.log(r["architecture"]["vocab_size"])
        assert 0.0 <= r["understanding_accuracy"] <= 1.0 and 0.0 <= r["generation_accuracy"] <= 1.0
        assert r["step_seconds_in_run"] > 0


def test_steps_to_match_covers_every_mot_run_and_outputs_are_written(smoke):
    settings, record = smoke
    mot_runs = {name for name, r in record["runs"].items() if r["arm"] != "dense"}
    assert set(record["steps_to_match"]) == mot_runs
    for match in record["steps_to_match"].values():
        for modality in experiment.MODALITIES:
            for rule in ("held_out", "train_running_mean"):
                value = match[modality][rule]
                assert value is None or 0.0 < value <= 1.0
    assert set(record["speed"]) == set(settings.sizes)
    assert all(s["mot_over_dense"] > 0 for s in record["speed"].values())
    out = settings.out_dir
    assert json.loads(open(f"{out}/results.json").read())["steps_to_match"] == record["steps_to_match"]
    table = open(f"{out}/results.md").read()
    assert all(f"| {name} |" in table for name in record["runs"])
    assert len(record["plots"]) == len(settings.sizes) + 1
    for path in record["plots"]:
        with open(path, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_steps_to_match_rule():
    # MoT reaches dense's final 1.0 between its evaluations at steps 20 (1.5) and 30 (0.5): at step 25 of 40
    dense = {"val": {"step": [10, 20, 30, 40], "text": [3.0, 2.0, 1.5, 1.0], "image": [3.0, 2.0, 1.5, 1.0]},
             "train": {"step": [1, 2, 3, 4], "text": [4.0, 3.0, 2.0, 1.0], "image": [4.0, 3.0, 2.0, 1.0]}}
    mot = {"val": {"step": [10, 20, 30, 40], "text": [2.0, 1.5, 0.5, 0.4], "image": [3.0, 2.0, 1.5, 1.1]},
           "train": {"step": [1, 2, 3, 4], "text": [3.0, 1.0, 1.0, 1.0], "image": [4.0, 3.0, 2.0, 1.0]}}
    match = experiment.steps_to_match(dense, mot, 40, window=2)
    assert match["text"]["held_out"] == pytest.approx(25 / 40)
    assert match["image"]["held_out"] is None  # never reached: reported as such, not as 1.0
    # running means over 2 steps: dense ends at 1.5; MoT's are 2.0, 1.0, 1.0 at steps 2, 3, 4 -> reached at 2.5
    assert match["text"]["train_running_mean"] == pytest.approx(2.5 / 40)
    assert match["image"]["train_running_mean"] == pytest.approx(4 / 40)
    assert experiment.eval_interval(600, 12) == 50 and experiment.eval_interval(400, 12) == 40


def test_the_command_needs_a_finished_demo_made_with_the_named_settings(finished_demo, tmp_path, capsys):
    from experiments.commands import main

    _, out = finished_demo
    threads = torch.get_num_threads()  # the command sets the process's thread count: restored below
    assert main(["experiment", "mot", "--smoke", "--demo-dir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "python train.py demo --preset smoke" in capsys.readouterr().err
    # the folder holds a demo made with other settings (fewer held-out digits): its held-out split is not smoke's
    assert main(["experiment", "mot", "--smoke", "--demo-dir", str(out), "--out", str(tmp_path / "o")]) == 2
    assert "held-out digits" in capsys.readouterr().err
    assert main(["experiment", "nothing"]) == 2 and "mot" in capsys.readouterr().err
    torch.set_num_threads(threads)


def test_a_rerun_with_reuse_keeps_every_finished_run(smoke, finished_demo):
    settings, record = smoke
    demo, _ = finished_demo
    messages: list[str] = []
    again = experiment.run(replace(settings, reuse=True), log=messages.append, demo=demo)
    assert sum("reusing the finished run" in m for m in messages) == len(record["runs"])
    assert again["steps_to_match"] == record["steps_to_match"]
    assert {k: r["final_held_out"] for k, r in again["runs"].items()} == \
        {k: r["final_held_out"] for k, r in record["runs"].items()}
