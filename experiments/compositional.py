"""`python train.py experiment compositional`: three decoder designs on the synthetic scene world
(`data_shards.scenes`), trained for the same training FLOPs and scored by the `scenes` evaluation suite.

Arms: `chameleon` (the dense decoder on VQ codes), `mot` (the Mixture-of-Transformers block,
`--model.config.block mot`, on the same token shards) and `transfusion` (continuous latents, the transfusion family).
Every arm trains the demo's decoder (configs/fusion/demo.yaml, one size for all) through `train.py fit` from the same
seed on the same documents: one set of raw shards of the world's training documents (captions of GenEval's six
skills, questions about scenes, a few interleaved edit documents), written once as VQ token shards (preset
`scenes-64`, 8x8 codes) and as latent shards (preset `kl-scenes-64`, 8x8 latents) with the same flip seed. The two
image tokenizers train on the same training images for the same steps and batch size (the VQ tokenizer's run, capped
in minutes, sets the steps the KL one gets); one vocabulary (BPE over the documents' text plus both tokenizers'
image-code block) serves every arm.

Equal FLOPs: a training-FLOPs budget is split into steps per arm, budget / (its family's `flops_per_token(seq_len)`
x decoder positions per step, the mean of the first packed batches); each run records the FLOPs it actually trained
(flops_per_token x the decoder positions it ran). Each checkpoint is then scored by
`evaluation.run.evaluate(checkpoint, "scenes", ...)` alone (the experiment samples and scores nothing itself):
generation accuracy per skill with its ground-truth and reconstruction ceilings, understanding, held-out text loss,
Fréchet distance and diversity. Writes `<out>/results.json`, `<out>/results.md` and `<out>/plots/skills.png`;
`--render-doc` writes docs/results/compositional.md from a finished results.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.files import atomic_write_json, atomic_write_text
from experiments.demo.settings import REPO_ROOT
from experiments.fusion import fit
from experiments.transfusion import SIZES

# arm -> (family, decoder block): `--model.family` and `--model.config.block` over configs/fusion/demo.yaml
ARMS: dict[str, tuple[str, str]] = {
    "chameleon": ("chameleon", "dense"),
    "mot": ("chameleon", "mot"),
    "transfusion": ("transfusion", "dense"),
}
DOC = REPO_ROOT / "docs" / "results" / "compositional.md"
DOC_PLOT = "compositional_skills.png"  # beside the doc


@dataclass
class CompositionalConfig:
    """The experiment's settings; defaults are the full run (about 35 minutes on one thread of a 2-core CPU)."""

    out_dir: str = "runs/compositional"
    seed: int = 0  # the documents, the tokenizers, the flip of captions and every fit
    # data: the scene world's training documents (data_shards.scenes.training_samples)
    documents: int = 16000
    samples_per_shard: int = 4096
    flip_probability: float = 0.5  # caption->image vs image->caption (the demo's)
    # image tokenizers: the VQ one runs up to tokenizer_steps or tokenizer_minutes; the KL one gets its steps
    vq_preset: str = "scenes-64"
    kl_preset: str = "kl-scenes-64"
    tokenizer_steps: int = 1500
    tokenizer_minutes: float | None = 4.0
    tokenizer_batch_size: int = 32
    tokenizer_images: int = 4096  # training images the tokenizers train on (the first documents')
    tokenizer_overrides: dict[str, Any] = field(default_factory=dict)  # ImageTokenizerConfig fields, both presets
    psnr_images: int = 256  # held-out scenes (another seed) each tokenizer's PSNR is measured on
    # vocabulary: byte-level BPE over the documents' text; the text part of the vocabulary
    text_tokens: int = 384
    # decoders: one size for every arm (experiments.transfusion.SIZES over the `demo` preset), configs/fusion/demo.yaml
    size: str = "demo"
    arms: tuple[str, ...] = ("chameleon", "mot", "transfusion")
    seq_len: int = 256  # a row holds about three scene documents (~82 positions each)
    batch_size: int = 8
    flops_budget: float = 1.6e13  # training FLOPs of every arm (chameleon at the demo size: ~1,270 steps)
    # evaluation (evaluation.base.EvalSettings)
    samples_per_prompt: int = 10  # 12 x 10 = 120 images per skill: a standard error of at most 4.6 points
    prompts_per_skill: int = 12
    understanding_items: int = 300
    text_documents: int = 200
    denoising_steps: int = 25
    cfg_scale: float = 3.0
    eval_batch_size: int = 32
    reuse: bool = False  # keep stages (and runs) already finished with the same settings
    smoke: bool = False  # the smoke mode's settings (its results never become docs/results/compositional.md)


