"""Run the benchmarks (`python -m bench [names] [--smoke]`), each in its own bounded process, and rewrite BENCHMARKS.md."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import COMPARE_SECONDS_ENV, RESULTS_DIR, RESULTS_DIR_ENV, resolve_results_dir, write_result
from bench.summary import Anchors, render_summary
from common.files import atomic_write_text

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
MARKDOWN = REPO_ROOT / "BENCHMARKS.md"
# shown in their own sections of BENCHMARKS.md, not in the table of ratios
LIMITS_NAME = "limits"
GPU_NAME = "gpu"
GPU_TITLE = "GPU (`bench/gpu.sh`)"
DEFAULT_MAX_SECONDS = 900.0
# benchmarks that need longer than the default kill time (wall seconds); --max-seconds, when given, wins
TIME_LIMITS_S = {"tokenizer_quality": 7200.0}  # 3 models x (3.5 + 15) CPU-minutes on one thread, plus load
TIME_LIMITS_S["stability"] = 2400.0  # a 20 CPU-minute budget on one thread, plus load on a shared machine
TIME_LIMITS_S["speculative"] = 1200.0  # 6,000 one-image generations on one thread (~5 min idle), plus load
TIME_LIMITS_S["sampling"] = 2400.0  # two presets x 2 batches x 6 timed paths and 4 compiles on one thread, plus load
TIME_LIMITS_S["mot"] = 1800.0  # ~7 min idle: 2 train mixes, 5 decode rows, 6 compiles on one thread, plus load
TIME_LIMITS_S["scale"] = 3600.0  # first run builds a 320M-token dataset (~5 min); 2 trees x 3 sizes x 3 processes
# benchmarks whose results also get a section of their own in BENCHMARKS.md: name -> (title, module with section(body))
SECTIONS = {"scale": ("Data at scale: one rank's start-up and memory (issue #33, `bench/bench_scale.py`)",
                      "bench.bench_scale"),
            "mot": ("Mixture-of-Transformers against dense at equal active parameters (issue #31, "
                    "`bench/bench_mot.py`)", "bench.bench_mot"),
            "memory": ("Memory plan against measured peaks (`train.py plan`, `bench/bench_memory.py`)",
                       "bench.bench_memory")}


def discover() -> list[str]:
    """Names of all benchmarks: `bench/bench_<name>.py` gives `<name>`."""
    return sorted(path.stem.removeprefix("bench_") for path in BENCH_DIR.glob("bench_*.py"))


def _check_payload(name: str, payload: object) -> dict:
    if not isinstance(payload, dict) or not isinstance(payload.get("figures"), dict) or not payload["figures"]:
        raise TypeError(
            f"bench/bench_{name}.py: run() must return a dict with a non-empty 'figures' dict "
            f"(and a 'config' dict), got {type(payload).__name__}: {str(payload)[:200]}"
        )
    return payload


def run_one(name: str, smoke: bool = False, out_dir: str | os.PathLike | None = None) -> Path:
    """Run one benchmark in this process and write its result (with run time and smoke flag); return the path."""
    module = importlib.import_module(f"bench.bench_{name}")
    start = time.perf_counter()
    payload = _check_payload(name, module.run(smoke=smoke))
    elapsed = time.perf_counter() - start
    return write_result(name, {**payload, "smoke": smoke, "elapsed_s": round(elapsed, 2)}, out_dir)


def _run_in_child(name: str, smoke: bool, out_dir: Path, max_seconds: float, compare_seconds: float | None) -> str:
    """Run one benchmark in a fresh interpreter, killed after `max_seconds`; return 'ok' or why not."""
    env = dict(os.environ, **{RESULTS_DIR_ENV: str(out_dir)})
    if compare_seconds is not None:
        env[COMPARE_SECONDS_ENV] = str(compare_seconds)
    command = [sys.executable, "-m", "bench.run", "--child", name, "--results-dir", str(out_dir)]
    command += ["--smoke"] if smoke else []
    # a new session so that a timeout kills the benchmark and anything it started, and nothing else
    child = subprocess.Popen(command, cwd=REPO_ROOT, env=env, start_new_session=True)
    try:
        code = child.wait(timeout=max_seconds)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return f"timed out after {max_seconds:g} s (raise --max-seconds or shrink the benchmark)"
    except KeyboardInterrupt:
        # its own session does not see the terminal's Ctrl-C, so take it down before leaving
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        raise
    return "ok" if code == 0 else f"failed with exit code {code} (its traceback is printed above)"


# ---------------------------------------------------------------- rendering BENCHMARKS.md


def _number(value: float, unit: str = "") -> str:
    """Engineering notation for big rates (12.3 G FLOP/s), plain significant digits otherwise."""
    if not math.isfinite(value):
        return str(value)
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale and unit:
            return f"{value / scale:.3g} {prefix}{unit}"
    if 1e4 <= abs(value) < 1e7:
        return f"{float(f'{value:.3g}'):,.0f} {unit}".strip()  # 3 significant digits, thousands separated
    return f"{value:.3g} {unit}".strip()


def _is_paired(value: object) -> bool:
    return isinstance(value, dict) and "speedup_median" in value


def _paired_from_flat(figures: dict) -> tuple[str, dict, set[str]] | None:
    """A comparison spelled as flat keys (`speedup_x`, `speedup_q25`, `speedup_q75`, `pairs`) ->
    (median key, paired dict, keys it used)."""
    for key in figures:
        base = key.removesuffix("_q25")
        if base == key or f"{base}_q75" not in figures:
            continue
        spread = {key, f"{base}_q75"}
        medians = [k for k in figures if k.startswith(base) and k not in spread]
        if len(medians) == 1 and isinstance(figures[medians[0]], (int, float)):
            paired = {"speedup_median": figures[medians[0]], "speedup_q25": figures[key],
                      "speedup_q75": figures[f"{base}_q75"], "pairs": figures.get("pairs", "")}
            used = spread | {medians[0], "pairs"}
            if isinstance(figures.get("ours_median_s"), (int, float)) and isinstance(
                figures.get("reference_median_s"), (int, float)
            ):
                paired["ours_median_s"] = figures["ours_median_s"]
                paired["reference_median_s"] = figures["reference_median_s"]
                used |= {"ours_median_s", "reference_median_s"}
            return medians[0], paired, used
    return None


def _flatten(figures: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Figures may nest ({"small": {"train": paired, "mfu": 0.4}}); leaves are paired results, values or numbers."""
    rows: list[tuple[str, object]] = []
    used: set[str] = set()
    flat = _paired_from_flat(figures)
    if flat is not None:
        key, paired, used = flat
        rows.append((f"{prefix}{key}", paired))
    for key, value in figures.items():
        if key in used:
            continue
        label = f"{prefix}{key}"
        if isinstance(value, dict) and not _is_paired(value) and "value" not in value:
            rows += _flatten(value, f"{label}.")
        else:
            rows.append((label, value))
    return rows


