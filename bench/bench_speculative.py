"""Speculative Jacobi decoding on the demo's trained model: forwards, image codes per forward, seconds, generation
accuracy and distribution-level scores (Fréchet distance, diversity) per image for windows 0 (plain), 4 and 8, at the
demo's sampling settings and at temperature 1 / no CFG; windows 4 and 8 also with independently redrawn drafts (SJD
as published) against the sampler's coupled ones."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock as unittest_mock

import numpy as np
import torch

from bench.harness import paired_result, time_rounds, write_result
from evaluation.frechet import frechet_distance, per_group_diversity
from experiments.demo.bookkeeping import read_marker
from experiments.demo.datasets import caption_prompt, to_model_images
from experiments.demo.settings import GenerateSettings, load_config
from experiments.demo.stages import digits_for, load_decoder, load_image_tokenizer, load_vocab
from fusion_model.sampling import SamplingConfig, generate_ids, speculative
from fusion_model.sampling.generate import split_segments

NAME = "speculative"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUN_DIR = REPO_ROOT / "runs" / "demo"  # where `bash scripts/demo.sh` writes
RUN_DIR_ENV = "BENCH_DEMO_RUN_DIR"  # lets `python -m bench speculative` measure another finished run
# name -> (window, drafts coupled across forwards); window 0 is the plain sampler every other variant is compared with
VARIANTS = {"window0": (0, True), "window4": (4, True), "window8": (8, True),
            "window4_independent": (4, False), "window8_independent": (8, False)}
SETTINGS = ("demo_settings", "temperature1_cfg1")  # the names settings_to_measure gives its two sampling settings
# 10 digits x 100 = 1,000 images per window and setting: a standard error of about 1.3 points on an accuracy
# near 80% (1.8 on a difference); 6 x 1,000 images take about 5 minutes on one thread of an idle CPU
FULL_SAMPLES_PER_DIGIT = 100
SMOKE_SAMPLES_PER_DIGIT = 2  # diversity needs two images of a caption
# files of a finished demo run that this benchmark reads (stages.load_* and run_generate's classifier)
RUN_FILES = ("train/model.ckpt", "vocab/tokenizer.json", "tokenizer/model/config.json", "generate/classifier.pt")


def image_sampling(settings: GenerateSettings, grid: tuple[int, int], seed: int) -> SamplingConfig:
    """Sampling settings for one generated image (temperature, top-k, CFG from the demo config)."""
    return SamplingConfig(mode="image", image_temperature=settings.temperature, image_top_k=settings.top_k,
                          cfg_scale=settings.cfg_scale, image_grid=grid, seed=seed)


def image_codes(vocab, new_ids: list[list[int]], grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first generated image of each row as codes (N, h, w), and which rows produced a complete image (one that
    `split_segments` keeps: closed by `<eoi>` after exactly h*w codes; zeros where none)."""
    codes = torch.zeros(len(new_ids), *grid, dtype=torch.long)
    complete = torch.zeros(len(new_ids), dtype=torch.bool)
    for r, ids in enumerate(new_ids):
        image = next((segment for segment in split_segments(ids, vocab, grid) if not isinstance(segment, str)), None)
        if image is not None:
            codes[r], complete[r] = image, True
    return codes, complete


def missing_run_message(run_dir: Path) -> str | None:
    """One sentence on what to do when `run_dir` is not a finished demo run, or None when it is."""
    missing = [name for name in RUN_FILES if not (run_dir / name).is_file()]
    if not missing:
        return None
    return (f"{run_dir} is not a finished demo run (no {missing[0]}): run `bash scripts/demo.sh` "
            f"(or `python train.py demo`) first, or pass --run-dir")


def load_run(run_dir: Path):
    """(decoder, vocab, image tokenizer, classifier) of a finished demo run, through the demo's own loaders."""
    from common.files import load_checkpoint_file
    from evaluation.digit_classifier import DigitClassifier

    message = missing_run_message(run_dir)
    if message is not None:
        raise FileNotFoundError(message)
    classifier = DigitClassifier()
    classifier.load_state_dict(load_checkpoint_file(run_dir / "generate" / "classifier.pt"))
    return load_decoder(run_dir), load_vocab(run_dir), load_image_tokenizer(run_dir), classifier.eval()


