"""The end-to-end demo (`python train.py demo`): six resumable stages from raw digits to an HTML report.

A finished stage leaves `<out>/<stage>/stage.json` (its config key, outputs, timings); a rerun reuses it
unless the stage's configuration (or an upstream stage's) changed, or `--force` names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from common.threads import free_cores
from experiments.demo import stages as impl
from experiments.demo.bookkeeping import (
    STAGES,
    UPSTREAM,
    is_fresh,
    prepare_folder,
    read_marker,
    stage_key,
    write_marker,
)
from experiments.demo.settings import DemoConfig, load_config


def run(config: DemoConfig, stages: list[str] | None = None, force: tuple[str, ...] = (),
        progress: bool = True, log: Callable[[str], None] = print) -> dict[str, dict]:
    """Run the requested stages in order (all by default), reusing fresh ones; return every stage's record."""
    out_dir = Path(config.out_dir)
    if not out_dir.is_absolute():
        out_dir = Path.cwd() / out_dir
    wanted = list(STAGES) if not stages else stages
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown demo stage(s) {unknown}; stages are {list(STAGES)}")
    records: dict[str, dict] = {}
    threads = free_cores() if config.threads == "auto" else int(config.threads)
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
            write_marker(out_dir, stage, record)
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
    except (FileNotFoundError, ValueError) as error:
        print(f"train.py demo: {error}", file=sys.stderr)
        return 2
    if args.out:
        config = dataclasses.replace(config, out_dir=args.out)
    records = run(config, args.stage, tuple(args.force), progress=not args.no_progress)
    if "report" in records:
        print(f"report: {records['report']['path']}")
        for name, value in records["report"].get("summary", {}).items():
            print(f"  {name}: {value}")
    return 0
