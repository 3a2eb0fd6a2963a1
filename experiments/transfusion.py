"""`python train.py experiment transfusion`: Chameleon (the demo's VQ codes) vs Transfusion (continuous latents with
the same encoder and decoder) on the same documents (issue #30).

Arms: `chameleon` trains on the demo's token shards (next-token loss on text and image codes); `transfusion` trains
on latent shards written from the SAME raw shards with the same flip seed by a continuous tokenizer (preset
kl-demo-64: demo-64's encoder/decoder, an 8-channel Gaussian on the same 4x4 grid, so a digit is 16 latent patches
as it is 16 codes) trained on the same digits for the steps the demo's VQ tokenizer ran, at its batch size.
Both go through `train.py fit --config configs/fusion/demo.yaml` from the same seed, at every size x budget (each
budget its own run, its own cosine decay); `transfusion_causal` (causal attention inside images, the paper's 0.76B
ablation) trains at one size and the largest budget. Every run is scored the same way, by the `digits` suite of
`train.py eval` (`evaluation.digits`) through its family's own `generate` (the sampler `train.py generate` runs):
Chameleon's checkpoint with the demo's VQ bundle (its temperature, top-k and guidance), Transfusion's with the
continuous bundle (guided DDIM over `TransfusionFamily.denoise`, the same guidance scale, `--ddim-steps`).
Generation accuracy by the demo's independent classifier, Fréchet distance in its penultimate features to held-out
digits (with real digits and each tokenizer's reconstructions as floors), per-caption diversity, caption accuracy of
held-out digits, the held-out text loss (the validation documents, from the held-out digits), training FLOPs (the
family's `flops_per_token` x decoder positions trained) and wall time; each run's suite results and sample page are
in `<out>/<run>/eval/`. Needs a finished demo (`python train.py demo`). Writes
`<out>/results.json`, `<out>/results.md` and `<out>/plots/fd_vs_flops.png`.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.files import atomic_write_json, atomic_write_text
from experiments.demo.datasets import to_model_images
from experiments.demo.settings import DemoConfig, load_config
from experiments.demo.stages import (
    digits_for,
    experiment_parser,
    load_vocab,
    require_outputs,
    run_experiment_command,
)
from experiments.fusion import fit, score_digits

# Decoder sizes over the `demo` preset (d 128, 4 layers, 4 heads, FFN 384): head width 32 and FFN ratio 3x kept.
SIZES: dict[str, dict[str, int]] = {
    "demo": {},
    "d192": {"dim": 192, "n_layers": 6, "n_heads": 6, "ffn_dim": 576},
    # the smoke mode's sizes: seconds per run
    "d32": {"dim": 32, "n_layers": 1, "n_heads": 1, "ffn_dim": 96},
    "d48": {"dim": 48, "n_layers": 2, "n_heads": 2, "ffn_dim": 144},
}
# arm -> (family, family_options)
ARMS: dict[str, tuple[str, dict]] = {
    "chameleon": ("chameleon", {}),
    "transfusion": ("transfusion", {}),
    "transfusion_causal": ("transfusion", {"image_bidirectional": False}),
}
KL_PRESET = "kl-demo-64"
PAPER = {"fid_parity_flop_ratio_7b": 0.029, "causal_fid_0.76b": 61.3, "bidirectional_fid_0.76b": 20.3}


@dataclass
class TransfusionExperimentConfig:
    """The comparison's settings; defaults are the full run."""

    demo: str = "full"  # the demo preset whose finished outputs are reused
    demo_dir: str | None = None  # default: that preset's out_dir
    out_dir: str = "runs/transfusion"
    sizes: tuple[str, ...] = ("demo", "d192")
    budgets: tuple[int, ...] = (150, 300)  # optimizer steps; every size trains every budget (8 rows x 256 tokens)
    ablation_size: str = "demo"  # where transfusion_causal trains (at the largest budget)
    ddim_steps: int = 50
    images_per_caption: int | None = None  # generated per digit (None: the demo's setting)
    understanding_examples: int | None = None  # held-out digits captioned (None: the demo's setting)
    held_out_arithmetic: int = 200  # arithmetic documents of the held-out text loss (plus one caption per digit)
    seed: int = 0
    reuse: bool = False  # keep a run (and the continuous tokenizer) already finished with the same options


