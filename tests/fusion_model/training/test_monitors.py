"""Stability monitors: each logged quantity equals a direct computation on a tiny model, the early warning fires on
forced growth and stays silent on a normal run, and monitoring changes neither the loss nor the gradients."""

import copy
import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger

from data_shards.stream import with_window_denominators
from fusion_model.config import FusionConfig
from fusion_model.layers.rope import apply_rope, rope_cos_sin
from fusion_model.model import FusionModel
from fusion_model.training.lightning_module import FusionLightningModule
from fusion_model.training.monitors import (
    PARAMETER_GROUPS,
    InstabilityWarning,
    StabilityMonitor,
    max_attention_logit,
    parameter_groups,
)

IMAGE_OFFSET, IMAGE_CODES = 16, 64


def tiny_config(**overrides) -> FusionConfig:
    """Tiny decoder with GQA, QK-norm and an image block (ids 16..79)."""
    fields = dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64,
                  image_offset=IMAGE_OFFSET, image_codes=IMAGE_CODES, z_loss_coef=1e-3)
    return FusionConfig(**{**fields, **overrides})


def packed_batch(seed: int, rows: int = 2) -> dict[str, torch.Tensor]:
    """Rows of two documents (text, then an image run, then text) and trailing padding (document -1, id 0)."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(80, 256, (rows, 32), generator=generator)
    image = torch.randint(IMAGE_OFFSET, IMAGE_OFFSET + IMAGE_CODES, (rows, 32), generator=generator)
    ids = torch.where((torch.arange(32) % 12) >= 6, image, text)
    docs = torch.cat([torch.zeros(rows, 14), torch.ones(rows, 12), torch.full((rows, 6), -1)], dim=1).long()
    return {"input_ids": torch.where(docs >= 0, ids, 0), "document_ids": docs}


class MemoryLogger(Logger):
    """Keeps every logged metric in memory: rows of (step, metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    name, version = "memory", 0

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def series(self, key: str) -> dict[int, float]:
        return {step: metrics[key] for step, metrics in self.rows if key in metrics}


def fit(module: FusionLightningModule, batches: list[dict], callbacks: list, root=None, accumulate: int = 1,
        clip: float | None = 1.0) -> MemoryLogger:
    logger = MemoryLogger()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=len(batches) // accumulate, logger=logger,
                        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, gradient_clip_val=clip,
                        accumulate_grad_batches=accumulate, default_root_dir=root)
    # each micro-batch carries its step's loss denominators, as the project's loader gives them
    batches = list(with_window_denominators(batches, accumulate, module.window_denominators))
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return logger


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


# ---- the quantities, against direct computations ---------------------------------------------------------


def test_every_parameter_falls_in_a_named_group():
    model = FusionModel(tiny_config())
    groups = parameter_groups(model)
    assert list(groups) == [name for name, _ in model.named_parameters()]
    assert set(groups.values()) == set(PARAMETER_GROUPS)
    assert groups["embed.weight"] == "embeddings" and groups["head.weight"] == "output_head"
    assert groups["layers.0.attn.qkv.weight"] == groups["layers.1.attn.out.weight"] == "attention"
    assert groups["layers.0.attn.q_norm.weight"] == groups["layers.0.attn.k_norm.bias"] == "norms"
    assert groups["layers.1.mlp_norm.weight"] == groups["norm.weight"] == "norms"
    assert groups["layers.0.mlp.gate_up.weight"] == groups["layers.0.mlp.down.weight"] == "mlp"


