"""Side-by-side timing: ours and the reference alternate (A B A B ...) and the pairwise ratios are summarised."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

from common.files import atomic_write_text

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# `python -m bench` and the smoke test point these at their own choices; benchmarks need not know.
RESULTS_DIR_ENV = "BENCH_RESULTS_DIR"
COMPARE_SECONDS_ENV = "BENCH_COMPARE_MAX_SECONDS"


@dataclass
class PairedResult:
    """Summary of alternating timings; `speedup` > 1 means ours is faster than the reference."""

    speedup_median: float
    speedup_q25: float
    speedup_q75: float
    pairs: int
    ours_median_s: float
    reference_median_s: float

    def as_dict(self) -> dict:
        """Plain-JSON form."""
        return asdict(self)


def _seconds(fn: Callable[[], object], sync: Callable[[], None] | None, clock: Callable[[], float]) -> float:
    start = clock()
    fn()
    if sync is not None:
        sync()
    return clock() - start


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def compare_seconds_cap() -> float | None:
    """The per-comparison time cap set by the runner (env `BENCH_COMPARE_MAX_SECONDS`), if any."""
    raw = os.environ.get(COMPARE_SECONDS_ENV)
    if not raw:
        return None
    try:
        cap = float(raw)
    except ValueError as error:
        raise ValueError(f"{COMPARE_SECONDS_ENV}={raw!r} is not a number of seconds; unset it or give e.g. 5") from error
    if cap < 0:
        raise ValueError(f"{COMPARE_SECONDS_ENV}={raw!r} must be >= 0 seconds")
    return cap


def time_rounds(
    steps: dict[str, Callable[[], object]],
    *,
    warmup: int = 1,
    min_rounds: int = 3,
    max_rounds: int = 30,
    max_seconds: float = 20.0,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> dict[str, list[float]]:
    """Time every step once per round, the order rotating by one each round so that none always runs
    first or last; return each step's seconds, round by round. `clock` defaults to time.perf_counter;
    time.process_time gives CPU seconds, which other jobs on a shared machine inflate far less."""
    if min_rounds < 1 or max_rounds < min_rounds:
        raise ValueError(f"need 1 <= min_rounds <= max_rounds, got min_rounds={min_rounds}, max_rounds={max_rounds}")
    clock = clock or time.perf_counter
    cap = compare_seconds_cap()
    if cap is not None:
        max_seconds = min(max_seconds, cap)
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    rounds = 0
    deadline = time.perf_counter() + max_seconds
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() < deadline):
        shift = rounds % len(names)
        for name in names[shift:] + names[:shift]:  # with two steps: A B, B A, A B, ...
            times[name].append(_seconds(steps[name], sync, clock))
        rounds += 1
    return times


def paired_result(ours_times: list[float], reference_times: list[float]) -> PairedResult:
    """Summarise two steps timed in the same rounds by their per-round ratios (reference / ours)."""
    if len(ours_times) != len(reference_times) or not ours_times:
        raise ValueError(f"need the same non-zero number of rounds, got {len(ours_times)} and {len(reference_times)}")
    # a clock tick of 0 s would divide by zero; the smallest positive float keeps the ratio finite-ish
    ratios = [ref / max(ours, 1e-12) for ours, ref in zip(ours_times, reference_times)]
    return PairedResult(
        speedup_median=statistics.median(ratios),
        speedup_q25=_quantile(ratios, 0.25),
        speedup_q75=_quantile(ratios, 0.75),
        pairs=len(ratios),
        ours_median_s=statistics.median(ours_times),
        reference_median_s=statistics.median(reference_times),
    )


def compare(
    ours: Callable[[], object],
    reference: Callable[[], object],
    *,
    warmup: int = 1,
    min_pairs: int = 3,
    max_pairs: int = 30,
    max_seconds: float = 20.0,
    sync: Callable[[], None] | None = None,
) -> PairedResult:
    """Time `ours` and `reference` alternately; the order flips each pair so neither always runs second."""
    if min_pairs < 1 or max_pairs < min_pairs:
        raise ValueError(f"need 1 <= min_pairs <= max_pairs, got min_pairs={min_pairs}, max_pairs={max_pairs}")
    times = time_rounds({"ours": ours, "reference": reference}, warmup=warmup, min_rounds=min_pairs,
                        max_rounds=max_pairs, max_seconds=max_seconds, sync=sync)
    return paired_result(times["ours"], times["reference"])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """What the figures were measured on."""
    import torch

    info = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # how busy the machine was: on shared hosts this explains noisy absolute times
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    return info


def resolve_results_dir(override: str | os.PathLike | None = None) -> Path:
    """Where results go: the argument, else env `BENCH_RESULTS_DIR`, else `bench/results/`."""
    chosen = override or os.environ.get(RESULTS_DIR_ENV) or RESULTS_DIR
    return Path(chosen)


def write_result(name: str, payload: dict, results_dir: str | os.PathLike | None = None) -> Path:
    """Write `<results dir>/<name>.json` atomically, with the machine description attached."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"benchmark name {name!r} must be a plain file stem such as 'decoder'")
    directory = resolve_results_dir(results_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    body = {
        "name": name,
        "machine": machine_info(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        **payload,
    }
    atomic_write_text(path, json.dumps(body, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(value: object) -> object:
    """JSON fallback: PairedResult and dataclasses as dicts, tensors / numpy scalars as numbers."""
    if isinstance(value, PairedResult):
        return value.as_dict()
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    return float(value)