def smoke_config(out_dir: str = "runs/compositional-smoke") -> CompositionalConfig:
    """The smoke mode: a few hundred documents, a few tokenizer steps on narrow tokenizers, a d32 decoder for a
    dozen steps, one sample per skill (seconds per stage)."""
    return CompositionalConfig(out_dir=out_dir, smoke=True, documents=400, samples_per_shard=128, tokenizer_steps=3,
                               tokenizer_minutes=None, tokenizer_batch_size=8, tokenizer_images=64,
                               tokenizer_overrides={"base_channels": 4, "norm_groups": 4}, psnr_images=8,
                               size="d32", flops_budget=1.2e10, samples_per_prompt=1, prompts_per_skill=1,
                               understanding_items=6, text_documents=4, denoising_steps=2, eval_batch_size=8)


def eval_settings(config: CompositionalConfig):
    """The suite's settings, the same for every arm."""
    from evaluation.base import EvalSettings

    return EvalSettings(seed=config.seed, samples_per_prompt=config.samples_per_prompt,
                        prompts_per_skill=config.prompts_per_skill, understanding_items=config.understanding_items,
                        text_documents=config.text_documents, denoising_steps=config.denoising_steps,
                        cfg_scale=config.cfg_scale, batch_size=config.eval_batch_size)


# ---------------------------------------------------------------- cached stages


def _reused(config: CompositionalConfig, record_path: Path, key: dict, *needed: Path) -> dict | None:
    """The stage's record when --reuse is on, it was made with `key` and its outputs exist."""
    if not (config.reuse and record_path.is_file() and all(p.exists() for p in needed)):
        return None
    record = json.loads(record_path.read_text())
    return record if record.get("key") == json.loads(json.dumps(key)) else None


def raw_shards(config: CompositionalConfig, out_dir: Path, log: Callable[[str], None]) -> tuple[Path, dict]:
    """The world's training documents as raw shards (`data_shards.scenes.training_samples`, the documents
    `train.py shards write --demo scenes` writes, with this seed)."""
    from data_shards.scenes import training_samples
    from data_shards.sources import write_raw

    folder = out_dir / "shards" / "raw"
    key = {"documents": config.documents, "seed": config.seed, "samples_per_shard": config.samples_per_shard}
    saved = out_dir / "shards" / "raw_record.json"
    if (record := _reused(config, saved, key, folder / "manifest.json")) is not None:
        log("  raw shards: reusing")
        return folder, record
    if folder.exists():
        shutil.rmtree(folder)
    start = time.perf_counter()
    manifest = write_raw(training_samples(config.documents, config.seed), folder,
                         shard_max_docs=config.samples_per_shard, prefix="scenes")
    record = {"key": key, "seconds": time.perf_counter() - start,
              "documents": int(manifest.get("documents", config.documents))}
    atomic_write_json(saved, record)
    log(f"  raw shards: {record['documents']:,} documents in {record['seconds']:.0f} s")
    return folder, record


def read_documents(raw_dir: Path, max_images: int) -> tuple[list[str], torch.Tensor, dict[str, int]]:
    """Every text segment of the raw shards, the first `max_images` images as (N, 3, 64, 64) in [-1, 1], and the
    documents per kind (the key's last word)."""
    from PIL import Image

    from data_shards.raw import iter_raw_shard, read_raw_manifest

    texts: list[str] = []
    images: list[np.ndarray] = []
    kinds: dict[str, int] = {}
    for shard in read_raw_manifest(raw_dir)["shards"]:
        for key, segments in iter_raw_shard(raw_dir / shard["name"]):
            kind = key.rsplit("_", 1)[-1]
            kinds[kind] = kinds.get(kind, 0) + 1
            for s in segments:
                if isinstance(s, str):
                    texts.append(s)
                elif len(images) < max_images:
                    images.append(np.asarray(Image.open(io.BytesIO(s[1])).convert("RGB")))
    return texts, to_pixels(images), kinds


def to_pixels(images: list[np.ndarray]) -> torch.Tensor:
    """uint8 (H, W, 3) arrays as a float (N, 3, H, W) batch in [-1, 1]."""
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def held_out_pixels(config: CompositionalConfig) -> torch.Tensor:
    """Images of documents of another seed (scenes the tokenizers never saw), for their PSNR."""
    from data_shards.scenes import training_samples

    images = []
    for sample in training_samples(config.psnr_images, config.seed + 1):
        images += [np.asarray(s.convert("RGB")) for s in sample.segments if not isinstance(s, str)]
    return to_pixels(images[:config.psnr_images])


