"""The end-to-end demo (`python train.py demo`): six resumable stages from raw digits to an HTML report.

A finished stage leaves `<out>/<stage>/stage.json` (its config key, outputs, timings); a rerun reuses it
unless the stage's configuration (or an upstream stage's) changed, or `--force` names it.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

# Bumped whenever what a stage writes changes meaning (e.g. the document layout), so old outputs are redone.
FORMAT_VERSION = 3
REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs" / "demo"
# stage -> the config sections it reads; upstream stages' keys are folded into its own key.
STAGES: dict[str, tuple[str, ...]] = {
    "tokenizer": ("seed", "data", "tokenizer"),
    "vocab": ("seed", "vocab", "tokenizer"),
    "shards": ("seed", "data", "shards"),
    "train": ("seed", "train"),
    "generate": ("seed", "data", "generate"),
    "report": (),
}
UPSTREAM: dict[str, tuple[str, ...]] = {
    "tokenizer": (),
    "vocab": (),
    "shards": ("tokenizer", "vocab"),
    "train": ("shards",),
    "generate": ("train",),
    "report": ("generate",),
}


def load_config(preset: str = "full", path: str | Path | None = None, overrides: list[str] | None = None) -> dict:
    """Read a demo YAML (a preset name from configs/demo or a path) and apply `section.key=value` overrides."""
    file = Path(path) if path else CONFIG_DIR / f"{preset}.yaml"
    if not file.is_file():
        names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"demo config {file} not found; presets are {names}, or pass --config PATH")
    config = yaml.safe_load(file.read_text())
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected section.key=value, e.g. train.max_minutes=2")
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise KeyError(f"--set {item!r}: no config section {part!r}")
            node = node[part]
        if leaf not in node:
            raise KeyError(f"--set {item!r}: unknown key {leaf!r}; known: {sorted(node)}")
        node[leaf] = yaml.safe_load(raw)
    try:  # shown in the report's rerun commands: relative to the working directory where possible
        config["_source"] = str(file.resolve().relative_to(Path.cwd()))
    except ValueError:
        config["_source"] = str(file.resolve())
    return config


def stage_key(config: dict, stage: str) -> str:
    """A hash of everything the stage's result depends on: its config sections and its upstream stages."""
    parts = {name: config.get(name) for name in STAGES[stage]}
    parts["format"] = FORMAT_VERSION
    parts["upstream"] = [stage_key(config, up) for up in UPSTREAM[stage]]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_marker(out_dir: Path, stage: str) -> dict | None:
    """The finished stage's record, or None when the stage has not finished."""
    file = out_dir / stage / "stage.json"
    return json.loads(file.read_text()) if file.is_file() else None


