"""Diffusion math: the cosine schedule against its closed form, noising, DDIM (a perfect noise predictor recovers
x0 at any step count), the step sub-sequences, guidance and keyed noise."""

from __future__ import annotations

import math

import pytest
import torch

from fusion_model.families.transfusion.diffusion import (
    CosineSchedule,
    cosine_alpha_bars,
    ddim_sample,
    guided_noise,
    keyed_noise,
)
from fusion_model.layers.keyed_random import keyed_normal


def closed_form_alpha_bar(t: int, steps: int, s: float = 0.008) -> float:
    """Nichol & Dhariwal's f((t + 1) / N) / f(0): what the product of (1 - beta) telescopes to before any clipping."""
    def f(u: float) -> float:
        return math.cos((u + s) / (1 + s) * math.pi / 2) ** 2

    return f((t + 1) / steps) / f(0)


def test_the_cosine_schedule_is_its_closed_form_until_the_clipped_last_step():
    bars = cosine_alpha_bars(1000)
    assert bars.shape == (1000,) and bars.dtype == torch.float64
    expected = torch.tensor([closed_form_alpha_bar(t, 1000) for t in range(999)], dtype=torch.float64)
    torch.testing.assert_close(bars[:999], expected, rtol=1e-9, atol=1e-12)
    assert bool((bars[1:] < bars[:-1]).all())  # ever more noise
    assert 0.9999 < float(bars[0]) < 1 and 0 < float(bars[-1]) < 1e-8  # the clip keeps the last step off zero
    # beta 0.999 at the last step: its alpha_bar is the one before times 0.001
    torch.testing.assert_close(bars[-1], bars[-2] * 0.001, rtol=1e-9, atol=0)
    with pytest.raises(ValueError, match="steps"):
        cosine_alpha_bars(0)


