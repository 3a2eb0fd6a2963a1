"""`python train.py experiment mot`: dense vs Mixture-of-Transformers decoders on the demo's data (issue #31).

At each size, a dense decoder and a MoT decoder (`--model.config.block mot`: weights per modality, global attention,
the dense model's FLOPs per token) train through `train.py fit --config configs/fusion/demo.yaml` on the demo's token
shards, for the same steps from the same seed, so they see the same batches in the same order. At one size the MoT
ablation (FFN only; FFN + attention; FFN + attention + norms) trains as well. Every run is scored on held-out
documents written from the demo's held-out digits (never trained on) at regular steps, per modality; at the end
the demo's independent classifier scores generated digits and captions of held-out digits. Needs a finished demo
(`python train.py demo`): its tokenizer, vocabulary, token shards and classifier. Writes `<out>/results.json`,
`<out>/results.md` and `<out>/plots/*.png`.
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.files import atomic_write_json, atomic_write_text
from experiments.demo.datasets import (
    arithmetic_document,
    arithmetic_pairs,
    caption_document,
    pick_by_label,
    to_model_images,
)
from experiments.demo.settings import DemoConfig, load_config
from experiments.demo.stages import (
    digits_for,
    experiment_parser,
    load_image_tokenizer,
    load_vocab,
    require_outputs,
    run_experiment_command,
)
from experiments.fusion import fit, score_digits

MODALITIES = ("text", "image")
# Decoder sizes: FusionConfig fields over the `demo` preset (d 128, 4 layers, 4 heads, FFN 384). Every size keeps
# the preset's head width (32) and FFN ratio (3x), so only width and depth change between sizes.
SIZES: dict[str, dict[str, int]] = {
    "demo": {},
    "d192": {"dim": 192, "n_layers": 6, "n_heads": 6, "ffn_dim": 576},
    "d256": {"dim": 256, "n_layers": 8, "n_heads": 8, "ffn_dim": 768},
    # the smoke mode's sizes: seconds per run
    "d32": {"dim": 32, "n_layers": 1, "n_heads": 1, "ffn_dim": 96},
    "d48": {"dim": 48, "n_layers": 2, "n_heads": 2, "ffn_dim": 144},
    "d64": {"dim": 64, "n_layers": 2, "n_heads": 2, "ffn_dim": 192},
}
# The arms: block name and block_options. "mot" is full MoT (every part per modality); the two others are the
# paper's ablation (section 3.5), trained at the ablation size only.
ARMS: dict[str, tuple[str, dict[str, bool]]] = {
    "dense": ("dense", {}),
    "mot": ("mot", {}),
    "mot_ffn": ("mot", {"attention": False, "norms": False}),
    "mot_ffn_attention": ("mot", {"norms": False}),
}
ABLATION = ("mot_ffn", "mot_ffn_attention", "mot")
PAPER_37M = {"image": 0.26, "text": 0.55}  # Liang et al. 2024, steps to match dense at their 37M configuration


@dataclass
class MoTExperimentConfig:
    """The comparison's settings; defaults are the full run (56 minutes on one thread of a shared 2-core host)."""

    demo: str = "full"  # the demo preset whose finished outputs are reused
    demo_dir: str | None = None  # default: that preset's out_dir
    out_dir: str = "runs/mot"
    sizes: tuple[str, ...] = ("demo", "d192", "d256")
    steps: tuple[int, ...] = (500, 300, 200)  # optimizer steps at each size (8 rows x 256 tokens each)
    ablation_size: str = "demo"  # where the FFN / FFN + attention arms train too
    evaluations: int = 10  # held-out evaluations per run, evenly spaced (the last at the final step)
    smoothing: float = 0.05  # running-mean window of the training curves, as a fraction of the run's steps
    held_out_arithmetic: int = 200  # arithmetic documents written from held-out digits (plus one caption each)
    understanding_examples: int | None = None  # held-out digits captioned (None: the demo's setting)
    speed_rounds: int = 3  # alternating rounds of the step timing (every arm of a size, one after another)
    speed_steps: int = 4  # timed steps per arm and round
    seed: int = 0
    reuse: bool = False  # keep a run whose record exists with the same options (resume an interrupted experiment)


