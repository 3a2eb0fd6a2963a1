"""`python train.py experiment video`: Emu3-style video tokens in an early-fusion decoder, offline (issue #32).

Seeded synthetic clips (the clip world, evaluation.clip_world: 4 colours x 3 shapes moving left/right/up/down, 8
frames of 32x32, captions such as "a red square moving left"), with held-out clips of the trained caption triples and
clips of triples no training clip shows. Per run:
1. the video tokenizer (configs/tokenizer/video-demo-32.yaml: 8 frames -> 2 x 8 x 8 = 128 codes) is trained on
   the training clips through `train.py tokenizer fit`, and a per-frame 2-D VQ (the project's ImageTokenizer,
   demo-64's layout at 32 px -> 4 x 4 codes, so 8 frames are the same 128 codes, the same codebook size, steps
   and pixels per step) through `fit_image_tokenizer`; both are scored by held-out per-frame PSNR against
   repeating the first frame;
2. `train.py vocab --video`, `train.py shards write --video-folder` and `shards tokenize` (captions always before
   their clip) turn the clips into documents; a second set of shards has the same clips with their captions
   shuffled among them (the same documents, lengths and steps: the equal-compute control);
3. `train.py fit --config configs/fusion/demo.yaml` trains one decoder on each for the same steps and seed;
4. each arm's checkpoint is scored by the `clips` evaluation suite (`evaluation.run.evaluate(checkpoint, "clips")`,
   what `train.py eval --suite clips` runs; the experiment samples and scores nothing itself): one clip per
   held-out caption sampled through the family's `generate` in video mode with the demo's temperature, top-k and
   guidance, read by the clip world's rule-based checker (colour, shape, direction from the centroid's motion),
   against chance, the shuffled-caption model and the ground-truth clips through the tokenizer (the ceiling); and
   the held-out loss per video token against a unigram of the training codes.
Writes `<out>/results.json`, `<out>/results.md`, `<out>/samples.png` (the tokenizers' reconstructions) and each
arm's `<out>/<arm>/eval/` (the suite's results.json, and index.html with every sampled clip). Needs no demo.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.files import atomic_write_json, atomic_write_text
from evaluation import clip_world
from experiments.demo.settings import REPO_ROOT
from experiments.demo.stages import run_experiment_command

if TYPE_CHECKING:
    from evaluation.base import EvalSettings
    from evaluation.clips import ClipOptions

VIDEO_TOKENIZER_CONFIG = REPO_ROOT / "configs" / "tokenizer" / "video-demo-32.yaml"
# Decoder sizes over the `demo` preset (d 128, 4 layers, 4 heads, FFN 384).
SIZES: dict[str, dict[str, int]] = {
    "demo": {},
    "d64": {"dim": 64, "n_layers": 2, "n_heads": 2, "ffn_dim": 192},
    "d32": {"dim": 32, "n_layers": 1, "n_heads": 1, "ffn_dim": 96},  # the smoke mode's: seconds per run
}
ARMS = ("captions", "shuffled")  # the decoder trained on true captions, and on captions shuffled among the clips
TEXT_IDS = 320  # the BPE's share of the vocabulary: 256 bytes and the merges of a dozen caption words


@dataclass
class VideoExperimentConfig:
    """The experiment's settings; defaults are the full run (about 15-20 minutes on 2 cores)."""

    out_dir: str = "runs/video"
    train_clips: int = 2000
    held_out_clips: int = 84  # new clips of the trained triples (2 per triple)
    novel_clips: int = 48  # clips of the held-out triples
    novel_triples: int = 6
    tokenizer_steps: int = 400  # the video tokenizer's and the per-frame VQ's optimizer steps
    tokenizer_batch: int = 8  # clips per step (the per-frame VQ: 8 x as many frames)
    size: str = "demo"
    steps: int = 600  # decoder optimizer steps of each arm
    seq_len: int = 288  # two caption + clip documents (about 140 ids each) per row
    batch_size: int = 8
    lr: float = 2.0e-3
    temperature: float = 0.7  # the demo's sampling settings (configs/demo/full.yaml)
    top_k: int = 50
    cfg_scale: float = 3.0
    seed: int = 0
    reuse: bool = False  # keep decoder runs already finished with the same settings (tokenizers and shards are remade)