def brute_force_max(q: torch.Tensor, k: torch.Tensor, docs: torch.Tensor, runs: torch.Tensor | None = None) -> float:
    """The masked max logit pair by pair, with the mask rules written out."""
    groups = q.shape[1] // k.shape[1]
    best = -math.inf
    for b in range(q.shape[0]):
        for i in range(q.shape[2]):
            for j in range(q.shape[2]):
                if docs[b, i] < 0:
                    allowed = i == j
                else:
                    same = bool(docs[b, i] == docs[b, j])
                    image_pair = runs is not None and runs[b, i] >= 0 and bool(runs[b, i] == runs[b, j])
                    allowed = same and (j <= i or image_pair)
                if allowed:
                    for h in range(q.shape[1]):
                        best = max(best, float(q[b, h, i] @ k[b, h // groups, j]) / q.shape[-1] ** 0.5)
    return best


@pytest.mark.parametrize("chunk_elements", [1, 64, 1 << 24])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_max_attention_logit_is_the_masked_maximum_in_any_chunking(chunk_elements, bidirectional):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, -1], [5, 5, 5, 5, 5, 5, 6, 6, -1, -1]])
    runs = torch.tensor([[-1, 1, 1, -1, 2, 2, -1, -1, -1, -1], [1, 1, 1, -1, -1, -1, -1, -1, -1, -1]])
    runs = runs if bidirectional else None
    got = max_attention_logit(q, k, docs, runs, chunk_elements=chunk_elements)
    assert float(got) == pytest.approx(brute_force_max(q, k, docs, runs), rel=1e-6)
    # the mask matters: the unmasked maximum of these scores is larger
    assert float((q @ k.repeat_interleave(2, 1).transpose(-1, -2)).amax()) / 8**0.5 > float(got)


@pytest.mark.parametrize("qk_norm,norm_placement", [(True, "pre"), (False, "swin")])
def test_attention_logits_and_block_norms_equal_a_computation_by_hand(qk_norm, norm_placement):
    torch.manual_seed(0)
    model = FusionModel(tiny_config(qk_norm=qk_norm, norm_placement=norm_placement, dropout=0.1))
    with torch.no_grad():  # QK-norm gains and biases away from their initial 1 and 0
        for name, p in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.copy_(torch.randn_like(p))
    model.train()
    batch = packed_batch(1)
    found = StabilityMonitor().forward_statistics(model, batch)
    assert model.training and all(block.attn.observer is None for block in model.layers)

    ids, docs = batch["input_ids"], batch["document_ids"]
    model.eval()  # the monitor measures without dropout
    positions = torch.cat([torch.arange(14), torch.arange(12), torch.arange(6)]).expand(2, 32)
    cos, sin = rope_cos_sin(positions, model.config.head_dim, model.config.rope_theta, torch.float32)
    ctx, _ = model.attention_context(ids, docs, None, None)
    x = model.embed(ids)
    real = docs >= 0
    maxima = []
    with torch.no_grad():
        for layer, block in enumerate(model.layers):
            attn = block.attn
            inner = block.attn_norm(x) if norm_placement == "pre" else x
            q, k, _ = (inner @ attn.qkv.weight.t()).view(2, 32, 8, 8).split([4, 2, 2], dim=2)
            if qk_norm:  # LayerNorm over head_dim without affine, then the per-head weight and bias
                q = F.layer_norm(q, (8,)) * attn.q_norm.weight + attn.q_norm.bias
                k = F.layer_norm(k, (8,)) * attn.k_norm.weight + attn.k_norm.bias
            q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
            maxima.append(brute_force_max(q, k, docs))
            assert float(found[f"stability/attn_logit_max/layer_{layer}"]) == pytest.approx(maxima[-1], rel=1e-5)
            x = block(x, cos, sin, ctx)
            rms = x[real].pow(2).mean().sqrt()  # over the non-padding tokens' residual stream
            torch.testing.assert_close(found[f"stability/block_rms/layer_{layer}"], rms, rtol=1e-5, atol=0)
    assert float(found["stability/attn_logit_max/all_layers"]) == pytest.approx(max(maxima), rel=1e-5)


