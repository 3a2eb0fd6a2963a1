"""Lightning training of the video tokenizer: the module (reconstruction + commitment through the project's quantizer
and its straight-through estimator; per-frame PSNR, a repeat-the-first-frame baseline, codebook usage), the data
module (a folder of clips, read by `tokenizer.video.clips`), and `fit_video_tokenizer` for in-memory clips."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from common.files import atomic_path
from tokenizer.image.data import note_skip
from tokenizer.image.lightning import log_codebook_usage
from tokenizer.image.losses import psnr, reconstruction_loss
from tokenizer.image.preprocess import to_pil
from tokenizer.image.quantizer import codebook_stats, set_codebook_sync
from tokenizer.image.train import TensorRows
from tokenizer.video.clips import ClipLoadError, list_clip_files, read_clip
from tokenizer.video.config import VideoTokenizerConfig
from tokenizer.video.video_tokenizer import VideoTokenizer, clip_to_tensor

log = logging.getLogger(__name__)


def frame_psnr(reconstruction: torch.Tensor, clips: torch.Tensor) -> torch.Tensor:
    """PSNR in dB of every frame (B, T) of clips (B, T, 3, H, W) in [-1, 1] (the reconstruction is clamped)."""
    b, t = clips.shape[:2]
    return psnr(reconstruction.flatten(0, 1), clips.flatten(0, 1)).view(b, t)


class VideoTokenizerModule(L.LightningModule):
    """Trains a `VideoTokenizer` built from a video preset (plus field overrides, e.g. {"codebook_size": 1024})."""

    def __init__(
        self,
        preset: str = "video-demo-32",
        overrides: dict[str, Any] | None = None,
        learning_rate: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        warmup_steps: int = 100,
        recon_loss: str = "l2",  # the squared error PSNR measures
        recon_weight: float = 1.0,
        grad_clip: float = 1.0,
        grid_clips: int = 4,  # validation clips drawn as originals / reconstructions in the logged PNG
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False  # the tokenizer's own gradient clipping, as the image module does
        self.tokenizer = VideoTokenizer(VideoTokenizerConfig.from_preset(preset, **(overrides or {})))
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.long))
        self._val_counts: torch.Tensor | None = None

    def setup(self, stage: str) -> None:
        """Codebook synchronisation under DDP; the data's frame size and clip length must be the preset's."""
        set_codebook_sync(self.tokenizer.quantize)
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        config = self.tokenizer.config
        for name, expected in (("image_size", config.image_size), ("clip_frames", config.clip_frames)):
            value = getattr(datamodule, name, None)
            if value is not None and value != expected:
                raise ValueError(f"data.{name}={value} but the video tokenizer preset expects {expected}; "
                                 "set both to the same value")

    def configure_optimizers(self):
        """AdamW with linear warmup."""
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.tokenizer.parameters(), lr=hp.learning_rate, betas=tuple(hp.betas),
                                      weight_decay=hp.weight_decay)
        warmup = max(1, hp.warmup_steps)
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """Reconstruction + commitment loss on clips (B, T, 3, H, W); logs per-frame PSNR and the batch's codes."""
        hp = self.hparams
        optimizer = self.optimizers()
        clips = batch
        out = self.tokenizer(clips)
        recon = reconstruction_loss(out.reconstruction, clips, hp.recon_loss)
        loss = hp.recon_weight * recon + out.vq_loss
        optimizer.zero_grad(set_to_none=True)
        self.manual_backward(loss)
        if hp.grad_clip > 0:
            self.clip_gradients(optimizer, gradient_clip_val=hp.grad_clip, gradient_clip_algorithm="norm")
        optimizer.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.steps_done += 1
        frame_db = frame_psnr(out.reconstruction.detach(), clips).mean()
        usage = codebook_stats(out.codes, self.tokenizer.config.codebook_size)["usage"]
        n = len(clips)
        self.log_dict({"train/loss": loss.detach(), "train/recon": recon.detach(), "train/vq": out.vq_loss.detach(),
                       "train/psnr": frame_db, "train/usage": usage}, batch_size=n)
        self.log("train/psnr_bar", frame_db, prog_bar=True, logger=False, batch_size=n)
        return loss.detach()

    def on_validation_epoch_start(self) -> None:
        """Reset the histogram of validation codes."""
        self._val_counts = torch.zeros(self.tokenizer.config.codebook_size, dtype=torch.long, device=self.device)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        """Per-frame PSNR (mean, and at each frame position), the repeat-the-first-frame baseline, code histogram."""
        if not bool(self.tokenizer.quantize.vq._codebook.initted):
            return  # k-means init must see training data, not the sanity check's validation batch
        clips = batch
        out = self.tokenizer(clips)  # eval mode: running BatchNorm statistics, no codebook update
        n = len(clips)
        frame_db = frame_psnr(out.reconstruction, clips)
        baseline = frame_psnr(clips[:, :1].expand_as(clips), clips)
        self._val_counts += torch.bincount(out.codes.flatten(), minlength=self._val_counts.numel())
        self.log("val/recon", reconstruction_loss(out.reconstruction, clips, self.hparams.recon_loss),
                 sync_dist=True, batch_size=n)
        self.log("val/psnr", frame_db.mean(), sync_dist=True, prog_bar=True, batch_size=n)
        self.log("val/psnr_repeat_first", baseline.mean(), sync_dist=True, batch_size=n)
        for k in range(frame_db.shape[1]):
            self.log(f"val/psnr_frame{k}", frame_db[:, k].mean(), sync_dist=True, batch_size=n)
        if batch_idx == 0:
            self._log_grid(clips[: self.hparams.grid_clips], out.reconstruction[: self.hparams.grid_clips])

    def on_validation_epoch_end(self) -> None:
        """Codebook usage (fraction of codes used on the validation clips), perplexity, codes used."""
        log_codebook_usage(self, self._val_counts)

    def _log_grid(self, originals: torch.Tensor, reconstructions: torch.Tensor) -> None:
        """Each clip as two rows of frames (original over reconstruction), clips stacked; a PNG in the log dir."""
        if self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        rows = []
        for clip, rec in zip(originals, reconstructions.clamp(-1, 1)):
            rows += [torch.cat(list(clip), dim=-1), torch.cat(list(rec), dim=-1)]
        grid = torch.cat(rows, dim=-2)
        for logger in self.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):
                experiment.add_image("val/clips_vs_reconstructions", (grid + 1) / 2, self.global_step)
        log_dir = self.trainer.log_dir if self.loggers else None
        if log_dir:
            target = Path(log_dir) / "images" / f"epoch{self.current_epoch:03d}_step{int(self.steps_done):06d}.png"
            with atomic_path(target) as tmp:
                to_pil(grid).save(tmp, format="PNG")