def smoke_config(out_dir: str = "runs/video-smoke") -> VideoExperimentConfig:
    """The smoke mode: a few clips, a few steps of each model, a tiny decoder."""
    return VideoExperimentConfig(out_dir=out_dir, train_clips=64, held_out_clips=8, novel_clips=6, tokenizer_steps=3,
                                 tokenizer_batch=4, size="d32", steps=3, batch_size=2)


# ---------------------------------------------------------------- data on disk


def write_clip_folder(folder: Path, clips: np.ndarray, captions: list[str]) -> Path:
    """One `NNNNN.npy` clip (uint8 T x H x W x 3) and `NNNNN.txt` caption per clip: what `shards write
    --video-folder` and `tokenizer fit --data.source` read. Rewritten every time (cheap, deterministic)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for i, (clip, text) in enumerate(zip(clips, captions)):
        np.save(folder / f"{i:05d}.npy", clip, allow_pickle=False)
        (folder / f"{i:05d}.txt").write_text(text + "\n")
    return folder


def shuffled_captions(captions: list[str], seed: int) -> list[str]:
    """The same captions in a seeded random order: each clip keeps a caption, almost never its own."""
    order = np.random.default_rng(seed).permutation(len(captions))
    return [captions[i] for i in order]


# ---------------------------------------------------------------- tokenizers


def run_cli(argv: list[str]) -> None:
    """One `train.py ...` command in this process (the whole command table); a non-zero exit raises."""
    from experiments.commands import main

    code = main(argv)
    if code:
        raise RuntimeError(f"`python train.py {' '.join(argv)}` exited with {code}")


def train_video_tokenizer(config: VideoExperimentConfig, clip_dir: Path, folder: Path) -> Path:
    """`train.py tokenizer fit --config configs/tokenizer/video-demo-32.yaml` on the training clips for
    `tokenizer_steps`; returns its bundle (<folder>/tokenizer)."""
    if folder.exists():
        shutil.rmtree(folder)
    run_cli(["tokenizer", "fit", "--config", str(VIDEO_TOKENIZER_CONFIG), f"--data.source={clip_dir}",
             f"--data.batch_size={config.tokenizer_batch}", f"--trainer.max_steps={config.tokenizer_steps}",
             "--trainer.max_time=null", f"--trainer.default_root_dir={folder}", f"--seed_everything={config.seed}"])
    return folder / "tokenizer"


def frame_vq_overrides(codebook_size: int) -> dict:
    """demo-64's layout one level shorter: 32-px frames -> 4 x 4 codes of `codebook_size`."""
    return {"image_size": clip_world.SIZE, "channel_multiplier": (1, 2, 4, 8), "num_res_blocks": (0, 0, 1, 2),
            "decoder_res_blocks": (0, 0, 1, 2), "codebook_size": int(codebook_size)}


def train_frame_vq(config: VideoExperimentConfig, clips: np.ndarray, codebook_size: int, folder: Path):
    """The per-frame 2-D VQ baseline: every frame of the training clips, the video tokenizer's steps, 8 x its
    clips per step (the same pixels per step), the same codebook size."""
    from tokenizer.image.train import fit_image_tokenizer

    frames = clip_world.to_model_clips(clips).flatten(0, 1)
    tokenizer, info = fit_image_tokenizer(
        frames, preset="demo-64", batch_size=config.tokenizer_batch * clips.shape[1], max_steps=config.tokenizer_steps,
        max_minutes=None, seed=config.seed, progress=False, log_dir=folder / "logs",
        overrides=frame_vq_overrides(codebook_size))
    tokenizer.save_pretrained(folder / "model")
    return tokenizer.eval(), info


def frame_psnr(reconstructed: torch.Tensor, clips: torch.Tensor) -> np.ndarray:
    """PSNR (dB, pixels in [-1, 1]) of every frame: (N, T)."""
    mse = ((reconstructed.float().clamp(-1, 1) - clips.float()) ** 2).mean(dim=(2, 3, 4)).clamp_min(1e-10)
    return (10 * torch.log10(4.0 / mse)).numpy()