def write_json(path: Path, payload: dict) -> None:
    """Write JSON atomically (tmp file + os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    os.replace(tmp, path)


def is_fresh(out_dir: Path, config: dict, stage: str) -> bool:
    """True when the stage finished with the current configuration, from the upstream outputs there now."""
    marker = read_marker(out_dir, stage)
    if marker is None or marker.get("key") != stage_key(config, stage):
        return False
    for up in UPSTREAM[stage]:  # an upstream stage rerun since (say with --force) makes this one stale
        upstream = read_marker(out_dir, up)
        if upstream is None or marker.get("inputs", {}).get(up) != upstream.get("run_id"):
            return False
        if not is_fresh(out_dir, config, up):
            return False
    return True


def prepare_folder(folder: Path, key: str, fresh: bool = False) -> None:
    """Keep a stage's partial outputs only when they were made with the same configuration (so it resumes)."""
    key_file = folder / "config_key.txt"
    if folder.exists() and (fresh or not key_file.is_file() or key_file.read_text() != key):
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key_file.write_text(key)


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs from /proc/stat (idle includes iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return fields[3] + fields[4], sum(fields)


def free_cores(window: float = 0.5) -> int:
    """Cores other processes leave idle: oversubscribed intra-op threads spin and run many times slower.

    Measured over `window` seconds from /proc/stat rather than from the load average, which lags by minutes
    (right after setup or a previous job it would still count those as busy).
    """
    cores = os.cpu_count() or 1
    try:
        idle0, total0 = _cpu_times()
        time.sleep(window)
        idle1, total1 = _cpu_times()
        idle = cores * (idle1 - idle0) / max(total1 - total0, 1)
    except (OSError, ValueError, IndexError):  # no /proc (not Linux): fall back to the load average
        try:
            idle = cores - os.getloadavg()[0]
        except OSError:
            idle = cores
    return max(1, min(cores, round(idle)))


def run(config: dict, stages: list[str] | None = None, force: tuple[str, ...] = (), progress: bool = True,
        log: Callable[[str], None] = print) -> dict[str, dict]:
    """Run the requested stages in order (all by default), reusing fresh ones; return every stage's record."""
    from fusion_model.demo import stages as impl

    out_dir = Path(config["out_dir"])
    if not out_dir.is_absolute():
        out_dir = Path.cwd() / out_dir
    wanted = list(STAGES) if not stages else stages
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown demo stage(s) {unknown}; stages are {list(STAGES)}")
    records: dict[str, dict] = {}
    threads = config.get("threads", "auto")
    threads = free_cores() if threads == "auto" else int(threads)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for number, stage in enumerate(STAGES, start=1):
            if stage not in wanted:
                continue
            for up in UPSTREAM[stage]:
                if not is_fresh(out_dir, config, up) and up not in wanted:
                    raise RuntimeError(
                        f"demo stage {stage!r} needs stage {up!r} finished with this configuration ({out_dir / up} "
                        f"is missing or stale); run `python train.py demo --stage {up}` first"
                    )
            label = f"[{number}/{len(STAGES)}] {stage}"
            if is_fresh(out_dir, config, stage) and stage not in force:
                records[stage] = read_marker(out_dir, stage)
                log(f"{label}: reusing finished stage ({records[stage]['seconds']:.0f} s)")
                continue
            log(f"{label}: running ({threads} thread{'s' if threads > 1 else ''})")
            prepare_folder(out_dir / stage, stage_key(config, stage), fresh=stage in force)
            start = time.perf_counter()
            result = getattr(impl, f"run_{stage}")(config, out_dir, progress=progress)
            record = {"stage": stage, "key": stage_key(config, stage), "run_id": uuid.uuid4().hex,
                      "inputs": {up: read_marker(out_dir, up)["run_id"] for up in UPSTREAM[stage]},
                      "seconds": time.perf_counter() - start, "threads": threads,
                      "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"), **result}
            write_json(out_dir / stage / "stage.json", record)
            records[stage] = record
            log(f"{label}: done in {record['seconds']:.0f} s")
    finally:
        torch.set_num_threads(previous_threads)
    return records


def build_parser() -> argparse.ArgumentParser:
    """The `train.py demo` options."""
    parser = argparse.ArgumentParser(prog="train.py demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="full", help="a config in configs/demo/ (full, smoke)")
    parser.add_argument("--config", default=None, help="a demo YAML file instead of a preset")
    parser.add_argument("--out", default=None, help="output directory (default: the config's out_dir)")
    parser.add_argument("--stage", action="append", choices=list(STAGES), default=None,
                        help="run only this stage (repeatable); its upstream stages must have finished")
    parser.add_argument("--force", action="append", choices=list(STAGES), default=[],
                        help="rerun this stage even if it finished (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value, e.g. --set train.max_minutes=2")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python train.py demo`."""
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.preset, args.config, args.set)
    except (FileNotFoundError, KeyError, ValueError) as error:
        print(f"train.py demo: {error}", file=sys.stderr)
        return 2
    if args.out:
        config["out_dir"] = args.out
    records = run(copy.deepcopy(config), args.stage, tuple(args.force), progress=not args.no_progress)
    if "report" in records:
        print(f"report: {records['report']['path']}")
        for name, value in records["report"].get("summary", {}).items():
            print(f"  {name}: {value}")
    return 0