def smoke_config(demo_dir: str | None = None, out_dir: str = "runs/mot-smoke") -> MoTExperimentConfig:
    """The smoke mode: the smoke demo's outputs, three tiny sizes, a few steps each (about a minute)."""
    return MoTExperimentConfig(demo="smoke", demo_dir=demo_dir, out_dir=out_dir, sizes=("d32", "d48", "d64"),
                               steps=(8, 6, 6), ablation_size="d32", evaluations=2, held_out_arithmetic=20,
                               understanding_examples=20, speed_rounds=1, speed_steps=1)


# ---------------------------------------------------------------- held-out documents


def held_out_shards(config: MoTExperimentConfig, demo: DemoConfig, demo_dir: Path, out_dir: Path) -> Path:
    """Token shards of documents made, as the demo makes its own, from its held-out digits: one captioned document
    per digit and `held_out_arithmetic` arithmetic documents; the validation set of every run."""
    from PIL import Image

    from data_shards.pretokenize import pretokenize
    from data_shards.raw import RawShardWriter
    from experiments.demo.report import to_uint8

    digits = digits_for(demo)
    labels = digits.test_labels
    pictures = [Image.fromarray(a) for a in to_uint8(to_model_images(digits.test_images, demo.data.image_size))]
    raw, tokens = out_dir / "held_out" / "raw", out_dir / "held_out" / "tokens"
    for folder in (raw, tokens):
        if folder.exists():
            shutil.rmtree(folder)  # cheap and deterministic: always rewritten
    rng = np.random.default_rng(config.seed)
    with RawShardWriter(raw, shard_max_docs=demo.shards.samples_per_shard, prefix="held_out") as writer:
        for i, label in enumerate(labels):
            writer.add(f"digit_{i:05d}", caption_document(int(label), int(rng.integers(0, 4)), pictures[i]))
        pairs = arithmetic_pairs(rng, config.held_out_arithmetic)
        picks = [pick_by_label(labels, wanted, rng) for wanted in (pairs[:, 0], pairs[:, 1], pairs.sum(axis=1))]
        for n, (a, b, c) in enumerate(zip(*picks)):
            writer.add(f"sum_{n:05d}", arithmetic_document(pictures[a], pictures[b], pictures[c], int(labels[a]),
                                                           int(labels[b])))
    pretokenize(raw, tokens, load_vocab(demo_dir), load_image_tokenizer(demo_dir),
                flip_probability=demo.shards.flip_probability, seed=demo.seed, progress=False)
    return tokens


# ---------------------------------------------------------------- curves and the steps-to-match rule


def eval_interval(steps: int, evaluations: int) -> int:
    """The divisor of `steps` closest to steps / evaluations: validation then also runs at the final step."""
    divisors = [d for d in range(1, steps + 1) if steps % d == 0]
    return min(divisors, key=lambda d: (abs(d - steps / evaluations), d))


def read_curves(folder: Path) -> dict[str, dict[str, list[float]]]:
    """Per-modality training loss (every step) and held-out loss (every evaluation) from the run's CSV log."""
    [metrics] = sorted((folder / "csv").glob("version_*/metrics.csv"))
    curves: dict[str, dict[str, list[float]]] = {part: {"step": [], **{m: [] for m in MODALITIES}}
                                                 for part in ("train", "val")}
    with metrics.open() as handle:
        for row in csv.DictReader(handle):
            for part in curves:
                values = [row.get(f"{part}/{m}_loss", "") for m in MODALITIES]
                if all(values):
                    # Lightning writes a row with the updates done before it (the row of the first step is 0,
                    # the validation after 4 updates is 3): +1 counts the updates done, as the LossRecorder does
                    step = int(row["step"]) + 1
                    curves[part]["step"].append(step)
                    for m, value in zip(MODALITIES, values):
                        curves[part][m].append(float(value))
    return curves


def running_mean(values: list[float], window: int) -> list[float]:
    """The trailing mean over `window` points, from the window-th point on (len(values) - window + 1 values)."""
    sums = np.cumsum(np.asarray(values, dtype=np.float64))
    return ((sums[window - 1:] - np.concatenate([[0.0], sums[:-window]])) / window).tolist()


def first_crossing(steps: list[int], values: list[float], target: float) -> float | None:
    """The first step at which the curve reaches `target` or below, interpolated linearly between the two points
    either side of the crossing; the first point's step when it starts there; None when it never does."""
    for i, (step, value) in enumerate(zip(steps, values)):
        if value <= target:
            if i == 0:
                return float(step)
            before, previous = steps[i - 1], values[i - 1]
            return before + (step - before) * (previous - target) / (previous - value)
    return None