def path_psnr(reconstructed: torch.Tensor, clips: torch.Tensor) -> np.ndarray:
    """PSNR of every frame over the clip's path only (the pixels the shape covers in any frame; the black
    background elsewhere is easy for every method): (N, T)."""
    bright = clips.amax(dim=2, keepdim=True) > 2 * clip_world.FOREGROUND - 1  # (N, T, 1, H, W)
    path = bright.any(dim=1, keepdim=True).expand_as(clips).float()
    squared = (reconstructed.float().clamp(-1, 1) - clips.float()) ** 2 * path
    mse = (squared.sum(dim=(2, 3, 4)) / path.sum(dim=(2, 3, 4)).clamp_min(1)).clamp_min(1e-10)
    return (10 * torch.log10(4.0 / mse)).numpy()


def psnr_summary(values: np.ndarray) -> dict:
    """Mean per-frame PSNR, and its mean at each frame index."""
    return {"psnr_db": float(values.mean()), "per_frame_index_db": [float(v) for v in values.mean(axis=0)]}


@torch.no_grad()
def reconstructions(video_tokenizer, frame_vq, clips: torch.Tensor, batch: int = 64) -> dict[str, torch.Tensor]:
    """Held-out clips through each tokenizer, and the repeat-the-first-frame baseline."""
    video, per_frame = [], []
    for start in range(0, len(clips), batch):
        chunk = clips[start:start + batch]
        video.append(video_tokenizer.decode_clips(video_tokenizer.encode_clips(chunk)).float())
        frames = chunk.flatten(0, 1)
        per_frame.append(frame_vq.decode(frame_vq.encode(frames)).float().view_as(chunk))
    return {"video_tokenizer": torch.cat(video), "frame_vq": torch.cat(per_frame),
            "repeat_first_frame": clips[:, :1].expand_as(clips).clone()}


def codes_per_clip(video_tokenizer, frame_vq, frames: int) -> dict[str, int]:
    """Codes one clip costs with each tokenizer."""
    t, h, w = video_tokenizer.video_grid
    fh, fw = frame_vq.grid_shape
    return {"video_tokenizer": int(t * h * w), "frame_vq": int(frames * fh * fw)}


# ---------------------------------------------------------------- vocabulary and shards


def build_vocab(config: VideoExperimentConfig, bundle: Path, folder: Path, codebook_size: int) -> Path:
    """`train.py vocab --video`: a BPE of TEXT_IDS ids on every caption, the codebook, the video markers."""
    corpus = folder / "captions.txt"
    folder.mkdir(parents=True, exist_ok=True)
    texts = sorted({clip_world.caption(*t) for t in clip_world.all_triples()})
    corpus.write_text("\n".join(texts * 4) + "\n")
    from tokenizer.vocab import DEFAULT_NUM_SPECIALS

    out = folder / "tokenizer.json"
    run_cli(["vocab", "--out", str(out), "--corpus", str(corpus), "--image-tokenizer", str(bundle), "--video",
             "--vocab-size", str(DEFAULT_NUM_SPECIALS + codebook_size + TEXT_IDS), "--min-frequency", "1",
             "--no-progress"])
    return out


def write_shards(clip_dir: Path, folder: Path, vocab: Path, bundle: Path, seed: int) -> Path:
    """`train.py shards write --video-folder` then `shards tokenize` (captions always before their clip: flip
    probability 0); returns the token shards' folder."""
    for sub in ("raw", "tokens"):
        if (folder / sub).exists():
            shutil.rmtree(folder / sub)
    run_cli(["shards", "write", "--out", str(folder / "raw"), "--video-folder", str(clip_dir)])
    run_cli(["shards", "tokenize", str(folder / "raw"), "--out", str(folder / "tokens"), "--vocab", str(vocab),
             "--image-tokenizer", str(bundle), "--flip-probability", "0", "--seed", str(seed), "--workers", "1",
             "--no-progress"])
    return folder / "tokens"


# ---------------------------------------------------------------- each arm: trained, then scored by the suite


@dataclass
class _Context:
    """What both arms share."""

    config: VideoExperimentConfig
    out_dir: Path
    vocab: Path  # tokenizer.json
    media_tokenizer: Path  # the video tokenizer bundle the shards were made with
    log: Callable[[str], None]