def build_smoke_run(directory: Path) -> Path:
    """An untrained tiny decoder, vocabulary, image tokenizer (4x4 codes) and classifier in the demo run layout."""
    from common.files import atomic_torch_save
    from evaluation.digit_classifier import DigitClassifier
    from experiments.demo.datasets import caption_texts
    from fusion_model.checkpoint import save_model
    from fusion_model.config import FusionConfig
    from fusion_model.model import FusionModel
    from tokenizer.image import ImageTokenizer
    from tokenizer.image.config import ImageTokenizerConfig
    from tokenizer.vocab import train_unified_vocab

    torch.manual_seed(0)
    image_config = ImageTokenizerConfig(image_size=16, base_channels=8, channel_multiplier=(1, 1, 1), num_res_blocks=1,
                                        latent_channels=8, norm_groups=4, codebook_size=64)
    ImageTokenizer(image_config).save_pretrained(directory / "tokenizer" / "model")
    vocab = train_unified_vocab(caption_texts() * 4, vocab_size=512, image_codes=image_config.codebook_size)
    vocab.save(directory / "vocab" / "tokenizer.json")
    config = FusionConfig.from_preset("tiny", vocab_size=vocab.vocab_size, image_offset=vocab.image_offset,
                                      image_codes=vocab.image_codes)
    (directory / "train").mkdir(parents=True, exist_ok=True)
    save_model(FusionModel(config), directory / "train" / "model.ckpt")
    (directory / "generate").mkdir(parents=True, exist_ok=True)
    atomic_torch_save(DigitClassifier().state_dict(), directory / "generate" / "classifier.pt")
    return directory


def settings_to_measure(demo: GenerateSettings) -> dict[str, GenerateSettings]:
    """The demo's own sampling settings, and the same with temperature 1 and no guidance (top-k kept)."""
    plain = dataclasses.replace(demo, temperature=1.0, cfg_scale=1.0)
    return dict(zip(SETTINGS, (demo, plain)))


def _independent_drafts(new_q, old_drafts, old_q, has_old, uniform, noise):
    """SJD's drafts as published: every forward redraws them from the new proposal, ignoring the old ones
    (speculative.coupled_drafts' signature)."""
    return speculative.draw_from_weights(new_q, noise)


def _drafts(coupled: bool):
    """The sampler as it is (coupled drafts), or with independently redrawn drafts for the comparison."""
    if coupled:
        return contextlib.nullcontext()
    return unittest_mock.patch.object(speculative, "coupled_drafts", _independent_drafts)