def smoke_config(demo_dir: str | None = None, out_dir: str = "runs/transfusion-smoke") -> TransfusionExperimentConfig:
    """The smoke mode: the smoke demo's outputs, two tiny sizes, a few steps, few DDIM steps and images."""
    return TransfusionExperimentConfig(demo="smoke", demo_dir=demo_dir, out_dir=out_dir, sizes=("d32", "d48"),
                                       budgets=(3, 6), ablation_size="d32", ddim_steps=8, images_per_caption=3,
                                       understanding_examples=20, held_out_arithmetic=20)


def run_name(size: str, steps: int, arm: str) -> str:
    """The folder and key of one run."""
    return f"{size}_{steps}_{arm}"


def planned_runs(config: TransfusionExperimentConfig) -> list[tuple[str, int, str]]:
    """(size, steps, arm) of every run, the ablation size first so that its runs finish even if a later size runs
    out of time."""
    order = [config.ablation_size] + [s for s in config.sizes if s != config.ablation_size]
    runs = [(size, steps, arm) for size in order for steps in sorted(config.budgets)
            for arm in ("chameleon", "transfusion")]
    runs.append((config.ablation_size, max(config.budgets), "transfusion_causal"))
    return runs


# ---------------------------------------------------------------- the continuous tokenizer and its shards


def continuous_tokenizer(config: TransfusionExperimentConfig, demo: DemoConfig, demo_dir: Path, out_dir: Path,
                         log: Callable[[str], None]):
    """kl-demo-64 trained on the demo's training digits with the VQ tokenizer's budget (the steps it ran, its batch
    size and encoder overrides, the demo's seed); returns (bundle, its record)."""
    from experiments.demo.bookkeeping import read_marker
    from tokenizer.image import ContinuousImageTokenizer
    from tokenizer.image.train import fit_image_tokenizer

    marker = read_marker(demo_dir, "tokenizer") or {}
    if "steps" not in marker:
        raise ValueError(f"{demo_dir / 'tokenizer' / 'stage.json'} does not record the VQ tokenizer's steps")
    settings = demo.tokenizer
    key = {"preset": KL_PRESET, "steps": int(marker["steps"]), "batch_size": settings.batch_size,
           "overrides": dict(settings.overrides), "seed": demo.seed, "vq_key": marker.get("key")}
    folder = out_dir / "tokenizer_kl"
    saved = folder / "record.json"
    if config.reuse and saved.is_file() and (folder / "model").is_dir():
        record = json.loads(saved.read_text())
        if record["key"] == key:
            log("  continuous tokenizer: reusing the finished one")
            return ContinuousImageTokenizer.from_pretrained(folder / "model"), record
    digits = digits_for(demo)
    size = demo.data.image_size
    start = time.perf_counter()
    tokenizer, info = fit_image_tokenizer(
        to_model_images(digits.train_images, size), preset=KL_PRESET, batch_size=settings.batch_size,
        max_steps=key["steps"], max_minutes=None, seed=demo.seed, progress=False, log_dir=folder / "logs",
        overrides=settings.overrides or None)
    tokenizer.save_pretrained(folder / "model")
    tokenizer = ContinuousImageTokenizer.from_pretrained(folder / "model")
    record = {"key": key, "seconds": time.perf_counter() - start, "vq_psnr_db": marker.get("psnr_db"),
              **{k: v for k, v in info.items() if isinstance(v, (int, float, str))},
              "psnr_db": psnr(tokenizer, to_model_images(digits.test_images, size))}
    atomic_write_json(saved, record)
    log(f"  continuous tokenizer: {key['steps']} steps in {record['seconds']:.0f} s, held-out PSNR "
        f"{record['psnr_db']:.2f} dB (VQ: {marker.get('psnr_db', float('nan')):.2f} dB)")
    return tokenizer, record


@torch.no_grad()
def psnr(tokenizer, images: torch.Tensor) -> float:
    """Held-out PSNR (dB, pixels in [-1, 1]) of encode -> decode."""
    recon = tokenizer.decode(tokenizer.encode(images))
    mse = float(((recon - images.float()) ** 2).mean())
    return 10 * float(np.log10(4.0 / mse))


