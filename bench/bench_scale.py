"""Scale probe (issue #33): one rank of a 64-rank job, time to its first batch and peak RSS at 1x, 10x, 100x a dataset."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The last commit before the shard-granular stream of issue #33: the "before" of the probe.
BEFORE_REVISION = "3d9dd4aa8e7c122df6326795b8d3f21dfeb47d92"
WORKTREE = "."  # a tree argument meaning this checkout as it is on disk, uncommitted edits included
DATA_ENV = "BENCH_SCALE_DATA"  # where the full probe keeps its synthetic datasets (built once, reused)
DEFAULT_DATA = REPO / "runs" / "bench_scale"
CHAMELEON_TOKENS = 4.4e12  # Chameleon's pretraining tokens: about 9 TB of uint16 ids
VOCAB_SIZE = 65_536  # Chameleon's vocabulary: uint16 ids
DOC_TOKENS = (64, 1_023)  # document lengths, uniform, as in the measurement
PER_SHARD_ARRAY_BYTES = 24  # what the stream holds per shard: row count, the epoch's order, cumulative rows (int64)
GOAL_RATIO = 1.5  # issue #33: at 100x, within 1.5x of the 1x value
RATE_TOLERANCE = 0.05  # issue #33: tokens per second unchanged, +-5%

FULL = {"base_shards": 64, "tokens_per_shard": 50_000, "multipliers": (1, 10, 100), "seq_len": 4_096,
        "batch_size": 4, "rank": 0, "world_size": 64, "repeats": 3, "rate_batches": 256, "rate_seconds": 10.0,
        "big_shards": (32, 10_000_000), "steady_rate_batches": 16_640}  # 16,640 x 4 rows: past one 65,536-row window
SMOKE = {"base_shards": 4, "tokens_per_shard": 2_000, "multipliers": (1, 2, 4), "seq_len": 512, "batch_size": 2,
         "rank": 0, "world_size": 4, "repeats": 1, "rate_batches": 4, "rate_seconds": 2.0, "big_shards": (2, 8_000),
         "steady_rate_batches": 8}

# What both measuring scripts start with: /proc/self/status fields, and the peak RSS counted from the call on.
PEAK_RSS = r"""
def status_kib(field):
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")

def reset_peak():  # (baseline KiB the peak is measured from, how): VmHWM reset to VmRSS where Linux allows it
    try:  # Linux >= 4.0: reset the peak RSS to the current RSS, so the peak counts from here
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return status_kib("VmRSS"), "VmHWM reset by /proc/self/clear_refs after imports, minus VmRSS then"
    except OSError:
        return status_kib("VmHWM"), "VmHWM minus VmHWM after imports (peak may hide under the import peak)"
"""

# What a rank reads of the dataset's metadata at start: the dataset index where the tree has one (it replaced the
# manifest's parse), else the whole manifest.
# (The tree's own file is checked first: an editable install of this checkout would supply a module the tree lacks.)
READ_METADATA = r"""
import os as _os
try:
    if not _os.path.isfile(_os.path.join("data_shards", "plan.py")):
        raise ImportError("this tree has no data_shards/plan.py")
    from data_shards.plan import read_index as read_metadata
except ImportError:
    from data_shards.token_shards import read_manifest as read_metadata
"""

# Runs in a fresh interpreter inside the tree under test (PYTHONPATH = that tree): only the stream's public API.
MEASURE = PEAK_RSS + READ_METADATA + r"""
import json, resource, sys, time
token_dir, seq_len, batch_size, rank, world, rate_batches, rate_seconds = sys.argv[1:8]
seq_len, batch_size, rank, world, rate_batches = map(int, (seq_len, batch_size, rank, world, rate_batches))
rate_seconds = float(rate_seconds)

import gc
import numpy, torch
torch.set_num_threads(1)
from data_shards import stream as stream_module
from data_shards.stream import PackedTokenStream
make_dataloader = getattr(stream_module, "make_dataloader", None)
gc.collect()
baseline, peak_method = reset_peak()
wall, cpu = time.perf_counter(), time.process_time()
stream = PackedTokenStream(token_dir, seq_len, batch_size, seed=0, rank=rank, world_size=world)
constructed_s = time.perf_counter() - wall
loader = make_dataloader(stream) if make_dataloader is not None else stream
batches = iter(loader)
first = next(batches)
first_batch_s, first_batch_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
peak_first = status_kib("VmHWM") - baseline
# the manifest read the stream did too (a tree with the dataset index reads that instead), again in this process
# (same files, same page cache), for "beyond the manifest"
manifest_wall, manifest_cpu = time.perf_counter(), time.process_time()
read_metadata(token_dir)
manifest_s, manifest_cpu_s = time.perf_counter() - manifest_wall, time.process_time() - manifest_cpu
# the loader's steady rate: whole batches of B x T slots, epochs run through as needed
count, real, start, start_cpu, epoch_batches = 0, 0, time.perf_counter(), time.process_time(), len(stream)
while count < rate_batches and (count == 0 or time.perf_counter() - start < rate_seconds):
    for batch in batches:
        count += 1
        real += int((batch["document_ids"] >= 0).sum())
        if count >= rate_batches or time.perf_counter() - start >= rate_seconds:
            break
    else:
        batches = iter(loader)  # the next epoch
        continue