def measure_setting(model, vocab, image_tokenizer, classifier, settings: GenerateSettings, *, seed: int,
                    samples_per_digit: int, variants: dict[str, tuple[int, bool]] = VARIANTS) -> dict[str, dict]:
    """Generate one image per call (batch 1) for every caption, each variant on the same prompts and seeds, the
    variants taking turns image by image (harness.time_rounds); the classifier then names every image."""
    targets = np.repeat(np.arange(10), samples_per_digit)
    prompts = [vocab.encode_document([caption_prompt(int(d))], bos=True, eos=False) for d in targets]
    grid = tuple(image_tokenizer.grid_shape)
    raw = {name: {"new_ids": [], "forwards": [], "image_codes": [], "cpu_s": []} for name in variants}

    def sample(name: str, index: int) -> tuple[list[int], dict]:
        window, coupled = variants[name]
        config = dataclasses.replace(image_sampling(settings, grid, seed + index), speculative_window=window)
        stats: dict = {}
        with _drafts(coupled):
            return generate_ids(model, vocab, [prompts[index % len(prompts)]], config, stats=stats)[0], stats

    def step(name: str):
        def generate_next() -> None:
            record = raw[name]
            start = time.process_time()
            new_ids, stats = sample(name, len(record["new_ids"]))
            record["cpu_s"].append(time.process_time() - start)
            record["new_ids"].append(new_ids)
            record["forwards"].append(stats["forwards"])
            record["image_codes"].append(stats["image_tokens"])
            done = len(record["new_ids"])
            if name == progress_variant and (done % progress_every == 0 or done == len(prompts)):
                # minutes of work on one thread: a line every tenth, so a log shows the run is alive
                print(f"bench_speculative: T {settings.temperature:g}, cfg {settings.cfg_scale:g}: {done}/{len(prompts)}"
                      f" images for each of {len(variants)} variants", file=sys.stderr, flush=True)
        return generate_next

    progress_variant, progress_every = next(iter(variants)), max(1, len(prompts) // 10)

    for name in variants:  # warm-up, on a seed no timed image uses
        sample(name, len(prompts))
    n = len(prompts)
    wall = time_rounds({name: step(name) for name in variants}, warmup=0, min_rounds=n, max_rounds=n)
    for name in variants:
        record = raw[name]
        record["wall_s"] = wall[name]
        codes, complete = image_codes(vocab, record["new_ids"], grid)
        with torch.inference_mode():
            images = image_tokenizer.decode(codes)
            predicted = classifier.predict(images).numpy()
            record["features"] = classifier.penultimate_features(images).numpy()
        record["correct"] = (predicted == targets) & complete.numpy()
        record["complete"] = complete.numpy()
        record["targets"] = targets
    return raw


def real_features(classifier, demo, image_size: int) -> np.ndarray:
    """The classifier's penultimate features of the demo's held-out real digits (never seen in training)."""
    with torch.inference_mode():
        return classifier.penultimate_features(to_model_images(digits_for(demo).test_images, image_size)).numpy()


def _halves(record: dict, parity: int) -> np.ndarray:
    """Features of the complete images with an even (0) or odd (1) index: one half of the seeds."""
    keep = record["complete"].copy()
    keep[1 - parity::2] = False
    return record["features"][keep]


def summarise(raw: dict[str, dict], real: np.ndarray) -> dict[str, dict]:
    """Per-variant figures, each SJD variant against window 0 of the same run: forwards saved, time speedup
    (per-image pairs, median and IQR), accuracy difference in points with its standard error, and the distribution-level
    scores: Fréchet distance to the held-out `real` features, per-caption diversity, and the Fréchet distance between
    this variant's odd-seed half and plain's even-seed half (for plain itself: its two halves, the noise floor)."""
    plain = raw["window0"]
    figures: dict[str, dict] = {}
    for name, record in raw.items():
        n = len(record["forwards"])
        accuracy = float(np.mean(record["correct"]))
        complete = record["complete"]
        features = record["features"][complete]
        row = {
            "images": n,
            "forwards_per_image": float(np.mean(record["forwards"])),
            "image_codes_per_image": float(np.mean(record["image_codes"])),
            # all forwards of the call count, the prefill and those that sample <boi> / <eoi> included
            "codes_per_forward": float(np.sum(record["image_codes"]) / np.sum(record["forwards"])),
            "seconds_per_image": float(np.mean(record["wall_s"])),
            "cpu_seconds_per_image": float(np.mean(record["cpu_s"])),
            "accuracy": accuracy,
            "complete_fraction": float(np.mean(record["complete"])),
            "frechet_distance_to_real": frechet_distance(features, real),
            "diversity": per_group_diversity(features, record["targets"][complete]),
            # disjoint seeds on the two sides, equal sizes: equal in expectation to plain's halves when SJD keeps the
            # distribution, larger when it does not
            "frechet_distance_to_plain_half": frechet_distance(_halves(record, 1), _halves(plain, 0)),
        }
        if name != "window0":
            plain_accuracy = float(np.mean(plain["correct"]))
            # the same prompts and seeds on both sides: the standard error of the per-image differences (paired)
            differences = record["correct"].astype(float) - plain["correct"].astype(float)
            spread = float(np.std(differences, ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
            row.update({
                "forwards_speedup_vs_plain": float(np.sum(plain["forwards"]) / np.sum(record["forwards"])),
                "time_speedup_vs_plain": paired_result(record["wall_s"], plain["wall_s"]).as_dict(),
                "cpu_time_speedup_vs_plain": float(np.sum(plain["cpu_s"]) / np.sum(record["cpu_s"])),
                "accuracy_diff_points": 100 * (accuracy - plain_accuracy),
                "accuracy_diff_se_points": 100 * spread,
            })
        figures[name] = row
    return figures


def format_table(figures: dict[str, dict[str, dict]], sampling: dict[str, dict]) -> str:
    """A plain-text table of every setting and window; ratios are plain ÷ SJD (> 1: SJD does better)."""
    header = (f"{'setting':<34} {'window':>18} {'fwd/img':>8} {'codes/fwd':>9} {'s/img':>8} {'fwd ratio':>9} "
              f"{'time ratio (IQR)':>20} {'accuracy':>8} {'Δacc pts (±se)':>15} {'FD real':>8} {'FD halves':>9} "
              f"{'diversity':>9}")
    lines = [header, "-" * len(header)]
    for name, windows in figures.items():
        label = f"{name} (T {sampling[name]['temperature']:g}, cfg {sampling[name]['cfg_scale']:g})"
        for key, row in windows.items():
            ratio, time_ratio, diff = "", "", ""
            if "time_speedup_vs_plain" in row:
                timed = row["time_speedup_vs_plain"]
                ratio = f"{row['forwards_speedup_vs_plain']:.2f}x"
                time_ratio = (f"{timed['speedup_median']:.2f}x ({timed['speedup_q25']:.2f}-"
                              f"{timed['speedup_q75']:.2f})")
                diff = f"{row['accuracy_diff_points']:+.1f} (±{row['accuracy_diff_se_points']:.1f})"
            lines.append(f"{label:<34} {key.removeprefix('window'):>18} {row['forwards_per_image']:>8.2f} "
                         f"{row['codes_per_forward']:>9.2f} {row['seconds_per_image']:>8.4f} {ratio:>9} "
                         f"{time_ratio:>20} {row['accuracy']:>8.3f} {diff:>15} {row['frechet_distance_to_real']:>8.2f} "
                         f"{row['frechet_distance_to_plain_half']:>9.2f} {row['diversity']:>9.2f}")
    return "\n".join(lines)


def run(smoke: bool = False, run_dir: str | os.PathLike | None = None, results_dir: str | os.PathLike | None = None,
        samples_per_digit: int | None = None, preset: str = "full", threads: int = 1, seed: int | None = None,
        settings: list[str] | None = None, variants: list[str] | None = None) -> dict:
    """Measure every setting and window on a finished demo run (smoke: a tiny untrained one built in a temp dir),
    print the table, write `<results dir>/speculative.json`, return the payload."""
    per_digit = samples_per_digit or (SMOKE_SAMPLES_PER_DIGIT if smoke else FULL_SAMPLES_PER_DIGIT)
    demo = load_config(preset)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-speculative-") as scratch:
            if smoke:
                directory = build_smoke_run(Path(scratch))
            else:
                directory = Path(run_dir or os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_DIR)
            model, vocab, image_tokenizer, classifier = load_run(directory)
            real = real_features(classifier, demo, image_tokenizer.config.image_size)
            recorded = read_marker(directory, "generate") or {}  # the demo's own evaluation (a batch, one seed)
            measured = settings_to_measure(demo.generate)
            measured = {name: measured[name] for name in settings or measured}
            chosen = {name: VARIANTS[name] for name in dict.fromkeys(["window0", *(variants or VARIANTS)])}
            first_seed = demo.seed if seed is None else seed
            figures = {}
            for name, sampling_settings in measured.items():
                raw = measure_setting(model, vocab, image_tokenizer, classifier, sampling_settings, seed=first_seed,
                                      samples_per_digit=per_digit, variants=chosen)
                figures[name] = summarise(raw, real)
    finally:
        torch.set_num_threads(previous_threads)
    sampling = {name: {k: getattr(s, k) for k in ("temperature", "top_k", "cfg_scale")} for name, s in measured.items()}
    if "demo_settings" in sampling and recorded.get("sampling") not in (None, sampling["demo_settings"]):
        print(f"bench_speculative: note: {directory} generated with {recorded['sampling']}, but the {preset} config "
              f"says {sampling['demo_settings']}; pass --preset to match", file=sys.stderr)
    print(format_table(figures, sampling))
    payload = {
        "figures": figures,
        "config": {
            "run_dir": "built in a temp dir (smoke: untrained tiny model)" if smoke else str(directory),
            "demo_config": demo.source, "sampling": sampling, "windows": sorted({window for window, _ in chosen.values()}),
            "variants": {name: {"window": w, "coupled_drafts": c} for name, (w, c) in chosen.items()},
            "coupled_drafts": "the sampler keeps an old draft with probability min(1, q_new/q_old), else draws from "
                              "max(0, q_new - q_old) (MC-SJD); _independent redraws every draft from q_new (SJD)",
            "images_per_window": 10 * per_digit, "samples_per_digit": per_digit, "batch": 1,
            "image_grid": list(image_tokenizer.grid_shape), "parameters": sum(p.numel() for p in model.parameters()),
            "demo_recorded_generation_accuracy": recorded.get("generation_accuracy"), "threads": threads,
            "seeds": f"first seed + image index ({first_seed} + 0..{10 * per_digit - 1}; the demo's seed unless "
                     "--seed), the same for every window",
            "timing": "windows take turns image by image, the order rotating (harness.time_rounds); ratios are "
                      "plain ÷ SJD, > 1 means SJD needs fewer forwards / less time",
            "codes_per_forward": "image codes ÷ every forward of the call (prefill, <boi> and <eoi> steps included)",
            "accuracy": "the demo classifier names the generated digit; an incomplete image counts as wrong; its "
                        "difference's standard error is paired (the same seeds on both sides)",
            "frechet_distance": "in the demo classifier's 128-d penultimate features, complete images only: "
                                "_to_real against the demo's held-out real digits; _to_plain_half between this "
                                "variant's odd-index seeds and plain's even-index ones (plain's own row: its two "
                                "halves, the noise floor a distribution-preserving variant matches)",
            "real_digits": len(real),
        },
    }
    write_result(NAME, payload, results_dir)
    return payload


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.bench_speculative [--run-dir DIR] [--results-dir DIR] [--smoke]`."""
    parser = argparse.ArgumentParser(prog="python -m bench.bench_speculative", description=__doc__)
    parser.add_argument("--run-dir", type=Path, default=None,
                        help=f"a finished demo run (default ${RUN_DIR_ENV} or {DEFAULT_RUN_DIR})")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="where speculative.json goes (default $BENCH_RESULTS_DIR or bench/results)")
    parser.add_argument("--smoke", action="store_true", help="a tiny untrained model in a temp dir, seconds")
    parser.add_argument("--samples-per-digit", type=int, default=None,
                        help=f"images per digit caption (default {FULL_SAMPLES_PER_DIGIT}, smoke "
                             f"{SMOKE_SAMPLES_PER_DIGIT})")
    parser.add_argument("--preset", default="full", help="demo config whose generate settings to use (default full)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--seed", type=int, default=None,
                        help="first image's seed (default the demo's): rerun on fresh seeds to check a difference")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=None,
                        help="measure only these sampling settings (default both)")
    parser.add_argument("--variants", nargs="+", choices=[name for name in VARIANTS if name != "window0"],
                        default=None, help="measure only these SJD variants against window0 (default all)")
    args = parser.parse_args(argv)
    try:
        run(smoke=args.smoke, run_dir=args.run_dir, results_dir=args.results_dir,
            samples_per_digit=args.samples_per_digit, preset=args.preset, threads=args.threads, seed=args.seed,
            settings=args.settings, variants=args.variants)
    except FileNotFoundError as error:
        print(f"bench_speculative: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