def steps_to_match(dense: dict, other: dict, steps: int, window: int) -> dict[str, dict]:
    """For each modality, the fraction of dense's steps at which `other` first reaches dense's final loss: on the
    held-out curve (interpolated between evaluations) and on the training curve's trailing running mean."""
    out: dict[str, dict] = {}
    for m in MODALITIES:
        held_dense, held_other = dense["val"], other["val"]
        target = held_dense[m][-1]
        crossing = first_crossing(held_other["step"], held_other[m], target)
        train_steps = dense["train"]["step"][window - 1:]
        smooth_dense, smooth_other = running_mean(dense["train"][m], window), running_mean(other["train"][m], window)
        train_crossing = first_crossing(train_steps, smooth_other, smooth_dense[-1])
        out[m] = {
            "held_out": None if crossing is None else crossing / steps,
            "held_out_first_evaluation": crossing is not None and crossing == held_other["step"][0],
            "train_running_mean": None if train_crossing is None else train_crossing / steps,
            "dense_final_held_out": target, "final_held_out": held_other[m][-1],
            "dense_final_train_running_mean": smooth_dense[-1], "final_train_running_mean": smooth_other[-1],
        }
    return out


# ---------------------------------------------------------------- runs


def run_name(size: str, arm: str) -> str:
    """The folder and key of one run."""
    return f"{size}_{arm}"


def model_options(size: str, arm: str) -> list[str]:
    """The `train.py fit` options that make one size and arm (on top of configs/fusion/demo.yaml)."""
    block, options = ARMS[arm]
    extra = [f"--model.config.{key}={value}" for key, value in SIZES[size].items()]
    extra.append(f"--model.config.block={block}")
    if options:
        extra.append(f"--model.config.block_options={json.dumps(options)}")
    return extra


def step_seconds_in_run(folder: Path) -> float:
    """Median wall-clock seconds between consecutive optimizer steps of a run (its LossRecorder's clock; the
    median leaves out the steps a validation ran after)."""
    seconds = json.loads((folder / "losses.json").read_text())["seconds"]
    return float(np.median(np.diff(seconds))) if len(seconds) > 1 else float("nan")


def evaluate_model(ctx: _Context, checkpoint: str, out: Path) -> dict:
    """Understanding (greedy captions of held-out digits) and generation (digits drawn from captions, read by the
    independent classifier): the digits suite (`experiments.fusion.score_digits`) on the run's checkpoint."""
    results = score_digits(checkpoint, ctx.demo, ctx.demo_dir, out, seed=ctx.config.seed,
                           parts="understanding,generation", understanding_examples=ctx.config.understanding_examples)
    under, drawn = results["figures"]["understanding"], results["figures"]["generation"]
    return {"understanding_accuracy": under["accuracy"], "understanding_count": under["count"],
            "generation_accuracy": drawn["accuracy"], "generation_count": drawn["count"],
            "sample_captions": under["sample_captions"]}


def speed(models: dict[str, torch.nn.Module], batch: dict[str, torch.Tensor], rounds: int, steps: int) -> dict:
    """Median seconds of one training step (forward, backward, AdamW) of each model on the same batch, the models
    taking turns round by round so that a change in the machine's load falls on every model alike."""
    copies = {name: copy.deepcopy(model).train() for name, model in models.items()}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in copies.items()}
    times: dict[str, list[float]] = {name: [] for name in models}

    def step(name: str) -> float:
        start = time.perf_counter()
        loss = copies[name].loss(batch["input_ids"], batch["document_ids"], batch["position_ids"])["loss"]
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for name in copies:  # warm-up: the first step allocates the optimizer state
        step(name)
    for _ in range(rounds):
        for name in copies:
            times[name] += [step(name) for _ in range(steps)]
    return {name: float(np.median(values)) for name, values in times.items()}