rate_s, rate_cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
print(json.dumps({
    "first_batch_s": first_batch_s, "first_batch_cpu_s": first_batch_cpu_s, "constructed_s": constructed_s,
    "peak_rss_increase_bytes": 1024 * peak_first,
    "peak_rss_increase_after_rate_bytes": 1024 * (status_kib("VmHWM") - baseline),
    "ru_maxrss_bytes": 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    "peak_method": peak_method, "batches_per_epoch": epoch_batches,
    "manifest_s": manifest_s, "manifest_cpu_s": manifest_cpu_s,
    "first_batch_shape": list(first["input_ids"].shape),
    "rate_batches": count, "rate_s": rate_s,
    "stream_tokens_per_s": count * batch_size * seq_len / rate_s,
    "stream_tokens_per_cpu_s": count * batch_size * seq_len / max(rate_cpu_s, 1e-9),
    "real_tokens_per_s": real / rate_s,
    "real_tokens_per_cpu_s": real / max(rate_cpu_s, 1e-9),
    "padding_fraction": 1 - real / max(count * batch_size * seq_len, 1),
}))
"""

# The O(shards) part a rank may still pay (issue #33: "beyond reading the manifest"): read_manifest alone in a fresh
# process, for its peak RSS (its time is also taken inside MEASURE, after the first batch, paired with the stream's).
MEASURE_MANIFEST = PEAK_RSS + READ_METADATA + r"""
import gc, json, sys, time

gc.collect()
baseline, _ = reset_peak()
wall, cpu = time.perf_counter(), time.process_time()
metadata = read_metadata(sys.argv[1])
print(json.dumps({"manifest_fresh_s": time.perf_counter() - wall, "manifest_fresh_cpu_s": time.process_time() - cpu,
                  "manifest_peak_rss_increase_bytes": 1024 * (status_kib("VmHWM") - baseline)}))
"""


# ---------------------------------------------------------------- the synthetic datasets


def _shard_documents(seed: int, index: int, tokens: int) -> list[list[int]]:
    """Shard `index`'s documents: lengths uniform in DOC_TOKENS until `tokens` ids, random ids (the same for any size)."""
    import numpy as np

    rng = np.random.default_rng([seed, index])
    documents, total = [], 0
    while total < tokens:
        length = int(rng.integers(DOC_TOKENS[0], DOC_TOKENS[1] + 1))
        documents.append(rng.integers(0, VOCAB_SIZE, size=length, dtype=np.int64).tolist())
        total += length
    return documents


def _shard_name(index: int) -> str:
    return f"scale-{index:06d}"


def build_datasets(root: Path, base_shards: int, tokens_per_shard: int, multipliers: Sequence[int],
                   seed: int = 0, log: bool = False) -> dict[int, Path]:
    """Token directories at each multiple of the base size, written with the project's writer and manifest.

    The largest is written once (cached: reused when its `probe.json` matches); each smaller one hard-links the
    first shards of it under its own manifest, so shard i is the same file at every size. Returns {multiplier: dir}.
    """
    from data_shards.token_shards import write_manifest, write_token_shard

    settings = {"base_shards": base_shards, "tokens_per_shard": tokens_per_shard, "seed": seed,
                "vocab_size": VOCAB_SIZE, "doc_tokens": list(DOC_TOKENS), "format": 1}
    info = {"vocab_size": VOCAB_SIZE, "vocab_fingerprint": "bench-scale", "image_tokenizer_fingerprint": "bench-scale",
            "images": 0}
    header = {**info, "pad_id": 0}
    root = Path(root)
    dirs = {}
    largest = max(multipliers)
    metas: list[dict] = []
    for multiplier in sorted(multipliers, reverse=True):
        directory = root / f"x{multiplier}-{base_shards}x{tokens_per_shard}-seed{seed}"
        dirs[multiplier] = directory
        marker = directory / "probe.json"
        wanted = {**settings, "multiplier": multiplier}
        if marker.is_file() and json.loads(marker.read_text()) == wanted:
            continue
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        shards = base_shards * multiplier
        if multiplier == largest:
            start = time.perf_counter()
            for index in range(shards):
                documents = _shard_documents(seed, index, tokens_per_shard)
                keys = [f"s{index}d{i}" for i in range(len(documents))]
                metas.append(write_token_shard(directory, _shard_name(index), keys, documents, info))
                if log and (index + 1) % max(shards // 10, 1) == 0:
                    print(f"bench scale: wrote {index + 1}/{shards} shards of x{multiplier} "
                          f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
        else:
            if not metas:  # the largest was cached: read its metas back
                from data_shards.token_shards import read_shard_meta

                metas = [read_shard_meta(dirs[largest], _shard_name(i)) for i in range(base_shards * largest)]
            for index in range(shards):
                for path in dirs[largest].glob(f"{_shard_name(index)}.*"):
                    os.link(path, directory / path.name)
        write_manifest(directory, header, metas[:shards])
        marker.write_text(json.dumps(wanted) + "\n")
    return dirs


# ---------------------------------------------------------------- trees under test


def resolve_revision(revision: str) -> tuple[str, str]:
    """(full commit hash, subject line) of a revision of this repository."""
    out = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%H %s", f"{revision}^{{commit}}", "--"],
                         capture_output=True, text=True, check=True).stdout.strip()
    commit, _, subject = out.partition(" ")
    return commit, subject


def last_data_change(revision: str) -> tuple[str, str]:
    """(commit, subject) of the last change to data_shards/ at `revision`: what the probe measures of a tree."""
    out = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%H %s", f"{revision}^{{commit}}", "--",
                          "data_shards"], capture_output=True, text=True, check=True).stdout.strip()
    commit, _, subject = out.partition(" ")
    return commit, subject