def test_output_logit_statistics_at_text_and_image_targets_equal_the_full_logits():
    torch.manual_seed(0)
    model = FusionModel(tiny_config())
    batch = packed_batch(2)
    found = StabilityMonitor().forward_statistics(model, batch, text_weight=1.0, image_weight=0.5)
    ids, docs = batch["input_ids"], batch["document_ids"]
    with torch.no_grad():
        logits = model(ids, document_ids=docs)[:, :-1]
        loss = model.loss(ids, docs, text_weight=1.0, image_weight=0.5)
    valid = (docs[:, :-1] == docs[:, 1:]) & (docs[:, :-1] >= 0)
    targets = ids[:, 1:]
    image = valid & (targets >= IMAGE_OFFSET) & (targets < IMAGE_OFFSET + IMAGE_CODES)
    text = valid & ~image
    assert image.sum() > 5 and text.sum() > 5
    for name, where in (("text", text), ("image", image)):
        torch.testing.assert_close(found[f"stability/{name}/logit_mean"], logits[where].mean(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(found[f"stability/{name}/log_z_mean"], logits[where].logsumexp(-1).mean(),
                                   rtol=1e-5, atol=0)
    lse = logits[valid].logsumexp(-1)
    torch.testing.assert_close(found["stability/log_z_sq_mean"], lse.pow(2).mean(), rtol=1e-5, atol=0)
    torch.testing.assert_close(found["stability/z_loss"], loss["z_loss"], rtol=1e-5, atol=0)


def test_a_modality_without_targets_is_not_logged():
    torch.manual_seed(0)
    model = FusionModel(tiny_config())
    batch = packed_batch(3)
    batch["input_ids"] = torch.where(batch["input_ids"] < 80, 100, batch["input_ids"])  # text only
    module = FusionLightningModule(tiny_config(), lr=1e-3, warmup_steps=1)
    module.model.load_state_dict(model.state_dict())
    monitor = StabilityMonitor(every_n_steps=1)
    fit(module, [batch], [monitor])
    assert "stability/text/log_z_mean" in monitor.latest
    assert not any(name.startswith("stability/image/") for name in monitor.latest)
    assert all(math.isfinite(value) for value in monitor.latest.values())


def group_norms(named: dict[str, torch.Tensor], groups: dict[str, str]) -> dict[str, float]:
    sums: dict[str, float] = {}
    for name, tensor in named.items():
        group = groups[name]
        sums[group] = sums.get(group, 0.0) + float(tensor.double().pow(2).sum())
    return {group: value**0.5 for group, value in sums.items()}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_gradient_norms_and_update_ratios_equal_a_direct_computation(accumulate):
    torch.manual_seed(0)
    module = FusionLightningModule(tiny_config(), lr=3e-3, warmup_steps=1)
    batches = [packed_batch(seed) for seed in range(accumulate)]
    if accumulate == 2:  # micro-batches with different numbers of targets: the module reweights them
        batches[1]["document_ids"][:, 20:] = -1
    reference = copy.deepcopy(module.model)
    before = {name: p.detach().clone() for name, p in module.model.named_parameters()}

    monitor = StabilityMonitor(every_n_steps=1)
    logger = fit(module, batches, [monitor], accumulate=accumulate, clip=1e-3)  # the clip acts: norms are pre-clip

    # the step's gradient is the one of the mean loss over all targets of its micro-batches
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    reference.loss(whole["input_ids"], whole["document_ids"])["loss"].backward()
    groups = parameter_groups(reference)
    expected = group_norms({name: p.grad for name, p in reference.named_parameters()}, groups)
    for group, value in expected.items():
        assert monitor.latest[f"stability/grad_norm/{group}"] == pytest.approx(value, rel=1e-4), group
    after = {name: p.detach() for name, p in module.model.named_parameters()}
    change = group_norms({name: after[name] - before[name] for name in before}, groups)
    weight = group_norms(before, groups)
    for group in PARAMETER_GROUPS:
        assert monitor.latest[f"stability/update_ratio/{group}"] == pytest.approx(change[group] / weight[group], rel=1e-4)
    assert logger.series("stability/grad_norm/mlp").keys() == logger.series("train/loss").keys() == {0}


def test_monitoring_changes_neither_the_losses_nor_the_gradients():
    batches = [packed_batch(seed) for seed in range(6)]

    def run(callbacks: list) -> tuple[list[float], list[dict]]:
        torch.manual_seed(0)
        module = FusionLightningModule(tiny_config(dropout=0.1), lr=1e-2, warmup_steps=1)  # dropout: RNG in use

        class Gradients(L.Callback):
            def __init__(self):
                self.seen = []

            def on_before_optimizer_step(self, trainer, pl_module, optimizer):
                self.seen.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})

        gradients = Gradients()
        L.seed_everything(0, verbose=False)
        logger = fit(module, batches, [gradients, *callbacks])
        return list(logger.series("train/loss").values()), gradients.seen

    plain_losses, plain_grads = run([])
    monitor = StabilityMonitor(every_n_steps=1)
    losses, grads = run([monitor, InstabilityWarning()])
    assert monitor.latest_step == 5 and len(losses) == 6
    assert losses == plain_losses
    for got, expected in zip(grads, plain_grads):
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[name], expected[name]) for name in got)