def latent_shards(raw: Path, out: Path, vocab, tokenizer, demo: DemoConfig) -> Path:
    """`raw`'s documents as latent shards (the demo's flip probability and seed); finished shards are kept."""
    from data_shards.pretokenize import pretokenize

    pretokenize(raw, out, vocab, tokenizer, flip_probability=demo.shards.flip_probability, seed=demo.seed,
                progress=False)
    return out


# ---------------------------------------------------------------- sampling and scoring


def family_options(arm: str) -> dict:
    """The run's `--model.family_options` (only what the arm sets; fit derives the rest from the shards)."""
    return dict(ARMS[arm][1])


def read_validation(folder: Path) -> dict[str, float]:
    """The last validation row's losses from the run's CSV log (`val/...` columns)."""
    [metrics] = sorted((folder / "csv").glob("version_*/metrics.csv"))
    last: dict[str, float] = {}
    with metrics.open() as handle:
        for row in csv.DictReader(handle):
            values = {k[4:]: float(v) for k, v in row.items() if k.startswith("val/") and v}
            if values:
                last = values
    return last


@dataclass
class _Context:
    """What every run of one experiment shares."""

    config: TransfusionExperimentConfig
    demo: DemoConfig
    demo_dir: Path
    out_dir: Path
    train_dirs: dict[str, Path]  # family -> training shards
    val_dirs: dict[str, Path]  # family -> held-out shards
    tokenizer_dirs: dict[str, Path]  # family -> image tokenizer bundle
    kl_dir: Path
    log: Callable[[str], None]


SUITE_PARTS = "understanding,generation,distribution"  # interleaved sums and the text-only loss: not compared here


def evaluate_run(ctx: _Context, checkpoint: str, arm: str, out: Path) -> dict:
    """The digits suite (`experiments.fusion.score_digits`) on the run's checkpoint with its family's image tokenizer
    (the demo's image sampling; Transfusion reads its guidance and `ddim_steps`, Chameleon its temperature and top-k
    too); the run's generation, distribution and understanding figures, and the suite's results under `eval`."""
    family, config = ARMS[arm][0], ctx.config
    results = score_digits(checkpoint, ctx.demo, ctx.demo_dir, out, seed=config.seed, parts=SUITE_PARTS,
                           media_tokenizer=ctx.tokenizer_dirs[family], images_per_caption=config.images_per_caption,
                           understanding_examples=config.understanding_examples, denoising_steps=config.ddim_steps)
    figures, settings = results["figures"], results["settings"]
    generation, distribution, under = figures["generation"], figures["distribution"], figures["understanding"]

    def finite(value: float | None) -> float:  # None (fewer than two images) stays NaN in this record
        return float("nan") if value is None else float(value)

    sampler = ({k: settings[k] for k in ("temperature", "top_k", "cfg_scale")} if family == "chameleon"
               else {"ddim_steps": settings["denoising_steps"], "cfg_scale": settings["cfg_scale"]})
    return {"generation_accuracy": generation["accuracy"], "generation_count": generation["count"],
            "complete": generation["complete"], "frechet_distance": finite(distribution["frechet_distance"]),
            "diversity": finite(distribution["diversity"]), "sampler": sampler,
            "understanding_accuracy": under["accuracy"], "understanding_count": under["count"],
            "sample_captions": under["sample_captions"],
            "eval": {k: results[k] for k in ("figures", "settings", "options", "fingerprints")}}