def materialize(revision: str, into: Path) -> Path:
    """Extract the files of `revision` (git archive) into a fresh folder under `into`; returns it.

    Unlike `git worktree add`, this leaves the shared repository's worktree list alone and needs no cleanup there.
    """
    commit, _ = resolve_revision(revision)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", commit], capture_output=True,
                             check=True).stdout
    tree = Path(into) / commit[:12]
    tree.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def has_plan_command(tree: Path, timeout: float = 300.0) -> bool:
    """Whether the tree's CLI offers `train.py shards plan` (the per-seq_len row-count plan of issue #33)."""
    result = subprocess.run([sys.executable, "train.py", "shards", "plan", "--help"], cwd=tree, env=_env(tree),
                            capture_output=True, text=True, timeout=timeout)
    return result.returncode == 0


def write_plan(tree: Path, token_dir: Path, seq_len: int, timeout: float = 1800.0) -> float:
    """Run `train.py shards plan DIR --seq-len N` in the tree, as a user would before training; returns its seconds."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "train.py", "shards", "plan", str(token_dir), "--seq-len", str(seq_len)],
                            cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"`train.py shards plan {token_dir} --seq-len {seq_len}` failed in {tree}:\n"
                           f"{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return time.perf_counter() - start


def measure(tree: Path, token_dir: Path, settings: dict, timeout: float = 900.0) -> dict:
    """Fresh processes in `tree`: rank `rank` of `world_size` builds the stream over `token_dir` (its figures), and
    `read_manifest` alone (what the stream pays beyond it: `*_beyond_manifest_*`)."""
    args = [str(token_dir), *(str(settings[k]) for k in ("seq_len", "batch_size", "rank", "world_size",
                                                           "rate_batches", "rate_seconds"))]
    result = subprocess.run([sys.executable, "-c", MEASURE, *args], cwd=tree, env=_env(tree), capture_output=True,
                            text=True, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {token_dir} in {tree} failed:\n{result.stderr[-3000:]}")
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    manifest = subprocess.run([sys.executable, "-c", MEASURE_MANIFEST, str(token_dir)], cwd=tree, env=_env(tree),
                              capture_output=True, text=True, timeout=timeout)
    if manifest.returncode != 0:
        raise RuntimeError(f"reading the manifest of {token_dir} in {tree} failed:\n{manifest.stderr[-3000:]}")
    figures.update(json.loads(manifest.stdout.strip().splitlines()[-1]))
    # what the rank pays beyond reading the manifest (which the stream reads too)
    figures["first_batch_beyond_manifest_s"] = figures["first_batch_s"] - figures["manifest_s"]
    figures["first_batch_cpu_beyond_manifest_s"] = figures["first_batch_cpu_s"] - figures["manifest_cpu_s"]
    figures["peak_rss_beyond_manifest_bytes"] = (figures["peak_rss_increase_bytes"]
                                                 - figures["manifest_peak_rss_increase_bytes"])
    return figures


# ---------------------------------------------------------------- the probe


# ratio rows: figure name -> measured key (wall time, CPU time: other jobs on a shared machine inflate it far less)
RATIOS = {"first_batch": "first_batch_s", "first_batch_cpu": "first_batch_cpu_s", "peak_rss": "peak_rss_increase_bytes",
          "first_batch_beyond_manifest": "first_batch_beyond_manifest_s",
          "first_batch_cpu_beyond_manifest": "first_batch_cpu_beyond_manifest_s",
          "peak_rss_beyond_manifest": "peak_rss_beyond_manifest_bytes"}
MEDIAN_KEYS = ("first_batch_s", "first_batch_cpu_s", "constructed_s", "peak_rss_increase_bytes",
               "peak_rss_increase_after_rate_bytes", "stream_tokens_per_s", "stream_tokens_per_cpu_s", "real_tokens_per_s",
               "real_tokens_per_cpu_s", "padding_fraction", "manifest_s", "manifest_cpu_s",
               "manifest_peak_rss_increase_bytes", *RATIOS.values())


def _ratios(per_size: dict[int, dict], key: str) -> dict[str, float]:
    low = min(per_size)
    return {f"{m}x_over_{low}x": per_size[m][key] / max(per_size[low][key], 1e-12) for m in sorted(per_size) if m != low}


def extrapolate(per_size: dict[int, dict], tokens: dict[int, int], key: str, target: float = CHAMELEON_TOKENS) -> float:
    """`key` at `target` tokens, linear in tokens through the two largest sizes (a fixed cost plus a per-token one)."""
    small, large = sorted(per_size)[-2:]
    slope = (per_size[large][key] - per_size[small][key]) / (tokens[large] - tokens[small])
    return per_size[large][key] + slope * (target - tokens[large])


def epoch_order_seconds(shards: int, repeats: int = 3) -> float:
    """Seconds (median) of what the stream computes per epoch over all shards: the seeded permutation and the
    cumulative rows along it (as `PackedTokenStream.shard_order`)."""
    import numpy as np

    rows = np.ones(shards, dtype=np.int64)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        order = np.random.default_rng([0, 0]).permutation(shards)
        np.concatenate([[0], np.cumsum(rows[order])])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in dict.fromkeys(MEDIAN_KEYS)} | {
        "batches_per_epoch": runs[0]["batches_per_epoch"]}


def probe(trees: dict[str, str], settings: dict, data_root: Path, log: bool = True) -> dict:
    """Measure every tree (label -> revision, or WORKTREE) at every size, sizes and trees alternating, `repeats`
    fresh processes each; returns the payload ({figures, config, measurements, ...}) for bench/results/scale.json.

    With settings["big_shards"] = (n, tokens), also the largest size's tokens again in n big shards (one row each).
    """
    started = time.perf_counter()
    dirs = build_datasets(data_root, settings["base_shards"], settings["tokens_per_shard"], settings["multipliers"],
                          log=log)
    big = settings.get("big_shards")
    big_dir = build_datasets(data_root, big[0], big[1], (1,), log=log)[1] if big else None
    build_s = time.perf_counter() - started
    from data_shards.token_shards import read_manifest

    def describe(directory: Path) -> dict:
        manifest = read_manifest(directory)
        return {"shards": len(manifest["shards"]), "tokens": manifest["tokens"], "documents": manifest["documents"],
                "id_bytes": 2 * manifest["tokens"]}

    sizes = {multiplier: describe(directory) for multiplier, directory in sorted(dirs.items())}
    tokens = {m: s["tokens"] for m, s in sizes.items()}
    # key -> (token dir, settings): the sizes; the big shards as rank 0 of world_size (start-up) and as the only rank
    # (the loader's steady rate when a rank's share of the epoch spans many shuffle windows, as at 9 TB, not a part of one)
    targets: dict[str, tuple[Path, dict]] = {str(m): (d, settings) for m, d in sorted(dirs.items())}
    if big_dir is not None:
        targets["big_shards"] = (big_dir, settings)
        targets["big_shards_world1"] = (big_dir, {**settings, "rank": 0, "world_size": 1, "rate_seconds": 900.0,
                                                  "rate_batches": settings.get("steady_rate_batches", 1_000)})
    revisions: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-scale-trees-") as scratch:
        paths = {}
        for label, revision in trees.items():
            if revision == WORKTREE:
                paths[label] = REPO
                revisions[label] = {"revision": "worktree", "commit": resolve_revision("HEAD")[0] + " + uncommitted"}
            else:
                paths[label] = materialize(revision, Path(scratch))
                commit, subject = resolve_revision(revision)
                revisions[label] = {"revision": revision, "commit": commit, "subject": subject}
            data_commit, data_subject = last_data_change("HEAD" if revision == WORKTREE else revision)
            revisions[label].update(data_commit=data_commit, data_subject=data_subject)
            revisions[label]["plan_command"] = has_plan_command(paths[label])
        plans: dict[str, dict[str, float]] = {label: {} for label in trees}
        for label, path in paths.items():
            if revisions[label]["plan_command"]:
                for key, (directory, _) in targets.items():
                    if key == "big_shards_world1":
                        continue  # the same data and seq_len as big_shards
                    plans[label][key] = write_plan(path, directory, settings["seq_len"])
                    if log:
                        print(f"bench scale: {label} shards plan {key}: {plans[label][key]:.1f} s", file=sys.stderr,
                              flush=True)
        runs: dict[str, dict[str, list[dict]]] = {label: {key: [] for key in targets} for label in trees}
        for round_ in range(settings["repeats"]):
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for key, (directory, measured_with) in targets.items():
                for label in order:
                    result = measure(paths[label], directory, measured_with)
                    runs[label][key].append(result)
                    if log:
                        print(f"bench scale: round {round_ + 1}/{settings['repeats']} {label} {key}: "
                              f"first batch {result['first_batch_s']:.3f} s (manifest {result['manifest_s']:.3f} s), "
                              f"+{result['peak_rss_increase_bytes'] / 1e6:.1f} MB peak, "
                              f"{result['stream_tokens_per_cpu_s'] / 1e6:.2f} Mtok/CPU s", file=sys.stderr, flush=True)
    medians = {label: {key: _medians(rs) for key, rs in per.items()} for label, per in runs.items()}
    # the stream's O(shards) arithmetic at each epoch's start (a seeded shard permutation and the cumulative rows),
    # flat at the probe's sizes: timed at a million shards for the extrapolation
    figures_order = {"epoch_order_s_per_million_shards": epoch_order_seconds(1_000_000)}
    per_size = {label: {int(k): v for k, v in per.items() if k.isdigit()} for label, per in medians.items()}
    largest = max(dirs)
    figures: dict = dict(figures_order)
    summary: dict = {}
    for label, measured in per_size.items():
        ratios = {name: _ratios(measured, key) for name, key in RATIOS.items()}
        figures[label] = {
            **{f"{name}_{k}": v for name, per in ratios.items() for k, v in per.items()},
            f"first_batch_s_at_{largest}x": {"value": measured[largest]["first_batch_s"], "unit": "s"},
            f"peak_rss_increase_at_{largest}x": {"value": measured[largest]["peak_rss_increase_bytes"], "unit": "B"},
            f"stream_tokens_per_s_at_{largest}x": {"value": measured[largest]["stream_tokens_per_s"], "unit": "tok/s"},
            f"stream_tokens_per_cpu_s_at_{largest}x": {"value": measured[largest]["stream_tokens_per_cpu_s"],
                                                      "unit": "tok/s"},
        }
        if big_dir is not None:
            for key in ("big_shards", "big_shards_world1"):
                figures[label][f"stream_tokens_per_cpu_s_{key}"] = {
                    "value": medians[label][key]["stream_tokens_per_cpu_s"], "unit": "tok/s"}
        summary[label] = {"ratios": ratios, "at_9tb_linear": {
            key: extrapolate(measured, tokens, key) for key in ("first_batch_s", "first_batch_cpu_s",
                                                                "peak_rss_increase_bytes")}}
    labels = list(trees)
    if len(labels) == 2:
        before, after = labels
        for key in ("stream_tokens_per_s", "stream_tokens_per_cpu_s", "real_tokens_per_cpu_s"):
            figures[f"{after}_over_{before}_{key}"] = (per_size[after][largest][key]
                                                       / per_size[before][largest][key])
        if big_dir is not None:
            for target in ("big_shards", "big_shards_world1"):
                for key in ("stream_tokens_per_cpu_s", "real_tokens_per_cpu_s"):
                    figures[f"{after}_over_{before}_{key}_{target}"] = (medians[after][target][key]
                                                                        / medians[before][target][key])
    config = {
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in settings.items()},
        "trees": revisions, "sizes": {str(m): s for m, s in sizes.items()}, "doc_tokens": list(DOC_TOKENS),
        "big_shards_size": describe(big_dir) if big_dir is not None else None,
        "vocab_size": VOCAB_SIZE, "data_root": str(data_root), "dataset_build_or_check_s": round(build_s, 1),
        "measured": "each size in its own fresh process per tree, sizes and trees alternating, medians of repeats; "
                    "first batch = wall time from PackedTokenStream(...) to next(iter(make_dataloader(stream))) "
                    "(0 workers); peak RSS = VmHWM increase over the RSS after imports",
        "page_cache": "the dataset files are warm in the page cache (just built or read): the before's hashing runs "
                      "at memory speed here, slower from a disk or network filesystem",
        "tokens_per_s": "the loader's own rate (rank 0 of world_size, B x T slots per batch, epochs run through), "
                        "not training's",
        "plan": "when a tree offers `train.py shards plan`, it is run for each size before the measurements "
                "(outside the timing), as a user would; its seconds are in plan_s",
    }
    return {"figures": figures, "config": config, "summary": summary,
            "measurements": {label: {str(m): v for m, v in per.items()} for label, per in medians.items()},
            "plan_s": {label: {str(m): s for m, s in p.items()} for label, p in plans.items()},
            "runs": {label: {str(m): rs for m, rs in per.items()} for label, per in runs.items()}}


def default_trees() -> dict[str, str]:
    """before = BEFORE_REVISION; after = HEAD when HEAD's stream (data_shards/stream.py) differs from it, else none."""
    changed = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", BEFORE_REVISION, "HEAD", "--",
                              "data_shards/stream.py"], capture_output=True).returncode != 0
    return {"before": BEFORE_REVISION, "after": "HEAD"} if changed else {"before": BEFORE_REVISION}