# units read off a bare number's name, longest suffix first
UNIT_SUFFIXES = (("flops_per_s", "FLOP/s"), ("flops", "FLOP/s"), ("bytes_per_s", "B/s"), ("tokens_per_s", "tok/s"),
                 ("images_per_s", "images/s"), ("seconds_per_image", "s"), ("_median_s", "s"), ("_s", "s"))


def _bare_number(label: str, value: float) -> str:
    """A number without a unit of its own: fractions of peaks / bounds as percentages, else a unit from its name."""
    name = label.rsplit(".", 1)[-1].lower()
    if ("mfu" in name or "fraction" in name) and abs(value) <= 10:
        return f"{100 * value:.1f}%"
    unit = next((unit for suffix, unit in UNIT_SUFFIXES if name.endswith(suffix)), "")
    return _number(value, unit)


def _figure_cells(value: object, label: str = "") -> tuple[str, str, str, str]:
    """(result, spread, pairs, ours/reference seconds) cells for one figure."""
    if _is_paired(value):
        result = f"**{value['speedup_median']:.2f}×**"
        spread = f"{value.get('speedup_q25', float('nan')):.2f}–{value.get('speedup_q75', float('nan')):.2f}×"
        times = ""
        if "ours_median_s" in value and "reference_median_s" in value:
            times = f"{value['ours_median_s']:.3g} / {value['reference_median_s']:.3g}"
        return result, spread, str(value.get("pairs", "")), times
    if isinstance(value, dict) and str(value.get("unit", "")).startswith("of ") and isinstance(value.get("value"), float):
        # fractions of a peak or bound read best as percentages
        notes = {k: v for k, v in value.items() if k not in {"value", "unit"}}
        extras = ", ".join(f"{k} {v}" for k, v in notes.items() if not isinstance(v, (dict, list)))
        return f"{100 * value['value']:.1f}% {value['unit']}" + (f" ({extras})" if extras else ""), "", "", ""
    if isinstance(value, dict):
        shown = {"value", "unit", "q25", "q75", "pairs"}
        extras = ", ".join(f"{k} {v}" for k, v in value.items() if k not in shown and not isinstance(v, (dict, list)))
        number, unit = value["value"], value.get("unit", "")
        text = _number(float(number), unit) if isinstance(number, (int, float)) else str(number)
        spread = ""
        if isinstance(value.get("q25"), (int, float)) and isinstance(value.get("q75"), (int, float)):
            spread = f"{_number(float(value['q25']), unit)}–{_number(float(value['q75']), unit)}"
        return text + (f" ({extras})" if extras else ""), spread, str(value.get("pairs", "")), ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value), "", "", ""
    if isinstance(value, int):
        return f"{value:,}", "", "", ""  # counts are exact
    return _bare_number(label, value), "", "", ""