class ClipFiles(Dataset):
    """Clips from files (`tokenizer.video.clips.read_clip`): `clip_frames` consecutive frames (a random window in
    training, the first ones in validation), each frame resized and center-cropped to `size`; (T, 3, size, size).

    Unusable clips (unreadable, or shorter than `clip_frames`) raise `ClipLoadError`, or with `skip_bad=True` are
    replaced by the next good clip and recorded in `skipped`.
    """

    def __init__(self, files: list[Path], size: int, clip_frames: int, train: bool, skip_bad: bool = True,
                 seed: int = 0, length: int | None = None):
        if not files:
            raise ValueError("no clips found; check the folder (clips are .npy, .mp4/.webm/... or folders of frames)")
        self.files, self.size, self.clip_frames, self.train = files, size, clip_frames, train
        self.skip_bad, self.seed = skip_bad, seed
        self.length = max(len(files), length or 0) if train else len(files)
        self.skipped: dict[str, str] = {}

    def __len__(self) -> int:
        return self.length

    def _load(self, index: int, draw: int) -> torch.Tensor:
        path = self.files[index]
        # training windows start anywhere in the first 4 clip lengths: long videos are not decoded to the end
        frames = read_clip(path, max_frames=self.clip_frames * (4 if self.train else 1))
        if len(frames) < self.clip_frames:
            raise ClipLoadError(f"{path}: {len(frames)} frames, fewer than the {self.clip_frames} a training clip "
                                "needs; remove it or lower clip_frames")
        start = 0
        if self.train and len(frames) > self.clip_frames:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + draw)
            start = int(torch.randint(len(frames) - self.clip_frames + 1, (1,), generator=generator))
        return clip_to_tensor(frames[start : start + self.clip_frames], self.size)

    def __getitem__(self, index: int) -> torch.Tensor:
        count = len(self.files)
        for attempt in range(count):
            i = (index + attempt) % count
            try:
                return self._load(i, index)
            except ClipLoadError as err:
                if not self.skip_bad:
                    raise
                self._note_skip(str(self.files[i]), str(err))
        raise ClipLoadError(f"none of the {count} clips could be used; first error: "
                            f"{next(iter(self.skipped.values()), '?')}")

    def _note_skip(self, name: str, reason: str) -> None:
        note_skip(self.skipped, name, reason, f"the {'training' if self.train else 'validation'} clips",
                  what="unusable clip(s)", flag="--data.skip_bad_clips")


