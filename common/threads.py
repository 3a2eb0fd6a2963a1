"""How many CPU threads a command uses: the cores other processes leave idle, measured at start, unless told.

On a shared machine, intra-op threads beyond the idle cores spin against the other jobs and run many times
slower (an image tokenizer made 25 steps in 4.5 minutes with 2 threads on 2 busy cores, 374 with 1), so every
training and tokenizing command picks its thread count this way and prints what it chose.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

AUTO = "auto"


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs from /proc/stat (idle includes iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return fields[3] + fields[4], sum(fields)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a cgroup or taskset), else all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_cores(window: float = 0.5) -> int:
    """Cores other processes leave idle, at least 1.

    Measured over `window` seconds from /proc/stat rather than from the load average, which lags by minutes
    (right after setup or a previous job it would still count those as busy).
    """
    cores = usable_cores()
    machine = os.cpu_count() or cores
    try:
        idle0, total0 = _cpu_times()
        time.sleep(window)
        idle1, total1 = _cpu_times()
        idle = machine * (idle1 - idle0) / max(total1 - total0, 1)
    except (OSError, ValueError, IndexError):  # no /proc (not Linux): fall back to the load average
        try:
            idle = machine - os.getloadavg()[0]
        except OSError:
            idle = machine
    return max(1, min(cores, round(idle)))


def parse_threads(value: str | int | None, flag: str = "--threads") -> str | int:
    """`auto` or a positive int, from a flag or config value; anything else is a ValueError naming `flag`."""
    if value is None or str(value).strip().lower() == AUTO:
        return AUTO
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise ValueError(f"{flag} must be 'auto' or a positive number, got {value!r}")
    return number


def choose_threads(requested: str | int | None = AUTO, log: Callable[[str], None] | None = print,
                   what: str = "training") -> int:
    """Set torch's intra-op threads to `requested` (or the idle cores for `auto`), say so, and return the count."""
    import torch

    requested = parse_threads(requested)
    if requested == AUTO:
        threads = free_cores()
        reason = f"{threads} of {usable_cores()} cores idle; --threads N to override"
    else:
        threads, reason = int(requested), "--threads"
    torch.set_num_threads(threads)
    if log is not None:
        log(f"{what} on {threads} CPU thread{'s' if threads != 1 else ''} ({reason})")
    return threads