def test_q_sample_is_the_forward_process_and_predict_x0_its_inverse():
    schedule = CosineSchedule(1000)
    x0, noise = torch.randn(5, 12, dtype=torch.float64), torch.randn(5, 12, dtype=torch.float64)
    t = torch.tensor([0, 10, 500, 998, 999])
    bars = torch.tensor([closed_form_alpha_bar(int(i), 1000) for i in t[:4]] + [float(cosine_alpha_bars()[-1])],
                        dtype=torch.float64)[:, None]
    x_t = schedule.q_sample(x0, t, noise)
    torch.testing.assert_close(x_t, bars.sqrt() * x0 + (1 - bars).sqrt() * noise, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(schedule.predict_x0(x_t, noise, t), x0, rtol=1e-6, atol=1e-6)
    # images (N, C, h, w) with one step each broadcast the same way
    images = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    noisy = schedule.q_sample(images, torch.tensor([3, 700]), torch.zeros_like(images))
    torch.testing.assert_close(noisy[1], images[1] * math.sqrt(closed_form_alpha_bar(700, 1000)))
    with pytest.raises(ValueError, match="outside"):
        schedule.q_sample(x0, torch.full((5,), 1000), noise)


def test_ddim_timesteps_are_distinct_descending_and_span_the_schedule():
    schedule = CosineSchedule(1000)
    for count in (1, 2, 7, 50, 999, 1000):
        steps = schedule.ddim_timesteps(count)
        assert len(steps) == count and len(set(steps.tolist())) == count
        assert int(steps[0]) == 999 and (count == 1 or int(steps[-1]) == 0)
        assert bool((steps[1:] < steps[:-1]).all())
    assert torch.equal(schedule.ddim_timesteps(1000), torch.arange(999, -1, -1))
    assert schedule.ddim_timesteps(4).tolist() == [999, 666, 333, 0]
    for bad in (0, 1001, True):
        with pytest.raises(ValueError, match="num_steps"):
            schedule.ddim_timesteps(bad)


def test_one_ddim_step_is_the_eta_zero_update():
    schedule = CosineSchedule(1000)
    x_t, eps = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    a, b = closed_form_alpha_bar(600, 1000), closed_form_alpha_bar(400, 1000)
    x0 = (x_t - math.sqrt(1 - a) * eps) / math.sqrt(a)
    expected = math.sqrt(b) * x0 + math.sqrt(1 - b) * eps
    torch.testing.assert_close(schedule.ddim_step(x_t, eps, torch.tensor(600), torch.tensor(400)), expected)
    # the last step returns the clean estimate itself
    torch.testing.assert_close(schedule.ddim_step(x_t, eps, torch.tensor(600), torch.tensor(-1)), x0)


@pytest.mark.parametrize("num_steps", [1, 10, 50, 250, 1000])
def test_ddim_with_a_perfect_noise_predictor_recovers_x0(num_steps):
    schedule = CosineSchedule(1000)
    generator = torch.Generator().manual_seed(num_steps)
    x0 = torch.randn(4, 16, generator=generator, dtype=torch.float64)
    eps = torch.randn(4, 16, generator=generator, dtype=torch.float64)
    x_start = schedule.q_sample(x0, torch.full((4,), 999), eps)

    def predictor(target: torch.Tensor):
        def predict(x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # the noise x_t holds around target
            bar = schedule.alpha_bar(t)
            return (x_t - bar.sqrt() * target) / (1 - bar).sqrt()
        return predict

    torch.testing.assert_close(ddim_sample(predictor(x0), x_start, schedule, num_steps), x0, rtol=0, atol=1e-8)
    # in fp32 the first step divides by sqrt(alpha_bar_999) ~ 5e-5: a few 1e-3 of rounding, not more
    got = ddim_sample(predictor(x0), x_start.float(), schedule, num_steps)
    torch.testing.assert_close(got, x0.float(), rtol=0, atol=1e-2)
    # the sample is what the predictor implies, not x_start's own x0: a predictor of another x0 lands there
    torch.testing.assert_close(ddim_sample(predictor(x0 + 0.5), x_start, schedule, num_steps), x0 + 0.5,
                               rtol=0, atol=1e-8)


def test_guidance_mixes_conditional_and_unconditional():
    cond, uncond = torch.randn(3, 5), torch.randn(3, 5)
    torch.testing.assert_close(guided_noise(cond, uncond, 1.0), cond)
    torch.testing.assert_close(guided_noise(cond, uncond, 0.0), uncond)
    torch.testing.assert_close(guided_noise(cond, uncond, 3.0), uncond + 3.0 * (cond - uncond))


def test_keyed_noise_follows_the_key():
    keys = torch.tensor([5, 9, 1 << 41, 3])
    noise = keyed_noise(keys, 6, seed=2, step=7, stream="sample")
    assert noise.shape == (4, 6)
    torch.testing.assert_close(noise, keyed_normal(keys, seed=2, step=7, stream="sample", draws=6), rtol=0, atol=0)
    torch.testing.assert_close(keyed_noise(keys.flip(0), 6, seed=2, step=7, stream="sample"), noise.flip(0),
                               rtol=0, atol=0)
    assert not torch.equal(keyed_noise(keys, 6, seed=2, step=8, stream="sample"), noise)


def test_clipping_the_clean_estimate_keeps_the_first_step_from_the_last_noise_level_bounded():
    schedule = CosineSchedule(1000)
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 16, 8, generator=generator, dtype=torch.float64).clamp(-3, 3)
    noise = torch.randn(4, 16, 8, generator=generator, dtype=torch.float64)
    t, t_prev = torch.tensor(999), torch.tensor(979)
    x_t = schedule.q_sample(x0, t, noise)
    slightly_wrong = noise + 0.01 * torch.randn(4, 16, 8, generator=generator, dtype=torch.float64)
    # alpha_bar(999) = 2.4e-9: a 1% error in the noise becomes an error of ~200 in x0_hat, and of ~6 in the next x_t
    unclipped = schedule.ddim_step(x_t, slightly_wrong, t, t_prev)
    assert float(schedule.predict_x0(x_t, slightly_wrong, t).abs().max()) > 50
    assert float((unclipped - schedule.q_sample(x0, t_prev, noise)).abs().max()) > 2
    clipped = schedule.ddim_step(x_t, slightly_wrong, t, t_prev, clip=4.0)
    assert float(clipped.abs().max()) < 6, "the next x_t stays at the scale of a noisy sample"
    # with a perfect predictor and x0 inside the clip range, clipping changes nothing
    for steps in (10, 50):
        out = ddim_sample(lambda x, s: (x - schedule.alpha_bar(s).sqrt() * x0) / (1 - schedule.alpha_bar(s)).sqrt(),
                          schedule.q_sample(x0, torch.tensor(999), noise), schedule, steps, clip=4.0)
        torch.testing.assert_close(out, x0, rtol=0, atol=1e-6)
