"""The training monitors read the family: MFU counts the family's FLOPs per token (Transfusion's patch projections
and timestep MLP on top of the decoder's; Chameleon's unchanged), and the stability monitor's attention statistics
treat continuous-image placeholders as image positions (bidirectional runs) as the decoder does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fusion_model.config import FusionConfig
from fusion_model.layers import attention_backends as attn_lib
from fusion_model.training import callbacks, monitors
from fusion_model.training.callbacks import ThroughputMonitor
from fusion_model.training.lightning_module import FusionLightningModule
from fusion_model.training.monitors import StabilityMonitor

BOS, EOS, BOI, EOI, PH = 1, 2, 3, 4, 6  # the unified vocabulary's specials (<image> = 6)
IMAGE = dict(image_offset=128, image_codes=64)
TRANSFUSION = dict(latent_channels=4, patch_size=2, image_placeholder_id=PH)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


def module(family: str) -> FusionLightningModule:
    options = TRANSFUSION if family == "transfusion" else None
    return FusionLightningModule(FusionConfig.from_preset("tiny", **IMAGE), family=family, family_options=options)


def logged_mfu(pl_module: FusionLightningModule, monkeypatch, seq_len: int, seconds: float) -> dict[str, float]:
    """What ThroughputMonitor logs for one optimizer step of a (2, seq_len) batch that took `seconds`."""
    clock = iter([100.0, 100.0 + seconds])
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    logged: dict[str, float] = {}
    monkeypatch.setattr(pl_module, "log_dict", lambda values, **kwargs: logged.update(values))
    monitor = ThroughputMonitor(peak_flops=1e12)
    trainer = SimpleNamespace(global_step=0, world_size=1)
    monitor.on_fit_start(trainer, pl_module)
    batch = {"input_ids": torch.zeros(2, seq_len, dtype=torch.long)}
    monitor.on_train_batch_start(trainer, pl_module, batch, 0)
    trainer.global_step = 1  # the optimizer stepped
    monitor.on_train_batch_end(trainer, pl_module, None, batch, 0)
    return logged


def test_mfu_counts_the_transfusion_projections_and_chameleons_decoder_alone(monkeypatch):
    seq_len, seconds = 32, 2.0
    tokens_per_s = 2 * seq_len / seconds
    transfusion = module("transfusion")
    family = transfusion.family
    assert family.flops_per_token(seq_len) > transfusion.model_config.flops_per_token(seq_len)
    logged = logged_mfu(transfusion, monkeypatch, seq_len, seconds)
    assert logged["train/tokens_per_s"] == pytest.approx(tokens_per_s)
    assert logged["train/mfu"] == pytest.approx(family.flops_per_token(seq_len) * tokens_per_s / 1e12, rel=1e-12)

    chameleon = module("chameleon")
    assert chameleon.family.flops_per_token(seq_len) == chameleon.model_config.flops_per_token(seq_len)
    logged = logged_mfu(chameleon, monkeypatch, seq_len, seconds)
    expected = chameleon.model_config.flops_per_token(seq_len) * tokens_per_s / 1e12
    assert logged["train/mfu"] == pytest.approx(expected, rel=1e-12)


def test_attention_statistics_see_placeholder_images_as_bidirectional_runs(monkeypatch):
    decoder = module("transfusion").parts["model"]
    assert decoder.config.image_placeholder_id == PH and decoder.config.image_bidirectional
    ids = torch.tensor([[BOS, 200, 201, BOI, PH, PH, PH, PH, EOI, 202, EOS, 0]])
    documents = torch.tensor([[0] * 11 + [-1]])
    seen = []
    real = monitors.max_attention_logit

    def spy(q, k, document_ids, runs, **kwargs):
        seen.append(runs)
        return real(q, k, document_ids, runs, **kwargs)

    monkeypatch.setattr(monitors, "max_attention_logit", spy)
    found = StabilityMonitor().forward_statistics(decoder, {"input_ids": ids, "document_ids": documents})
    assert len(seen) == decoder.config.n_layers and "stability/attn_logit_max/all_layers" in found
    expected = attn_lib.image_runs(ids, IMAGE["image_offset"], IMAGE["image_codes"], PH)
    assert bool((expected[0, 4:8] >= 0).all()) and int((expected >= 0).sum()) == 4
    for runs in seen:
        assert torch.equal(runs, expected)