def run(smoke: bool = False) -> dict:
    """The runner's entry (`python -m bench scale`): the full probe, or tiny sizes on this checkout; writes scale.json."""
    from bench.harness import write_result

    if smoke:
        with tempfile.TemporaryDirectory(prefix="bench-scale-smoke-") as tmp:
            payload = probe({"current": WORKTREE}, SMOKE, Path(tmp), log=False)
    else:
        payload = probe(default_trees(), FULL, Path(os.environ.get(DATA_ENV, DEFAULT_DATA)))
    payload["config"]["smoke"] = smoke
    write_result("scale", payload)
    return payload


# ---------------------------------------------------------------- BENCHMARKS.md section


def _mb(value: float) -> str:
    return f"{value / 1e6:,.1f} MB" if abs(value) < 1e9 else f"{value / 1e9:,.1f} GB"


def _duration(seconds: float) -> str:
    if seconds >= 7_200:
        return f"{seconds / 3_600:,.1f} h"
    return f"{seconds / 60:,.1f} min" if seconds >= 120 else f"{seconds:.2f} s"


def _per_thousand_shards(measurements: dict, sizes: dict[int, dict], key: str) -> float:
    """The cost of `key` per 1,000 shards between the two largest sizes (the manifest's O(shards) term)."""
    small, large = sorted(sizes)[-2:]
    return 1000 * (measurements[str(large)][key] - measurements[str(small)][key]) / (
        sizes[large]["shards"] - sizes[small]["shards"])