def eval_settings(config: VideoExperimentConfig) -> EvalSettings:
    """The `clips` suite's sampling settings: the demo's temperature, top-k and guidance, 32 prompts a batch (with
    the seed, what fixes every batch's sampling seed)."""
    from evaluation.base import EvalSettings

    return EvalSettings(seed=config.seed, temperature=config.temperature, top_k=config.top_k,
                        cfg_scale=config.cfg_scale, batch_size=32)


def clip_options(config: VideoExperimentConfig) -> ClipOptions:
    """The `clips` suite's options: the split this run trained on."""
    from evaluation.clips import ClipOptions

    return ClipOptions(split_seed=config.seed, train_clips=config.train_clips, held_out_clips=config.held_out_clips,
                       novel_clips=config.novel_clips, novel_triples=config.novel_triples)


def score_arm(ctx: _Context, checkpoint: str, out: Path) -> dict:
    """The `clips` suite's figures of one arm's checkpoint (its results.json and index.html under `out`)."""
    from evaluation.run import evaluate

    results = evaluate(checkpoint, "clips", vocab=ctx.vocab, media_tokenizer=ctx.media_tokenizer, out=out,
                       settings=eval_settings(ctx.config), options=clip_options(ctx.config),
                       progress=lambda message: None)
    return results["figures"]


def train_and_score(ctx: _Context, arm: str, train_dir: Path) -> dict:
    """Train one decoder (or reuse a finished one) and score it."""
    from experiments.fusion import fit

    config = ctx.config
    extra = [f"--model.config.{key}={value}" for key, value in SIZES[config.size].items()]
    extra += [f"--data.seq_len={config.seq_len}", f"--model.config.max_seq_len={config.seq_len}",
              f"--data.batch_size={config.batch_size}", f"--model.lr={config.lr}",
              f"--model.warmup_steps={max(1, min(50, config.steps // 10))}", "--model.config.dropout=0.0",
              f"--trainer.log_every_n_steps={max(1, min(10, config.steps))}"]
    folder = ctx.out_dir / arm
    saved = folder / "record.json"
    record = None
    if config.reuse and saved.is_file():
        previous = json.loads(saved.read_text())
        if (previous["extra"] == extra and previous["steps"] == config.steps
                and Path(previous["last_checkpoint"]).is_file()):
            ctx.log(f"  {arm}: reusing the finished run")
            record = previous
    if record is None:
        module, trained = fit(arm, ctx.out_dir, ctx.out_dir, train_dir, config.steps, config.seed, extra, ctx.log)
        parameters = sum(p.numel() for part in module.parts.values() for p in part.parameters())
        del module
        record = {**trained, "arm": arm, "size": config.size, "extra": extra, "parameters": parameters}
    if "suite" not in record:  # trained just now, or reused from a run scored before the suite existed
        start = time.perf_counter()
        figures = score_arm(ctx, record["last_checkpoint"], folder / "eval")
        for name in ("held_out", "novel"):
            record[f"generation_{name}"] = figures["generation"][name]
            record[f"video_loss_{name}"] = figures["video_loss"][name]
        record["suite"] = figures  # every figure of the suite (its results.json and page: <arm>/eval/)
        record["sampling_seconds"] = time.perf_counter() - start
        atomic_write_json(saved, record)
    g, n = record["generation_held_out"], record["generation_novel"] or {}
    ctx.log(f"  {arm}: held-out captions colour/shape/direction {_pct(g, 'colour')}/{_pct(g, 'shape')}/"
            f"{_pct(g, 'direction')}, held-out triples {_pct(n, 'colour')}/{_pct(n, 'shape')}/"
            f"{_pct(n, 'direction')}; loss per video token {record['video_loss_held_out']:.3f}")
    return record