def first_batch(token_dir: Path, seq_len: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
    """One training batch of the demo's shards, as the runs read them."""
    from data_shards.stream import PackedTokenStream

    return next(iter(PackedTokenStream(token_dir, seq_len, batch_size, seed=seed, shuffle=True)))


# ---------------------------------------------------------------- the experiment


@dataclass
class _Context:
    """What every run of one experiment shares."""

    config: MoTExperimentConfig
    demo: DemoConfig
    demo_dir: Path
    out_dir: Path
    token_dir: Path
    val_dir: Path
    log: Callable[[str], None]
    modules: dict[str, object] = field(default_factory=dict)


def train_and_score(ctx: _Context, size: str, arm: str, steps: int) -> dict:
    """One run: train (or reuse), read its curves, score it; its record is also written to `<run>/record.json`."""
    from fusion_model.checkpoint import load_model

    name, config = run_name(size, arm), ctx.config
    folder = ctx.out_dir / name
    every = eval_interval(steps, config.evaluations)
    extra = [*model_options(size, arm), f"--data.val_dir={ctx.val_dir}", f"--trainer.val_check_interval={every}",
             "--trainer.check_val_every_n_epoch=null", "--trainer.log_every_n_steps=1"]
    saved = folder / "record.json"
    if config.reuse and saved.is_file():
        record = json.loads(saved.read_text())
        if record["extra"] == extra and record["steps"] == steps and Path(record["last_checkpoint"]).is_file():
            ctx.log(f"  {name}: reusing the finished run")
            ctx.modules[name] = load_model(record["last_checkpoint"]).eval()
            return record
    module, trained = fit(name, ctx.out_dir, ctx.demo_dir, ctx.token_dir, steps, config.seed, extra, ctx.log)
    model = module.model.eval()
    ctx.modules[name] = model
    model_config = module.model_config
    seq_len, batch_size = int(module.trainer.datamodule.seq_len), int(module.trainer.datamodule.batch_size)
    curves = read_curves(folder)
    scores = evaluate_model(ctx, trained["last_checkpoint"], folder / "eval")
    record = {
        **trained, "size": size, "arm": arm, "extra": extra, "eval_every": every,
        "block": model_config.block, "block_options": dict(model_config.block_options),
        "architecture": {k: getattr(model_config, k) for k in ("dim", "n_layers", "n_heads", "ffn_dim", "vocab_size")},
        "parameters": model_config.num_parameters(), "active_parameters": model_config.active_parameters(),
        "module_parameters": sum(p.numel() for p in model.parameters()),
        "seq_len": seq_len, "batch_size": batch_size, "flops_per_token": model_config.flops_per_token(seq_len),
        "flops": model_config.flops_per_token(seq_len) * trained["decoder_positions"],
        "step_seconds_in_run": step_seconds_in_run(folder),
        "final_held_out": {m: curves["val"][m][-1] for m in MODALITIES}, "curves": curves, **scores,
    }
    atomic_write_json(saved, record)
    ctx.log(f"  {name}: held-out text {record['final_held_out']['text']:.3f} / image "
            f"{record['final_held_out']['image']:.3f}, understanding {scores['understanding_accuracy']:.1%}, "
            f"generation {scores['generation_accuracy']:.1%}")
    return record


def run(config: MoTExperimentConfig, log: Callable[[str], None] = print, demo: DemoConfig | None = None) -> dict:
    """Train dense and MoT at every size (and the ablation at one), score each; returns (and writes) the results.

    `demo`: the settings the demo in `demo_dir` ran with (default: the preset's); its held-out digits must be the
    ones the demo held out, which the shards stage's key checks."""
    from experiments.demo.bookkeeping import read_marker, stage_key

    if len(config.steps) != len(config.sizes):
        raise ValueError(f"--steps gives {len(config.steps)} step counts for {len(config.sizes)} sizes")
    unknown = [s for s in (*config.sizes, config.ablation_size) if s not in SIZES]
    if unknown or config.ablation_size not in config.sizes:
        raise ValueError(f"unknown size(s) {unknown} or ablation size {config.ablation_size!r} not among --sizes; "
                         f"sizes are {list(SIZES)}")
    demo = demo or load_config(config.demo)
    demo_dir = Path(config.demo_dir or demo.out_dir).resolve()
    out_dir = Path(config.out_dir).resolve()
    require_outputs(demo_dir, config.demo, ("tokenizer/model", "vocab/tokenizer.json", "shards/tokens",
                                            "generate/classifier.pt"),
                    "tokenizer, vocabulary, token shards and classifier")
    marker = read_marker(demo_dir, "shards")
    if marker is None or marker.get("key") != stage_key(demo, "shards"):
        raise ValueError(f"{demo_dir} was not made with the {config.demo!r} demo settings (its shards stage key "
                         "differs): the held-out digits would not be the ones it held out; pass the matching --demo")
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    log("[1/4] held-out documents from the demo's held-out digits")
    val_dir = held_out_shards(config, demo, demo_dir, out_dir)
    ctx = _Context(config, demo, demo_dir, out_dir, demo_dir / "shards" / "tokens", val_dir, log)

    log("[2/4] training (train.py fit, configs/fusion/demo.yaml) and scoring")
    runs: dict[str, dict] = {}
    speeds: dict[str, dict] = {}
    steps_of = dict(zip(config.sizes, config.steps))
    # the ablation size first, so that its pair and the ablation finish even if a later size runs out of time
    order = [config.ablation_size] + [s for s in config.sizes if s != config.ablation_size]
    batch = None
    for size in order:
        arms = ["dense", *ABLATION] if size == config.ablation_size else ["dense", "mot"]
        for arm in arms:
            runs[run_name(size, arm)] = train_and_score(ctx, size, arm, steps_of[size])
        first = runs[run_name(size, "dense")]
        batch = batch or first_batch(ctx.token_dir, first["seq_len"], first["batch_size"], config.seed)
        log(f"  {size}: timing a training step of each arm ({config.speed_rounds} alternating rounds)")
        seconds = speed({arm: ctx.modules[run_name(size, arm)] for arm in arms}, batch, config.speed_rounds,
                        config.speed_steps)
        speeds[size] = {"step_seconds": seconds, "mot_over_dense": seconds["mot"] / seconds["dense"]}
        record = summarize(config, runs, speeds, out_dir, demo_dir, start, complete=False)
        atomic_write_json(out_dir / "results.json", record)  # partial results survive an interrupted run

    log("[3/4] plots")
    record = summarize(config, runs, speeds, out_dir, demo_dir, start, complete=True)
    record["plots"] = write_plots(record, out_dir / "plots")
    log("[4/4] results")
    atomic_write_json(out_dir / "results.json", record)
    atomic_write_text(out_dir / "results.md", results_table(record))
    log(results_table(record))
    log(f"results: {out_dir / 'results.md'} ({record['minutes']:.1f} minutes)")
    return record


def summarize(config: MoTExperimentConfig, runs: dict[str, dict], speeds: dict[str, dict], out_dir: Path,
              demo_dir: Path, start: float, complete: bool) -> dict:
    """The results record: every run, steps to match dense for every MoT run, the step timings."""
    matches: dict[str, dict] = {}
    for name, r in runs.items():
        dense = runs.get(run_name(r["size"], "dense"))
        if r["arm"] != "dense" and dense is not None:
            window = max(1, round(config.smoothing * r["steps"]))
            matches[name] = {"window": window,
                             **steps_to_match(dense["curves"], r["curves"], dense["steps"], window)}
    return {"config": dataclasses.asdict(config), "demo_dir": str(demo_dir), "out_dir": str(out_dir),
            "sizes": {s: SIZES[s] for s in config.sizes}, "runs": runs, "steps_to_match": matches, "speed": speeds,
            "paper_37m_steps_to_match": PAPER_37M, "complete": complete,
            "minutes": (time.perf_counter() - start) / 60, "threads": torch.get_num_threads(),
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}


# ---------------------------------------------------------------- outputs


def _fraction(value: float | None, first: bool = False) -> str:
    """A steps-to-match fraction as the table shows it ("not reached" when the run never got there)."""
    if value is None:
        return "not reached"
    return f"<= {value:.2f}" if first else f"{value:.2f}"


def results_table(record: dict) -> str:
    """The results as Markdown tables: one row per run, then steps to match, then step timings."""
    runs, matches = record["runs"], record["steps_to_match"]
    lines = ["| run | steps | parameters (active) | FLOPs/token | FLOPs | held-out text | held-out image | "
             "understanding | generation | s/step in run |", "|---" * 10 + "|"]
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['steps']} | {r['parameters']:,} ({r['active_parameters']:,}) | "
            f"{r['flops_per_token'] / 1e6:.2f}M | {r['flops']:.3g} | {r['final_held_out']['text']:.4f} | "
            f"{r['final_held_out']['image']:.4f} | {r['understanding_accuracy']:.1%} | "
            f"{r['generation_accuracy']:.1%} | {r['step_seconds_in_run']:.3f} |")
    lines += ["", "| run | window | text: held-out | text: train mean | image: held-out | image: train mean |",
              "|---" * 6 + "|"]
    for name, m in matches.items():
        cells = []
        for modality in MODALITIES:
            cells += [_fraction(m[modality]["held_out"], m[modality]["held_out_first_evaluation"]),
                      _fraction(m[modality]["train_running_mean"])]
        lines.append(f"| {name} | {m['window']} | " + " | ".join(cells) + " |")
    lines += ["", "| size | dense s/step | MoT s/step | MoT / dense |", "|---" * 4 + "|"]
    for size, s in record["speed"].items():
        lines.append(f"| {size} | {s['step_seconds']['dense']:.3f} | {s['step_seconds']['mot']:.3f} | "
                     f"{s['mot_over_dense']:.2f} |")
    config = record["config"]
    lines += ["", f"Steps to match: the fraction of dense's steps at which the run first reaches dense's final loss "
              f"(held-out: interpolated between evaluations, '<=' when already there at the first one; train mean: "
              f"the trailing running mean of the training loss over `window` steps against dense's at its last step). "
              f"Paper (37M): image {PAPER_37M['image']}, text {PAPER_37M['text']}. Timing: median of "
              f"{config['speed_rounds']} x {config['speed_steps']} steps per arm, arms alternating. "
              f"{record['minutes']:.1f} minutes on {record['threads']} thread(s)."]
    return "\n".join(lines) + "\n"