def image_tokenizer(config: CompositionalConfig, out_dir: Path, folder_name: str, preset: str, steps: int,
                    minutes: float | None, images: torch.Tensor, held_out: torch.Tensor, upstream: dict,
                    log: Callable[[str], None]) -> tuple[Path, dict]:
    """One image tokenizer trained on `images` (the bundle's folder and its record)."""
    from tokenizer.image.evaluate import evaluate
    from tokenizer.image.train import fit_image_tokenizer

    folder = out_dir / folder_name
    key = {"preset": preset, "steps": steps, "minutes": minutes, "batch_size": config.tokenizer_batch_size,
           "overrides": dict(config.tokenizer_overrides), "seed": config.seed, "images": len(images),
           "upstream": upstream}
    saved = folder / "record.json"
    if (record := _reused(config, saved, key, folder / "model")) is not None:
        log(f"  {folder_name}: reusing ({record['steps']} steps, PSNR {record['psnr_db']:.2f} dB)")
        return folder / "model", record
    if folder.exists():
        shutil.rmtree(folder)
    start = time.perf_counter()
    tokenizer, info = fit_image_tokenizer(images, preset=preset, batch_size=config.tokenizer_batch_size,
                                          max_steps=steps, max_minutes=minutes, seed=config.seed, progress=False,
                                          log_dir=folder / "logs", overrides=config.tokenizer_overrides or None)
    tokenizer.save_pretrained(folder / "model")
    seconds = time.perf_counter() - start
    with torch.no_grad():
        fidelity = evaluate(tokenizer.eval(), held_out)
    record = {"key": key, "seconds": seconds, "grid": list(tokenizer.grid_shape),
              **{k: v for k, v in info.items() if isinstance(v, (int, float, str))},
              **{k: v for k, v in fidelity.items() if isinstance(v, (int, float))}}
    atomic_write_json(saved, record)
    log(f"  {folder_name} ({preset}): {record['steps']} steps in {seconds:.0f} s, held-out PSNR "
        f"{record['psnr_db']:.2f} dB")
    return folder / "model", record


def build_vocab(config: CompositionalConfig, out_dir: Path, texts: list[str], codes: int, upstream: dict,
                log: Callable[[str], None]) -> tuple[Path, dict]:
    """One unified vocabulary for every arm: byte-level BPE over the documents' text (`text_tokens` of it) and
    `codes` image ids (the VQ codebook; latent images use the `<image>` placeholder)."""
    from tokenizer.specials import DEFAULT_NUM_SPECIALS
    from tokenizer.vocab import UnifiedVocab, train_unified_vocab

    path = out_dir / "vocab" / "tokenizer.json"
    key = {"text_tokens": config.text_tokens, "image_codes": codes, "upstream": upstream}
    saved = out_dir / "vocab" / "record.json"
    if (record := _reused(config, saved, key, path)) is not None:
        log("  vocabulary: reusing")
        return path, record
    vocab = train_unified_vocab(texts, vocab_size=DEFAULT_NUM_SPECIALS + codes + config.text_tokens,
                                image_codes=codes)
    vocab.save(path)
    vocab = UnifiedVocab.load(path)
    example = texts[0] if texts else ""
    record = {"key": key, "vocab_size": vocab.vocab_size, "image_codes": vocab.image_codes,
              "image_offset": vocab.image_offset, "fingerprint": vocab.fingerprint(),
              "text_segments": len(texts), "example": {"text": example, "tokens": len(vocab.encode_text(example))}}
    atomic_write_json(saved, record)
    log(f"  vocabulary: {vocab.vocab_size} ids ({codes} image codes), '{example}' -> {record['example']['tokens']} "
        "tokens")
    return path, record


def token_shards(config: CompositionalConfig, raw_dir: Path, out: Path, vocab_path: Path, tokenizer_dir: Path) -> Path:
    """`raw_dir`'s documents as token shards (codes or latents, by the tokenizer), flip probability and seed the
    same for both; pretokenize itself skips shards already finished with the same inputs."""
    from data_shards.pretokenize import pretokenize
    from tokenizer.bundle import load_media_tokenizer
    from tokenizer.vocab import UnifiedVocab

    if out.exists() and not config.reuse:
        shutil.rmtree(out)
    pretokenize(raw_dir, out, UnifiedVocab.load(vocab_path), load_media_tokenizer(tokenizer_dir),
                flip_probability=config.flip_probability, seed=config.seed, progress=False)
    return out


# ---------------------------------------------------------------- equal FLOPs


def arm_family(config: CompositionalConfig, arm: str, vocab_path: Path, shards: Path):
    """The family object `train.py fit` will build for `arm` (its decoder config and derived options), for its
    FLOPs per token before training."""
    from data_shards.token_shards import read_manifest
    from fusion_model.config import FusionConfig
    from fusion_model.families import family_class
    from tokenizer.vocab import UnifiedVocab

    name, block = ARMS[arm]
    vocab = UnifiedVocab.load(vocab_path)
    model = {"preset": "demo", **SIZES[config.size], "vocab_size": vocab.vocab_size, "block": block,
             "image_offset": vocab.image_offset, "image_codes": vocab.image_codes, "max_seq_len": config.seq_len}
    family = family_class(name)
    derived: dict = {}
    family.derive_options(derived, read_manifest(shards), vocab)
    return family(FusionConfig.from_dict(model), derived)


def positions_per_step(token_dir: Path, config: CompositionalConfig, batches: int = 8) -> float:
    """Mean decoder positions (padding left out) of the first `batches` packed batches, as the runs read them."""
    from itertools import islice

    from data_shards.stream import PackedTokenStream

    stream = PackedTokenStream(token_dir, config.seq_len, config.batch_size, seed=config.seed, shuffle=True)
    counts = [float((batch["document_ids"] >= 0).sum()) for batch in islice(iter(stream), batches)]
    return float(np.mean(counts))


