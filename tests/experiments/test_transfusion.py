"""`train.py experiment transfusion` in its smoke mode, on a demo cut down to the stages it reuses: structure and
sanity; the FLOP-parity rule on hand-made runs."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from experiments import transfusion as experiment

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the fixtures are in conftest.py


@pytest.fixture(scope="module")
def smoke(finished_demo, tmp_path_factory):
    """The smoke mode's record (run once for the tests below)."""
    demo, out = finished_demo
    settings = replace(experiment.smoke_config(str(out), str(tmp_path_factory.mktemp("transfusion"))),
                       understanding_examples=10)
    return settings, experiment.run(settings, log=lambda message: None, demo=demo)


def test_both_families_train_every_size_and_budget_on_the_same_documents(smoke):
    settings, record = smoke
    runs = record["runs"]
    expected = {experiment.run_name(s, b, a) for s in settings.sizes for b in settings.budgets
                for a in ("chameleon", "transfusion")}
    expected.add(experiment.run_name(settings.ablation_size, max(settings.budgets), "transfusion_causal"))
    assert set(runs) == expected and record["complete"]
    for size in settings.sizes:
        for steps in settings.budgets:
            chameleon = runs[experiment.run_name(size, steps, "chameleon")]
            transfusion = runs[experiment.run_name(size, steps, "transfusion")]
            assert chameleon["family"] == "chameleon" and transfusion["family"] == "transfusion"
            assert chameleon["steps"] == transfusion["steps"] == steps
            # a latent image is as many positions as its codes: the same documents pack into the same rows
            assert chameleon["decoder_positions"] == transfusion["decoder_positions"] > 0
            assert chameleon["architecture"] == transfusion["architecture"]
            # Transfusion's FLOPs count its patch projections and timestep MLP on top of the same decoder
            assert transfusion["flops_per_token"] > chameleon["flops_per_token"]
            for r in (chameleon, transfusion):
                assert r["flops"] == pytest.approx(r["flops_per_token"] * r["decoder_positions"])
    causal = runs[experiment.run_name(settings.ablation_size, max(settings.budgets), "transfusion_causal")]
    assert causal["family_options"]["image_bidirectional"] is False
    assert runs[experiment.run_name(settings.ablation_size, max(settings.budgets), "transfusion")][
        "family_options"]["image_bidirectional"] is True
    # the continuous tokenizer got the VQ tokenizer's steps (the fixture's tokenizer.max_steps)
    assert record["continuous_tokenizer"]["key"]["steps"] == 4
    assert record["continuous_tokenizer"]["key"]["preset"] == "kl-demo-64"


def test_every_run_is_scored_the_same_way(smoke):
    settings, record = smoke
    per = settings.images_per_caption
    for name, r in record["runs"].items():
        assert r["generation_count"] == 10 * per, name
        assert 0.0 <= r["generation_accuracy"] <= 1.0 and 0.0 <= r["understanding_accuracy"] <= 1.0
        assert r["understanding_count"] == settings.understanding_examples
        if r["complete"] >= 2:
            assert np.isfinite(r["frechet_distance"]) and r["frechet_distance"] >= 0
        assert np.isfinite(r["held_out"]["text_loss"]) and r["held_out"]["text_loss"] > 0
        assert r["seconds"] > 0 and r["flops"] > 0
        if r["family"] == "transfusion":
            assert r["complete"] == 10 * per and "diffusion_mse" in r["held_out"]
    floors = record["floors"]
    assert all(np.isfinite(floors[k]) and floors[k] >= 0 for k in ("real", "vq_reconstructed", "kl_reconstructed"))
    assert floors["sample_count"] == 10 * per  # floors are measured on as many images as one generation pass


def test_outputs_are_written(smoke):
    settings, record = smoke
    out = settings.out_dir
    saved = json.loads(open(f"{out}/results.json").read())
    assert saved["flop_parity"] == json.loads(json.dumps(record["flop_parity"]))
    table = open(f"{out}/results.md").read()
    assert all(f"| {name} |" in table for name in record["runs"])
    assert "FLOP parity" in table and "Causal-only image attention" in table
    [path] = record["plots"]
    with open(path, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"


def test_flop_parity_rule():
    def r(size, steps, arm, flops, fd):
        return {"size": size, "steps": steps, "arm": arm, "flops": flops, "frechet_distance": fd}

    runs = {"a": r("s", 1, "chameleon", 100.0, 9.0), "b": r("s", 2, "chameleon", 200.0, 5.0),
            "c": r("s", 1, "transfusion", 110.0, 6.0), "d": r("s", 2, "transfusion", 220.0, 4.0),
            "e": r("t", 1, "transfusion", 50.0, 5.0), "f": r("t", 1, "transfusion_causal", 10.0, 1.0)}
    parity = experiment.flop_parity(runs)
    # Chameleon's best is 5.0 at 200 FLOPs; the cheapest bidirectional Transfusion run at or below it costs 50
    assert parity["chameleon_best_fd"] == 5.0 and parity["transfusion_run"] == "t_1_transfusion"
    assert parity["flop_ratio"] == pytest.approx(0.25)
    assert experiment.flop_parity(runs, ("s",))["flop_ratio"] == pytest.approx(220 / 200)
    runs["d"]["frechet_distance"] = 5.5
    assert experiment.flop_parity(runs, ("s",))["flop_ratio"] is None  # never reached: None, not 1.0


def test_the_command_needs_a_finished_demo(tmp_path, capsys):
    from experiments.commands import main

    threads = torch.get_num_threads()  # the command sets the process's thread count: restored below
    assert main(["experiment", "transfusion", "--smoke", "--demo-dir", str(tmp_path), "--out",
                 str(tmp_path / "o")]) == 2
    assert "python train.py demo --preset smoke" in capsys.readouterr().err
    torch.set_num_threads(threads)


def test_a_rerun_with_reuse_keeps_every_finished_run(smoke, finished_demo):
    settings, record = smoke
    demo, _ = finished_demo
    messages: list[str] = []
    again = experiment.run(replace(settings, reuse=True), log=messages.append, demo=demo)
    assert sum("reusing the finished run" in m for m in messages) == len(record["runs"])
    assert any("continuous tokenizer: reusing" in m for m in messages)
    def distances(result):  # as JSON: a NaN distance (fewer than two complete images) compares equal to itself
        return json.dumps({k: r["frechet_distance"] for k, r in result["runs"].items()})

    assert distances(again) == distances(record)