def train_and_score(ctx: _Context, size: str, steps: int, arm: str) -> dict:
    """One run: train (or reuse), score; its record is also written to `<run>/record.json`."""
    from fusion_model.families.loading import load_family

    family, options = ARMS[arm]
    name, config = run_name(size, steps, arm), ctx.config
    folder = ctx.out_dir / name
    extra = [f"--model.config.{key}={value}" for key, value in SIZES[size].items()]
    if family != "chameleon":
        extra += [f"--model.family={family}", f"--data.image_tokenizer={ctx.kl_dir}"]
    if options:
        extra.append(f"--model.family_options={json.dumps(options)}")
    extra += [f"--data.val_dir={ctx.val_dirs[family]}", f"--trainer.val_check_interval={steps}",
              "--trainer.check_val_every_n_epoch=null"]
    saved = folder / "record.json"
    if config.reuse and saved.is_file():
        record = json.loads(saved.read_text())
        if record["extra"] == extra and record["steps"] == steps and Path(record["last_checkpoint"]).is_file():
            ctx.log(f"  {name}: reusing the finished run")
            return record
    module, trained = fit(name, ctx.out_dir, ctx.demo_dir, ctx.train_dirs[family], steps, config.seed, extra, ctx.log)
    seq_len = int(module.trainer.datamodule.seq_len)
    del module
    loaded = load_family(trained["last_checkpoint"])
    flops_per_token = float(loaded.family.flops_per_token(seq_len))
    model_config = loaded.parts["model"].config
    family_options = loaded.family.options_dict()
    parameters = sum(p.numel() for part in loaded.parts.values() for p in part.parameters())
    del loaded
    scores = evaluate_run(ctx, trained["last_checkpoint"], arm, folder / "eval")
    record = {
        **trained, "size": size, "arm": arm, "family": family, "family_options": family_options,
        "extra": extra, "architecture": {k: getattr(model_config, k) for k in ("dim", "n_layers", "n_heads", "ffn_dim")},
        "parameters": parameters,
        "seq_len": seq_len, "flops_per_token": flops_per_token,
        "flops": flops_per_token * trained["decoder_positions"], "held_out": read_validation(folder), **scores,
    }
    atomic_write_json(saved, record)
    ctx.log(f"  {name}: FD {record['frechet_distance']:.2f}, generation {record['generation_accuracy']:.1%}, "
            f"understanding {record['understanding_accuracy']:.1%}, held-out text "
            f"{record['held_out'].get('text_loss', float('nan')):.3f}, {record['flops']:.3g} FLOPs")
    return record


# ---------------------------------------------------------------- the comparison


def flop_parity(runs: dict[str, dict], sizes: tuple[str, ...] | None = None) -> dict:
    """Chameleon's best (lowest) FD among its runs, and the cheapest Transfusion run (bidirectional) that reaches it:
    its FLOPs over those of Chameleon's best run. With a grid of budgets this ratio is an upper bound at the grid's
    resolution; None when no Transfusion run reaches it. `sizes`: only runs of those sizes."""
    def pick(arm: str) -> list[dict]:
        return [r for r in runs.values() if r["arm"] == arm and np.isfinite(r["frechet_distance"])
                and (sizes is None or r["size"] in sizes)]

    chameleon, transfusion = pick("chameleon"), sorted(pick("transfusion"), key=lambda r: r["flops"])
    if not chameleon:
        return {"chameleon_best_fd": None, "transfusion_run": None, "flop_ratio": None}
    best = min(chameleon, key=lambda r: (r["frechet_distance"], r["flops"]))
    first = next((r for r in transfusion if r["frechet_distance"] <= best["frechet_distance"]), None)
    return {"chameleon_best_run": run_name(best["size"], best["steps"], "chameleon"),
            "chameleon_best_fd": best["frechet_distance"], "chameleon_best_flops": best["flops"],
            "transfusion_run": None if first is None else run_name(first["size"], first["steps"], "transfusion"),
            "transfusion_fd": None if first is None else first["frechet_distance"],
            "flop_ratio": None if first is None else first["flops"] / best["flops"]}


