"""Answer-only SFT in the Chameleon family: a batch's `target_mask` decides which tokens are targets, in the
objective and in its denominators alike; the objective against a hand computation (dense and MoT blocks),
accumulation 2 x 1 = 1 x 2 (by hand, and through `train.py fit` on conversation shards), an all-true mask = no
mask, the SFT recipe."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fusion_model.config import FusionConfig
from fusion_model.families import family_class, family_names
from fusion_model.families.base import OPTIONAL_BATCH_KEYS, LossSettings, ObjectiveContext
from fusion_model.families.chameleon.family import ChameleonFamily
from fusion_model.layers.loss import fusion_loss

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "training"))
import fit_worker as fw  # noqa: E402

IMAGE = dict(image_offset=128, image_codes=64)
LOSSES = LossSettings(text_weight=1.0, image_weight=0.5, chunk_size=5)  # 5: several chunks, recomputed in backward

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


def family(block: str = "dense") -> ChameleonFamily:
    """A tiny Chameleon family with a visible z-loss; the MoT block gets per-modality weights."""
    config = FusionConfig.from_preset("tiny", z_loss_coef=1e-2, **IMAGE)
    return ChameleonFamily(dataclasses.replace(config, block=block), losses=LOSSES)


def conversation(seed: int, answer_from: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Two rows of 16 tokens, each a prompt then an answer with image codes in it (row r's answer starts at
    answer_from[r]), row 1 ending in padding: the batch a conversation shard gives."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 128, (2, 16), generator=generator)
    ids[:, 10:13] = torch.randint(128, 192, (2, 3), generator=generator)  # image codes inside the answers
    documents = torch.zeros_like(ids)
    documents[1, 14:] = -1
    ids[1, 14:] = 0
    positions = torch.arange(16)[None]
    mask = positions >= torch.tensor(answer_from)[:, None]
    mask &= documents >= 0
    return {"input_ids": ids, "document_ids": documents, "target_mask": mask}


def by_hand(parts: dict, batch: dict[str, torch.Tensor], z_loss_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over answer targets of weight x (CE + z x logZ^2), sum of weights) from the full logits of forward."""
    ids, documents, mask = batch["input_ids"], batch["document_ids"], batch["target_mask"]
    logits = parts["model"](ids, document_ids=documents)[:, :-1]
    log_probs = torch.log_softmax(logits, dim=-1)
    targets = ids[:, 1:]
    scored = (documents[:, :-1] == documents[:, 1:]) & (documents[:, :-1] >= 0) & mask[:, 1:]
    ce = -log_probs.gather(-1, targets[..., None]).squeeze(-1)
    log_z = torch.logsumexp(logits, dim=-1)
    weights = torch.where((targets >= 128) & (targets < 192), LOSSES.image_weight, LOSSES.text_weight) * scored
    return (weights * (ce + z_loss_coef * log_z**2)).sum(), weights.sum()


@pytest.mark.parametrize("block", ["dense", "mot"])
def test_the_objective_and_its_gradient_are_the_hand_computation_over_answer_tokens(block):
    torch.manual_seed(0)
    chameleon = family(block)
    parts = chameleon.build()
    batch = conversation(0, (4, 7))
    objective = chameleon.objective(parts, batch, ObjectiveContext(step=0))
    count = chameleon.denominators(batch)["loss"]
    torch.testing.assert_close(objective.terms["loss"].count, count)
    head = parts["model"].head.weight
    got = torch.autograd.grad(objective.loss(count[None]), (head, parts["model"].embed.weight))
    total, weight = by_hand(parts, batch, chameleon.config.z_loss_coef)
    torch.testing.assert_close(count, weight)
    assert float(weight) == 12 + 7 - 6 * 0.5  # answers of 12 and 7 tokens, 3 image codes at half weight in each
    torch.testing.assert_close(objective.loss(count[None]), total / weight)
    expected = torch.autograd.grad(total / weight, (head, parts["model"].embed.weight))
    for got_grad, want in zip(got, expected):
        torch.testing.assert_close(got_grad, want)


def test_a_prompt_token_changes_no_denominator_and_a_prompt_logit_gets_no_gradient():
    chameleon = family()
    batch = conversation(1, (6, 6))
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][0, 3] = 150  # a prompt token (its next token is prompt too), made an image code
    assert torch.equal(chameleon.denominators(batch)["loss"], chameleon.denominators(changed)["loss"])
    # the CE reads no prompt position's logits: d loss / d logits is zero wherever the next token is no target
    logits = torch.randn(2, 16, 256, requires_grad=True)
    out = fusion_loss(logits, batch["input_ids"], batch["document_ids"], z_loss_coef=1e-2,
                      target_mask=batch["target_mask"], **IMAGE)
    out["loss"].backward()
    assert logits.grad[:, :5].abs().sum() == 0 and (logits.grad[:, 5:13].abs().sum(-1) > 0).all()


