"""TimeBudget: the lr decay and max_steps fitted to a wall-clock budget from the measured step rate;
PlainTextProgress: plain progress lines for log files."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from fusion_model.training import callbacks
from fusion_model.training.callbacks import PlainTextProgress, TimeBudget, stdout_is_terminal
from fusion_model.training.optim import WarmupDecay, build_scheduler


class FakeClock:
    """A perf_counter that moves only when the test advances it."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def fake_trainer():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, WarmupDecay(50, 1_000_000, "cosine", 0.1))
    return SimpleNamespace(global_step=0, fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(max_steps=1_000_000)),
                           lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])


def run_steps(budget: TimeBudget, trainer, clock: FakeClock, steps: int, seconds_per_step: float) -> None:
    for _ in range(steps):
        clock.now += seconds_per_step
        trainer.global_step += 1
        budget.on_train_batch_end(trainer, None, None, None, trainer.global_step - 1)


def test_horizon_is_the_steps_that_fit_in_the_budget(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(callbacks, "time", clock)
    trainer = fake_trainer()
    budget = TimeBudget(minutes=10, measure_steps=40, skip_steps=5, safety=1.0)
    clock.now += 3.0  # setup before the first step is not part of the rate
    budget.on_train_start(trainer, None)
    run_steps(budget, trainer, clock, 40, seconds_per_step=0.25)
    # 600 s budget, 10 s spent in 40 steps, 0.25 s per step: 40 + 590 / 0.25 = 2,400 steps
    assert budget.horizon == 2400
    assert trainer.fit_loop.epoch_loop.max_steps == 2400
    schedule = trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0]
    assert schedule.decay_steps == 2400 and schedule(2399) == pytest.approx(0.1, abs=1e-5)


def test_horizon_follows_the_rate_of_later_windows_then_settles(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(callbacks, "time", clock)
    trainer = fake_trainer()
    budget = TimeBudget(minutes=10, measure_steps=40, skip_steps=5, safety=1.0)
    budget.on_train_start(trainer, None)
    run_steps(budget, trainer, clock, 40, seconds_per_step=0.25)  # slow start (allocator, caches)
    assert budget.horizon == 2400
    run_steps(budget, trainer, clock, 40, seconds_per_step=0.125)
    # measured again over steps 40-80: 0.125 s per step, 585 s left -> 80 + 4,680
    assert budget.horizon == 4760 and trainer.fit_loop.epoch_loop.max_steps == 4760
    run_steps(budget, trainer, clock, 2480, seconds_per_step=0.125)  # windows to 1,280; 2,560 > 30% of 4,760
    assert budget.horizon == 4760 and budget.settled
    run_steps(budget, trainer, clock, 1000, seconds_per_step=1.0)  # slower late steps move nothing: max_time stops
    assert budget.horizon == 4760


def test_a_resumed_run_keeps_its_horizon(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(callbacks, "time", clock)
    first = TimeBudget(minutes=1, measure_steps=10, skip_steps=2)
    trainer = fake_trainer()
    first.on_train_start(trainer, None)
    run_steps(first, trainer, clock, 10, seconds_per_step=0.5)
    resumed, trainer = TimeBudget(minutes=1, measure_steps=10, skip_steps=2), fake_trainer()
    resumed.load_state_dict(first.state_dict())
    resumed.on_train_start(trainer, None)
    assert trainer.fit_loop.epoch_loop.max_steps == first.horizon == resumed.horizon
    assert trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0].decay_steps == first.horizon
    run_steps(resumed, trainer, clock, 200, seconds_per_step=5.0)  # no new measurement after a resume
    assert resumed.horizon == first.horizon


def test_slow_steps_get_a_horizon_before_the_budget_is_spent_and_the_lr_decays(monkeypatch):
    """30 s per step in a 5-minute budget: measure_steps (40) would never be reached; after 5% of the budget the
    rate since the first step sets the horizon, and the recipe's 50 warmup steps shrink to half of it."""
    clock = FakeClock()
    monkeypatch.setattr(callbacks, "time", clock)
    trainer = fake_trainer()
    budget = TimeBudget(minutes=5, measure_steps=40, skip_steps=5, safety=1.0)
    budget.on_train_start(trainer, None)
    run_steps(budget, trainer, clock, 1, seconds_per_step=30.0)
    assert budget.horizon is None, "one step gives no rate"
    run_steps(budget, trainer, clock, 1, seconds_per_step=30.0)
    assert budget.horizon == 2 + 240 // 30 == trainer.fit_loop.epoch_loop.max_steps
    schedule = trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0]
    assert (schedule.warmup_steps, schedule.decay_steps) == (5, 10)
    assert schedule(4) == 1.0 and schedule(10) == pytest.approx(0.1), "peak after warmup, the floor at the horizon"


