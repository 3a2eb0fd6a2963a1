"""The side-by-side timer and the result writer: alternation, ratio summary, time cap, results-dir override."""

import json

import pytest

import bench.harness as harness
from bench.harness import (
    COMPARE_SECONDS_ENV,
    RESULTS_DIR,
    RESULTS_DIR_ENV,
    PairedResult,
    compare,
    paired_result,
    time_rounds,
    write_result,
)


class FakeClock:
    """A perf_counter that only moves when a timed function says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def taking(self, seconds: float, log: list[str], tag: str):
        def fn():
            log.append(tag)
            self.now += seconds

        return fn


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(harness.time, "perf_counter", fake)
    monkeypatch.delenv(COMPARE_SECONDS_ENV, raising=False)
    return fake


def test_compare_alternates_and_flips_order_after_warmup(clock):
    log: list[str] = []
    compare(clock.taking(1, log, "A"), clock.taking(1, log, "B"), warmup=1, min_pairs=4, max_pairs=4)
    # warm-up pair, then A B, B A, A B, B A: neither side always runs second
    assert log == ["A", "B", "A", "B", "B", "A", "A", "B", "B", "A"]


def test_compare_reports_reference_over_ours_as_speedup(clock):
    log: list[str] = []
    result = compare(clock.taking(0.5, log, "ours"), clock.taking(2.0, log, "ref"), min_pairs=5, max_pairs=5)
    assert result.pairs == 5
    assert result.speedup_median == pytest.approx(4.0)
    assert result.speedup_q25 == pytest.approx(4.0) and result.speedup_q75 == pytest.approx(4.0)
    assert result.ours_median_s == pytest.approx(0.5) and result.reference_median_s == pytest.approx(2.0)


def test_compare_quartiles_follow_the_pairwise_ratios(clock):
    durations = iter([1.0, 2.0, 4.0, 8.0, 16.0])
    log: list[str] = []

    def ours():
        log.append("ours")
        clock.now += next(durations)

    result = compare(ours, clock.taking(16.0, log, "ref"), warmup=0, min_pairs=5, max_pairs=5)
    # ratios 16, 8, 4, 2, 1 -> median 4, quartiles 2 and 8 (linear interpolation)
    assert (result.speedup_q25, result.speedup_median, result.speedup_q75) == pytest.approx((2.0, 4.0, 8.0))


def test_compare_stops_at_the_deadline_once_min_pairs_are_done(clock):
    log: list[str] = []
    result = compare(clock.taking(1, log, "A"), clock.taking(1, log, "B"), min_pairs=3, max_pairs=100, max_seconds=10)
    # each pair costs 2 fake seconds: pairs keep coming until the 10-second deadline has passed
    assert result.pairs == 5


def test_runner_time_cap_overrides_a_longer_max_seconds(clock, monkeypatch):
    monkeypatch.setenv(COMPARE_SECONDS_ENV, "0")
    log: list[str] = []
    result = compare(clock.taking(1, log, "A"), clock.taking(1, log, "B"), min_pairs=3, max_pairs=100, max_seconds=1e6)
    assert result.pairs == 3


def test_time_rounds_rotates_the_order_so_no_step_is_always_first(clock):
    log: list[str] = []
    steps = {tag: clock.taking(1, log, tag) for tag in "ABC"}
    times = time_rounds(steps, warmup=0, min_rounds=3, max_rounds=3)
    assert log == ["A", "B", "C", "B", "C", "A", "C", "A", "B"]
    assert times == {"A": [1, 1, 1], "B": [1, 1, 1], "C": [1, 1, 1]}


def test_time_rounds_reads_the_clock_it_is_given(clock):
    cpu = FakeClock()
    times = time_rounds({"A": cpu.taking(0.25, [], "A"), "B": clock.taking(1, [], "B")}, warmup=0,
                        min_rounds=2, max_rounds=2, clock=cpu)
    # B moved only the wall clock, so on the given clock it took no time
    assert times == {"A": [0.25, 0.25], "B": [0.0, 0.0]}


def test_paired_result_takes_ratios_round_by_round():
    # per-round ratios 2, 4, 1: a drift that slows both steps in round 2 cancels out
    result = paired_result([1.0, 2.0, 4.0], [2.0, 8.0, 4.0])
    assert (result.speedup_median, result.pairs) == (2.0, 3)
    assert (result.ours_median_s, result.reference_median_s) == (2.0, 4.0)
    with pytest.raises(ValueError, match="same non-zero number of rounds"):
        paired_result([1.0], [1.0, 2.0])


def test_bad_time_cap_names_the_variable(clock, monkeypatch):
    monkeypatch.setenv(COMPARE_SECONDS_ENV, "soon")
    with pytest.raises(ValueError, match=COMPARE_SECONDS_ENV):
        compare(lambda: None, lambda: None)


def test_compare_rejects_impossible_pair_counts():
    with pytest.raises(ValueError, match="min_pairs"):
        compare(lambda: None, lambda: None, min_pairs=5, max_pairs=2)


def test_write_result_honours_env_override_and_argument(tmp_path, monkeypatch):
    env_dir, arg_dir = tmp_path / "env", tmp_path / "arg"
    monkeypatch.setenv(RESULTS_DIR_ENV, str(env_dir))
    paired = PairedResult(2.0, 1.5, 2.5, 3, 0.1, 0.2)
    path = write_result("demo_bench", {"figures": {"speed": paired}, "config": {"n": 1}})
    assert path == env_dir / "demo_bench.json"
    body = json.loads(path.read_text())
    assert body["figures"]["speed"]["speedup_median"] == 2.0
    assert body["config"] == {"n": 1}
    assert body["machine"]["torch"] and body["measured_at"].endswith("UTC")
    assert write_result("demo_bench", {"figures": {"x": 1.0}}, arg_dir) == arg_dir / "demo_bench.json"
    assert not (RESULTS_DIR / "demo_bench.json").exists()
    assert sorted(p.name for p in env_dir.iterdir()) == ["demo_bench.json"]  # no temp file left behind


def test_write_result_refuses_a_path_as_name(tmp_path):
    with pytest.raises(ValueError, match="plain file stem"):
        write_result("../escape", {"figures": {}}, tmp_path)