def _machine_key(machine: dict) -> str:
    device = machine.get("cuda") or f"{machine.get('processor', '?')}, {machine.get('cpu_count', '?')} cores"
    return f"{device}; torch {machine.get('torch', '?')}, {machine.get('threads', '?')} threads"


def _load_results(directory: Path) -> dict[str, dict]:
    results = {}
    for path in sorted(directory.glob("*.json")):
        try:
            body = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            print(f"bench: skipping unreadable result {path}: {error}", file=sys.stderr)
            continue
        # other tools' files share the folder (bench.compare_revisions writes revision.json): no figures, no rows
        if isinstance(body, dict) and isinstance(body.get("figures"), dict):
            results[path.stem] = body
    return results


def _rows(results: dict[str, dict], machines: dict[str, str]) -> list[tuple[str, str, tuple, str]]:
    """(benchmark, figure, cells, when) for every figure; numbers each new machine M1, M2, … in order."""
    rows = []
    for name, body in results.items():
        machine = machines.setdefault(_machine_key(body.get("machine", {})), f"M{len(machines) + 1}")
        load = body.get("machine", {}).get("load_avg_1m")
        when = f"{body.get('measured_at', '?')}, {machine}" + (f", load {load:g}" if load is not None else "")
        when += " (smoke)" if body.get("smoke") else ""
        rows += [(name, label, _figure_cells(value, label), when) for label, value in _flatten(body.get("figures", {}))]
    return rows


def _wide(rows: list[tuple[str, str, tuple, str]]) -> bool:
    """Whether some figure is a side-by-side comparison (then the table has the ratio columns)."""
    return any(cells[1] for _, _, cells, _ in rows)


def _table(results: dict[str, dict], machines: dict[str, str], wide: bool | None = None) -> list[str]:
    """One row per figure; the ratio columns appear when `wide`, by default when some figure is a comparison."""
    rows = _rows(results, machines)
    if not rows:
        return []
    if _wide(rows) if wide is None else wide:
        lines = ["| Benchmark | Figure | Result | Spread (IQR) | Pairs | Ours / ref. median s | Measured |"]
        lines.append("|---|---|---|---|---|---|---|")
        lines += [f"| {n} | {label} | {' | '.join(cells)} | {when} |" for n, label, cells, when in rows]
    else:
        lines = ["| Benchmark | Figure | Value | Measured |", "|---|---|---|---|"]
        lines += [f"| {n} | {label} | {cells[0]} | {when} |" for n, label, cells, when in rows]
    return lines


def _figures_title(name: str) -> str:
    """The heading of one benchmark's figures in the table of ratios."""
    return f"{name} (`bench/bench_{name}.py`)" if (BENCH_DIR / f"bench_{name}.py").exists() else f"`{name}`"


