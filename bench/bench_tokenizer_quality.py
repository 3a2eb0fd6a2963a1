"""Image tokenizer quality at equal CPU time, side by side in one run: our preset (the real Lightning module and
data path), a plain VQ-VAE of equal parameter count, and mean-colour baselines, on the demo's digits and the
built-in photos. Held-out PSNR, codebook usage and steps done for each.

`python -m bench tokenizer_quality` uses the default budgets (3.5 CPU-minutes per model on digits, 15 on
photos); `python -m bench.bench_tokenizer_quality --digits-seconds 60 --photos-seconds 0` sets them (0 skips a task).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import nn
from torch.utils.data import DataLoader, Dataset

from bench.harness import resolve_results_dir, write_result
from common.files import atomic_write_text

NAME = "tokenizer_quality"
REPO_ROOT = Path(__file__).resolve().parents[1]
PHOTOS_CONFIG = REPO_ROOT / "configs" / "tokenizer" / "photos-64.yaml"
THREADS = 1  # every model trains on one torch thread, one after another, so each gets the same CPU
DEFAULT_SECONDS = {"digits": 210.0, "photos": 900.0}  # CPU seconds of training per model
SMOKE_SECONDS = 1.0
SMOKE_IMAGES = 64  # training and held-out images per task in smoke mode
PHOTO_HELD_OUT = 512  # docs/results/image_tokenizer.md's held-out crops
CODEBOOK_SIZE = 512
BASELINE_LR = 1e-3
BASELINE_EMBED_DIM = 64  # the VQ-VAE paper's code dimension
RESTART_BELOW = 0.03  # EMA hits per step under which a baseline code is restarted (~350 steps unused)


# ---------------------------------------------------------------- the plain VQ-VAE baseline


class ResidualBlock(nn.Module):
    """ReLU, 3x3 conv, ReLU, 1x1 conv, added to the input (the VQ-VAE paper's residual block)."""

    def __init__(self, channels: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.ReLU(), nn.Conv2d(channels, hidden, 3, padding=1), nn.ReLU(), nn.Conv2d(hidden, channels, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + f(x)."""
        return x + self.net(x)


class EMACodebook(nn.Module):
    """Nearest-neighbour (Euclidean) codebook updated by exponential moving averages (VQ-VAE paper, appendix),
    with a commitment loss and straight-through gradients."""

    def __init__(self, size: int, dim: int, decay: float = 0.99, beta: float = 0.25, eps: float = 1e-5,
                 data_init: bool = True, restart_below: float = RESTART_BELOW):
        super().__init__()
        self.size, self.decay, self.beta, self.eps = size, decay, beta, eps
        self.data_init, self.restart_below = data_init, restart_below
        embed = torch.randn(size, dim)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.zeros(size))
        self.register_buffer("embed_sum", embed.clone())
        self.register_buffer("initialised", torch.tensor(not data_init))

    @torch.no_grad()
    def _sample(self, flat: torch.Tensor, count: int) -> torch.Tensor:
        """`count` random rows of the batch (with replacement only when the batch is smaller)."""
        if len(flat) >= count:
            return flat[torch.randperm(len(flat), device=flat.device)[:count]].clone()
        return flat[torch.randint(len(flat), (count,), device=flat.device)].clone()

    def forward(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(quantized (B, D, h, w) with straight-through gradients, codes (B, h, w), commitment loss)."""
        b, d, h, w = latents.shape
        flat = latents.permute(0, 2, 3, 1).reshape(-1, d)
        if self.training and not bool(self.initialised):
            # random encoder outputs as the first codes: a N(0, 1) codebook far from the encoder's outputs
            # collapses onto one code (measured: 1 of 512 used after 60 s on digits)
            self.embed.copy_(self._sample(flat.detach(), self.size))
            self.embed_sum.copy_(self.embed)
            self.cluster_size.fill_(1.0)
            self.initialised.fill_(True)
        distances = (
            flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.embed.t() + self.embed.pow(2).sum(1)[None]
        )
        codes = distances.argmin(1)
        quantized = self.embed[codes]  # before the update: the codes this batch chose
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(codes, self.size).type_as(flat)
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_sum.mul_(self.decay).add_(onehot.t() @ flat, alpha=1 - self.decay)
                total = self.cluster_size.sum()
                # Laplace smoothing keeps unused codes from dividing by zero
                smoothed = (self.cluster_size + self.eps) / (total + self.size * self.eps) * total
                self.embed.copy_(self.embed_sum / smoothed[:, None])
                # random restarts (as in Jukebox): codes nobody picked for a while take a batch vector
                dead = self.cluster_size < self.restart_below
                if self.restart_below > 0 and bool(dead.any()):
                    fresh = self._sample(flat, int(dead.sum()))
                    self.embed[dead] = fresh
                    self.embed_sum[dead] = fresh
                    self.cluster_size[dead] = 1.0
        loss = self.beta * F.mse_loss(flat, quantized.detach())
        quantized = flat + (quantized - flat).detach()
        return quantized.reshape(b, h, w, d).permute(0, 3, 1, 2), codes.reshape(b, h, w), loss


class PlainVQVAE(nn.Module):
    """Textbook VQ-VAE: `downsamplings` stride-2 4x4 convs (4: 64 px -> 4x4 codes) and two residual blocks each way."""

    def __init__(self, width: int, embed_dim: int = BASELINE_EMBED_DIM, codebook_size: int = CODEBOOK_SIZE,
                 downsamplings: int = 4):
        super().__init__()
        if not 1 <= downsamplings <= 4:
            raise ValueError(f"PlainVQVAE: downsamplings must be 1..4, got {downsamplings}")
        widths = [width // 4, width // 2, width, width][4 - downsamplings:]  # narrowest at full resolution
        down: list[nn.Module] = []
        for w_in, w_out in zip([3, *widths[:-1]], widths):
            down += [nn.Conv2d(w_in, w_out, 4, 2, 1), nn.ReLU()]
        self.encoder = nn.Sequential(
            *down, nn.Conv2d(width, width, 3, padding=1),
            ResidualBlock(width, width), ResidualBlock(width, width), nn.ReLU(),
            nn.Conv2d(width, embed_dim, 1),
        )  # fmt: skip
        self.codebook = EMACodebook(codebook_size, embed_dim)
        up: list[nn.Module] = []
        for w_in, w_out in zip(reversed(widths), [*reversed(widths[:-1]), 3]):
            up += [nn.ConvTranspose2d(w_in, w_out, 4, 2, 1), nn.ReLU()]
        self.decoder = nn.Sequential(
            nn.Conv2d(embed_dim, width, 3, padding=1),
            ResidualBlock(width, width), ResidualBlock(width, width), nn.ReLU(),
            *up[:-1],  # no ReLU after the last transposed conv: pixels are in [-1, 1]
        )  # fmt: skip

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(reconstruction, codes, commitment loss)."""
        quantized, codes, loss = self.codebook(self.encoder(pixels))
        return self.decoder(quantized), codes, loss


def parameter_count(module: nn.Module) -> int:
    """Trainable parameters (codebooks updated by EMA are buffers, in ours and in the baseline)."""
    return sum(p.numel() for p in module.parameters())


def matched_width(target: int, downsamplings: int = 4) -> int:
    """The baseline width (a multiple of 8) whose parameter count is closest to `target`."""
    previous = (16, parameter_count(PlainVQVAE(16, downsamplings=downsamplings)))
    for width in range(24, 1025, 8):  # the count grows with the width: stop at the first one past the target
        count = parameter_count(PlainVQVAE(width, downsamplings=downsamplings))
        if count >= target:
            return width if count - target < target - previous[1] else previous[0]
        previous = (width, count)
    return previous[0]


# ---------------------------------------------------------------- tasks: data, held-out images, our recipe


@dataclass
class Task:
    """One data set: how our recipe trains on it, and the images every model is scored on."""

    name: str
    held_out: torch.Tensor  # (N, 3, 64, 64) in [-1, 1]
    module_kwargs: dict[str, Any]  # ImageTokenizerModule arguments of the recipe users get
    train_loader: Callable[[], DataLoader]  # a fresh loader of training batches (same for every model)
    recipe: str  # where the recipe comes from


class _Pixels(Dataset):
    """Rows of an image tensor (the tokenizer module's batch is a pixel tensor)."""

    def __init__(self, images: torch.Tensor):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.images[index]


def digits_task(smoke: bool) -> Task:
    """The demo's digits and its tokenizer settings (configs/demo/full.yaml); held out: the demo's test digits."""
    from experiments.demo.datasets import load_digits, to_model_images
    from experiments.demo.settings import load_config

    config = load_config("full")
    split = load_digits(held_out=config.data.held_out, limit=config.data.train_limit, seed=config.seed)
    size, settings = config.data.image_size, config.tokenizer
    train, test = split.train_images, split.test_images
    if smoke:
        train, test = train[:SMOKE_IMAGES], test[:SMOKE_IMAGES]
    train_images = to_model_images(train, size)
    batch = min(settings.batch_size, len(train_images))

    def loader() -> DataLoader:
        # tokenizer.image.train.fit_image_tokenizer's loader: shuffled, full batches only
        return DataLoader(_Pixels(train_images), batch_size=batch, shuffle=True, drop_last=True)

    kwargs = {"preset": settings.preset, "overrides": settings.overrides or None}
    return Task("digits", to_model_images(test, size), kwargs, loader,
                f"configs/demo/full.yaml (preset {settings.preset}, batch {batch}, module defaults)")


def photos_task(smoke: bool) -> Task:
    """configs/tokenizer/photos-64.yaml's model and data; held out: crops of the 3 photos never trained on."""
    from tokenizer.image.evaluate import held_out_photo_crops
    from tokenizer.image.lightning import ImageDataModule

    config = yaml.safe_load(PHOTOS_CONFIG.read_text())
    model, data = dict(config["model"]), dict(config["data"])
    datamodule = ImageDataModule(**data)
    datamodule.setup("fit")
    held_out = held_out_photo_crops(data["image_size"], SMOKE_IMAGES if smoke else PHOTO_HELD_OUT)
    return Task("photos", held_out, model, datamodule.train_dataloader,
                f"{PHOTOS_CONFIG.relative_to(REPO_ROOT)} (model and data sections)")


def endless(make_loader: Callable[[], DataLoader]) -> Iterator[torch.Tensor]:
    """Batches from fresh epochs of the loader, forever."""
    for _ in itertools.count():
        yield from make_loader()


# ---------------------------------------------------------------- training at a CPU-time budget


def _import_lightning():
    import lightning as L

    class CpuBudget(L.Callback):
        """Stops training once the process has used `seconds` of CPU time since training started."""

        def __init__(self, seconds: float):
            self.seconds, self.start = seconds, 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = time.process_time()

        def on_train_batch_end(self, trainer, *args) -> None:
            if time.process_time() - self.start >= self.seconds:
                trainer.should_stop = True

    return L, CpuBudget


def train_ours(task: Task, seconds: float, seed: int, changes: dict[str, Any] | None = None) -> dict:
    """Our recipe through ImageTokenizerModule and a Lightning Trainer (as `tokenizer fit` and the demo run it);
    `changes`: module arguments replacing the recipe's, its "overrides" merged into the recipe's."""
    from tokenizer.image.evaluate import evaluate
    from tokenizer.image.lightning import ImageTokenizerModule

    L, CpuBudget = _import_lightning()
    L.seed_everything(seed, verbose=False)
    changes = dict(changes or {})
    overrides = {**(task.module_kwargs.get("overrides") or {}), **changes.pop("overrides", {})}
    kwargs = {**task.module_kwargs, **changes, "overrides": overrides or None}
    module = ImageTokenizerModule(**kwargs)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, precision="32-true", max_epochs=-1, max_steps=-1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[CpuBudget(seconds)],
    )  # fmt: skip
    cpu, wall = time.process_time(), time.perf_counter()
    trainer.fit(module, train_dataloaders=task.train_loader())
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    metrics = evaluate(module.tokenizer.eval(), task.held_out, batch_size=250)
    return _row(metrics["psnr_db"], metrics["codes_used"], int(module.steps_done), cpu, wall,
                parameter_count(module.tokenizer))


def train_baseline(task: Task, seconds: float, seed: int, width: int, downsamplings: int = 4) -> dict:
    """The plain VQ-VAE: Adam, MSE + commitment, the same training batches as ours."""
    from tokenizer.image.losses import psnr

    torch.manual_seed(seed)
    model = PlainVQVAE(width, downsamplings=downsamplings)
    optimizer = torch.optim.Adam(model.parameters(), lr=BASELINE_LR)
    batches = endless(task.train_loader)
    steps, cpu, wall = 0, time.process_time(), time.perf_counter()
    while time.process_time() - cpu < seconds:
        pixels = next(batches)
        reconstruction, _, commitment = model(pixels)
        loss = F.mse_loss(reconstruction, pixels) + commitment
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps += 1
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    model.eval()
    with torch.no_grad():
        outputs = [model(chunk) for chunk in task.held_out.split(250)]
    reconstruction = torch.cat([out[0] for out in outputs])
    codes = torch.cat([out[1] for out in outputs])
    used = int(codes.unique().numel())
    return _row(float(psnr(reconstruction, task.held_out).mean()), used, steps, cpu, wall, parameter_count(model))


TRAINED_MODELS = ("preset", "plain_vqvae")


def train_model(model: str, task: Task, seconds: float, seed: int, baseline_width: int, downsamplings: int = 4) -> dict:
    """Train and score one of TRAINED_MODELS (the baseline with our preset's code grid)."""
    if model == "plain_vqvae":
        return train_baseline(task, seconds, seed, baseline_width, downsamplings)
    return train_ours(task, seconds, seed)


def _row(psnr_db: float, codes_used: int, steps: int, cpu_s: float, wall_s: float, parameters: int) -> dict:
    return {
        "psnr_db": round(float(psnr_db), 3), "codes_used": int(codes_used),
        "codebook_usage_fraction": round(codes_used / CODEBOOK_SIZE, 4), "steps": int(steps),
        "train_cpu_s": round(cpu_s, 1), "train_wall_s": round(wall_s, 1), "parameters": int(parameters),
    }  # fmt: skip


def mean_colour_rows(held_out: torch.Tensor, patch: int = 16) -> dict[str, dict]:
    """PSNR of each image replaced by its mean colour, and by the mean colour of each patch x patch square (one
    continuous colour where the tokenizer has one code)."""
    from tokenizer.image.losses import psnr

    image_mean = held_out.mean(dim=(2, 3), keepdim=True).expand_as(held_out)
    patch_mean = F.interpolate(F.avg_pool2d(held_out, patch), scale_factor=patch, mode="nearest")
    return {
        "mean_colour_image": {"psnr_db": round(float(psnr(image_mean, held_out).mean()), 3)},
        "mean_colour_patch": {"psnr_db": round(float(psnr(patch_mean, held_out).mean()), 3), "patch_px": patch},
    }


# ---------------------------------------------------------------- the run, the table


def run(smoke: bool = False, seconds: dict[str, float] | None = None, seed: int = 0) -> dict:
    """Train every model on every task (budget 0 skips a task); write the result json and a markdown table."""
    from tokenizer.image.config import ImageTokenizerConfig
    from tokenizer.image.image_tokenizer import ImageTokenizer

    budgets = dict(DEFAULT_SECONDS, **(seconds or {}))
    if smoke:
        budgets = {task: SMOKE_SECONDS if budget > 0 else 0.0 for task, budget in budgets.items()}
    bad = {task: budget for task, budget in budgets.items() if task not in DEFAULT_SECONDS or budget < 0}
    if bad:
        raise ValueError(f"training budgets must be >= 0 seconds for tasks {sorted(DEFAULT_SECONDS)}, got {bad}")
    torch.set_num_threads(THREADS)
    figures: dict[str, dict] = {}
    recipes: dict[str, str] = {}
    widths: dict[str, int] = {}
    for name, make_task in (("digits", digits_task), ("photos", photos_task)):
        if budgets[name] <= 0:
            continue
        task = make_task(smoke)
        preset = ImageTokenizerConfig.from_preset(task.module_kwargs["preset"], **(task.module_kwargs.get("overrides") or {}))
        levels = preset.levels - 1  # stride-2 steps: the baseline gets the same code grid
        widths[name] = matched_width(parameter_count(ImageTokenizer(preset)), levels)
        print(f"bench {NAME}: {name}, {budgets[name]:g} CPU s per model", file=sys.stderr, flush=True)
        figures[name] = {}
        for model in TRAINED_MODELS:
            row = figures[name][model] = train_model(model, task, budgets[name], seed, widths[name], levels)
            print(f"bench {NAME}: {name} {model}: {row['psnr_db']:.2f} dB, {row['codes_used']} codes, "
                  f"{row['steps']} steps", file=sys.stderr, flush=True)
        figures[name].update(mean_colour_rows(task.held_out, preset.downsample_factor))
        recipes[name] = task.recipe
    if not figures:
        raise ValueError("every task has a budget of 0 seconds: nothing to measure")
    payload = {
        "figures": figures,
        "config": {
            "budget": "equal CPU time per model (time.process_time of the training loop; data loading included, "
            "evaluation excluded)", "budget_cpu_s": budgets, "torch_threads": torch.get_num_threads(),
            "recipes": recipes, "baseline_width": widths, "baseline_lr": BASELINE_LR,
            "baseline": "plain VQ-VAE: a stride-2 4x4 conv per downsampling of our preset (the same code grid) + 2 residual blocks each way, Euclidean EMA codebook "
            f"512 x {BASELINE_EMBED_DIM} (decay 0.99, beta 0.25), straight-through, MSE, Adam",
            "held_out_images": {name: int(f) for name, f in _held_out_counts(figures, smoke).items()},
            "seed": seed, "smoke": smoke,
        },
    }  # fmt: skip
    write_result(NAME, payload)
    atomic_write_text(resolve_results_dir() / f"{NAME}.md", markdown_table(payload))
    return payload


def _held_out_counts(figures: dict, smoke: bool) -> dict[str, int]:
    full = {"digits": 500, "photos": PHOTO_HELD_OUT}
    return {name: SMOKE_IMAGES if smoke else full[name] for name in figures}


MODEL_LABELS = {
    "preset": "our preset",
    "plain_vqvae": "plain VQ-VAE",
    "mean_colour_image": "mean colour per image",
    "mean_colour_patch": "mean colour per patch (one per code)",
}


def markdown_table(payload: dict) -> str:
    """One table per task: held-out PSNR, codes used, steps and CPU/wall seconds of each model."""
    config = payload["config"]
    lines = [
        f"# Image tokenizer quality at equal CPU time ({'smoke run' if config['smoke'] else 'full run'})",
        "",
        f"Written by bench/bench_{NAME}.py. Budget: {config['budget']}; torch threads: {config['torch_threads']}.",
    ]
    for task, rows in payload["figures"].items():
        lines += [
            "",
            f"## {task}: {config['budget_cpu_s'][task]:g} CPU s per model, recipe {config['recipes'][task]}",
            "",
            "| model | held-out PSNR (dB) | codes used / 512 | steps | train CPU s | train wall s | parameters |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for key, row in rows.items():
            cells = [f"{row['psnr_db']:.2f}"]
            if "steps" in row:
                cells += [f"{row['codes_used']} ({100 * row['codebook_usage_fraction']:.1f}%)", f"{row['steps']:,}",
                          f"{row['train_cpu_s']:g}", f"{row['train_wall_s']:g}", f"{row['parameters']:,}"]
            else:
                cells += ["-"] * 5
            label = MODEL_LABELS.get(key, key) + (f", {row['patch_px']} px" if "patch_px" in row else "")
            lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line with budgets per task; prints the markdown table."""
    parser = argparse.ArgumentParser(prog="python -m bench.bench_tokenizer_quality", description=__doc__)
    parser.add_argument("--digits-seconds", type=float, default=DEFAULT_SECONDS["digits"],
                        help="CPU seconds of training per model on digits (0 skips digits)")
    parser.add_argument("--photos-seconds", type=float, default=DEFAULT_SECONDS["photos"],
                        help="CPU seconds of training per model on photos (0 skips photos)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_SECONDS:g} s per model on {SMOKE_IMAGES} images")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for flag, value in (("--digits-seconds", args.digits_seconds), ("--photos-seconds", args.photos_seconds)):
        if value < 0:
            parser.error(f"{flag} must be >= 0 seconds, got {value:g}")
    payload = run(args.smoke, {"digits": args.digits_seconds, "photos": args.photos_seconds}, args.seed)
    print(markdown_table(payload))
    print(json.dumps(payload["figures"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
