"""Side-by-side timing: ours and the reference alternate (A B A B ...) and the pairwise ratios are summarised."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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


def _seconds(fn: Callable[[], object], sync: Callable[[], None] | None) -> float:
    start = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


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
    for _ in range(warmup):
        ours()
        reference()
    ratios: list[float] = []
    ours_times: list[float] = []
    ref_times: list[float] = []
    deadline = time.perf_counter() + max_seconds
    while len(ratios) < max_pairs and (len(ratios) < min_pairs or time.perf_counter() < deadline):
        if len(ratios) % 2 == 0:
            t_ours, t_ref = _seconds(ours, sync), _seconds(reference, sync)
        else:
            t_ref, t_ours = _seconds(reference, sync), _seconds(ours, sync)
        ours_times.append(t_ours)
        ref_times.append(t_ref)
        ratios.append(t_ref / t_ours)
    return PairedResult(
        speedup_median=statistics.median(ratios),
        speedup_q25=_quantile(ratios, 0.25),
        speedup_q75=_quantile(ratios, 0.75),
        pairs=len(ratios),
        ours_median_s=statistics.median(ours_times),
        reference_median_s=statistics.median(ref_times),
    )


def machine_info() -> dict:
    """What the figures were measured on."""
    import torch

    info = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def write_result(name: str, payload: dict, results_dir: Path | None = None) -> Path:
    """Write `bench/results/<name>.json` atomically, with the machine description attached."""
    results_dir = Path(results_dir or RESULTS_DIR)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    body = {"name": name, "machine": machine_info(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), **payload}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=2, default=float) + "\n")
    os.replace(tmp, path)
    return path
