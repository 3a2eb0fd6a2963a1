"""TimeBudget: the lr decay and max_steps fitted to a wall-clock budget from the measured step rate."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fusion_model.training import callbacks
from fusion_model.training.callbacks import TimeBudget
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


def test_measuring_needs_steps_after_the_skipped_ones():
    with pytest.raises(ValueError, match="measure_steps"):
        TimeBudget(minutes=1, measure_steps=5, skip_steps=5)
