"""Training tokens/s before and after the shard-granular stream (issue #33): each tree's own stream feeds each tree's
own training step, one rank of a 64-rank job over the scale probe's largest dataset, trees alternating in fresh
processes; the ratio after / before is the issue's "tokens per second of training unchanged (±5%)".

    python -m bench.bench_scale_train                 # before = bench_scale.BEFORE_REVISION, after = HEAD
    python -m bench.bench_scale_train --smoke         # tiny data, this checkout only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import bench_scale
from bench.compare_revisions import TRAIN_STEP

# The decoder: the `tiny` preset over 4,096-token rows. The probe's ids span 65,536 entries; they are folded into
# MODEL_VOCAB (ids % MODEL_VOCAB) so that a CPU step takes a fraction of a second instead of seconds of LM head: a
# smaller step makes the data path a larger share of it, a stricter test of the loader than a real model would be.
MODEL_VOCAB = 2_048
FULL = {"multiplier": 100, "batch_size": 1, "rank": 0, "world_size": 64, "warmup_steps": 3, "steps": 20,
        "num_workers": 0, "repeats": 5}
SMOKE = {"multiplier": 2, "batch_size": 1, "rank": 0, "world_size": 4, "warmup_steps": 1, "steps": 2,
         "num_workers": 0, "repeats": 1}

# Runs in a fresh interpreter inside the tree under test: the tree's stream, loader and Lightning module.
MEASURE_TRAIN = TRAIN_STEP + r"""
import json, sys, time
import torch
torch.set_num_threads(1)
token_dir, seq_len, batch_size, rank, world, warmup, steps, workers, vocab = sys.argv[1:10]
seq_len, batch_size, rank, world, warmup, steps, workers, vocab = map(
    int, (seq_len, batch_size, rank, world, warmup, steps, workers, vocab))
from data_shards import stream as stream_module
from data_shards.stream import PackedTokenStream
from fusion_model.config import FusionConfig
from fusion_model.training.lightning_module import FusionLightningModule

torch.manual_seed(0)
stream = PackedTokenStream(token_dir, seq_len, batch_size, seed=0, rank=rank, world_size=world)
make_dataloader = getattr(stream_module, "make_dataloader", None)
loader = make_dataloader(stream, num_workers=workers) if make_dataloader is not None else stream
module = FusionLightningModule(FusionConfig.from_preset("tiny", vocab_size=vocab, max_seq_len=seq_len))
optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)

def train_step(batch):
    batch = {k: v for k, v in batch.items() if k in ("input_ids", "document_ids", "position_ids")}
    batch["input_ids"] = batch["input_ids"] % vocab
    optimizer_step(module, optimizer, batch)

batches = iter(loader)
for _ in range(warmup):
    train_step(next(batches))
wall, cpu = time.perf_counter(), time.process_time()
for _ in range(steps):
    train_step(next(batches))
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
tokens = steps * batch_size * seq_len
print(json.dumps({"train_tokens_per_s": tokens / wall, "train_tokens_per_cpu_s": tokens / cpu, "steps": steps,
                  "step_s": wall / steps}))