def render_markdown(directory: Path, failures: dict[str, str] | None = None) -> str:
    """BENCHMARKS.md text from every result in `directory`: a summary (one row per result file, see
    bench/summary.py), then the detail: ratios with spread per benchmark, limits, GPU, own sections, machines."""
    results = _load_results(directory)
    limits = {k: v for k, v in results.items() if k == LIMITS_NAME}
    gpu = {k: v for k, v in results.items() if k == GPU_NAME}
    others = {k: v for k, v in results.items() if k not in {LIMITS_NAME, GPU_NAME}}
    machines: dict[str, str] = {}
    # headings in document order, so that each anchor is the one GitHub gives it
    anchors = Anchors()
    anchors.add("Benchmarks")
    anchors.add("Summary")
    detail: dict[str, list[tuple[str, str]]] = {}
    out = [
        "# Benchmarks",
        "",
        "Written by `python -m bench` (bench/run.py) from `bench/results/*.json`; rerun it to refresh.",
        "Every ratio is a **speedup** = reference time ÷ our time, measured side by side in one process:",
        "ours and the reference alternate (A B, B A, …) after a warm-up, and the table gives the median of the",
        "pairwise ratios with its inter-quartile spread. Absolute seconds are shown only for orientation; the",
        "machines are shared and noisy, so only the ratios are results. > 1 means ours is faster.",
        "`Measured` gives the UTC time, the machine (listed at the end) and the 1-minute load average",
        "when the result was written: a load above the core count means other work shared the CPU.",
        "",
    ]
    summary_at = len(out)  # the summary goes here once the detail has numbered the machines
    out += ["## Ratios and figures", ""]
    anchors.add("Ratios and figures")
    wide = _wide(_rows(others, {}))
    for name in others:
        title = _figures_title(name)
        detail.setdefault(name, []).append(("figures", anchors.add(title)))
        out += [f"### {title}", "", *_table({name: others[name]}, machines, wide), ""]
    if not others:
        out += ["No benchmark results yet: run `python -m bench`.", ""]
    limits_title = "Machine limits (measured by `bench/limits.py`)"
    limits_anchor = anchors.add(limits_title)
    for name in limits:
        detail.setdefault(name, []).append(("machine limits", limits_anchor))
    out += [f"## {limits_title}", ""]
    limit_table = _table(limits, machines)
    out += limit_table or ["Not measured yet: run `python -m bench limits`."]
    out += [
        "",
        "MFU figures are achieved model FLOP/s ÷ the matmul peak; decode figures compare the time per token",
        "with the bandwidth bound (weight bytes ÷ copy bandwidth, counting bytes read + written).",
        "",
        f"## {GPU_TITLE}",
        "",
        "One script, under 10 minutes on one H100/H200: a bf16 train step (forward, chunked CE + z-loss,",
        "backward, clip, fused AdamW) at a ~1.1B config (d 2048, 16 layers, vocab 65,536, 4 x 4,096 packed",
        "tokens, flex attention, per-block torch.compile), as MFU against the measured bf16 matmul peak and",
        "the data-sheet peak; seconds per 512x512 image (1,024 image tokens) at the chameleon-7b shape",
        "with random bf16 weights and the KV cache (a hand-written eager loop, one token per step), batch 1",
        "and Chameleon's three-stream CFG; and the real sampler there (three-stream CFG, batch 1 and 8), eager",
        "against the compiled decode step (a CUDA graph) and the compiled step with speculative Jacobi decoding",
        "(window 4; on random weights, so its acceptance is not a trained model's). Decode rows compare with",
        "the bound of reading every weight once per forward at the copy bandwidth.",
        "",
    ]
    gpu_anchor = anchors.add(GPU_TITLE)
    for name in gpu:
        detail.setdefault(name, []).append(("GPU", gpu_anchor))
    gpu_table = _table(gpu, machines)
    out += gpu_table or [
        "Not measured yet: no GPU result in bench/results. The script is dry-run tested on CPU",
        "(`tests/bench/test_gpu_dry_run.py`); run `bash bench/gpu.sh` on a GPU machine.",
    ]
    for name, (title, module) in SECTIONS.items():
        if name in results:
            lines = importlib.import_module(module).section(results[name])
            if lines:
                # its own section reads best: first among the links
                detail.setdefault(name, []).insert(0, ("section", anchors.add(title)))
                out += ["", f"## {title}", "", *lines]
    if failures:
        anchors.add("Not measured in the last run")
        out += ["", "## Not measured in the last run", ""]
        out += [f"- `{name}`: {why}" for name, why in sorted(failures.items())]
    anchors.add("Configurations")
    out += ["", "## Configurations", ""]
    for name, body in results.items():
        config = json.dumps(body.get("config", {}), separators=(", ", ": "), default=str)
        if len(config) > 600:
            config = config[:600] + f" … (all of it in bench/results/{name}.json)"
        elapsed = f", ran {body['elapsed_s']} s" if "elapsed_s" in body else ""
        out.append(f"- **{name}**{elapsed}: `{config}`")
    anchors.add("Machines")
    out += ["", "## Machines", ""]
    out += [f"- {key}: {description}" for description, key in machines.items()]
    summary = render_summary(directory, detail, lambda machine: machines.get(_machine_key(machine)))
    out[summary_at:summary_at] = [*summary, ""]
    return "\n".join(out) + "\n"