def plan_steps(config: CompositionalConfig, flops_per_token: dict[str, float], positions_per_step: float) -> dict:
    """Each arm's optimizer steps: the budget over (its FLOPs per token x decoder positions per step)."""
    return {arm: max(1, round(config.flops_budget / (f * positions_per_step))) for arm, f in flops_per_token.items()}


def fit_options(config: CompositionalConfig, arm: str, kl_dir: Path) -> list[str]:
    """The `train.py fit` options of one arm on top of experiments.fusion.fit's (configs/fusion/demo.yaml)."""
    family, block = ARMS[arm]
    extra = [f"--model.config.{key}={value}" for key, value in SIZES[config.size].items()]
    extra += [f"--data.seq_len={config.seq_len}", f"--model.config.max_seq_len={config.seq_len}",
              f"--data.batch_size={config.batch_size}"]
    if block != "dense":
        extra.append(f"--model.config.block={block}")
    if family != "chameleon":
        extra += [f"--model.family={family}", f"--data.image_tokenizer={kl_dir}"]
    return extra


# ---------------------------------------------------------------- one arm


@dataclass
class _Context:
    """What every arm of one experiment shares."""

    config: CompositionalConfig
    out_dir: Path
    vocab: Path
    tokenizers: dict[str, Path]  # family -> image tokenizer bundle
    shards: dict[str, Path]  # family -> training shards
    log: Callable[[str], None]


def train_arm(ctx: _Context, arm: str, steps: int) -> dict:
    """Train one arm (or reuse its finished run): its record, also written to `<out>/<arm>/record.json`."""
    family = ARMS[arm][0]
    folder = ctx.out_dir / arm
    extra = fit_options(ctx.config, arm, ctx.tokenizers["transfusion"])
    saved = folder / "record.json"
    key = {"extra": extra, "steps": steps, "seed": ctx.config.seed, "shards": str(ctx.shards[family])}
    if ctx.config.reuse and saved.is_file():
        record = json.loads(saved.read_text())
        if record.get("key") == key and Path(record["last_checkpoint"]).is_file():
            ctx.log(f"  {arm}: reusing the finished run")
            return record
    # experiments.fusion.fit reads <out>/vocab/tokenizer.json and, for a `tokens` folder, <out>/tokenizer/model
    module, trained = fit(arm, ctx.out_dir, ctx.out_dir, ctx.shards[family], steps, ctx.config.seed, extra, ctx.log)
    seq_len = int(module.trainer.datamodule.seq_len)
    flops_per_token = float(module.family.flops_per_token(seq_len))
    model_config = module.family.config
    parameters = sum(p.numel() for part in module.parts.values() for p in part.parameters())
    del module
    record = {**trained, "key": key, "arm": arm, "family": family, "block": model_config.block,
              "architecture": {k: getattr(model_config, k) for k in ("dim", "n_layers", "n_heads", "ffn_dim")},
              "parameters": parameters, "seq_len": seq_len, "flops_per_token": flops_per_token,
              "flops": flops_per_token * trained["decoder_positions"],
              "step_seconds": trained["seconds"] / max(trained["steps"], 1)}
    atomic_write_json(saved, record)
    return record


def score_arm(ctx: _Context, arm: str, trained: dict) -> dict:
    """The `scenes` suite's results.json of one arm's checkpoint (reused when --reuse finds it for the same
    checkpoint and settings)."""
    from evaluation.run import evaluate

    family = ARMS[arm][0]
    out = ctx.out_dir / arm / "eval"
    settings = eval_settings(ctx.config)
    saved = out / "results.json"
    if ctx.config.reuse and saved.is_file():
        results = json.loads(saved.read_text())
        if (results.get("settings") == json.loads(json.dumps(dataclasses.asdict(settings)))
                and results.get("files", {}).get("checkpoint") == trained["last_checkpoint"]
                and saved.stat().st_mtime >= Path(trained["last_checkpoint"]).stat().st_mtime):
            ctx.log(f"  {arm}: reusing its evaluation")
            return results
    start = time.perf_counter()
    results = evaluate(trained["last_checkpoint"], "scenes", vocab=ctx.vocab, media_tokenizer=ctx.tokenizers[family],
                       out=out, settings=settings, progress=lambda message: None)
    results["seconds"] = time.perf_counter() - start
    atomic_write_json(saved, results)
    return results


# ---------------------------------------------------------------- the experiment