def run(config: TransfusionExperimentConfig, log: Callable[[str], None] = print,
        demo: DemoConfig | None = None) -> dict:
    """Train both families at every size x budget (and the causal ablation), score each; returns (and writes) the
    results. `demo`: the settings the demo in `demo_dir` ran with (default: the preset's)."""
    from experiments.demo.bookkeeping import read_marker, stage_key
    from experiments.mot import held_out_shards

    unknown = [s for s in (*config.sizes, config.ablation_size) if s not in SIZES]
    if unknown or config.ablation_size not in config.sizes:
        raise ValueError(f"unknown size(s) {unknown} or ablation size {config.ablation_size!r} not among --sizes; "
                         f"sizes are {list(SIZES)}")
    if not config.budgets or min(config.budgets) < 1:
        raise ValueError(f"--budgets {config.budgets}: give positive step counts")
    demo = demo or load_config(config.demo)
    demo_dir = Path(config.demo_dir or demo.out_dir).resolve()
    out_dir = Path(config.out_dir).resolve()
    require_outputs(demo_dir, config.demo, ("tokenizer/model", "tokenizer/stage.json", "vocab/tokenizer.json",
                                            "shards/raw", "shards/tokens", "generate/classifier.pt"),
                    "tokenizer, vocabulary, raw and token shards and classifier")
    marker = read_marker(demo_dir, "shards")
    if marker is None or marker.get("key") != stage_key(demo, "shards"):
        raise ValueError(f"{demo_dir} was not made with the {config.demo!r} demo settings (its shards stage key "
                         "differs): the held-out digits would not be the ones it held out; pass the matching --demo")
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    log("[1/5] the continuous tokenizer (kl-demo-64, the VQ tokenizer's budget)")
    vocab = load_vocab(demo_dir)
    kl, kl_record = continuous_tokenizer(config, demo, demo_dir, out_dir, log)

    log("[2/5] latent shards of the demo's documents; held-out documents in both forms")
    train_latents = latent_shards(demo_dir / "shards" / "raw", out_dir / "shards_kl" / "latents", vocab, kl, demo)
    val_tokens = held_out_shards(config, demo, demo_dir, out_dir)
    val_latents = latent_shards(out_dir / "held_out" / "raw", out_dir / "held_out" / "latents", vocab, kl, demo)

    ctx = _Context(config, demo, demo_dir, out_dir, {"chameleon": demo_dir / "shards" / "tokens",
                                                     "transfusion": train_latents},
                   {"chameleon": val_tokens, "transfusion": val_latents},
                   {"chameleon": demo_dir / "tokenizer" / "model", "transfusion": out_dir / "tokenizer_kl" / "model"},
                   out_dir / "tokenizer_kl" / "model", log)

    log("[3/5] training (train.py fit, configs/fusion/demo.yaml) and scoring")
    runs: dict[str, dict] = {}
    for size_name, steps, arm in planned_runs(config):
        runs[run_name(size_name, steps, arm)] = train_and_score(ctx, size_name, steps, arm)
        record = summarize(config, runs, kl_record, out_dir, demo_dir, start, complete=False)
        atomic_write_json(out_dir / "results.json", record)  # partial results survive an interrupted run

    log("[4/5] plots")
    record = summarize(config, runs, kl_record, out_dir, demo_dir, start, complete=True)
    record["plots"] = write_plots(record, out_dir / "plots")
    log("[5/5] results")
    atomic_write_json(out_dir / "results.json", record)
    atomic_write_text(out_dir / "results.md", results_markdown(record))
    log(results_markdown(record))
    log(f"results: {out_dir / 'results.md'} ({record['minutes']:.1f} minutes)")
    return record


def floors_of(runs: dict[str, dict]) -> dict:
    """The floors every run's suite measured (the same for every run of a family: they depend on the split, the
    seed, the classifier and the image tokenizer only): real held-out digits, each tokenizer's reconstructions."""
    floors: dict = {}
    for family, name in (("chameleon", "vq_reconstructed"), ("transfusion", "kl_reconstructed")):
        scored = next((r for r in runs.values() if r["family"] == family), None)
        if scored is None:
            continue
        distribution = scored["eval"]["figures"]["distribution"]
        floors.update({"real": distribution["frechet_real"], name: distribution["frechet_reconstruction"],
                       f"{name}_accuracy": distribution["accuracy_reconstruction"],
                       "real_accuracy": distribution["accuracy_real"], "real_diversity": distribution["diversity_real"],
                       "reference_count": distribution["reference_count"],
                       "sample_count": distribution["sample_count"]})
    return floors