def write_markdown(directory: Path, path: Path, failures: dict[str, str] | None = None) -> Path:
    """Render and write BENCHMARKS.md atomically."""
    text = render_markdown(directory, failures)
    return atomic_write_text(path, text)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options of `python -m bench`."""
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run benchmarks side by side against their references and rewrite BENCHMARKS.md.",
    )
    parser.add_argument("names", nargs="*", help=f"benchmarks to run (default: all of {', '.join(discover())})")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds each; results go to a temp dir")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help=f"kill a benchmark after this long (default {DEFAULT_MAX_SECONDS:g}, or the benchmark's own "
                        f"limit: {TIME_LIMITS_S}; the decoder one takes about 7 min)")
    parser.add_argument(
        "--compare-seconds", type=float, default=None,
        help=f"cap every side-by-side comparison at this many seconds (sets {COMPARE_SECONDS_ENV}; 1 with --smoke)",
    )
    parser.add_argument("--results-dir", type=Path, default=None, help=f"where results go (default {RESULTS_DIR})")
    parser.add_argument(
        "--markdown", type=Path, default=None,
        help=f"Markdown file to rewrite (default {MARKDOWN.name} at the repo root; not rewritten with --smoke unless given)",
    )
    parser.add_argument("--list", action="store_true", help="print the benchmark names and exit")
    parser.add_argument(
        "--render-only", action="store_true",
        help="run nothing; rewrite the Markdown from the results already there (e.g. after bench/gpu.sh)",
    )
    parser.add_argument("--child", metavar="NAME", help=argparse.SUPPRESS)  # internal: run one in this process
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen benchmarks, each in a child process with a time limit, then rewrite the Markdown."""
    args = parse_args(argv)
    if args.child:
        print(f"bench: wrote {run_one(args.child, smoke=args.smoke, out_dir=args.results_dir)}")
        return 0
    available = discover()
    if args.list:
        print("\n".join(available))
        return 0
    unknown = [name for name in args.names if name not in available]
    if unknown:
        print(f"bench: unknown benchmark(s) {', '.join(unknown)}; choose from: {', '.join(available)}", file=sys.stderr)
        return 2
    if args.max_seconds is not None and args.max_seconds <= 0:
        print(f"bench: --max-seconds must be positive, got {args.max_seconds}", file=sys.stderr)
        return 2
    if args.results_dir is not None:
        out_dir = args.results_dir
    elif args.smoke:
        # smoke figures are meaningless as results; keep them away from bench/results
        out_dir = Path(tempfile.mkdtemp(prefix="bench-smoke-"))
    else:
        out_dir = resolve_results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = args.markdown if args.markdown is not None else (None if args.smoke else MARKDOWN)
    if args.render_only:
        print(f"bench: wrote {write_markdown(out_dir, markdown or MARKDOWN)}")
        return 0
    compare_seconds = args.compare_seconds
    if compare_seconds is None and args.smoke:
        compare_seconds = 1.0  # smoke runs check that a benchmark works, not how fast it is
    failures: dict[str, str] = {}
    for name in args.names or available:
        print(f"bench: {name} ...", flush=True)
        start = time.perf_counter()
        limit = args.max_seconds if args.max_seconds is not None else TIME_LIMITS_S.get(name, DEFAULT_MAX_SECONDS)
        status = _run_in_child(name, args.smoke, out_dir, limit, compare_seconds)
        print(f"bench: {name} {status} ({time.perf_counter() - start:.1f} s)", flush=True)
        if status != "ok":
            failures[name] = status
    if markdown is not None:
        print(f"bench: wrote {write_markdown(out_dir, markdown, failures)}")
    print(f"bench: results in {out_dir}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
