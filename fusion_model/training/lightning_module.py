"""FusionLightningModule: pretraining of the fused decoder (Chameleon's recipe) under any Lightning strategy."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from fusion_model.checkpoint import architecture_differences, checkpoint_config, connector_weights, load_model
from fusion_model.config import FusionConfig, FusionConfigDict
from fusion_model.late_fusion import LateFusionConfig, LateFusionModel, late_layout, set_stage
from fusion_model.loss import fusion_loss_from_hidden
from fusion_model.model import FusionModel
from fusion_model.qformer_pretraining import QFormerPretrainer, caption_pairs
from fusion_model.training.checkpointing import rng_state, set_rng_state
from fusion_model.training.optim import WarmupDecay, build_adamw, build_scheduler

NONFINITE_POLICIES = ("stop", "skip")


class NonFiniteLossError(RuntimeError):
    """Training met a NaN/inf loss or gradient norm and `nonfinite='stop'`."""


def align_batch_progress(trainer: L.Trainer) -> int:
    """Move Lightning's restored count of the epoch's batches by the train loader's `resume_shift`; returns it.

    A loader resumed under another world size x batch size renumbers its position (the rows left are
    re-dealt over the new ranks). Lightning restored the old count and ends the epoch when that count
    reaches `len(loader)`, so without this a job that grew would end its epoch early and skip rows.
    """
    loaders = trainer.train_dataloader
    loaders = list(loaders.values()) if isinstance(loaders, dict) else loaders
    loaders = list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]
    shifts = {int(getattr(loader, "resume_shift", 0)) for loader in loaders}
    shift = shifts.pop() if len(shifts) == 1 else 0
    if shift:
        current = trainer.fit_loop.epoch_loop.batch_progress.current
        for field in ("ready", "started", "processed", "completed"):
            setattr(current, field, max(0, getattr(current, field) + shift))
        for loader in loaders:
            loader.resume_shift = 0  # applied once
    return shift


class FusionLightningModule(L.LightningModule):
    """Next-token pretraining on packed batches (`input_ids`, `document_ids`, `position_ids`, each (B, T)).

    The loss of a micro-batch is normalised by the number of targets over ALL data-parallel ranks, so
    one process with the global batch and N processes with 1/N of it each compute the same gradient.
    """

    def __init__(
        self,
        config: FusionConfigDict | FusionConfig | None = None,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-5,
        weight_decay: float = 0.1,
        warmup_steps: int = 4000,
        lr_schedule: str = "exponential",
        decay_steps: int | None = None,
        min_lr_ratio: float = 0.01,
        text_weight: float = 1.0,
        image_weight: float = 1.0,
        activation_checkpointing: bool = False,
        compile: bool = False,
        loss_chunk_size: int = 4096,
        nonfinite: str = "stop",
        init_weights: str | None = None,
        late_fusion: dict | None = None,
    ) -> None:
        """`config` is the decoder; the rest is the recipe (defaults: Chameleon's).

        config: a FusionConfig, or a dict naming a preset plus field overrides ({"preset": "small",
        "dropout": 0.1}; see FusionConfig.from_dict), or None for the tiny preset. hparams["config"] always
        holds the full resolved dict, so a checkpoint rebuilds the same decoder even if a preset changes.

        decay_steps: where the lr reaches `min_lr_ratio` x lr (default: trainer.max_steps).
        nonfinite: "stop" raises NonFiniteLossError naming the step and batch (no checkpoint is written
        for that step, so the last one stays good); "skip" drops that optimizer step and counts it.
        init_weights: start a new run from these decoder weights (a checkpoint file, e.g. from `train.py convert
        import`, or a transformers Chameleon directory); with config None the decoder config is the checkpoint's,
        otherwise its architecture must match. Ignored when the run resumes from its own checkpoint.
        late_fusion: train a late-fusion connector in front of the decoder instead (fusion_model.late_fusion's
        LateFusionConfig as a dict, e.g. {"kind": "llava", "stage": 1}): the batches' image codes are replaced by
        the shards' pre-quantisation features (`shards tokenize --features`), image positions add no loss, and the
        stage decides whether the decoder trains. `train.py fit` fills in the ids and feature_dim from the shards.
        """
        super().__init__()
        if config is None and init_weights:
            config = checkpoint_config(init_weights)
        if config is None:
            config = FusionConfig.from_preset("tiny")
        if not isinstance(config, FusionConfig):
            config = FusionConfig.from_dict(config)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={nonfinite!r}: choose one of {NONFINITE_POLICIES}")
        config = dataclasses.replace(config, gradient_checkpointing=config.gradient_checkpointing or activation_checkpointing)
        # hparams hold only plain values (the config as a dict) so checkpoints load with weights_only=True
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = config.to_dict()
        self.model_config = config
        self.model = FusionModel(config)
        self.late_config: LateFusionConfig | None = None
        self._late: LateFusionModel | None = None
        if late_fusion is not None:
            self._build_late_fusion(LateFusionConfig.from_dict(late_fusion))
        self._init_weights = init_weights
        self.skipped_steps = 0
        self.decoder_positions = 0  # positions the decoder trained on in this process (late fusion changes the count)
        self._bad_in_window = False
        self._batch_idx = -1
        self._rng_to_restore: dict[str, torch.Tensor] | None = None
        # gradient accumulation: the first micro-batch's global target weight (the unit every micro-batch's
        # loss sum is divided by) and the window's total; the gradients are rescaled by unit / total at the step
        self._window_unit: torch.Tensor | None = None
        self._window_weight: torch.Tensor | None = None
        self._sharded = False

    def _build_late_fusion(self, late: LateFusionConfig) -> None:
        missing = [name for name in ("feature_dim", "image_token_id", "boi_id", "eoi_id") if getattr(late, name) is None]
        if missing:
            raise ValueError(f"late_fusion needs {missing} (train.py fit takes them from the token shards' manifest)")
        wrapped = LateFusionModel(self.model, late.kind, late.image_token_id, feature_dim=late.feature_dim,
                                  connector_dim=late.connector_dim, num_latents=late.num_latents,
                                  num_queries=late.num_queries, depth=late.depth, heads=late.heads)
        self.connector = wrapped.connector
        # not a submodule: its parts are self.model and self.connector, so checkpoints name each weight once
        self.__dict__["_late"] = wrapped
        set_stage(wrapped, late.stage)
        self.late_config = late
        if (late.kind, late.stage) == ("qformer", 1):
            heads = QFormerPretrainer(self.connector, self.model_config.vocab_size, late.text_len)
            # the Q-Former is self.connector already: keep only the stage-1 heads as this submodule's own weights
            del heads._modules["qformer"]
            object.__setattr__(heads, "qformer", self.connector)
            self.stage1_heads = heads
            # the projection to the decoder's width is stage 2's: unused here (DDP refuses unused trainable weights)
            self.connector.to_language_model.requires_grad_(False)

    @property
    def reads_image_features(self) -> bool:
        """Whether the batches must carry image features (a late-fusion model)."""
        return self.late_config is not None

    # ---- model wrapping (FSDP2 / compile), called by Lightning inside the strategy's init context ----
    def setup(self, stage: str) -> None:
        """Load `init_weights` (and a late-fusion `init_connector`) into a new run (a resumed run restores its own
        checkpoint instead)."""
        if stage != "fit" or self.trainer.ckpt_path is not None:
            return
        if self.late_config is not None and self.late_config.init_connector:
            self.connector.load_state_dict(connector_weights(self.late_config.init_connector))
        if not self._init_weights:
            return
        loaded = load_model(self._init_weights)
        differences = architecture_differences(loaded.config, self.model_config)
        if differences:
            raise ValueError(
                f"model.init_weights {self._init_weights} holds another architecture ({'; '.join(differences)}; "
                "checkpoint vs model.config): pass --model.config null to take the checkpoint's config"
            )
        self.model.load_state_dict(loaded.state_dict())

    def configure_model(self) -> None:
        """Apply torch.compile and, under ModelParallelStrategy, FSDP2 `fully_shard` per block and at the root."""
        if self._sharded:
            return
        self._sharded = True
        if self.hparams.compile:
            for block in self.model.layers:
                block.compile()  # in place: parameter names (and so checkpoints) do not change
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None:
            return
        if self._late is not None:
            # the late-fusion path calls decoder.embed, forward_hidden and head.weight outside any FSDP forward, so
            # the root's parameters would stay sharded (and an unsharded connector's gradients unsynchronised)
            raise ValueError("model.late_fusion does not run under ModelParallelStrategy (FSDP2) yet: train it with "
                             "--trainer.strategy=ddp (or auto on one device)")
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        # Pure data parallelism: this decoder has no tensor-parallel layers, so shard over ALL ranks even
        # when the strategy's "auto" sizes split them into data x tensor (it does so within a node).
        dp_mesh = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
        if dp_mesh.size() != mesh.size():
            dp_mesh = init_device_mesh(mesh.device_type, (mesh.size(),), mesh_dim_names=("data_parallel",))
        for block in self.model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)
        register_fsdp_forward_method(self.model, "loss")  # root params are gathered around model.loss too

    # ---- training ----------------------------------------------------------------------------------
    def _losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._late is not None:
            return self._late_fusion_losses(batch)
        out = self.model.loss(
            batch["input_ids"], batch["document_ids"], batch.get("position_ids"),
            text_weight=self.hparams.text_weight, image_weight=self.hparams.image_weight,
            chunk_size=self.hparams.loss_chunk_size,
        )
        return {**out, "positions": (batch["document_ids"] >= 0).sum()}

    def _late_fusion_losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss of the late-fusion model on the same batch: codes replaced by the connector's view of the
        features, image placeholders ignored (label -100), the rest as in pretraining (CE + z-loss)."""
        if "image_features" not in batch:
            raise ValueError("a late-fusion model needs batches with image_features: set data.image_features true "
                             "(or leave it null) and tokenize the shards with --features")
        self._late.train(self.training)  # a frozen decoder runs in eval mode: no dropout
        if hasattr(self, "stage1_heads"):
            return self._qformer_stage1_losses(batch)
        config = self.model_config
        layout = late_layout(batch["input_ids"], batch["document_ids"], batch["image_features"],
                             config=self.late_config, image_offset=config.image_offset, image_codes=config.image_codes)
        if layout["input_ids"].shape[1] > config.max_seq_len:
            raise ValueError(f"late fusion made rows of {layout['input_ids'].shape[1]} positions (each image costs "
                             f"{self.late_config.per_image}), more than model.config.max_seq_len {config.max_seq_len}: "
                             "raise max_seq_len or lower data.seq_len")
        hidden = self._late.hidden(layout["input_ids"], features=layout["features"],
                                   feature_mask=layout["feature_mask"], document_ids=layout["document_ids"],
                                   position_ids=layout["position_ids"])
        out = fusion_loss_from_hidden(
            hidden, self.model.head.weight, layout["input_ids"], layout["document_ids"],
            image_offset=config.image_offset, image_codes=config.image_codes, z_loss_coef=config.z_loss_coef,
            text_weight=self.hparams.text_weight, image_weight=self.hparams.image_weight,
            chunk_size=self.hparams.loss_chunk_size, ignore_id=self.late_config.image_token_id,
        )
        return {**out, "positions": (layout["document_ids"] >= 0).sum()}

    def _qformer_stage1_losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """BLIP-2's stage 1 on the batch's one-image documents (image-text pairs): ITC + ITM + ITG, no decoder."""
        config, late = self.model_config, self.late_config
        pairs = caption_pairs(batch["input_ids"], batch["document_ids"], batch["image_features"],
                              image_offset=config.image_offset, image_codes=config.image_codes,
                              special_ids=list(late.special_ids), pad_id=0,  # padding is masked: never read
                              max_text_len=late.text_len)
        zero = batch["image_features"].new_zeros(())
        if pairs is None:  # nothing to contrast: a zero loss that still reaches every trainable weight
            loss = sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
            parts = {"itc": zero, "itm": zero, "itg": zero, "itc_accuracy": zero}
            count = zero.long()
        else:
            parts = self.stage1_heads(pairs["features"], pairs["text_ids"], pairs["text_mask"],
                                      pairs["feature_mask"], pair_ids=pairs["pair_ids"])
            loss, count = parts["loss"], pairs["pair_ids"].new_tensor(len(pairs["pair_ids"]))
        prefix = "train" if self.training else "val"
        self.log_dict({f"{prefix}/{name}": parts[name].detach() for name in ("itc", "itm", "itg", "itc_accuracy")},
                      on_step=self.training, on_epoch=not self.training, batch_size=max(int(count), 1))
        return {"loss": loss, "ce": loss, "z_loss": zero, "text_loss": parts["itg"].detach(), "image_loss": zero,
                "n_text_targets": count, "n_image_targets": zero.long(), "positions": zero.long()}

    def _weight(self, out: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss's denominator on this rank: modality-weighted number of targets."""
        return (out["n_text_targets"] * self.hparams.text_weight + out["n_image_targets"] * self.hparams.image_weight).float()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Loss of one micro-batch, scaled so that the optimizer sees the mean over every target of the step.

        Ranks and accumulated micro-batches hold different numbers of targets (documents end, padding), so each
        micro-batch contributes its loss sum over a common unit (the window's first global weight); DDP's
        mean over ranks and Lightning's division by accumulate_grad_batches are undone here, and
        configure_gradient_clipping rescales the summed gradients by unit / (the window's total weight).
        """
        if self._rng_to_restore is not None:  # first batch after a resume: continue the saved RNG streams
            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None
        self._batch_idx = batch_idx
        out = self._losses(batch)
        self.decoder_positions += int(out.pop("positions"))
        loss = out["loss"]
        weight = self._weight(out)
        # one collective for both: the global target weight and whether any rank saw a non-finite loss
        stats = torch.stack([weight, (~torch.isfinite(loss.detach())).float()])
        stats = self.trainer.strategy.reduce(stats, reduce_op="sum") if self.trainer.world_size > 1 else stats
        global_weight, bad_ranks = stats[0], int(stats[1].item())
        if bad_ranks:
            self._nonfinite(f"loss {loss.item()} on this rank ({bad_ranks} rank(s) non-finite)", batch_idx)
            # skip: a zero loss hanging off every parameter keeps DDP/FSDP collectives in step; the
            # optimizer step itself is dropped in configure_gradient_clipping
            self._bad_in_window = True
            return sum(p.sum() for p in self.parameters()) * 0.0
        if self._window_unit is None:
            self._window_unit, self._window_weight = global_weight.clamp_min(1e-12), global_weight.new_zeros(())
        self._window_weight = self._window_weight + global_weight
        scale = weight * self.trainer.world_size * self.trainer.accumulate_grad_batches / self._window_unit
        self.log_dict(
            {
                "train/loss": loss.detach(),
                "train/ce": out["ce"].detach(),
                "train/text_loss": out["text_loss"],
                "train/image_loss": out["image_loss"],
                "train/z_loss": out["z_loss"].detach(),
            },
            on_step=True, on_epoch=False, prog_bar=False,
        )
        self.log("loss", loss.detach(), on_step=True, on_epoch=False, prog_bar=True, logger=False)
        return loss * scale

    def _nonfinite(self, what: str, batch_idx: int) -> None:
        """Stop with a message naming step and batch, or (skip policy) count and carry on."""
        if self.hparams.nonfinite == "stop":
            callback = self.trainer.checkpoint_callback
            last = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "") or "none yet"
            raise NonFiniteLossError(
                f"non-finite {what} at optimizer step {self.global_step}, batch {batch_idx} of epoch "
                f"{self.current_epoch}; training stopped and no checkpoint was written for this step. "
                f"Last good checkpoint: {last}. Resume from it with a lower model.lr / tighter "
                f"trainer.gradient_clip_val, or set model.nonfinite=skip to drop such steps."
            )

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip the global grad norm (DTensor-aware, so FSDP2 works too), log it, and drop non-finite steps."""
        params = [p for p in self.parameters() if p.grad is not None]
        unit, total = self._window_unit, self._window_weight
        self._window_unit = self._window_weight = None
        if unit is not None and params and self.trainer.accumulate_grad_batches > 1:
            # (one micro-batch per step needs none: its unit is the total.) A Python float, because FSDP2's
            # gradients are DTensors, which foreach ops do not mix with plain tensors.
            torch._foreach_mul_([p.grad for p in params], float(unit / total.clamp_min(1e-12)))
        max_norm = float(gradient_clip_val) if gradient_clip_val else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if not torch.isfinite(norm) and not self._bad_in_window:
            self._nonfinite(f"gradient norm {norm.item()}", self._batch_idx)
            self._bad_in_window = True
        if self._bad_in_window:  # skip policy: no update at all (AdamW leaves params without grads untouched)
            self._bad_in_window = False
            self.skipped_steps += 1
            optimizer.zero_grad(set_to_none=True)
        self.log_dict(
            {"train/grad_norm": norm.detach().float(), "train/skipped_steps": float(self.skipped_steps),
             "train/lr": optimizer.param_groups[0]["lr"]},
            on_step=True, on_epoch=False,
        )

    # ---- validation ----------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        """Token-weighted validation loss over the held-out shards (all ranks)."""
        out = self._losses(batch)
        weight = self._weight(out)
        self.log("val/loss", out["loss"], on_epoch=True, sync_dist=True, batch_size=max(int(weight), 1), prog_bar=True)
        self.log("val/text_loss", out["text_loss"], on_epoch=True, sync_dist=True, batch_size=max(int(out["n_text_targets"]), 1))
        self.log("val/image_loss", out["image_loss"], on_epoch=True, sync_dist=True, batch_size=max(int(out["n_image_targets"]), 1))

    # ---- optimiser ------------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (decay on matrices only) + per-step warmup/decay schedule.

        The horizon comes from decay_steps or trainer.max_steps, never trainer.estimated_stepping_batches:
        that re-creates the train dataloader and drops the loader state restored from a checkpoint
        (Lightning issue 20550), which would break exact resume.
        """
        hp = self.hparams
        horizon = hp.decay_steps or (self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0 else None)
        if horizon is None:
            raise ValueError("set trainer.max_steps or model.decay_steps: the lr schedule needs a horizon")
        # the module, not only the decoder: a late-fusion connector trains too (frozen parameters are left out)
        optimizer = build_adamw(self, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, weight_decay=hp.weight_decay)
        schedule = WarmupDecay(min(hp.warmup_steps, max(horizon - 1, 0)), horizon, hp.lr_schedule, hp.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": build_scheduler(optimizer, schedule), "interval": "step"}}

    def on_train_start(self) -> None:
        """After a resume under another world size: continue the epoch's batch count where the loader is."""
        shift = align_batch_progress(self.trainer)
        if shift:
            progress = self.trainer.fit_loop.epoch_loop.batch_progress.current
            rank_zero_info(f"resumed under another world size x batch size: the epoch continues at batch "
                           f"{progress.ready} of {self.trainer.num_training_batches} (moved by {shift:+d})")

    # ---- checkpoint extras: RNG states of every rank, skipped-step count ----------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add all ranks' RNG states (as tensors) and the skip counter; called on every rank."""
        state = rng_state()
        if self.trainer.world_size > 1:
            # all ranks' states, so each continues its own dropout stream after a resume
            state = {k: self.all_gather(v.to(self.device)).cpu() for k, v in state.items()}
        else:
            state = {k: v.unsqueeze(0) for k, v in state.items()}
        checkpoint["rng_states"] = state
        checkpoint["skipped_steps"] = self.skipped_steps

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Pick this rank's RNG state (applied at the first batch, after loaders have drawn their seeds)."""
        self.skipped_steps = int(checkpoint.get("skipped_steps", 0))
        states = checkpoint.get("rng_states")
        if states is not None:
            rank = self.global_rank if states["torch"].shape[0] > self.global_rank else 0
            self._rng_to_restore = {k: v[rank] for k, v in states.items()}
