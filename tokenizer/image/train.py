"""Train an image tokenizer from Python on a tensor of images (what the demo does), through the same Lightning
module as `train.py tokenizer fit`."""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tokenizer.image.bundle import AnyImageTokenizer
from tokenizer.image.lightning import ImageTokenizerModule


class TensorRows(TensorDataset):
    """Yields the rows of one tensor alone (a tokenizer module's batch is a pixel or clip tensor, not a tuple)."""

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tensors[0][index]


def fit_image_tokenizer(
    images: torch.Tensor,
    preset: str = "demo-64",
    batch_size: int = 64,
    max_steps: int = 1000,
    max_minutes: float | None = None,
    seed: int = 0,
    progress: bool = True,
    log_dir: str | Path | None = None,
    val_images: torch.Tensor | None = None,
    overrides: dict[str, Any] | None = None,
    **module_kwargs: Any,
) -> tuple[AnyImageTokenizer, dict[str, float]]:
    """Train on `images` (N, 3, H, W) in [-1, 1]; returns the tokenizer (eval mode; a ContinuousImageTokenizer for a
    kl preset) and a summary of the run."""
    if images.dim() != 4 or images.shape[1] != 3 or not images.dtype.is_floating_point:
        raise ValueError(
            f"images must be a float tensor (N, 3, H, W) in [-1, 1], got {images.dtype} {tuple(images.shape)}"
        )
    L.seed_everything(seed, verbose=False)
    module = ImageTokenizerModule(preset=preset, overrides=overrides, **module_kwargs)
    if (
        images.shape[-1] != module.tokenizer.config.image_size
        or images.shape[-2] != module.tokenizer.config.image_size
    ):
        raise ValueError(
            f"preset {preset!r} expects {module.tokenizer.config.image_size}-px images, "
            f"got {tuple(images.shape[-2:])}"
        )
    train = DataLoader(
        TensorRows(images.float()), batch_size=min(batch_size, len(images)), shuffle=True, drop_last=True
    )
    val = DataLoader(TensorRows(val_images.float()), batch_size=batch_size) if val_images is not None else None
    loggers = False
    if log_dir is not None:
        from lightning.pytorch.loggers import CSVLogger

        loggers = [CSVLogger(str(log_dir), name="csv")]
    trainer = L.Trainer(
        max_steps=max_steps,
        # the epochs max_steps implies (Lightning's default of -1 made the progress bar read "Epoch 4/-2")
        max_epochs=math.ceil(max_steps / max(len(train), 1)),
        max_time=datetime.timedelta(minutes=max_minutes) if max_minutes else None,
        logger=loggers,
        enable_checkpointing=False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        limit_val_batches=1.0 if val is not None else 0,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=1,
        default_root_dir=str(log_dir) if log_dir is not None else None,
    )
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("train/", "val/"))}
    info = {"steps": int(module.steps_done), **{k.replace("/", "_"): v for k, v in metrics.items()}}
    if module.continuous:
        info["latent_scale"] = float(module.tokenizer.latent_scale)
    return module.tokenizer.eval(), info