def run(config: VideoExperimentConfig, log: Callable[[str], None] = print) -> dict:
    """The whole experiment; returns (and writes) the results."""
    from tokenizer.bundle import load_media_tokenizer

    if config.size not in SIZES:
        raise ValueError(f"unknown size {config.size!r}; sizes are {list(SIZES)}")
    if min(config.steps, config.tokenizer_steps, config.train_clips) < 1:
        raise ValueError("--steps, --tokenizer-steps and --train-clips must be positive")
    out_dir = Path(config.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        seconds[name] = time.perf_counter() - since
        return time.perf_counter()

    log("[1/6] synthetic clips (seeded)")
    split = clip_world.make_split(config.train_clips, config.held_out_clips, config.novel_clips,
                                  config.novel_triples, config.seed)
    clip_root = out_dir / "clips"
    train_dir = write_clip_folder(clip_root / "train", split.train.clips, split.train.captions)
    shuffled_dir = write_clip_folder(clip_root / "train_shuffled", split.train.clips,
                                     shuffled_captions(split.train.captions, config.seed + 7))
    t = lap("data", start)

    log("[2/6] tokenizers: video (train.py tokenizer fit) and per-frame 2-D VQ at the same codes per clip")
    bundle = train_video_tokenizer(config, train_dir, out_dir / "tokenizer_run")
    video_tokenizer = load_media_tokenizer(bundle).eval()
    # fusion_experiment.fit reads the vocabulary and tokenizer at the demo's places: <out>/vocab, <out>/tokenizer
    if (out_dir / "tokenizer" / "model").exists():
        shutil.rmtree(out_dir / "tokenizer" / "model")
    shutil.copytree(bundle, out_dir / "tokenizer" / "model")
    codebook = int(video_tokenizer.config.codebook_size)
    frame_vq, frame_info = train_frame_vq(config, split.train.clips, codebook, out_dir / "frame_vq")
    t = lap("tokenizers", t)
    held = clip_world.to_model_clips(np.concatenate([split.held_out.clips, split.novel.clips]))
    recon = reconstructions(video_tokenizer, frame_vq, held)
    reconstruction = {name: {**psnr_summary(frame_psnr(x, held)),
                             "path_psnr_db": float(path_psnr(x, held).mean())} for name, x in recon.items()}
    reconstruction["codes_per_clip"] = codes_per_clip(video_tokenizer, frame_vq, split.train.clips.shape[1])
    reconstruction["codebook_size"] = codebook
    n_held = len(split.held_out)
    # the checker on the other reconstructions (the video tokenizer's is the suite's ceiling, read per arm)
    baselines = {f"{name}_held_out": clip_world.score(clip_world.check_clips(recon[name][:n_held]),
                                                      split.held_out.specs)
                 for name in ("frame_vq", "repeat_first_frame")}
    log(f"  held-out per-frame PSNR: video tokenizer {reconstruction['video_tokenizer']['psnr_db']:.2f} dB, "
        f"per-frame VQ {reconstruction['frame_vq']['psnr_db']:.2f} dB, repeat the first frame "
        f"{reconstruction['repeat_first_frame']['psnr_db']:.2f} dB")
    t = lap("reconstruction", t)

    log("[3/6] vocabulary (train.py vocab --video) and shards (shards write --video-folder, shards tokenize)")
    vocab_path = build_vocab(config, bundle, out_dir / "vocab", codebook)
    shards = {"captions": write_shards(train_dir, out_dir / "shards", vocab_path, bundle, config.seed),
              "shuffled": write_shards(shuffled_dir, out_dir / "shards_shuffled", vocab_path, bundle, config.seed)}
    t = lap("vocab_and_shards", t)

    log(f"[4/6] decoders (train.py fit, configs/fusion/demo.yaml, size {config.size}, {config.steps} steps each), "
        "each scored by the clips suite")
    ctx = _Context(config, out_dir, vocab_path, out_dir / "tokenizer" / "model", log)
    runs = {arm: train_and_score(ctx, arm, shards[arm]) for arm in ARMS}
    t = lap("decoders", t)
    # what does not depend on the arm (the split, the checker, the tokenizer), from the first arm's suite figures
    shared = runs[ARMS[0]]["suite"]

    log("[5/6] figure")
    record = {"config": dataclasses.asdict(config), "out_dir": str(out_dir), "split": {
        "train_clips": len(split.train), "held_out_clips": len(split.held_out), "novel_clips": len(split.novel),
        "novel_triples": [" ".join(x) for x in split.novel_triples]},
        "reconstruction": reconstruction, "frame_vq": {k: v for k, v in frame_info.items()
                                                       if isinstance(v, (int, float, str))},
        "checker_ground_truth": shared["checker_ground_truth"], "ceiling": {**shared["ceiling"], **baselines},
        "chance": shared["chance"], "unigram_loss": shared["unigram_loss"], "runs": runs, "seconds": seconds, "threads": torch.get_num_threads()}
    record["figure"] = write_figure(out_dir, split, recon, n_held)
    lap("figure", t)
    record["minutes"] = (time.perf_counter() - start) / 60
    record["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    log("[6/6] results")
    atomic_write_json(out_dir / "results.json", record)
    atomic_write_text(out_dir / "results.md", results_markdown(record))
    log(results_markdown(record))
    log(f"results: {out_dir / 'results.md'} ({record['minutes']:.1f} minutes)")
    return record


# ---------------------------------------------------------------- outputs


def write_figure(out_dir: Path, split: clip_world.VideoSplit, recon: dict[str, torch.Tensor], n_held: int,
                 shown: int = 4) -> str:
    """`samples.png`: frame strips of held-out clips (ground truth, video tokenizer, per-frame VQ, first frame
    repeated). Each arm's samples, with what the checker read, are on its suite page (`<arm>/eval/index.html`)."""
    from PIL import Image, ImageDraw

    from tokenizer.video.clips import frame_strip

    rows: list[tuple[str, np.ndarray]] = []
    for i in range(min(shown, n_held)):
        rows.append((f"truth: {split.held_out.captions[i]}", split.held_out.clips[i]))
        for name in ("video_tokenizer", "frame_vq", "repeat_first_frame"):
            rows.append((f"  {name}", clip_world.to_uint8_clips(recon[name][i:i + 1])[0]))
    strips = [frame_strip(frames) for _, frames in rows]
    label_width, scale = 260, 2
    width = label_width + max(s.width for s in strips) * scale
    height = sum(s.height * scale + 4 for s in strips)
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    y = 0
    for (label, _), strip in zip(rows, strips):
        canvas.paste(strip.resize((strip.width * scale, strip.height * scale), Image.NEAREST), (label_width, y))
        draw.text((4, y + strip.height * scale // 2 - 6), label[:40], fill="black")
        y += strip.height * scale + 4
    path = out_dir / "samples.png"
    canvas.save(path)
    return str(path)


def _pct(scores: dict | None, key: str) -> str:
    value = (scores or {}).get(key)
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.1%}"


def _nats(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def results_markdown(record: dict) -> str:
    """The results as Markdown tables: reconstruction, generation against its references, loss per video token."""
    rec, runs = record["reconstruction"], record["runs"]
    cpc = rec["codes_per_clip"]
    lines = ["| reconstruction (held-out clips) | codes per clip | per-frame PSNR (dB) | on the shape's path (dB) | "
             "by frame index (dB) |", "|---|---|---|---|---|"]
    for name, label in (("video_tokenizer", "video tokenizer"), ("frame_vq", "per-frame 2-D VQ"),
                        ("repeat_first_frame", "repeat the first frame (exact)")):
        lines.append(f"| {label} | {cpc.get(name, '-')} | {rec[name]['psnr_db']:.2f} | {rec[name]['path_psnr_db']:.2f} | "
                     f"{' / '.join(f'{v:.1f}' for v in rec[name]['per_frame_index_db'])} |")
    lines.append("")
    lines += ["| generation (checker accuracy) | captions | colour | shape | direction | all three | incomplete |",
              "|---|---|---|---|---|---|---|"]
    chance = record["chance"]
    for split_name, label in (("held_out", "held-out clips, trained triples"), ("novel", "held-out triples")):
        for arm in ARMS:
            g = runs[arm][f"generation_{split_name}"] or {}  # None: the split had no clips
            lines.append(f"| {arm} model, {label} | {g.get('count', 0)} | {_pct(g, 'colour')} | {_pct(g, 'shape')} | "
                         f"{_pct(g, 'direction')} | {_pct(g, 'all')} | {g.get('incomplete', '-')} |")
        c = record["ceiling"][split_name] or {}
        lines.append(f"| ceiling: ground truth through the video tokenizer, {label} | {c.get('count', 0)} | "
                     f"{_pct(c, 'colour')} | {_pct(c, 'shape')} | {_pct(c, 'direction')} | {_pct(c, 'all')} | - |")
    for key, label in (("frame_vq_held_out", "(per-frame VQ reconstructions, held-out clips)"),
                       ("repeat_first_frame_held_out", "(first frame repeated, held-out clips)")):
        c = record["ceiling"][key]
        lines.append(f"| {label} | {c['count']} | {_pct(c, 'colour')} | {_pct(c, 'shape')} | {_pct(c, 'direction')} | "
                     f"{_pct(c, 'all')} | - |")
    gt = record["checker_ground_truth"]["held_out"]
    lines += [f"| (ground truth, held-out clips) | {gt['count']} | {_pct(gt, 'colour')} | {_pct(gt, 'shape')} | "
              f"{_pct(gt, 'direction')} | {_pct(gt, 'all')} | - |",
              f"| chance | - | {chance['colour']:.0%} | {chance['shape']:.1%} | {chance['direction']:.0%} | "
              f"{chance['all']:.1%} | - |", ""]
    lines += ["| held-out loss per video token (nats) | held-out clips | held-out triples |", "|---|---|---|"]
    for arm in ARMS:
        lines.append(f"| {arm} model | {_nats(runs[arm]['video_loss_held_out'])} | "
                     f"{_nats(runs[arm]['video_loss_novel'])} |")
    unigram = record["unigram_loss"]
    lines.append(f"| unigram of the training codes | {_nats(unigram['held_out'])} | {_nats(unigram['novel'])} |")
    config = record["config"]
    arm = runs[ARMS[0]]
    lines += ["", f"{record['split']['train_clips']} training clips; held-out triples: "
              f"{', '.join(record['split']['novel_triples'])}. Tokenizers: {config['tokenizer_steps']} steps each, "
              f"codebook {rec['codebook_size']}. Decoders: size {config['size']} ({arm['parameters']:,} parameters), "
              f"{config['steps']} steps of {config['batch_size']} x {config['seq_len']} ids, the same seed and "
              f"documents for both arms (shuffled: the same clips, captions permuted). Sampling: temperature "
              f"{config['temperature']}, top-k {config['top_k']}, guidance {config['cfg_scale']}. "
              f"{record['minutes']:.1f} minutes on {record['threads']} thread(s). Generation and loss: the `clips` "
              f"suite on each arm's checkpoint ({', '.join(f'{a}/eval/' for a in ARMS)}: results.json, and "
              "index.html with every sampled clip).", "",
              "![held-out clips through each tokenizer](samples.png)"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The `train.py experiment video` options (the shared --smoke, --out, --reuse, --threads and its own)."""
    defaults = VideoExperimentConfig()
    parser = argparse.ArgumentParser(prog="train.py experiment video", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a few clips and steps, a tiny decoder (about a minute)")
    parser.add_argument("--out", default=None, help=f"output folder (default: {defaults.out_dir})")
    parser.add_argument("--size", choices=list(SIZES), default=None, help=f"decoder size (default: {defaults.size})")
    parser.add_argument("--reuse", action="store_true", help="keep decoder runs already finished with the same options")
    parser.add_argument("--threads", default="auto", help="torch threads: auto = the cores other processes leave idle")
    for name in ("train_clips", "held_out_clips", "novel_clips", "novel_triples", "tokenizer_steps",
                 "tokenizer_batch", "steps", "seq_len", "batch_size", "top_k", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default: {getattr(defaults, name)}")
    for name in ("lr", "temperature", "cfg_scale"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=None,
                            help=f"default: {getattr(defaults, name)}")
    return parser


def config_from_args(args: argparse.Namespace) -> VideoExperimentConfig:
    """The full run's or the smoke mode's settings, with the options given replacing theirs."""
    base = smoke_config() if args.smoke else VideoExperimentConfig()
    names = [f.name for f in dataclasses.fields(VideoExperimentConfig) if f.name not in ("out_dir", "reuse")]
    given = {"out_dir": args.out, "reuse": args.reuse or None,
             **{name: getattr(args, name, None) for name in names}}
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python train.py experiment video`."""
    return run_experiment_command("video", argv, build_parser, config_from_args, run)
