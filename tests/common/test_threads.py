"""Thread choice: idle cores measured from /proc/stat, `auto` or a number, printed, applied to torch."""

from __future__ import annotations

import pytest
import torch

from common import threads


def test_free_cores_counts_the_idle_share_of_the_machine(monkeypatch):
    samples = iter([(1000, 4000), (1000 + 100, 4000 + 400)])  # 100 of 400 jiffies idle: a quarter of 4 cores
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(threads.time, "sleep", lambda seconds: None)
    assert threads.free_cores() == 1


def test_free_cores_is_at_least_one_and_at_most_the_usable_cores(monkeypatch):
    busy = iter([(0, 0), (0, 800)])  # nothing idle
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(busy))
    monkeypatch.setattr(threads.time, "sleep", lambda seconds: None)
    assert threads.free_cores() == 1


def test_free_cores_on_this_machine_is_within_its_cores():
    assert 1 <= threads.free_cores(window=0.05) <= threads.usable_cores()


@pytest.mark.parametrize("value, expected", [("auto", "auto"), (None, "auto"), ("AUTO", "auto"), ("3", 3), (2, 2)])
def test_parse_threads(value, expected):
    assert threads.parse_threads(value) == expected


@pytest.mark.parametrize("value", ["0", "-1", "many", 0])
def test_a_bad_thread_count_names_the_flag(value):
    with pytest.raises(ValueError, match="--threads must be 'auto' or a positive number"):
        threads.parse_threads(value)
    with pytest.raises(ValueError, match="--workers must be 'auto'"):
        threads.parse_threads(value, flag="--workers")


def test_choose_threads_applies_and_reports_the_choice(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "free_cores", lambda: 1)
    lines: list[str] = []
    try:
        assert threads.choose_threads("auto", log=lines.append, what="tokenizer training") == 1
        assert torch.get_num_threads() == 1
        assert lines == [f"tokenizer training on 1 CPU thread (1 of {threads.usable_cores()} cores idle; "
                         "--threads N to override)"]
        assert threads.choose_threads(2, log=lines.append) == 2 and torch.get_num_threads() == 2
        assert lines[-1] == "training on 2 CPU threads (--threads)"
    finally:
        torch.set_num_threads(before)