def test_the_configured_max_steps_caps_the_horizon(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(callbacks, "time", clock)
    trainer = fake_trainer()
    budget = TimeBudget(minutes=10, measure_steps=40, skip_steps=5, safety=1.0, max_steps=1000)
    budget.on_train_start(trainer, None)
    run_steps(budget, trainer, clock, 40, seconds_per_step=0.25)  # 2,400 steps would fit in the budget
    assert budget.horizon == 1000 == trainer.fit_loop.epoch_loop.max_steps


def test_measuring_needs_steps_after_the_skipped_ones():
    with pytest.raises(ValueError, match="measure_steps"):
        TimeBudget(minutes=1, measure_steps=5, skip_steps=5)


class SquareModule(L.LightningModule):
    """Minimises (w - 2)^2 with SGD, logging `train/loss` and remembering each value it logged."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = (self.weight - 2.0) ** 2
        self.losses.append(loss.item())
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run_with_progress(progress: PlainTextProgress, batches, **trainer_options) -> SquareModule:
    torch.set_num_threads(1)
    module = SquareModule()
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[progress], **trainer_options)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=2))
    return module


def token_batches(count: int) -> list[dict]:
    return [{"input_ids": torch.zeros(8, dtype=torch.long)} for _ in range(count)]


def test_progress_prints_a_plain_line_per_step_with_its_loss():
    stream = io.StringIO()
    module = run_with_progress(PlainTextProgress(every_seconds=0, stream=stream), token_batches(16), max_steps=4)
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 5
    for step, line in enumerate(lines[:4], start=1):
        assert line.startswith(f"step {step}/4 ({25 * step}%) | epoch 0 | loss {module.losses[step - 1]:.4g} | ")
        assert re.search(r"\| [\d.,e+]+ tok/s \| lr 1\.0e-01 \| \d+:\d\d:\d\d elapsed \| ETA \d+:\d\d:\d\d$", line)
    assert module.losses[:2] == pytest.approx([4.0, 2.56])
    assert lines[4].startswith(f"done: step 4/4 (100%) | epoch 0 | loss {module.losses[3]:.4g} | ")
    assert "ETA" not in lines[4]


def test_progress_with_a_long_interval_prints_the_first_and_the_last_line():
    stream = io.StringIO()
    run_with_progress(PlainTextProgress(every_seconds=3600, stream=stream), token_batches(16), max_steps=6)
    lines = stream.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 1/6 (17%)", "done: step 6/6 (100%)"]


def test_progress_without_max_steps_counts_samples_and_takes_the_eta_from_max_time():
    stream = io.StringIO()
    images = [torch.zeros(3, 4, 4) for _ in range(6)]
    run_with_progress(PlainTextProgress(every_seconds=0, stream=stream), images, max_epochs=1,
                      max_time={"minutes": 10})
    lines = stream.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 1", "step 2", "step 3", "done: step 3"]
    assert "samples/s" in lines[0] and "tok/s" not in lines[0]
    hours, minutes, seconds = map(int, re.search(r"ETA (\d+):(\d\d):(\d\d)$", lines[0]).groups())
    eta = hours * 3600 + minutes * 60 + seconds
    assert eta <= 10 * 60, "the ETA is what is left of max_time (10 minutes), never more"


def test_progress_refuses_a_negative_interval_and_a_stringio_is_no_terminal(monkeypatch):
    with pytest.raises(ValueError, match="every_seconds"):
        PlainTextProgress(every_seconds=-1)
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert stdout_is_terminal() is False