class VideoDataModule(L.LightningDataModule):
    """Video tokenizer training data: `source`, a folder of clips (searched recursively); validation is
    `val_source`, or every `val_every`-th clip of the folder (held out from training)."""

    def __init__(
        self,
        source: str | None = None,
        val_source: str | None = None,
        image_size: int = 32,
        clip_frames: int = 8,
        batch_size: int = 8,
        num_workers: int = 0,
        train_samples: int = 0,  # clip windows per epoch (0: one per training clip)
        val_samples: int = 64,
        val_every: int = 10,
        skip_bad_clips: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.image_size, self.clip_frames = image_size, clip_frames
        self.train_set = self.val_set = None

    def setup(self, stage: str | None = None) -> None:
        """List the clips and split off the validation ones."""
        hp = self.hparams
        if self.train_set is not None:
            return
        if not hp.source:
            raise ValueError("--data.source is required for a video tokenizer: a folder of clips "
                             "(.npy uint8 (T, H, W, 3), .mp4/.webm, or folders of frames)")
        files = list_clip_files(hp.source)
        if hp.val_source is not None:
            train_files, val_files = files, list_clip_files(hp.val_source)
        else:
            val_files = files[:: hp.val_every]
            held_out = set(val_files)
            train_files = [f for f in files if f not in held_out] or files
        self.train_set = ClipFiles(train_files, hp.image_size, hp.clip_frames, True, hp.skip_bad_clips, hp.seed,
                                   hp.train_samples)
        self.val_set = ClipFiles(val_files[: hp.val_samples], hp.image_size, hp.clip_frames, False,
                                 hp.skip_bad_clips)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(dataset, batch_size=self.hparams.batch_size, shuffle=shuffle,
                          num_workers=self.hparams.num_workers, drop_last=shuffle,
                          persistent_workers=self.hparams.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        """Random windows of the training clips, shuffled; refuses fewer clips than one batch."""
        size, batch = len(self.train_set), self.hparams.batch_size
        if size < batch:
            raise ValueError(f"the training clips of data.source {self.hparams.source!r} number {size} (after the "
                             f"validation split) but data.batch_size is {batch}: no full batch; lower "
                             f"--data.batch_size to at most {size}, set --data.train_samples, or add clips")
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """The held-out clips' first frames, fixed order."""
        return self._loader(self.val_set, shuffle=False)

    def skipped(self) -> dict[str, str]:
        """Unusable clips skipped so far in this process: name -> reason."""
        return {**getattr(self.train_set, "skipped", {}), **getattr(self.val_set, "skipped", {})}


def fit_video_tokenizer(clips: torch.Tensor, preset: str = "video-demo-32", batch_size: int = 16,
                        max_steps: int = 1000, max_minutes: float | None = None, seed: int = 0,
                        val_clips: torch.Tensor | None = None, overrides: dict[str, Any] | None = None,
                        progress: bool = False, **module_kwargs: Any) -> tuple[VideoTokenizer, dict[str, float]]:
    """Train on in-memory clips (N, T, 3, H, W) in [-1, 1]; returns the tokenizer (eval mode) and a summary
    (steps, and with `val_clips` the held-out per-frame PSNR, the repeat-first-frame baseline and codebook usage)."""
    if clips.dim() != 5 or clips.shape[2] != 3 or not clips.dtype.is_floating_point:
        raise ValueError(f"clips must be a float tensor (N, T, 3, H, W) in [-1, 1], got {clips.dtype} "
                         f"{tuple(clips.shape)}")
    L.seed_everything(seed, verbose=False)
    module = VideoTokenizerModule(preset=preset, overrides=overrides, **module_kwargs)
    config = module.tokenizer.config
    if tuple(clips.shape[-2:]) != (config.image_size, config.image_size):
        raise ValueError(f"preset {preset!r} expects {config.image_size}-px frames, got {tuple(clips.shape[-2:])}")
    loader = DataLoader(TensorRows(clips.float()), batch_size=min(batch_size, len(clips)), shuffle=True, drop_last=True)
    trainer = L.Trainer(max_steps=max_steps, max_time={"minutes": max_minutes} if max_minutes else None,
                        accelerator="cpu" if not torch.cuda.is_available() else "auto", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=progress, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, loader)
    tokenizer = module.tokenizer.eval()
    summary: dict[str, float] = {"steps": float(module.steps_done)}
    if val_clips is not None:
        summary.update(evaluate_video_tokenizer(tokenizer, val_clips))
    return tokenizer, summary


@torch.no_grad()
def evaluate_video_tokenizer(tokenizer: VideoTokenizer, clips: torch.Tensor, batch_size: int = 8) -> dict[str, float]:
    """Held-out per-frame PSNR of the reconstruction through the codes, the repeat-the-first-frame baseline, and
    codebook usage, on clips (N, T, 3, H, W) in [-1, 1]."""
    codes = tokenizer.encode_clips(clips, batch_size)
    video = tokenizer.decode_clips(codes, batch_size).cpu()
    stats = codebook_stats(codes, tokenizer.config.codebook_size)
    return {"psnr": float(frame_psnr(video, clips).mean()),
            "psnr_repeat_first": float(frame_psnr(clips[:, :1].expand_as(clips), clips).mean()),
            "usage": stats["usage"], "perplexity": stats["perplexity"]}
