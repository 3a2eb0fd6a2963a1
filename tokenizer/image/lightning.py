"""Lightning training of the image tokenizer: the module (reconstruction + commitment for VQ or + KL for the
continuous tokenizer, optional perceptual and PatchGAN losses; PSNR, codebook usage, perplexity or latent statistics,
image grids) and the data module (photos, folder, shards)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from common.files import atomic_path
from tokenizer.image import data as image_data
from tokenizer.image.bundle import build_image_tokenizer
from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.image.continuous import ContinuousImageTokenizer
from tokenizer.image.image_tokenizer import ImageAutoencoder
from tokenizer.image.losses import (
    PatchDiscriminator,
    PerceptualLoss,
    adaptive_weight,
    hinge_d_loss,
    psnr,
    reconstruction_loss,
)
from tokenizer.image.preprocess import to_pil
from tokenizer.image.quantizer import set_codebook_sync, stats_from_counts


def log_codebook_usage(module: L.LightningModule, counts: torch.Tensor | None) -> None:
    """Log val/usage (fraction of codes used), val/perplexity and val/codes_used of per-code `counts` summed over
    ranks; nothing when no code was counted (a continuous tokenizer, or no validation batch)."""
    if counts is None or int(counts.sum()) == 0:
        return
    stats = stats_from_counts(module.trainer.strategy.reduce(counts.double(), reduce_op="sum").cpu())
    module.log("val/usage", stats["usage"], prog_bar=True, rank_zero_only=True)
    module.log("val/perplexity", stats["perplexity"], rank_zero_only=True)
    module.log("val/codes_used", float(stats["codes_used"]), rank_zero_only=True)


class ImageTokenizerModule(L.LightningModule):
    """Trains an `ImageTokenizer` (or, for a preset with bottleneck "kl", a `ContinuousImageTokenizer`) built from a
    preset (plus field overrides, e.g. {"quantizer": "chameleon"})."""

    def __init__(
        self,
        preset: str = "demo-64",
        overrides: dict[str, Any] | None = None,
        learning_rate: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),  # VQGAN's (0.5, 0.9) is for GAN training: set it with disc_weight
        weight_decay: float = 0.0,
        warmup_steps: int = 100,
        recon_loss: str = "l2",  # the squared error PSNR measures (+0.6 dB over l1 on digits at equal time)
        recon_weight: float = 1.0,
        perceptual_weight: float = 0.0,
        perceptual_weights: str | None = None,
        disc_weight: float = 0.0,
        disc_start: int = 2000,
        disc_width: int = 32,
        disc_layers: int = 2,
        grad_clip: float = 1.0,
        grid_images: int = 8,
        # continuous tokenizer only. The KL (summed over latent elements) weighs against the squared error summed
        # over pixel values, LDM's convention (its VAEs use 1e-6): the loss adds kl_weight * KL / (3 H W)
        kl_weight: float = 1e-6,
        scale_images: int = 1024,  # training images latent_scale is measured on at the end of fit (0: keep the
        # running estimate kept while training)
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = (
            False  # two optimizers (generator, discriminator) and an adaptive weight
        )
        self.tokenizer = build_image_tokenizer(ImageTokenizerConfig.from_preset(preset, **(overrides or {})))
        self.continuous = isinstance(self.tokenizer, ContinuousImageTokenizer)
        self.discriminator = PatchDiscriminator(3, disc_width, disc_layers) if disc_weight > 0 else None
        # frozen and loaded from a local file: kept out of the state dict (not registered as a submodule)
        self._perceptual = [PerceptualLoss(perceptual_weights)] if perceptual_weight > 0 else []
        if perceptual_weight > 0 and not perceptual_weights:
            raise ValueError("perceptual_weight > 0 needs perceptual_weights: a local VGG16 weights file")
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.long))
        self._val_counts: torch.Tensor | None = None

    # ----- setup -----

    def setup(self, stage: str) -> None:
        """Switch on codebook synchronisation when the DDP process group exists (it does not at __init__)."""
        if not self.continuous:
            set_codebook_sync(self.tokenizer.quantize)
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        size = getattr(datamodule, "image_size", None)
        if size is not None and size != self.tokenizer.config.image_size:
            raise ValueError(
                f"data.image_size={size} but the tokenizer preset expects {self.tokenizer.config.image_size}"
                "; set both to the same value"
            )

    def configure_optimizers(self):
        """AdamW for the tokenizer (and the discriminator), linear warmup."""
        hp = self.hparams
        opt_g = torch.optim.AdamW(
            self.tokenizer.parameters(),
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
            weight_decay=hp.weight_decay,
        )
        warmup = max(1, hp.warmup_steps)
        sched_g = torch.optim.lr_scheduler.LambdaLR(opt_g, lambda step: min(1.0, (step + 1) / warmup))
        if self.discriminator is None:
            return [opt_g], [sched_g]
        opt_d = torch.optim.AdamW(
            self.discriminator.parameters(),
            lr=hp.learning_rate,
            betas=tuple(hp.betas),
            weight_decay=hp.weight_decay,
        )
        return [opt_g, opt_d], [sched_g]

    # ----- training -----

    def _nll(
        self, reconstruction: torch.Tensor, pixels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hp = self.hparams
        rec = reconstruction_loss(reconstruction, pixels, hp.recon_loss)
        logs = {"recon": rec}
        nll = hp.recon_weight * rec
        if self._perceptual:
            perceptual = self._perceptual[0].to(pixels.device)(reconstruction, pixels)
            logs["perceptual"] = perceptual
            nll = nll + hp.perceptual_weight * perceptual
        return nll, logs

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """One generator step (and one discriminator step once the GAN has started)."""
        hp = self.hparams
        optimizers = self.optimizers()
        opt_g = optimizers[0] if isinstance(optimizers, list) else optimizers
        pixels = batch
        out = self.tokenizer(pixels)
        nll, logs = self._nll(out.reconstruction, pixels)
        if self.continuous:
            loss = nll + hp.kl_weight * out.kl.mean() / pixels[0].numel()
            logs.update(self._latent_stats(out))
            self._update_latent_scale(out.mean)
        else:
            loss = nll + out.vq_loss
            logs["vq"] = out.vq_loss
        gan_on = self.discriminator is not None and int(self.steps_done) >= hp.disc_start
        if gan_on:
            g_loss = -self.discriminator(out.reconstruction).mean()
            weight = adaptive_weight(nll, g_loss, self.tokenizer.decoder.last_layer) * hp.disc_weight
            loss = loss + weight * g_loss
            logs.update(g_loss=g_loss, disc_weight=weight)
        opt_g.zero_grad(set_to_none=True)
        self.manual_backward(loss)
        if hp.grad_clip > 0:
            self.clip_gradients(opt_g, gradient_clip_val=hp.grad_clip, gradient_clip_algorithm="norm")
        opt_g.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        if gan_on:
            opt_d = optimizers[1]
            d_loss = hinge_d_loss(self.discriminator(pixels), self.discriminator(out.reconstruction.detach()))
            opt_d.zero_grad(set_to_none=True)
            self.manual_backward(d_loss)
            opt_d.step()
            logs["d_loss"] = d_loss
        self.steps_done += 1
        logs.update(loss=loss, psnr=psnr(out.reconstruction.detach(), pixels).mean())
        self.log_dict(
            {f"train/{k}": v.detach() for k, v in logs.items()}, prog_bar=False, batch_size=len(pixels)
        )
        self.log("train/psnr_bar", logs["psnr"], prog_bar=True, logger=False, batch_size=len(pixels))
        return loss.detach()

    # ----- the continuous tokenizer's latents -----

    @staticmethod
    def _latent_stats(out) -> dict[str, torch.Tensor]:
        """KL in nats per image, the posterior means' mean and std (what latent_scale normalises), the posterior's
        own std (how much noise the decoder learns to ignore)."""
        mean = out.mean.detach().float()
        return {"kl": out.kl.mean(), "latent_mean": mean.mean(), "latent_std": mean.std(),
                "posterior_std": (0.5 * out.logvar.detach().float()).exp().mean()}

    def _update_latent_scale(self, mean: torch.Tensor) -> None:
        """Keep latent_scale = 1 / std of recent posterior means (their mean over the first 20 steps, then an EMA),
        so that a checkpoint written mid-run exports a usable scale; `on_train_end` replaces it by a measurement."""
        # tensor operations only: a Python-side test would wait for the GPU at every step
        variance = mean.detach().float().var()  # NaN for a single element: then the scale stays
        rate = (1.0 / (self.steps_done.float() + 1.0)).clamp(min=0.05)
        scale = self.tokenizer.latent_scale
        running = (1 - rate) * scale.float().pow(-2) + rate * variance
        usable = torch.isfinite(running) & (running > 0)
        scale.copy_(torch.where(usable, running.rsqrt(), scale.float()))

    @torch.no_grad()
    def measure_latent_scale(self, batches: Iterable[torch.Tensor], max_images: int) -> float | None:
        """Set latent_scale to 1 / std of the posterior means of up to `max_images` images (summed over DDP ranks);
        returns it, or None (unchanged) when there were none."""
        tokenizer = self.tokenizer
        was_training = tokenizer.training
        tokenizer.eval()
        moments = torch.zeros(3, dtype=torch.float64, device=self.device)  # count, sum, sum of squares
        images = 0
        try:
            for batch in batches:
                if images >= max_images:
                    break
                pixels = batch[: max_images - images].to(self.device, tokenizer.quant_conv.weight.dtype)
                images += len(pixels)
                mean = tokenizer.posterior(pixels)[0].double()
                moments += torch.stack([mean.new_tensor(mean.numel()), mean.sum(), mean.pow(2).sum()])
        finally:
            tokenizer.train(was_training)
        if self._trainer is not None:
            moments = self.trainer.strategy.reduce(moments, reduce_op="sum")
        count, total, squares = (float(v) for v in moments)
        variance = (squares - total * total / count) / max(count - 1, 1) if count else 0.0
        if variance <= 0:
            return None
        tokenizer.latent_scale.fill_(variance ** -0.5)
        return float(tokenizer.latent_scale)

    def on_train_end(self) -> None:
        """Measure latent_scale with the final weights on training images (before ExportTokenizer writes the bundle,
        which happens at fit end)."""
        if not self.continuous or self.hparams.scale_images <= 0:
            return
        loader = self.trainer.train_dataloader
        if loader is None:
            return
        scale = self.measure_latent_scale(loader, self.hparams.scale_images)
        if scale is not None and self.trainer.is_global_zero:
            print(f"latent_scale {scale:.4g} (1 / std of the posterior means of up to {self.hparams.scale_images} "
                  "training images)")

    # ----- validation -----

    def on_validation_epoch_start(self) -> None:
        """Reset the histogram of validation codes."""
        if self.continuous:
            return
        self._val_counts = torch.zeros(
            self.tokenizer.config.codebook_size, dtype=torch.long, device=self.device
        )

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        """Reconstruction loss, PSNR and code histogram (or latent statistics) on held-out images."""
        if not self.continuous and not bool(self.tokenizer.quantize.vq._codebook.initted):
            return  # k-means init must see training data, not the sanity-check's validation batch
        pixels = batch
        out = self.tokenizer(pixels)  # eval mode: the continuous tokenizer decodes the posterior mean, as `encode`
        nll, logs = self._nll(out.reconstruction, pixels)
        n = len(pixels)
        if self.continuous:
            for key, value in self._latent_stats(out).items():
                self.log(f"val/{key}", value, sync_dist=True, batch_size=n)
        else:
            self._val_counts += torch.bincount(out.codes.flatten(), minlength=self._val_counts.numel())
        self.log("val/recon", logs["recon"], sync_dist=True, batch_size=n)
        self.log(
            "val/psnr", psnr(out.reconstruction, pixels).mean(), sync_dist=True, prog_bar=True, batch_size=n
        )
        if batch_idx == 0:
            self._log_grid(pixels[: self.hparams.grid_images], out.reconstruction[: self.hparams.grid_images])

    def on_validation_epoch_end(self) -> None:
        """Codebook usage (fraction of codes used on the validation set) and perplexity, summed over ranks."""
        log_codebook_usage(self, self._val_counts)

    def _log_grid(self, originals: torch.Tensor, reconstructions: torch.Tensor) -> None:
        """Top row originals, bottom row reconstructions: to TensorBoard if present, and as a PNG in the log dir."""
        if self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        grid = torch.cat(
            [torch.cat(list(originals), dim=-1), torch.cat(list(reconstructions.clamp(-1, 1)), dim=-1)],
            dim=-2,
        )
        for logger in self.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):
                experiment.add_image("val/originals_vs_reconstructions", (grid + 1) / 2, self.global_step)
        # without a logger Lightning's log_dir falls back to the working directory: write nothing there
        log_dir = self.trainer.log_dir if self.loggers else None
        if log_dir:
            target = Path(log_dir) / "images" / f"epoch{self.current_epoch:03d}_step{int(self.steps_done):06d}.png"
            with atomic_path(target) as tmp:
                to_pil(grid).save(tmp, format="PNG")  # the temporary name has no .png for PIL to go by


class ImageDataModule(L.LightningDataModule):
    """Tokenizer training data: `source` is "photos" (built-in skimage photos), an image folder, or a shard pattern.

    Validation: held-out photos (photos), `val_source`, or every `val_every`-th file of the folder.
    """

    def __init__(
        self,
        source: str = "photos",
        val_source: str | None = None,
        image_size: int = 64,
        batch_size: int = 16,
        num_workers: int = 0,
        train_samples: int = 4096,
        val_samples: int = 64,
        val_every: int = 20,
        skip_bad_images: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.image_size = image_size
        self.train_set = self.val_set = None

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets (crops are computed on the fly)."""
        hp = self.hparams
        if self.train_set is not None:
            return
        if hp.source == "photos":
            self.train_set = image_data.PhotoCrops(
                image_data.TRAIN_PHOTOS, hp.image_size, hp.train_samples, hp.seed
            )
            self.val_set = image_data.PhotoCrops(
                image_data.HELD_OUT_PHOTOS, hp.image_size, hp.val_samples, seed=hp.seed + 10_000
            )
        elif image_data.is_shard_folder(hp.source):  # img2dataset's output folder: its tars are the shards
            pattern = str(Path(hp.source) / "*.tar")
            self.train_set = image_data.ShardImages(pattern, hp.image_size, True, hp.skip_bad_images, hp.seed)
            self.val_set = image_data.ShardImages(hp.val_source or pattern, hp.image_size, False, hp.skip_bad_images)
        elif Path(hp.source).is_dir():
            files = image_data.list_image_files(hp.source)
            if hp.val_source is not None:
                train_files, val_files = files, image_data.list_image_files(hp.val_source)
            else:
                val_files = files[:: hp.val_every]
                train_files = [f for f in files if f not in set(val_files)] or files
            self.train_set = image_data.ImageFiles(
                train_files, hp.image_size, True, hp.skip_bad_images, hp.seed
            )
            self.val_set = image_data.ImageFiles(
                val_files[: hp.val_samples], hp.image_size, False, hp.skip_bad_images
            )
        else:  # webdataset shards
            self.train_set = image_data.ShardImages(
                hp.source, hp.image_size, True, hp.skip_bad_images, hp.seed
            )
            val = hp.val_source or hp.source
            self.val_set = image_data.ShardImages(val, hp.image_size, False, hp.skip_bad_images)

    def _loader(self, dataset, shuffle: bool) -> DataLoader:
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle and not iterable,
            num_workers=self.hparams.num_workers,
            drop_last=shuffle,
            persistent_workers=self.hparams.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Random crops, shuffled; refuses a training set smaller than one batch (every epoch would be empty), the
        same for every source: photos, a folder, tar shards (counted from their headers)."""
        dataset, batch = self.train_set, self.hparams.batch_size
        size = dataset.count_images() if isinstance(dataset, image_data.ShardImages) else len(dataset)
        if size < batch:
            raise ValueError(
                f"the training images of data.source {self.hparams.source!r} number {size} (after the validation split) "
                f"but data.batch_size is {batch}: no full batch, so training would never "
                f"take a step; lower --data.batch_size to at most {size} or add images"
            )
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Held-out images, fixed order."""
        return self._loader(self.val_set, shuffle=False)

    def skipped(self) -> dict[str, str]:
        """Bad files skipped so far in this process: name -> reason."""
        found: dict[str, str] = {}
        for dataset in (self.train_set, self.val_set):
            found.update(getattr(dataset, "skipped", {}))
        return found