def test_an_all_true_mask_and_no_mask_are_the_same_objective_bit_for_bit():
    torch.manual_seed(0)
    chameleon = family()
    parts = chameleon.build()
    batch = conversation(2, (0, 0))
    plain = {key: batch[key] for key in ("input_ids", "document_ids")}
    masked = dict(plain, target_mask=torch.ones_like(batch["input_ids"], dtype=torch.bool))
    results = []
    for one in (plain, masked):
        objective = chameleon.objective(parts, one, ObjectiveContext(step=0))
        count = chameleon.denominators(one)["loss"]
        grads = torch.autograd.grad(objective.loss(count[None]), list(parts["model"].parameters()))
        results.append((objective.terms["loss"].total, count, grads))
    (total0, count0, grads0), (total1, count1, grads1) = results
    assert torch.equal(total0, total1) and torch.equal(count0, count1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))


def test_two_micro_batches_with_different_answer_counts_accumulate_to_one_batch_of_both():
    torch.manual_seed(0)
    chameleon = family()
    parts = chameleon.build()
    params = list(parts["model"].parameters())
    first, second = conversation(3, (2, 12)), conversation(4, (9, 5))
    counts = [chameleon.denominators(b)["loss"] for b in (first, second)]
    assert float(counts[0]) != float(counts[1])
    # as the trainer: each micro-batch's total over the step's count (the loader's sum of `denominators`)
    step_count = torch.stack(counts).sum()
    accumulated = [torch.zeros_like(p) for p in params]
    for micro in (first, second):
        loss = chameleon.objective(parts, micro, ObjectiveContext(step=0)).loss(step_count[None])
        for into, grad in zip(accumulated, torch.autograd.grad(loss, params)):
            into += grad
    both = {key: torch.cat([first[key], second[key]]) for key in first}
    whole = chameleon.objective(parts, both, ObjectiveContext(step=0))
    torch.testing.assert_close(whole.terms["loss"].count, step_count)
    expected = torch.autograd.grad(whole.loss(chameleon.denominators(both)["loss"][None]), params)
    for got, want in zip(accumulated, expected):
        torch.testing.assert_close(got, want)
    # averaging the two micro-batches' means instead (each its own count) gives another gradient
    means = [chameleon.objective(parts, m, ObjectiveContext(step=0)).loss(c[None]) / 2
             for m, c in zip((first, second), counts)]
    wrong = torch.autograd.grad(sum(means), params)
    assert not torch.allclose(wrong[0], expected[0])


def test_only_the_chameleon_family_reads_target_mask():
    assert "target_mask" in OPTIONAL_BATCH_KEYS and "target_mask" in ChameleonFamily.batch_keys
    for name in family_names():
        keys = family_class(name).batch_keys
        assert set(keys) <= set(OPTIONAL_BATCH_KEYS), name
        # transfusion and late fusion train no answer-only loss: conversation shards are refused for them
        assert ("target_mask" in keys) == (name == "chameleon"), name


def test_the_sft_config_layers_the_papers_fine_tuning_recipe_over_a_pretraining_config(capsys):
    from fusion_model.cli.fit import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(fw.REPO / "configs/fusion/small.yaml"), "--config",
              str(fw.REPO / "configs/fusion/post/sft.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    model = printed["model"]
    assert model["config"] == {"preset": "small", "dropout": 0.05}
    assert (model["lr"], model["weight_decay"], model["lr_schedule"]) == (1e-5, 0.1, "cosine")
    assert 0 < model["warmup_steps"] < printed["trainer"]["max_steps"]
    assert FusionConfig.from_dict(model["config"]).z_loss_coef == 1e-5  # the z-loss stays the pretraining one
    assert printed["data"]["seq_len"] == 256  # the rest is the pretraining config's


def test_answer_only_fit_accumulates_exactly_and_differs_from_training_on_every_token(tmp_path):
    from fusion_model.cli.fit import main

    tokens = fw.make_conversation_token_dir(tmp_path / "tokens")
    runs = {"one": (4, []), "accumulated": (2, ["--trainer.accumulate_grad_batches=2"]),
            "every_token": (4, ["--data.answer_only=false"])}
    weights = {}
    for name, (batch_size, extra) in runs.items():
        assert main(fw.tiny_args(tokens, tmp_path / name, 3, batch_size=batch_size, extra=extra)) == 0
        weights[name] = torch.load(tmp_path / name / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    # summation order differs, and Adam turns that into ~1e-6 differences
    for key, weight in weights["one"].items():
        torch.testing.assert_close(weights["accumulated"][key], weight, rtol=0, atol=1e-5, msg=key)
    moved = max(float((weights["every_token"][k] - w).abs().max()) for k, w in weights["one"].items())
    assert moved > 1e-3  # the prompts' loss changes training: the mask reached the objective

