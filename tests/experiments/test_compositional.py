"""`train.py experiment compositional` in its smoke mode, end to end in a tmp folder (about 15 s on one thread):
the files, equal training FLOPs across the arms, every skill scored for every arm, a --reuse rerun that retrains
nothing, and the doc rendered from results.json."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from experiments import compositional as experiment

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the fixture is in conftest.py


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke mode's settings and record (run once for the tests below)."""
    settings = experiment.smoke_config(str(tmp_path_factory.mktemp("compositional")))
    return settings, experiment.run(settings, log=lambda message: None)


def test_every_arm_trains_on_the_same_documents_at_the_same_flops(smoke):
    settings, record = smoke
    arms = record["arms"]
    assert list(arms) == list(settings.arms) == ["chameleon", "mot", "transfusion"] and record["complete"]
    assert [arms[a]["family"] for a in arms] == ["chameleon", "chameleon", "transfusion"]
    assert [arms[a]["block"] for a in arms] == ["dense", "mot", "dense"]
    for r in arms.values():
        assert r["steps"] == r["planned_steps"] >= 5
        assert r["flops_per_token"] == pytest.approx(r["planned_flops_per_token"])  # the plan counted what fit built
        assert r["flops"] == pytest.approx(r["flops_per_token"] * r["decoder_positions"])
        assert r["flops"] == pytest.approx(settings.flops_budget, rel=0.2)
        assert r["architecture"] == arms["chameleon"]["architecture"]
    flops = [r["flops"] for r in arms.values()]
    assert max(flops) / min(flops) - 1 == pytest.approx(record["flops_spread"]) and record["flops_spread"] < 0.1
    # Transfusion counts its patch projections and timestep MLP on top of the same decoder: fewer steps
    assert arms["transfusion"]["flops_per_token"] > arms["chameleon"]["flops_per_token"]
    assert arms["transfusion"]["steps"] < arms["chameleon"]["steps"]
    # both tokenizers trained for the same steps on the same images; one vocabulary
    vq, kl = record["tokenizers"]["vq"], record["tokenizers"]["kl"]
    assert vq["steps"] == kl["steps"] == settings.tokenizer_steps and vq["grid"] == kl["grid"] == [8, 8]
    assert (vq["key"]["preset"], kl["key"]["preset"]) == ("scenes-64", "kl-scenes-64")
    assert record["vocab"]["image_codes"] == 256


def test_every_skill_is_scored_for_every_arm(smoke):
    from data_shards.scenes import SKILLS

    settings, record = smoke
    for arm, r in record["arms"].items():
        figures = r["figures"]
        assert set(figures["generation"]) == set(SKILLS), arm
        for s in figures["generation"].values():
            assert s["count"] == settings.prompts_per_skill * settings.samples_per_prompt
            assert 0.0 <= s["accuracy"] <= 1.0 and s["ceiling_ground_truth"] == 1.0
            assert isinstance(s["ranked"], bool)
        assert 0.0 <= figures["understanding"]["overall"] <= 1.0
        assert figures["text_loss"] > 0
        assert {"frechet_distance", "frechet_real", "frechet_reconstruction", "diversity",
                "diversity_real"} <= set(figures["distribution"])
        assert json.loads((Path(settings.out_dir) / arm / "eval" / "results.json").read_text())["suite"] == "scenes"


def test_outputs_are_written(smoke):
    settings, record = smoke
    out = Path(settings.out_dir)
    saved = json.loads((out / "results.json").read_text())
    assert saved["arms"].keys() == record["arms"].keys() and saved["complete"]
    table = (out / "results.md").read_text()
    assert all(a in table for a in record["arms"]) and all(s in table for s in experiment.skills_of(record))
    assert (out / "plots" / "skills.png").stat().st_size > 1000


def test_a_rerun_with_reuse_retrains_nothing(smoke):
    settings, record = smoke
    logged: list[str] = []
    again = experiment.run(replace(settings, reuse=True), log=logged.append)
    assert sum("reusing" in line for line in logged) == 2 * len(settings.arms) + 4  # raw, 2 tokenizers, vocab
    for arm, r in record["arms"].items():
        assert again["arms"][arm]["last_checkpoint"] == r["last_checkpoint"]
        assert again["arms"][arm]["figures"] == json.loads(json.dumps(r["figures"]))


def test_the_doc_is_rendered_from_results_json(smoke, tmp_path):
    settings, record = smoke
    doc = experiment.render_doc(Path(settings.out_dir) / "results.json", tmp_path / "compositional.md")
    text = doc.read_text()
    assert text.startswith("# Compositional generation") and experiment.DOC_PLOT in text
    assert (tmp_path / experiment.DOC_PLOT).is_file()
    with pytest.raises(ValueError, match="smoke"):  # a smoke run never becomes the recorded doc
        experiment.render_doc(Path(settings.out_dir) / "results.json")
    # two runs (e.g. two budgets) are two sections; a hand-written reading survives a new render
    doc.write_text(text + "\n## Reading\n\nwritten by hand\n")
    experiment.render_doc([Path(settings.out_dir) / "results.json"] * 2, doc)
    again = doc.read_text()
    assert again.count("## Budget") == 2 and again.endswith("## Reading\n\nwritten by hand\n")


def test_seeds_of_one_budget_are_compared_side_by_side(smoke):
    _, smoke_record = smoke
    record, other = json.loads(json.dumps(smoke_record)), json.loads(json.dumps(smoke_record))
    other["config"]["seed"] = 7
    for run, score in ((record, 0.25), (other, 0.5)):  # the smoke run ranks no skill: its score is None
        for arm in run["arms"].values():
            arm["figures"]["summary"]["generation_score"] = score
    assert experiment.seeds_table([record]) == []  # one seed: nothing to compare
    lines = experiment.seeds_table([other, record])
    assert lines[0].startswith("## Seeds at") and f"| seed {record['config']['seed']} | seed 7 |" in lines[2]
    chameleon = next(line for line in lines if line.startswith("| chameleon | generation score"))
    assert chameleon == "| chameleon | generation score | 25.0% | 50.0% | 37.5% | 25.0% |"
    assert f"{record['config']['seed']}, 7" in experiment._seeds_sentence([record, other])


def test_the_command_line_takes_the_smoke_mode_and_options():
    parser = experiment.build_parser()
    config = experiment.config_from_args(parser.parse_args(["--smoke", "--out", "x", "--arms", "mot",
                                                            "--flops-budget", "1e10", "--seed", "3"]))
    assert (config.out_dir, config.arms, config.flops_budget, config.seed, config.size) == ("x", ("mot",), 1e10, 3,
                                                                                            "d32")
    assert config.smoke and not experiment.config_from_args(parser.parse_args(["--reuse"])).smoke
    full = experiment.config_from_args(parser.parse_args([]))
    assert full == experiment.CompositionalConfig()