# ---- the early warning -----------------------------------------------------------------------------------


class ScaleEachStep(L.Callback):
    """Multiplies some weights by `factor` before every step: a run whose logits are forced to grow."""

    def __init__(self, names: tuple[str, ...], factor: float):
        self.names, self.factor = names, factor

    @torch.no_grad()
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for name, p in pl_module.model.named_parameters():
            if name.endswith(self.names):
                p.mul_(self.factor)


def test_the_warning_fires_when_the_output_logits_are_forced_to_grow_and_saves_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    module = FusionLightningModule(tiny_config(z_loss_coef=0.0), lr=1e-4, warmup_steps=1)
    warning = InstabilityWarning(log_z_bound=20.0, save_checkpoint=True)
    batches = [packed_batch(seed) for seed in range(12)]
    with pytest.warns(UserWarning, match=r"InstabilityWarning: step \d+, the output layer: mean log Z at (text|image)"):
        fit(module, batches, [ScaleEachStep(("head.weight",), 2.0), warning, StabilityMonitor(every_n_steps=2)],
            root=tmp_path)
    first = warning.events[0]
    assert first["layer"] == "output" and abs(first["value"]) > 20.0 and first["step"] % 2 == 0
    assert {event["quantity"] for event in warning.events} <= {"text log_z_mean", "image log_z_mean"}
    saved = tmp_path / "checkpoints" / f"warning-step={first['step']}.ckpt"
    assert saved.is_file()
    assert torch.load(saved, weights_only=True)["global_step"] == first["step"] + 1


def test_the_warning_names_the_layer_whose_attention_logits_grow():
    torch.manual_seed(0)
    module = FusionLightningModule(tiny_config(qk_norm=False), lr=1e-4, warmup_steps=1)
    warning = InstabilityWarning(growth_factor=2.0, window=2, min_attn_logit=5.0)
    batches = [packed_batch(seed) for seed in range(10)]
    # layer 1's query/key/value projection doubles every step: its logits grow 4x per step
    with pytest.warns(UserWarning, match=r"step \d+, layer 1: attn_logit_max grew"):
        fit(module, batches, [StabilityMonitor(every_n_steps=1), warning, ScaleEachStep(("1.attn.qkv.weight",), 2.0)])
    assert {(event["quantity"], event["layer"]) for event in warning.events} == {("attn_logit_max", 1)}


def test_the_warning_stays_silent_on_a_normal_run(recwarn):
    torch.manual_seed(0)
    module = FusionLightningModule(tiny_config(), lr=3e-3, warmup_steps=2)
    warning = InstabilityWarning(window=3)
    monitor = StabilityMonitor(every_n_steps=1)
    fit(module, [packed_batch(seed % 4) for seed in range(16)], [monitor, warning])
    assert monitor.latest_step == 15 and warning.events == []
    assert not [w for w in recwarn if "InstabilityWarning" in str(w.message)]