class ExportTokenizer(L.Callback):
    """At the end of fit, write the inference bundle (config json + safetensors) to `<log_dir>/tokenizer`."""

    def __init__(self, dirpath: str | None = None):
        self.dirpath = dirpath

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Save from rank zero only."""
        # the image module, or any other that trains a `tokenizer` with a bundle (the video tokenizer's module)
        tokenizer = getattr(pl_module, "tokenizer", None)
        if not trainer.is_global_zero or not hasattr(tokenizer, "save_pretrained"):
            return
        target = Path(self.dirpath or Path(trainer.log_dir or ".") / "tokenizer")
        pl_module.tokenizer.save_pretrained(target)
        print(f"{bundle_description(pl_module.tokenizer)} written to {target} "
              f"(fingerprint {pl_module.tokenizer.fingerprint()})")


def bundle_description(tokenizer: ImageAutoencoder) -> str:
    """How the messages that announce a bundle name it (the continuous kind says so, with its latent scale; the
    video kind with its grid)."""
    if getattr(tokenizer, "kind", None) == "video":
        t, h, w = tokenizer.video_grid
        return f"video tokenizer bundle ({t}x{h}x{w} codes per {tokenizer.config.clip_frames}-frame clip)"
    if isinstance(tokenizer, ContinuousImageTokenizer):
        return (f"continuous image tokenizer bundle ({tokenizer.latent_channels} latent channels, "
                f"latent_scale {float(tokenizer.latent_scale):.4g})")
    return "image tokenizer bundle"
