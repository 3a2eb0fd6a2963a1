"""The machine limits: FLOP and byte accounting, argument checks, and the derived MFU / decode bounds."""

import pytest
import torch

import bench.limits as limits
import fusion_model.training.flops as flops  # the one matmul peak and timer, which bench.limits re-exports


def test_matmul_peak_counts_two_flops_per_multiply_add(monkeypatch):
    monkeypatch.setattr(flops, "best_seconds", lambda fn, device, repeats, warmup, min_seconds: 0.5)
    assert limits.matmul_peak_flops(size=64) == 2 * 64**3 / 0.5


def test_copy_bandwidth_counts_bytes_read_and_written(monkeypatch):
    monkeypatch.setattr(limits, "best_seconds", lambda fn, device, repeats, warmup, min_seconds: 2.0)
    assert limits.copy_bandwidth(nbytes=4096) == 2 * 4096 / 2.0


def test_read_bandwidth_counts_bytes_read_once(monkeypatch):
    monkeypatch.setattr(limits, "best_seconds", lambda fn, device, repeats, warmup, min_seconds: 2.0)
    assert limits.read_bandwidth(nbytes=4096) == 4096 / 2.0
    assert limits.read_bandwidth("cpu", nbytes=1 << 16) > 0
    with pytest.raises(ValueError, match="at least 4 bytes"):
        limits.read_bandwidth(nbytes=2)


def test_best_seconds_runs_the_function_and_keeps_the_fastest(monkeypatch):
    clock = iter([0.0, 100.0, 102.0, 103.0, 103.5, 110.0, 113.0, 114.0])  # window, 3 start/stop pairs, check
    monkeypatch.setattr(flops.time, "perf_counter", lambda: next(clock))
    calls = []
    seconds = flops.best_seconds(lambda: calls.append(1), torch.device("cpu"), repeats=3, warmup=2)
    assert len(calls) == 5  # 2 warm-up + 3 timed
    assert seconds == 0.5  # the calls took 2, 0.5 and 3 fake seconds


def test_best_seconds_keeps_going_for_its_time_window(monkeypatch):
    fake = {"now": 0.0}

    def call():
        fake["now"] += 1.0

    monkeypatch.setattr(flops.time, "perf_counter", lambda: fake["now"])
    calls_before = fake["now"]
    flops.best_seconds(call, torch.device("cpu"), repeats=2, warmup=0, min_seconds=10)
    assert fake["now"] - calls_before == 10  # ten 1-second calls fill the 10-second window


def test_cpu_defaults_are_fp32_and_real_measurements_are_positive():
    assert limits.default_device().type in {"cpu", "cuda"}
    peak = limits.matmul_peak_flops(device="cpu", size=64, repeats=1)
    bandwidth = limits.copy_bandwidth("cpu", nbytes=1 << 16, repeats=1)
    assert peak > 0 and bandwidth > 0
    # the default size outgrows the 300 MiB L3 cache of the CI hosts
    assert 2 * limits.default_copy_bytes(torch.device("cpu")) > 300 << 20


@pytest.mark.parametrize("bad", [dict(size=0), dict(size=-3)])
def test_matmul_peak_rejects_nonsense_sizes(bad):
    with pytest.raises(ValueError, match="size"):
        limits.matmul_peak_flops(device="cpu", **bad)


def test_copy_bandwidth_rejects_tiny_buffers():
    with pytest.raises(ValueError, match="at least 4 bytes"):
        limits.copy_bandwidth("cpu", nbytes=2)


def test_mfu_and_decode_bound_arithmetic():
    assert limits.model_flops_utilization(25e9, 100e9) == pytest.approx(0.25)
    # 14 GB of bf16 weights at 3 TB/s: at least 4.67 ms per token
    assert limits.decode_seconds_bound(14e9, 3e12) == pytest.approx(14e9 / 3e12)
    with pytest.raises(ValueError):
        limits.decode_seconds_bound(1.0, 0.0)
    with pytest.raises(ValueError):
        limits.model_flops_utilization(1.0, 0.0)