def write_plots(record: dict, folder: Path) -> list[str]:
    """One PNG per size (held-out loss per modality, dense vs MoT, training running means faint) and one of the
    ablation; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    runs, config = record["runs"], record["config"]
    colours = {"dense": "black", "mot": "tab:red", "mot_ffn": "tab:blue", "mot_ffn_attention": "tab:green"}
    figures = [(f"loss_{size}", size, ["dense", "mot"]) for size in config["sizes"]]
    figures.append(("ablation", config["ablation_size"], ["dense", *ABLATION]))
    paths = []
    for stem, size, arms in figures:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110)
        for ax, modality in zip(axes, MODALITIES):
            for arm in arms:
                r = runs[run_name(size, arm)]
                window = max(1, round(config["smoothing"] * r["steps"]))
                train = r["curves"]["train"]
                ax.plot(train["step"][window - 1:], running_mean(train[modality], window), color=colours[arm],
                        alpha=0.3, linewidth=1)
                val = r["curves"]["val"]
                ax.plot(val["step"], val[modality], color=colours[arm], marker="o", markersize=3, linewidth=1.4,
                        label=f"{arm} held-out")
            # zoom on the held-out points after the first evaluation: the first steps' drop (from about 7 nats)
            # would otherwise flatten the differences between arms that the plot is for
            shown = [v for arm in arms for v in runs[run_name(size, arm)]["curves"]["val"][modality][1:]] or [0.0]
            pad = 0.15 * (max(shown) - min(shown)) or 0.05
            ax.set_ylim(min(shown) - pad, max(shown) + pad)
            ax.set_title(f"{size}: {modality} loss")
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("loss (faint: training, running mean)")  # y zoomed: see above
        axes[1].legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"{stem}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(str(path))
    return paths


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The `train.py experiment mot` options."""
    defaults = MoTExperimentConfig()
    parser = experiment_parser("mot", __doc__, defaults, SIZES, "tiny sizes and a few steps on the smoke demo's "
                               "outputs (runs/demo-smoke), about a minute")
    parser.add_argument("--steps", nargs="+", type=int, default=None,
                        help=f"optimizer steps at each size (default: {' '.join(map(str, defaults.steps))})")
    for name in ("evaluations", "held_out_arithmetic", "understanding_examples", "speed_rounds", "speed_steps",
                 "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default: {getattr(defaults, name)}")
    parser.add_argument("--smoothing", type=float, default=None, help=f"default: {defaults.smoothing}")
    return parser


def config_from_args(args: argparse.Namespace) -> MoTExperimentConfig:
    """The experiment's settings: the full run's or the smoke mode's, with the options given replacing theirs."""
    base = smoke_config() if args.smoke else MoTExperimentConfig()
    given = {"demo": args.demo, "demo_dir": args.demo_dir, "out_dir": args.out,
             "sizes": tuple(args.sizes) if args.sizes else None, "steps": tuple(args.steps) if args.steps else None,
             "ablation_size": args.ablation_size, "smoothing": args.smoothing, "reuse": args.reuse or None,
             **{name: getattr(args, name) for name in ("evaluations", "held_out_arithmetic", "understanding_examples",
                                                       "speed_rounds", "speed_steps", "seed")}}
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python train.py experiment mot`."""
    return run_experiment_command("mot", argv, build_parser, config_from_args, run)