def run(config: CompositionalConfig, log: Callable[[str], None] = print) -> dict:
    """Data, tokenizers, vocabulary, shards, then every arm trained at the same FLOPs and scored; returns (and
    writes) the results."""
    unknown = [a for a in config.arms if a not in ARMS]
    if unknown or not config.arms:
        raise ValueError(f"--arms {list(config.arms)}: choose from {list(ARMS)}")
    if config.size not in SIZES:
        raise ValueError(f"--size {config.size!r}: sizes are {list(SIZES)}")
    if not config.flops_budget > 0:
        raise ValueError(f"--flops-budget {config.flops_budget}: give a positive number")
    out_dir = Path(config.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    log(f"[1/5] data: {config.documents:,} scene-world documents as raw shards")
    raw_dir, raw_record = raw_shards(config, out_dir, log)
    texts, images, kinds = read_documents(raw_dir, config.tokenizer_images)
    raw_record["kinds"] = kinds

    log(f"[2/5] image tokenizers ({config.vq_preset}, {config.kl_preset}) on {len(images):,} training images")
    held_out = held_out_pixels(config)
    vq_dir, vq_record = image_tokenizer(config, out_dir, "tokenizer", config.vq_preset, config.tokenizer_steps,
                                        config.tokenizer_minutes, images, held_out, raw_record["key"], log)
    kl_dir, kl_record = image_tokenizer(config, out_dir, "tokenizer_kl", config.kl_preset, int(vq_record["steps"]),
                                        None, images, held_out, raw_record["key"], log)
    del images
    if vq_record["grid"] != kl_record["grid"]:
        raise ValueError(f"{config.vq_preset} makes a {vq_record['grid']} grid but {config.kl_preset} "
                         f"{kl_record['grid']}: the arms would see images of different lengths")

    log("[3/5] vocabulary and token shards (VQ codes and KL latents of the same documents)")
    from tokenizer.image.config import ImageTokenizerConfig

    codes = ImageTokenizerConfig.from_preset(config.vq_preset, **config.tokenizer_overrides).codebook_size
    vocab_path, vocab_record = build_vocab(config, out_dir, texts, codes, raw_record["key"], log)
    shards = {"chameleon": token_shards(config, raw_dir, out_dir / "shards" / "tokens", vocab_path, vq_dir),
              "transfusion": token_shards(config, raw_dir, out_dir / "shards" / "latents", vocab_path, kl_dir)}
    ctx = _Context(config, out_dir, vocab_path, {"chameleon": vq_dir, "transfusion": kl_dir}, shards, log)

    positions = positions_per_step(shards["chameleon"], config)
    flops_per_token = {arm: float(arm_family(config, arm, vocab_path, shards[ARMS[arm][0]])
                                  .flops_per_token(config.seq_len)) for arm in config.arms}
    steps = plan_steps(config, flops_per_token, positions)
    log(f"[4/5] training at {config.flops_budget:.3g} FLOPs each ({positions:.0f} decoder positions per step): "
        + ", ".join(f"{arm} {steps[arm]} steps" for arm in config.arms))
    runs: dict[str, dict] = {}
    for arm in config.arms:
        trained = train_arm(ctx, arm, steps[arm])
        log(f"  {arm}: scoring on the scenes suite")
        results = score_arm(ctx, arm, trained)
        runs[arm] = {**{k: v for k, v in trained.items() if k not in ("options",)},
                     "planned_steps": steps[arm], "planned_flops_per_token": flops_per_token[arm], "eval_seconds": results.get("seconds"),
                     "eval_dir": str(out_dir / arm / "eval"), "figures": results["figures"]}
        summary = runs[arm]["figures"]
        log(f"  {arm}: {trained['steps']} steps, {runs[arm]['flops']:.3g} FLOPs, generation score "
            f"{_pct(summary.get('generation_score'))}, understanding "
            f"{_pct((summary.get('understanding') or {}).get('overall'))}, text loss "
            f"{_num(summary.get('text_loss'), '.3f')}")
        record = summarize(config, runs, raw_record, vq_record, kl_record, vocab_record, positions, start, False)
        atomic_write_json(out_dir / "results.json", record)  # partial results survive an interrupted run

    log("[5/5] results")
    record = summarize(config, runs, raw_record, vq_record, kl_record, vocab_record, positions, start, True)
    record["plots"] = write_plots(record, out_dir / "plots")
    atomic_write_json(out_dir / "results.json", record)
    atomic_write_text(out_dir / "results.md", results_markdown(record))
    log(results_markdown(record))
    log(f"results: {out_dir / 'results.md'} ({record['minutes']:.1f} minutes)")
    return record


def summarize(config: CompositionalConfig, runs: dict[str, dict], raw: dict, vq: dict, kl: dict, vocab: dict,
              positions: float, start: float, complete: bool) -> dict:
    """The results record: settings, every stage's record, every arm, the FLOPs spread."""
    flops = [r["flops"] for r in runs.values()]
    return {"config": dataclasses.asdict(config), "arms": runs, "data": raw, "tokenizers": {"vq": vq, "kl": kl},
            "vocab": vocab, "positions_per_step": positions,
            "flops_spread": (max(flops) / min(flops) - 1) if flops else None,
            "complete": complete, "minutes": (time.perf_counter() - start) / 60,
            "threads": torch.get_num_threads(), "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}


# ---------------------------------------------------------------- outputs


def _pct(value: float | None) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.1%}"


def _num(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None or not np.isfinite(value) else format(value, spec)


def skills_of(record: dict) -> list[str]:
    """Every skill any arm was scored on, in the suite's order."""
    seen: list[str] = []
    for r in record["arms"].values():
        for skill in (r["figures"].get("generation") or {}):
            if skill not in seen:
                seen.append(skill)
    return seen


def results_markdown(record: dict, plot: str = "plots/skills.png") -> str:
    """The results as Markdown: generation per skill and arm with the ceilings, then one row per arm."""
    arms = record["arms"]
    names = list(arms)
    lines = ["| skill | caption-blind floor | " + " | ".join(f"{a}: accuracy (ceiling: truth / recon.)" for a in names)
             + " |", "|---" * (len(names) + 2) + "|"]
    for skill in skills_of(record):
        cells = []
        ranked_any = False
        for a in names:
            s = (arms[a]["figures"].get("generation") or {}).get(skill)
            if s is None:
                cells.append("-")
                continue
            ranked_any |= bool(s.get("ranked"))
            mark = "" if s.get("ranked") else " (unranked)"
            cells.append(f"{_pct(s.get('accuracy'))} ({_pct(s.get('ceiling_ground_truth'))} / "
                         f"{_pct(s.get('ceiling_reconstruction'))}){mark}")
        floors = [(arms[a]["figures"].get("generation") or {}).get(skill, {}).get("floor_caption_blind") for a in names]
        floor = next((f for f in floors if f is not None), None)  # the same draw for every arm (the suite's seed)
        lines.append(f"| {skill}{' *' if ranked_any else ''} | {_pct(floor)} | " + " | ".join(cells) + " |")
    lines.append("| **generation score** (ranked skills) | | "
                 + " | ".join(_pct(arms[a]["figures"].get("generation_score")) for a in names) + " |")
    from data_shards.scenes import QUESTION_KINDS

    # the kinds some arm was asked about (a run with no understanding items has none)
    kinds = [k for k in QUESTION_KINDS
             if any(isinstance((r["figures"].get("understanding") or {}).get(k), float) for r in arms.values())]
    lines += ["", "| arm | family / block | steps | training FLOPs | train s | s/step | generation score | "
              "understanding | " + "".join(f"{k} | " for k in kinds) + "text loss | FD (real / recon.) | "
              "diversity (real) |", "|---" * (10 + len(kinds)) + "|"]
    for a in names:
        r, f = arms[a], arms[a]["figures"]
        under = f.get("understanding") or {}
        dist = f.get("distribution") or {}
        lines.append(
            f"| {a} | {r['family']} / {r['block']} | {r['steps']} | {r['flops']:.3g} | {r['seconds']:.0f} | "
            f"{_num(r.get('step_seconds'), '.3f')} | {_pct(f.get('generation_score'))} | {_pct(under.get('overall'))} | "
            + "".join(f"{_pct(under.get(k)) if isinstance(under.get(k), float) else 'n/a'} | " for k in kinds)
            + f"{_num(f.get('text_loss'), '.3f')} | {_num(dist.get('frechet_distance'))} "
            f"({_num(dist.get('frechet_real'))} / {_num(dist.get('frechet_reconstruction'))}) | "
            f"{_num(dist.get('diversity'))} ({_num(dist.get('diversity_real'))}) |")
    config, tok = record["config"], record["tokenizers"]
    spread = record.get("flops_spread")
    lines += ["", f"Budget {config['flops_budget']:.3g} training FLOPs per arm (the family's flops_per_token(seq_len) "
              f"x decoder positions trained; {record['positions_per_step']:.0f} positions per step of "
              f"{config['batch_size']} x {config['seq_len']}); the arms' FLOPs differ by at most "
              f"{_pct(spread)}. Decoder size {config['size']}. Tokenizers: {config['vq_preset']} "
              f"{tok['vq']['steps']} steps, held-out PSNR {_num(tok['vq'].get('psnr_db'))} dB; {config['kl_preset']} "
              f"{tok['kl']['steps']} steps, {_num(tok['kl'].get('psnr_db'))} dB. Vocabulary "
              f"{record['vocab']['vocab_size']} ids. {record['data']['documents']:,} training documents "
              f"({', '.join(f'{k} {v:,}' for k, v in sorted(record['data'].get('kinds', {}).items()))}).",
              "", "Accuracy: the fraction of generated images the scene checker reads as satisfying the held-out "
              "caption; ceilings: the checker on the captions' ground-truth scenes and on their round trip through "
              "the arm's image tokenizer; caption-blind floor: scenes of random training captions checked against "
              "the caption asked for; `*`: ranked skills (reconstruction ceiling high enough to rank models). "
              f"Eval: {config['prompts_per_skill']} prompts x {config['samples_per_prompt']} samples per skill, "
              f"cfg {config['cfg_scale']}, {config['denoising_steps']} DDIM steps (transfusion), "
              f"{config['understanding_items']} questions, {config['text_documents']} text documents, seed "
              f"{config['seed']}. This invocation: {record['minutes']:.1f} minutes on {record['threads']} thread(s) "
              "(stages it reused not counted).",
              "", f"![accuracy per skill]({plot})"]
    return "\n".join(lines) + "\n"


def write_plots(record: dict, folder: Path) -> list[str]:
    """Grouped bars: accuracy per skill, one bar per arm, each with its reconstruction ceiling as a tick."""
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    skills, arms = skills_of(record), list(record["arms"])
    colours = {"chameleon": "tab:blue", "mot": "tab:green", "transfusion": "tab:red"}
    width = 0.8 / max(len(arms), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(skills) + 2), 4), dpi=110)
    x = np.arange(len(skills))
    for i, arm in enumerate(arms):
        generation = record["arms"][arm]["figures"].get("generation") or {}
        values = [(generation.get(s) or {}).get("accuracy") or 0.0 for s in skills]
        ceilings = [(generation.get(s) or {}).get("ceiling_reconstruction") for s in skills]
        positions = x - 0.4 + width * (i + 0.5)
        ax.bar(positions, values, width, label=arm, color=colours.get(arm))
        for p, c in zip(positions, ceilings):
            if c is not None:
                ax.plot([p - width / 2, p + width / 2], [c, c], color="black", linewidth=1)
    ranked = {s for r in record["arms"].values() for s, v in (r["figures"].get("generation") or {}).items()
              if v.get("ranked")}
    ax.set_xticks(x, [f"{s}{' *' if s in ranked else ''}" for s in skills], rotation=20, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("generation accuracy (scene checker)")
    ax.set_title("equal training FLOPs; black ticks: reconstruction ceiling; *: ranked", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = folder / "skills.png"
    fig.savefig(path)
    plt.close(fig)
    return [str(path)]


def _seeds_sentence(records: list[dict]) -> str:
    """How many seeds each budget of the rendered runs has, in words."""
    seeds: dict[float, list[int]] = {}
    for record in records:
        seeds.setdefault(record["config"]["flops_budget"], []).append(record["config"]["seed"])
    return ("Seeds (each one the whole pipeline: documents, tokenizers, decoders, sampling; the held-out captions "
            "are split seed 0's in every run): ") + "; ".join(
        f"{budget:.3g} FLOPs: {', '.join(str(s) for s in sorted(values))}" for budget, values in seeds.items()) + "."


def seeds_table(records: list[dict]) -> list[str]:
    """Markdown lines comparing the seeds of each budget that has several: each arm's generation score,
    understanding and held-out text loss per seed, and their mean and spread (max - min)."""
    by_budget: dict[float, list[dict]] = {}
    for record in records:
        by_budget.setdefault(record["config"]["flops_budget"], []).append(record)
    lines: list[str] = []
    for budget, runs in by_budget.items():
        if len(runs) < 2:
            continue
        runs = sorted(runs, key=lambda r: r["config"]["seed"])
        seeds = [r["config"]["seed"] for r in runs]
        lines += [f"## Seeds at {budget:.3g} training FLOPs per arm", "",
                  "| arm | figure | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | spread (max - min) |",
                  "|---" * (len(seeds) + 4) + "|"]
        arms = [a for a in runs[0]["arms"] if all(a in r["arms"] for r in runs)]
        for arm in arms:
            for label, key, fmt in (("generation score", "generation_score", _pct),
                                    ("understanding", "understanding", _pct),
                                    ("held-out text loss", "text_loss", lambda v: _num(v, ".3f"))):
                values = [r["arms"][arm]["figures"]["summary"].get(key) for r in runs]
                known = [v for v in values if v is not None]
                mean = sum(known) / len(known) if known else None
                spread = max(known) - min(known) if known else None
                lines.append(f"| {arm} | {label} | " + " | ".join(fmt(v) for v in values)
                             + f" | {fmt(mean)} | {fmt(spread) if key == 'text_loss' else _pct(spread)} |")
        lines.append("")
    return lines


READING_MARK = "## Reading"  # the doc's hand-written section from here on: kept when the tables are rendered again


def render_doc(results: str | Path | list[str | Path], doc: str | Path = DOC) -> Path:
    """docs/results/compositional.md from finished `results.json` files (one section per run, e.g. per budget; each
    run's plot copied beside the doc). A `## Reading` section already in the doc is kept below the tables."""
    paths = [Path(r) for r in (results if isinstance(results, list) else [results])]
    doc = Path(doc)
    records = []
    for path in paths:
        record = json.loads(path.read_text())
        if not record.get("complete"):
            raise ValueError(f"{path} is not a finished run (complete is false): rerun with --reuse to finish it")
        if record["config"].get("smoke") and doc.resolve() == DOC.resolve():
            raise ValueError(f"{path} is a --smoke run: its figures do not belong in {DOC.relative_to(REPO_ROOT)} "
                             "(pass --doc PATH to render it elsewhere)")
        records.append((path, record))
    reading = ""
    if doc.is_file() and READING_MARK in doc.read_text():
        reading = doc.read_text()[doc.read_text().index(READING_MARK):]
    doc.parent.mkdir(parents=True, exist_ok=True)
    config = records[0][1]["config"]
    outs = " ".join(f"--out {r['config']['out_dir']}" if k == 0 else f"--also {r['config']['out_dir']}"
                    for k, (_, r) in enumerate(records))
    lines = ["# Compositional generation on the scene world: Chameleon vs MoT vs Transfusion at equal FLOPs", "",
             "`python train.py experiment compositional` (experiments/compositional.py): three decoder designs at the "
             f"demo's size ({config['size']}) trained on the synthetic scene world (`data_shards.scenes`: 64-px "
             "scenes of coloured shapes, captions of GenEval's six skills with held-out caption combinations, "
             "questions, a few edit documents) for the same training FLOPs, each scored by `train.py eval --suite "
             "scenes` (`evaluation.scenes`: a rule-based scene checker, so generation accuracy is exact; "
             "[docs/evaluation.md](../evaluation.md)). `chameleon` and `mot` read VQ codes (the same token shards); "
             "`transfusion` reads continuous latents of the same documents, written by a KL tokenizer trained for "
             f"the VQ tokenizer's steps. {_seeds_sentence([r for _, r in records])}", "",
             "Rerun: " + "; ".join(f"`python train.py experiment compositional --flops-budget "
                                   f"{r['config']['flops_budget']:.3g}"
                                   + (f" --seed {r['config']['seed']}" if r["config"]["seed"] else "")
                                   + f" --out {r['config']['out_dir']}`" for _, r in records)
             + f"; then `python train.py experiment compositional --render-doc {outs}` (the tables below; the reading "
             "at the end is written by hand and kept).", ""]
    for k, (path, record) in enumerate(records):
        plot = path.parent / "plots" / "skills.png"
        name = DOC_PLOT if k == 0 else DOC_PLOT.replace(".png", f"_{k + 1}.png")
        if plot.is_file():
            shutil.copyfile(plot, doc.parent / name)
        lines += [f"## Budget {record['config']['flops_budget']:.3g} training FLOPs per arm, seed "
                  f"{record['config']['seed']} ({record['config']['out_dir']})", "", results_markdown(record, plot=name)]
    lines += seeds_table([r for _, r in records])
    atomic_write_text(doc, "\n".join(lines) + ("\n" + reading if reading else ""))
    return doc


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The `train.py experiment compositional` options."""
    defaults = CompositionalConfig()
    parser = argparse.ArgumentParser(prog="train.py experiment compositional", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="a few hundred documents, tiny tokenizers and decoder, a few steps (seconds per stage)")
    parser.add_argument("--out", default=None, help=f"output folder (default: {defaults.out_dir})")
    parser.add_argument("--reuse", action="store_true",
                        help="keep stages and runs already finished with the same settings (resume)")
    parser.add_argument("--threads", default="auto", help="torch threads: auto = the cores other processes leave idle")
    parser.add_argument("--render-doc", action="store_true",
                        help=f"only write {DOC.relative_to(REPO_ROOT)} (or --doc) from <out>/results.json")
    parser.add_argument("--doc", default=str(DOC), help="where --render-doc writes (its plot goes beside it)")
    parser.add_argument("--also", action="append", default=[], metavar="OUT",
                        help="with --render-doc: another finished run's folder (e.g. another budget), one section each")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=None,
                        help=f"default: {' '.join(defaults.arms)}")
    parser.add_argument("--size", choices=list(SIZES), default=None, help=f"decoder size (default: {defaults.size})")
    parser.add_argument("--flops-budget", type=float, default=None,
                        help=f"training FLOPs of every arm (default: {defaults.flops_budget:.3g})")
    parser.add_argument("--tokenizer-minutes", type=float, default=None,
                        help=f"the VQ tokenizer's time cap (default: {defaults.tokenizer_minutes})")
    parser.add_argument("--cfg-scale", type=float, default=None, help=f"default: {defaults.cfg_scale}")
    for name in ("seed", "documents", "tokenizer_steps", "text_tokens", "samples_per_prompt", "prompts_per_skill",
                 "understanding_items", "text_documents", "denoising_steps"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default: {getattr(defaults, name)}")
    return parser


NAMED = ("seed", "documents", "tokenizer_steps", "tokenizer_minutes", "text_tokens", "samples_per_prompt",
         "prompts_per_skill", "understanding_items", "text_documents", "denoising_steps", "cfg_scale", "size",
         "flops_budget")


def config_from_args(args: argparse.Namespace) -> CompositionalConfig:
    """The full run's or the smoke mode's settings, with the options given replacing theirs."""
    base = smoke_config() if args.smoke else CompositionalConfig()
    given = {"out_dir": args.out, "reuse": args.reuse or None, "arms": tuple(args.arms) if args.arms else None,
             **{name: getattr(args, name) for name in NAMED}}
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python train.py experiment compositional`."""
    import sys

    from experiments.demo.stages import run_experiment_command

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--render-doc" in argv[1:]:
        args = build_parser().parse_args(argv[1:])
        config = config_from_args(args)
        runs = [config.out_dir, *args.also]
        print(f"wrote {render_doc([Path(out) / 'results.json' for out in runs], args.doc)}")
        return 0
    return run_experiment_command("compositional", argv, build_parser, config_from_args, run)