"""


def measure(tree: Path, token_dir: Path, seq_len: int, settings: dict, timeout: float = 1200.0) -> dict:
    """One fresh process in `tree`: its stream over `token_dir` feeding its training step; tokens/s over `steps`."""
    args = [str(token_dir), str(seq_len), *(str(settings[k]) for k in ("batch_size", "rank", "world_size",
                                                                       "warmup_steps", "steps", "num_workers")),
            str(MODEL_VOCAB)]
    result = subprocess.run([sys.executable, "-c", MEASURE_TRAIN, *args], cwd=tree, env=bench_scale._env(tree),
                            capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"training on {token_dir} in {tree} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def probe(trees: dict[str, str], settings: dict, scale_settings: dict, data_root: Path, log: bool = True) -> dict:
    """Every tree (label -> revision, or bench_scale.WORKTREE), `repeats` fresh processes each, trees alternating."""
    multiplier, seq_len = settings["multiplier"], scale_settings["seq_len"]
    token_dir = bench_scale.build_datasets(data_root, scale_settings["base_shards"], scale_settings["tokens_per_shard"],
                                           (multiplier,), log=log)[multiplier]
    revisions, runs = {}, {label: [] for label in trees}
    with tempfile.TemporaryDirectory(prefix="bench-scale-train-trees-") as scratch:
        paths = {}
        for label, revision in trees.items():
            if revision == bench_scale.WORKTREE:
                paths[label] = bench_scale.REPO
                revisions[label] = {"revision": "worktree", "commit": bench_scale.resolve_revision("HEAD")[0]}
            else:
                paths[label] = bench_scale.materialize(revision, Path(scratch))
                commit, subject = bench_scale.resolve_revision(revision)
                revisions[label] = {"revision": revision, "commit": commit, "subject": subject}
            if bench_scale.has_plan_command(paths[label]):  # as a user would, outside the timing
                bench_scale.write_plan(paths[label], token_dir, seq_len)
        for round_ in range(settings["repeats"]):
            for label in (list(trees) if round_ % 2 == 0 else list(reversed(trees))):
                result = measure(paths[label], token_dir, seq_len, settings)
                runs[label].append(result)
                if log:
                    print(f"bench scale_train: round {round_ + 1}/{settings['repeats']} {label}: "
                          f"{result['train_tokens_per_s']:,.0f} tok/s ({result['step_s']:.3f} s/step)",
                          file=sys.stderr, flush=True)
    medians = {label: {key: statistics.median(r[key] for r in rs) for key in ("train_tokens_per_s",
                                                                             "train_tokens_per_cpu_s", "step_s")}
               for label, rs in runs.items()}
    figures = {f"{label}_train_tokens_per_s": {"value": m["train_tokens_per_s"], "unit": "tok/s"}
               for label, m in medians.items()}
    labels = list(trees)
    if len(labels) == 2:
        before, after = labels
        # named "..._ratio" (a bare number): a name ending in _per_s would be shown as tokens/s
        for key, what in (("train_tokens_per_s", "wall"), ("train_tokens_per_cpu_s", "cpu")):
            figures[f"train_tokens_per_{what}_second_{after}_over_{before}_ratio"] = (medians[after][key]
                                                                                     / medians[before][key])
            # paired by round: each round ran both trees back to back, so a round's ratio sees one machine load
            paired = [a[key] / b[key] for a, b in zip(runs[after], runs[before])]
            figures[f"train_tokens_per_{what}_second_{after}_over_{before}_paired_ratio"] = statistics.median(paired)
    config = {**settings, "seq_len": seq_len, "model": f"tiny preset, vocab {MODEL_VOCAB} (ids folded), fp32, "
              "one torch thread, AdamW", "data": describe(token_dir), "trees": revisions,
              "measured": "tokens/s over `steps` training steps after `warmup_steps`, the stream's batches fetched "
                          "inside the timing (num_workers 0: the data path on the critical path), medians of repeats; "
                          "per CPU second too (process time: less moved by other jobs on a shared machine than wall "
                          "time)", "goal": "after / before within 0.95-1.05 (issue #33)"}
    return {"figures": figures, "config": config, "measurements": medians, "runs": runs}


def describe(token_dir: Path) -> dict:
    """Shards and tokens of a token directory."""
    manifest = json.loads((token_dir / "manifest.json").read_text())
    return {"dir": str(token_dir), "shards": len(manifest["shards"]), "tokens": manifest["tokens"]}


def run(smoke: bool = False) -> dict:
    """The runner's entry (`python -m bench scale_train`): before and after HEAD, or tiny data on this checkout."""
    from bench.harness import write_result

    if smoke:
        with tempfile.TemporaryDirectory(prefix="bench-scale-train-smoke-") as tmp:
            payload = probe({"current": bench_scale.WORKTREE}, SMOKE, bench_scale.SMOKE, Path(tmp), log=False)
    else:
        payload = probe(bench_scale.default_trees(), FULL, bench_scale.FULL,
                        Path(os.environ.get(bench_scale.DATA_ENV, bench_scale.DEFAULT_DATA)))
    payload["config"]["smoke"] = smoke
    write_result("scale_train", payload)
    return payload


def main(argv: list[str] | None = None) -> int:
    """Command line: the full comparison (or --smoke); prints the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny data in a temp dir, this checkout only")
    args = parser.parse_args(argv)
    print(json.dumps(run(smoke=args.smoke)["figures"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