def section(body: dict) -> list[str]:
    """Markdown lines for BENCHMARKS.md: per-size figures, ratios against the goal, and the 9 TB extrapolation."""
    config, measurements = body.get("config", {}), body.get("measurements", {})
    if not measurements:
        return []
    labels = list(measurements)
    sizes = {int(m): s for m, s in config.get("sizes", {}).items()}
    big = config.get("big_shards_size")
    load = body.get("machine", {}).get("load_avg_1m")
    out = [
        f"One rank (rank {config.get('rank')}) of a {config.get('world_size')}-rank job over synthetic token shards "
        f"written with `write_token_shard` / `write_manifest` (documents of {DOC_TOKENS[0]}–{DOC_TOKENS[1]:,} random "
        f"uint16 ids; {config.get('base_shards')} shards × {config.get('tokens_per_shard', 0):,} tokens at 1×), "
        f"seq_len {config.get('seq_len')}, batch {config.get('batch_size')}. Each size runs in its own fresh process "
        f"per tree, {config.get('repeats')} times, sizes and trees alternating (medians). First batch: wall (and CPU) "
        "seconds from `PackedTokenStream(...)` to `next(iter(make_dataloader(stream)))`, 0 workers. Peak RSS: the "
        "VmHWM increase over the RSS after imports. Manifest: what the tree reads of the dataset's metadata at start "
        "(`read_manifest`, or `read_index` in a tree with the dataset index, which replaced the manifest's parse) "
        "timed again in the same process after the first batch, and alone in another fresh process for its peak RSS: "
        "the O(shards) part the issue allows (\"beyond reading the manifest\"). Tokens/s: the loader's own rate over "
        f"{config.get('rate_batches')} batches after the first (B × T slots per batch; epochs run through), not "
        "training's. The files are warm in the page cache, so hashing runs at memory speed. "
        f"Measured {body.get('measured_at', '?')}" + (f", load {load:g} on {body.get('machine', {}).get('cpu_count')}"
                                                      " cores" if load is not None else "")
        + (" (smoke)" if body.get("smoke") else "") + ". `python -m bench.bench_scale --before REV --after REV` "
        "measures any two revisions side by side.",
        "",
    ]
    if big:
        out += [f"Big shards: the largest size's tokens again in {big['shards']} shards of ~{big['tokens'] // big['shards']:,} "
                f"tokens, read as rank 0 of {config.get('world_size')} and as the only rank. A shard-granular stream packs "
                "a whole shard when the rank first reads it; with a rank's share of the epoch smaller than one shuffle "
                "window (as here with 64 ranks) the rank reads a few rows of every shard of the window, while at 9 TB a "
                "rank's share spans many windows and it packs only its own shards: the only-rank row, whose rate is "
                f"taken over {config.get('steady_rate_batches', 0):,} batches (past one 65,536-row shuffle window, so "
                "every table built is used up), is closer to that steady state.", ""]
    for label in labels:
        tree = config.get("trees", {}).get(label, {})
        plan = body.get("plan_s", {}).get(label, {})
        note = "; `shards plan` run first (outside the timing), " + ", ".join(
            f"{m}{'×' if m.isdigit() else ''}: {_duration(s)}" for m, s in plan.items()) if plan else (
            "; no `shards plan` in this tree")
        subject = tree.get("data_subject") or tree.get("subject", "")
        subject = subject if len(subject) <= 90 else subject[:89] + "…"
        data = tree.get("data_commit")
        where = (f"{tree.get('commit', '?')[:12]}, data_shards/ as of {data[:12]}" if data and data != tree.get("commit")
                 else tree.get("commit", "?")[:12])
        out.append(f"- **{label}**: {where} {subject}".rstrip() + note)
    out += ["", "| Tree | Data | Shards | Tokens | First batch | CPU s | Manifest s | Peak RSS + | Manifest RSS + | "
            "Peak RSS + after reading | Stream tok/s | tok/CPU s | Padding |", "|---" * 13 + "|"]
    for label in labels:
        for key, m in measurements[label].items():
            if key.startswith("big_shards"):
                size, name = big or {}, f"{max(sizes)}× tokens in big shards" if sizes else "big shards"
                name += ", the only rank" if key.endswith("world1") else ""
            else:
                size, name = sizes.get(int(key), {}), f"{key}×"
            out.append(
                f"| {label} | {name} | {size.get('shards', 0):,} | {size.get('tokens', 0):,} | "
                f"{m['first_batch_s']:.3f} s | {m['first_batch_cpu_s']:.3f} | {m.get('manifest_s', float('nan')):.3f} | "
                f"{_mb(m['peak_rss_increase_bytes'])} | {_mb(m.get('manifest_peak_rss_increase_bytes', float('nan')))} | "
                f"{_mb(m['peak_rss_increase_after_rate_bytes'])} | {m['stream_tokens_per_s'] / 1e6:.2f} M | "
                f"{m.get('stream_tokens_per_cpu_s', float('nan')) / 1e6:.2f} M | {100 * m['padding_fraction']:.1f}% |")
    summary = body.get("summary", {})
    names = {"first_batch": "first batch (wall)", "first_batch_cpu": "first batch (CPU)", "peak_rss": "peak RSS",
             "first_batch_beyond_manifest": "first batch beyond the manifest (wall)",
             "first_batch_cpu_beyond_manifest": "first batch beyond the manifest (CPU)",
             "peak_rss_beyond_manifest": "peak RSS beyond the manifest"}
    out += ["", "| Ratio | " + " | ".join(labels) + " | Goal |", "|---|" + "---|" * (len(labels) + 1)]
    for kind, name in names.items():
        keys = list(summary.get(labels[0], {}).get("ratios", {}).get(kind, {}))
        for key in keys:
            goal = f"≤ {GOAL_RATIO}" if key == keys[-1] else ""
            cells = " | ".join(f"{summary[label]['ratios'][kind][key]:.2f}×" for label in labels)
            out.append(f"| {name} {key.replace('_over_', ' / ')} | {cells} | {goal} |")
    rates = (("stream_tokens_per_s", "stream tok/s (wall)"), ("stream_tokens_per_cpu_s", "stream tok/CPU s"),
             ("real_tokens_per_cpu_s", "non-padding tok/CPU s"),
             ("stream_tokens_per_cpu_s_big_shards", "stream tok/CPU s, big shards"),
             ("real_tokens_per_cpu_s_big_shards", "non-padding tok/CPU s, big shards"),
             ("stream_tokens_per_cpu_s_big_shards_world1", "stream tok/CPU s, big shards, the only rank"),
             ("real_tokens_per_cpu_s_big_shards_world1", "non-padding tok/CPU s, big shards, the only rank"))
    for key, name in rates:
        rate = body.get("figures", {}).get(f"{labels[-1]}_over_{labels[0]}_{key}") if len(labels) > 1 else None
        if rate is not None:
            where = "" if "big_shards" in key else " at the largest size"
            out.append(f"| {name}, {labels[-1]} / {labels[0]}{where} | {rate:.3f} |"
                       + " |" * (len(labels) - 1) + f" {1 - RATE_TOLERANCE:.2f}–{1 + RATE_TOLERANCE:.2f} |")
    if not body.get("smoke") and labels and len(sizes) >= 2:
        tokens = CHAMELEON_TOKENS
        per_shard = config.get("tokens_per_shard", 0)
        out += ["", f"On paper at 9 TB ({tokens / 1e12:.1f}T tokens, uint16), one rank, every start and resume: the "
                f"{labels[0]} extrapolated linearly in tokens through its two largest sizes (its fixed cost plus its",
                f"per-token cost, shards kept at this probe's ~{per_shard:,} tokens, i.e. {tokens / max(per_shard, 1):,.0f} "
                "shards; much of the per-token cost here is per shard (open, meta, three hashes), so bigger shards",
                "would pay less per token, and hashing from disk instead of the page cache would pay more)"
                + (f"; the {', '.join(labels[1:])} as measured at the largest size, plus the O(shards) metadata "
                   "read (the manifest, or the dataset index), linear in shards:" if len(labels) > 1 else
                   "; the after is pending (no shard-granular stream in HEAD yet)."), "",
                "| Tree | First batch at 9 TB (wall) | (CPU) | Peak RSS + at 9 TB | How |", "|---|---|---|---|---|"]
        largest = str(max(sizes))
        for i, label in enumerate(labels):
            if i == 0:
                at = summary[label]["at_9tb_linear"]
                out.append(f"| {label} | {_duration(at['first_batch_s'])} | {_duration(at['first_batch_cpu_s'])} | "
                           f"{_mb(at['peak_rss_increase_bytes'])} | linear in tokens |")
                continue
            m = measurements[label][largest]
            out.append(f"| {label} | {_duration(m['first_batch_s'])} | {_duration(m['first_batch_cpu_s'])} | "
                       f"{_mb(m['peak_rss_increase_bytes'])} | as measured at {largest}× |")
            if "manifest_s" in m:
                # a difference within the noise reads as negative: clamped at zero; the stream's own per-shard
                # arrays (row counts, the epoch's order and cumulative rows: 3 int64) are added on paper, since at
                # 6,400 shards they are below the RSS's resolution
                wall, cpu, rss = (max(0.0, _per_thousand_shards(measurements[label], sizes, k))
                                  for k in ("manifest_s", "manifest_cpu_s", "manifest_peak_rss_increase_bytes"))
                rss += 1000 * PER_SHARD_ARRAY_BYTES
                order = body.get("figures", {}).get("epoch_order_s_per_million_shards", 0.0) / 1000
                wall, cpu = wall + order, cpu + order
                for shards, what in ((44_000, "44,000 shards of 100M tokens (200 MB)"),
                                     (tokens / max(per_shard, 1), f"shards of this probe's {per_shard:,} tokens")):
                    grow = shards - sizes[int(largest)]["shards"]
                    out.append(f"| {label}, metadata linear in shards | {_duration(m['first_batch_s'] + wall * grow / 1000)} "
                               f"| {_duration(m['first_batch_cpu_s'] + cpu * grow / 1000)} | "
                               f"{_mb(m['peak_rss_increase_bytes'] + rss * grow / 1000)} | {what}: the metadata read "
                               f"costs {1000 * wall:.2f} ms, {1000 * cpu:.2f} ms CPU and {rss / 1e3:,.0f} KB per 1,000 shards "
                               f"(with the stream's {PER_SHARD_ARRAY_BYTES} bytes of arrays per shard and its epoch "
                               "order, timed at a million shards) |")
    return out


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.bench_scale [--before REV] [--after REV] [--smoke]`: probe, write scale.json, print."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", default=BEFORE_REVISION, help=f"revision measured as 'before' (default "
                        f"{BEFORE_REVISION[:12]}, the last commit before the shard-granular stream); '.' = this checkout")
    parser.add_argument("--after", default=None, help="revision measured as 'after' ('.' = this checkout as it is on "
                        "disk); default: HEAD when its data_shards/stream.py differs from --before's, else none")
    parser.add_argument("--only-before", action="store_true", help="measure --before alone")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes in a temp dir: proves the probe runs")
    parser.add_argument("--repeats", type=int, default=None, help="fresh processes per tree and size")
    parser.add_argument("--data", type=Path, default=None, help=f"dataset cache (default ${DATA_ENV} or {DEFAULT_DATA})")
    parser.add_argument("--results-dir", type=Path, default=None, help="where scale.json goes (default bench/results)")
    parser.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md afterwards")
    args = parser.parse_args(argv)
    settings = dict(SMOKE if args.smoke else FULL)
    if args.repeats is not None:
        settings["repeats"] = args.repeats
    trees = {"before": args.before}
    if args.after is not None:
        trees["after"] = args.after
    elif not args.only_before and args.before == BEFORE_REVISION:
        trees = default_trees()
    from bench.harness import resolve_results_dir, write_result

    start = time.perf_counter()
    if args.smoke and args.data is None:
        with tempfile.TemporaryDirectory(prefix="bench-scale-smoke-") as tmp:
            payload = probe(trees, settings, Path(tmp))
    else:
        payload = probe(trees, settings, args.data or Path(os.environ.get(DATA_ENV, DEFAULT_DATA)))
    payload.update(smoke=args.smoke, elapsed_s=round(time.perf_counter() - start, 2))
    path = write_result("scale", payload, args.results_dir)
    print("\n".join(section(json.loads(path.read_text()))))
    print(f"wrote {path}")
    if not args.no_markdown and not args.smoke and args.results_dir is None:
        from bench import run as runner

        print(f"wrote {runner.write_markdown(resolve_results_dir(), runner.MARKDOWN)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