def summarize(config: TransfusionExperimentConfig, runs: dict[str, dict], kl_record: dict,
              out_dir: Path, demo_dir: Path, start: float, complete: bool) -> dict:
    """The results record: every run, the floors, FLOP parity overall and per size, the causal ablation."""
    ablation = {}
    causal = runs.get(run_name(config.ablation_size, max(config.budgets), "transfusion_causal"))
    bidirectional = runs.get(run_name(config.ablation_size, max(config.budgets), "transfusion"))
    if causal and bidirectional:
        ablation = {"bidirectional_fd": bidirectional["frechet_distance"], "causal_fd": causal["frechet_distance"],
                    "bidirectional_generation": bidirectional["generation_accuracy"],
                    "causal_generation": causal["generation_accuracy"]}
    return {"config": dataclasses.asdict(config), "demo_dir": str(demo_dir), "out_dir": str(out_dir),
            "sizes": {s: SIZES[s] for s in config.sizes}, "runs": runs, "floors": floors_of(runs),
            "continuous_tokenizer": kl_record, "flop_parity": flop_parity(runs),
            "flop_parity_per_size": {s: flop_parity(runs, (s,)) for s in config.sizes},
            "causal_ablation": ablation, "paper": PAPER, "complete": complete,
            "minutes": (time.perf_counter() - start) / 60, "threads": torch.get_num_threads(),
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}


# ---------------------------------------------------------------- outputs


def _number(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None or not np.isfinite(value) else format(value, spec)


def _parity_line(parity: dict) -> str:
    if parity.get("chameleon_best_fd") is None:
        return "no Chameleon run has a finite FD"
    head = f"Chameleon's best FD {parity['chameleon_best_fd']:.2f} ({parity['chameleon_best_run']})"
    if parity["flop_ratio"] is None:
        return f"{head}: no Transfusion run reaches it"
    return (f"{head}: first reached by {parity['transfusion_run']} (FD {parity['transfusion_fd']:.2f}) at "
            f"{parity['flop_ratio']:.3f} of its training FLOPs")


def results_markdown(record: dict, plot_dir: str = "plots") -> str:
    """The results as Markdown: one row per run, the floors, FLOP parity, the ablation, the plot."""
    runs, floors = record["runs"], record["floors"]
    lines = ["| run | steps | parameters | FLOPs/token | training FLOPs | wall s | generation | FD | diversity | "
             "understanding | held-out text loss |", "|---" * 11 + "|"]
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['steps']} | {r['parameters']:,} | {r['flops_per_token'] / 1e6:.2f}M | {r['flops']:.3g} | "
            f"{r['seconds']:.1f} | {r['generation_accuracy']:.1%} | {_number(r['frechet_distance'])} | "
            f"{_number(r['diversity'])} | {r['understanding_accuracy']:.1%} | "
            f"{_number(r['held_out'].get('text_loss'), '.4f')} |")
    kl = record["continuous_tokenizer"]
    lines += ["", "| floor | FD | classifier accuracy (every held-out digit) |", "|---|---|---|",
              f"| real held-out digits ({floors['sample_count']}) | {floors['real']:.2f} | "
              f"{floors['real_accuracy']:.1%} |",
              f"| VQ reconstructions (Chameleon's tokenizer) | {floors['vq_reconstructed']:.2f} | "
              f"{floors['vq_reconstructed_accuracy']:.1%} |",
              f"| KL reconstructions (Transfusion's tokenizer) | {floors['kl_reconstructed']:.2f} | "
              f"{floors['kl_reconstructed_accuracy']:.1%} |",
              "", f"Real digits' per-caption diversity: {floors['real_diversity']:.2f}. Continuous tokenizer: "
              f"{kl['key']['steps']} steps (the VQ tokenizer's), held-out PSNR {kl['psnr_db']:.2f} dB against the VQ's "
              f"{_number(kl.get('vq_psnr_db'))} dB.", "",
              f"FLOP parity (all sizes): {_parity_line(record['flop_parity'])}. Paper (7B): "
              f"{PAPER['fid_parity_flop_ratio_7b']}."]
    for size, parity in record["flop_parity_per_size"].items():
        lines.append(f"- {size}: {_parity_line(parity)}")
    ablation = record["causal_ablation"]
    if ablation:
        lines += ["", f"Causal-only image attention ({record['config']['ablation_size']}, "
                  f"{max(record['config']['budgets'])} steps): FD {_number(ablation['causal_fd'])} "
                  f"(generation {ablation['causal_generation']:.1%}) against bidirectional "
                  f"{_number(ablation['bidirectional_fd'])} ({ablation['bidirectional_generation']:.1%}); paper (0.76B, "
                  f"FID): causal {PAPER['causal_fid_0.76b']}, bidirectional {PAPER['bidirectional_fid_0.76b']}."]
    config = record["config"]
    lines += ["", f"FD: Fréchet distance in the demo classifier's 128-d penultimate features to "
              f"{floors['reference_count']} held-out digits, over {config['images_per_caption'] or 'the demo setting of'}"
              f" images per caption; diversity: mean pairwise feature distance among one caption's images. Training "
              f"FLOPs: the family's flops_per_token(seq_len) x decoder positions trained (Transfusion's counts its "
              f"patch projections and timestep MLP at every position). Every run scored by `train.py eval --suite digits` "
              f"(each run's eval/results.json and eval/index.html). {record['minutes']:.1f} minutes on "
              f"{record['threads']} thread(s).", "", f"![FD against training FLOPs]({plot_dir}/fd_vs_flops.png)"]
    return "\n".join(lines) + "\n"