def test_growth_counts_past_its_floor_once_per_window_and_log_z_once_per_crossing():
    warning = InstabilityWarning(growth_factor=2.0, window=2, min_attn_logit=10.0, log_z_bound=5.0)
    name = "stability/attn_logit_max/layer_3"
    fired = []
    logits = [1, 6, 9, 11, 15, 30, 40, 100]
    log_zs = [0, 0, 0, 6, -7, 1, 9, 2]
    for step, (logit, log_z) in enumerate(zip(logits, log_zs)):
        fired += warning.check(step, {name: float(logit), "stability/image/log_z_mean": float(log_z)})
    # 1 -> 9 grows 9x but under the floor; 15 -> 30 over two points is slower than 2x; 11 -> 30 fires at step 5,
    # the window restarts there (15 -> 40 at step 6 would fire again), and 30 -> 100 fires at step 7
    layer_events = [e for e in fired if e["layer"] == 3]
    assert [(e["step"], e["quantity"]) for e in layer_events] == [(5, "attn_logit_max"), (7, "attn_logit_max")]
    assert [e["step"] for e in fired if e["layer"] == "output"] == [3, 6]  # crossings out of +-5, not every point
    assert "step 5, layer 3: attn_logit_max grew 2.73x" in layer_events[0]["message"]
    nan = warning.check(7, {name: float("nan")})
    assert nan and "is nan" in nan[0]["message"]
    # a blow-up warns as soon as it shows, before a long window has filled
    fast = InstabilityWarning(window=10, min_attn_logit=10.0)
    assert not fast.check(0, {name: 2.0}) and fast.check(1, {name: 50.0})[0]["step"] == 1


def test_bad_settings_and_a_missing_monitor_are_refused(tmp_path):
    with pytest.raises(ValueError, match="every_n_steps"):
        StabilityMonitor(every_n_steps=0)
    with pytest.raises(ValueError, match="growth_factor"):
        InstabilityWarning(growth_factor=1.0)
    module = FusionLightningModule(tiny_config(), lr=1e-3, warmup_steps=1)
    with pytest.raises(ValueError, match="add fusion_model.training.monitors.StabilityMonitor"):
        fit(module, [packed_batch(0)], [InstabilityWarning()], root=tmp_path)


@pytest.mark.parametrize("preset", ["chameleon-7b", "chameleon-34b"])
def test_the_chameleon_presets_keep_both_monitors_on(preset):
    import importlib
    from pathlib import Path

    import yaml

    config = Path(__file__).resolve().parents[3] / "configs" / "fusion" / f"{preset}.yaml"
    callbacks = yaml.safe_load(config.read_text())["trainer"]["callbacks"]
    built = {}
    for entry in callbacks:
        module, _, name = entry["class_path"].rpartition(".")
        if module == "fusion_model.training.monitors":
            built[name] = getattr(importlib.import_module(module), name)(**entry.get("init_args", {}))
    assert set(built) == {"StabilityMonitor", "InstabilityWarning"}
    assert 10 <= built["StabilityMonitor"].every_n_steps <= 200


def test_ranks_combine_by_max_and_by_target_weighted_means():
    def stats(logit: float, text_z: float, text_n: float, image_z: float, image_n: float) -> dict:
        return {"stability/attn_logit_max/layer_0": torch.tensor(logit), "stability/block_rms/layer_0": torch.tensor(2.0),
                "stability/text/log_z_mean": torch.tensor(text_z), "stability/text/targets": torch.tensor(text_n),
                "stability/image/log_z_mean": torch.tensor(image_z), "stability/image/targets": torch.tensor(image_n)}

    this_rank, other_rank = stats(3.0, 1.0, 30.0, 5.0, 10.0), stats(7.0, 4.0, 10.0, float("nan"), 0.0)

    class Strategy:
        def all_gather(self, local):
            other = torch.stack([other_rank[name] for name in sorted(other_rank)])
            return torch.stack([local, other])

    class Trainer:
        world_size, strategy = 2, Strategy()

    combined = StabilityMonitor._gather(Trainer(), this_rank)
    assert combined.keys() == {"stability/attn_logit_max/layer_0", "stability/block_rms/layer_0",
                               "stability/text/log_z_mean", "stability/image/log_z_mean"}
    assert float(combined["stability/attn_logit_max/layer_0"]) == 7.0
    assert float(combined["stability/text/log_z_mean"]) == pytest.approx((1.0 * 30 + 4.0 * 10) / 40)
    assert float(combined["stability/image/log_z_mean"]) == 5.0  # the rank without image targets counts for nothing
    assert float(combined["stability/block_rms/layer_0"]) == 2.0