def write_plots(record: dict, folder: Path) -> list[str]:
    """FD (and generation accuracy) against training FLOPs, one line per family and size, the floors dashed."""
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    runs, floors = record["runs"], record["floors"]
    colours = {"chameleon": "tab:blue", "transfusion": "tab:red", "transfusion_causal": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), dpi=110)
    for ax, key, label in ((axes[0], "frechet_distance", "FD (classifier features)"),
                           (axes[1], "generation_accuracy", "generation accuracy")):
        for arm in ARMS:
            for i, size in enumerate(record["config"]["sizes"]):
                points = sorted((r["flops"], r[key]) for r in runs.values() if r["arm"] == arm and r["size"] == size)
                if points:
                    x, y = zip(*points)
                    ax.plot(x, y, linestyle=styles[i % len(styles)], marker="o", color=colours[arm],
                            label=f"{arm} {size}")
        if key == "frechet_distance":
            for name, colour in (("real", "grey"), ("vq_reconstructed", "tab:blue"), ("kl_reconstructed", "tab:red")):
                ax.axhline(floors[name], color=colour, linewidth=0.8, linestyle=(0, (2, 2)), label=f"floor: {name}")
        ax.set_xscale("log")
        ax.set_xlabel("training FLOPs")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = folder / "fd_vs_flops.png"
    fig.savefig(path)
    plt.close(fig)
    return [str(path)]


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The `train.py experiment transfusion` options."""
    defaults = TransfusionExperimentConfig()
    parser = experiment_parser("transfusion", __doc__, defaults, SIZES,
                               "tiny sizes and a few steps on the smoke demo's outputs (runs/demo-smoke)")
    parser.add_argument("--budgets", nargs="+", type=int, default=None,
                        help=f"optimizer steps, each size trains each (default: {' '.join(map(str, defaults.budgets))})")
    for name in ("ddim_steps", "images_per_caption", "understanding_examples", "held_out_arithmetic", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default: {getattr(defaults, name)}")
    return parser


def config_from_args(args: argparse.Namespace) -> TransfusionExperimentConfig:
    """The experiment's settings: the full run's or the smoke mode's, with the options given replacing theirs."""
    base = smoke_config() if args.smoke else TransfusionExperimentConfig()
    given = {"demo": args.demo, "demo_dir": args.demo_dir, "out_dir": args.out,
             "sizes": tuple(args.sizes) if args.sizes else None,
             "budgets": tuple(args.budgets) if args.budgets else None, "ablation_size": args.ablation_size,
             "reuse": args.reuse or None,
             **{name: getattr(args, name) for name in ("ddim_steps", "images_per_caption", "understanding_examples",
                                                       "held_out_arithmetic", "seed")}}
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python train.py experiment transfusion`."""
    return run_experiment_command("transfusion", argv, build_parser, config_from_args, run)
