"""FusionLightningModule: pretraining of any model family (fusion_model.families) under any Lightning strategy."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info

from fusion_model.checkpoint import (
    architecture_differences,
    architecture_refusal,
    can_upcycle,
    checkpoint_config,
    load_model_and_hparams,
    upcycle_weights,
)
from fusion_model.config import FusionConfig, FusionConfigDict
from fusion_model.families import DEFAULT_FAMILY, adapters, family_class, resolve_family
from fusion_model.families.base import LossSettings, Objective, ObjectiveContext
from fusion_model.training.checkpointing import rng_state, set_rng_state
from fusion_model.training.optim import OptimizerRecipe, build_scheduler
from tokenizer.layout import image_code_mask

NONFINITE_POLICIES = ("stop", "skip")
# what `--model.train_only` may train with everything else frozen: the output head's rows of the image codes (Anole)
TRAIN_ONLY = ("image_head_rows",)


class NonFiniteLossError(RuntimeError):
    """Training met a NaN/inf loss or gradient norm and `nonfinite='stop'`."""


# The batch key under which the train loader hands a step the message of a damaged shard instead of data
# (data_shards.stream.DATA_ERROR; the model layers do not import the data layer).
DATA_ERROR = "data_error"


class DataFailureError(ValueError):
    """A rank's loader found damaged training data; raised on every rank at the same step (bad input: exit 2)."""


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
    """Pretraining of any model family (fusion_model.families) on packed batches (`input_ids`, `document_ids`,
    `position_ids`, each (B, T), plus what the family asks for).

    What every family shares lives here: each loss term is divided by its count over ALL data-parallel ranks and
    every micro-batch of the optimizer step, so one process with the global batch and N processes with 1/N of it
    each compute the same gradient; the non-finite step skip; RNG and resume state; logging of what the
    objective returns.
    """

    def __init__(
        self,
        # what is trained: the decoder, the family around it, where its weights start, the tokenizers its data used
        config: FusionConfigDict | FusionConfig | None = None,
        family: str = DEFAULT_FAMILY,
        family_options: dict | None = None,
        init_weights: str | None = None,
        tokenizers: dict[str, str] | None = None,
        peft: dict | None = None,
        train_only: str | None = None,
        # the optimizer recipe (OptimizerRecipe)
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-5,
        weight_decay: float = 0.1,
        warmup_steps: int = 4000,
        lr_schedule: str = "exponential",
        decay_steps: int | None = None,
        min_lr_ratio: float = 0.01,
        # the loss settings every family receives (LossSettings), and the key of the objective's own randomness
        text_weight: float = 1.0,
        image_weight: float = 1.0,
        loss_chunk_size: int = 4096,
        objective_seed: int = 0,
        # how a step runs
        activation_checkpointing: bool = False,
        compile: bool = False,
        nonfinite: str = "stop",
        # the older spelling of a late-fusion family (translated by resolve_family; checkpoints store None)
        late_fusion: dict | None = None,
    ) -> None:
        """`config` is the decoder, `family` what is trained around it and how; the rest is the recipe (defaults:
        Chameleon's), in four groups: what is trained, the optimizer (`self.recipe`), the loss (`self.family.losses`)
        and how a step runs. The arguments stay flat, as `--model.<name>` options and checkpoint hparams name them.

        config: a FusionConfig, or a dict naming a preset plus field overrides ({"preset": "small",
        "dropout": 0.1}; see FusionConfig.from_dict), or None for the tiny preset. hparams["config"] always
        holds the full resolved dict, so a checkpoint rebuilds the same decoder even if a preset changes.
        family: a registered family name (chameleon, llava, qformer, blip2-stage1, flamingo) or a dotted path
        `package.module:Class` to a fusion_model.families.base.Family subclass; family_options: its options (a
        late-fusion family's LateFusionConfig fields, e.g. {"stage": 2}).
        decay_steps: where the lr reaches `min_lr_ratio` x lr (default: trainer.max_steps).
        nonfinite: "stop" raises NonFiniteLossError naming the step and batch (no checkpoint is written
        for that step, so the last one stays good); "skip" drops that optimizer step and counts it.
        init_weights: start a new run from these decoder weights (a checkpoint file, e.g. from `train.py convert
        import`, or a transformers Chameleon directory); with config None the decoder config is the checkpoint's,
        otherwise its architecture must match, or differ only in the block: a dense checkpoint into a block with
        weights per modality (config.block "mot") is upcycled, each dense weight copied into every modality's copy.
        Its family must be this run's or chameleon (a decoder alone: what every family starts from). Ignored (never
        opened) when the run resumes from its own checkpoint: set trainer.ckpt_path before trainer.fit, as
        `train.py fit` does (trainer.fit(ckpt_path=...) alone sets it only after the setup hook that loads it).
        late_fusion: the older spelling of a late-fusion family, {"kind": "llava", "stage": 1, ...}: names the
        family of that kind and stage and gives its options (family_options win key by key); see
        fusion_model.families.resolve_family.
        objective_seed: the key of the objective's own randomness (noise, timesteps, hard negatives), drawn per
        sample and step (fusion_model.families.base.ObjectiveContext), never from a rank's generator.
        tokenizers: fingerprints of the vocabulary and image tokenizer the shards were made with ({"vocab": ...,
        "image_tokenizer": ...}; `train.py fit` takes them from the manifest): `generate` refuses others.
        peft: LoRA on the decoder's projections, {rank, alpha, dropout, targets: attention | mlp | all}
        (fusion_model.families.adapters.LoraOptions); the base (`init_weights`) is frozen and checkpoints hold the
        adapter and the base's path and fingerprint, not the base.
        train_only: "image_head_rows" trains only the output head's rows of the image codes (Anole's recipe); every
        other weight, the text rows included, stays bit-identical.
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
        self.recipe = OptimizerRecipe(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      warmup_steps=warmup_steps, lr_schedule=lr_schedule, decay_steps=decay_steps,
                                      min_lr_ratio=min_lr_ratio)
        if not isinstance(objective_seed, int) or isinstance(objective_seed, bool):
            raise ValueError(f"--model.objective_seed={objective_seed!r} is invalid: it must be an integer")
        config = dataclasses.replace(config, gradient_checkpointing=config.gradient_checkpointing or activation_checkpointing)
        family, family_options = resolve_family(family, family_options, late_fusion)
        # hparams hold only plain values (the config as a dict) so checkpoints load with weights_only=True
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = config.to_dict()
        self.model_config = config
        losses = LossSettings(text_weight=text_weight, image_weight=image_weight, chunk_size=loss_chunk_size)
        self.family = family_class(family)(config, family_options, losses)
        # the resolved spelling, so a checkpoint names its family whichever spelling trained it
        self.hparams.update(family=family, family_options=self.family.options_dict(), late_fusion=None)
        self.parts = self.family.build()
        for name, part in self.parts.items():
            self.add_module(name, part)
        self._init_weights = init_weights
        self.lora = adapters.LoraOptions.from_dict(peft) if peft is not None else None
        if train_only not in (None, *TRAIN_ONLY):
            raise ValueError(f"--model.train_only={train_only!r} is invalid: choose one of {list(TRAIN_ONLY)} or null")
        if self.lora is not None and train_only is not None:
            raise ValueError("--model.peft and --model.train_only each choose what trains: give one of them")
        if train_only is not None and config.image_offset is None:
            raise ValueError("--model.train_only image_head_rows needs the vocabulary's image block (image_offset, "
                             "image_codes) in model.config")
        if self.lora is not None and set(self.parts) != {"model"}:
            raise ValueError(f"--model.peft adapts the decoder alone, but the {family} family also trains "
                             f"{sorted(set(self.parts) - {'model'})}, which an adapter checkpoint would not hold: "
                             f"train it without --model.peft")
        self.hparams["peft"] = self.lora.to_dict() if self.lora is not None else None
        self._adapter_record: dict[str, str] | None = None  # the base an adapter was trained on (path, fingerprint)
        self._narrowed = False
        self.skipped_steps = 0
        self.decoder_positions = 0  # positions the decoder ran on in this process (late fusion changes the count)
        self._bad_in_window = False
        self._batch_idx = -1
        self._rng_to_restore: dict[str, torch.Tensor] | None = None
        self._sharded = False
        self._step_at_start: int | None = None  # the optimizer step training (re)started at in this process

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """The batch entries the family reads beyond ids, documents and positions (the data module adds them)."""
        return tuple(self.family.batch_keys)

    def window_denominators(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Each loss term's count in a batch, from the batch alone (the loader sums them over an optimizer step's
        micro-batches); None when the family cannot count without a forward."""
        return self.family.denominators(batch)

    # ---- model wrapping (FSDP2 / compile), called by Lightning inside the strategy's init context ----
    def setup(self, stage: str) -> None:
        """Load `init_weights` and what the family starts from into a new run (a resumed run restores its own
        checkpoint instead)."""
        if stage != "fit":
            return
        if self.trainer.ckpt_path is None:
            self._start_new_run()
        self._narrow_training(resuming=self.trainer.ckpt_path is not None)

    def _start_new_run(self) -> None:
        """What a new run starts from: the family's start, then `init_weights`."""
        self.family.start_new_run(self.parts)
        if not self._init_weights:
            return
        loaded, hparams = load_model_and_hparams(self._init_weights)
        self._refuse_another_family(hparams)
        weights = loaded.state_dict()
        differences = architecture_differences(loaded.config, self.model_config)
        if differences and can_upcycle(loaded.config, self.model_config):
            # continue a dense run with per-modality weights: every modality's copy starts as the dense weight
            weights = upcycle_weights(weights, self.parts["model"])
            rank_zero_info(f"model.init_weights {self._init_weights}: upcycled the dense weights into the "
                           f"{self.model_config.block} block (each modality's copy starts as the dense weight)")
        elif differences:
            raise ValueError(architecture_refusal(self._init_weights, loaded.config, self.model_config))
        self.parts["model"].load_state_dict(weights)

    def _refuse_another_family(self, hparams: dict) -> None:
        """Refuse init_weights trained by a family other than this run's or the plain decoder's (chameleon): only
        its decoder would carry over, without what that family trained around it, and nothing would say so."""
        source, _ = resolve_family(hparams.get("family"), hparams.get("family_options"), hparams.get("late_fusion"))
        run = self.hparams.family  # the resolved spelling, as checkpoints store it
        if source not in (DEFAULT_FAMILY, run, self.family.name):
            raise ValueError(
                f"model.init_weights {self._init_weights} was trained by the {source} family, but this run trains "
                f"the {run} family: start it from a {DEFAULT_FAMILY} checkpoint (a decoder alone, e.g. from `train.py "
                f"convert import`) or one of the {run} family, or train --model.family {source}"
            )

    def _narrow_training(self, resuming: bool) -> None:
        """Freeze what `peft` / `train_only` do not train, after the base weights are in and before compile and
        parallelisation: LoRA wraps the decoder's projections (B = 0: the start is the base); `image_head_rows`
        leaves only the head trainable and zeroes the gradient of its text rows."""
        if self._narrowed or (self.lora is None and self.hparams.train_only is None):
            return
        self._narrowed = True
        model = self.parts["model"]
        if self.lora is not None:
            if not resuming:
                if not self._init_weights:
                    raise ValueError("--model.peft trains an adapter on a base: give the base's weights with "
                                     "--model.init_weights PATH")
                # the weights as loaded (after upcycling): what generate and a resume find again at this path
                self._adapter_record = adapters.adapter_record(self._init_weights, model.state_dict())
            for param in self.parameters():
                param.requires_grad_(False)
            # on resume the base (and the adapter) come in on_load_checkpoint
            adapters.inject_lora(model, self.lora, seed=self.hparams.objective_seed)
            return
        for param in self.parameters():
            param.requires_grad_(False)
        head = model.head.weight
        head.requires_grad_(True)
        rows = torch.arange(head.shape[0])
        text_rows = ~image_code_mask(rows, model.config.image_offset, model.config.image_codes)
        # zero before accumulation, clipping and the optimizer: Adam's moments of the text rows stay 0, so their
        # update is exactly 0 (and configure_optimizers gives the head no weight decay)
        head.register_hook(lambda grad: grad.masked_fill(text_rows.to(grad.device)[:, None], 0.0))

    @property
    def trained_in_this_process(self) -> bool:
        """Whether an optimizer step ran in this process (before one, a failed start wrote nothing worth keeping)."""
        return self._step_at_start is not None and self.trainer.global_step > self._step_at_start

    def configure_model(self) -> None:
        """Apply torch.compile and, under ModelParallelStrategy, FSDP2 as the family shards itself."""
        if self._sharded:
            return
        self._sharded = True
        if getattr(self, "_device_mesh", None) is not None and (self.lora is not None or self.hparams.train_only):
            raise ValueError("--model.peft and --model.train_only do not run under ModelParallelStrategy (FSDP2): "
                             "train them with the ddp strategy (the frozen base needs no sharded optimizer state)")
        if self.hparams.compile:
            self.family.compile(self.parts)  # in place: parameter names (and so checkpoints) do not change
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None:
            return
        self.family.parallelize(self.parts, mesh)

    # ---- training ----------------------------------------------------------------------------------
    def objective(self, batch: dict[str, torch.Tensor]) -> Objective:
        """The family's objective on one micro-batch, keyed by the current optimizer step."""
        self.family.set_mode(self.parts, self.training)
        context = ObjectiveContext(step=self.global_step, seed=self.hparams.objective_seed, training=self.training)
        return self.family.objective(self.parts, batch, context)

    def _denominators(self, objective: Objective, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each term's count over the optimizer step on this rank: the loader's sum over the step's micro-batches
        (`window_denominators`), or this micro-batch's own when nothing is accumulated."""
        window = batch.get("window_denominators")
        if window is not None:
            if set(window) != set(objective.terms):
                raise ValueError(f"the {self.family.name} family's denominators() counts {sorted(window)} but its "
                                 f"objective returns the terms {sorted(objective.terms)}: they must name the same terms")
            return torch.stack([window[name].float().reshape(()) for name in objective.terms]).to(self.device)
        if self.trainer.accumulate_grad_batches > 1:
            raise ValueError(
                f"trainer.accumulate_grad_batches={self.trainer.accumulate_grad_batches}, but the batches carry no "
                f"window_denominators: the {self.family.name} family cannot count its loss terms without a forward, "
                "or the train loader does not read a step ahead (FusionDataModule does): accumulate 1 and raise "
                "data.batch_size instead"
            )
        return objective.counts()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Loss of one micro-batch, scaled so that the optimizer sees each term's mean over the whole step.

        Ranks and micro-batches hold different numbers of targets (documents end, padding), so each term's sum is
        divided by its count over every rank and micro-batch of the step; DDP's mean over ranks and Lightning's
        division by accumulate_grad_batches are undone here.
        """
        if self._rng_to_restore is not None:  # first batch after a resume: continue the saved RNG streams
            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None
        self._batch_idx = batch_idx
        objective = self.objective(batch)
        self.decoder_positions += int(objective.positions)
        denominators = self._denominators(objective, batch)
        raw = torch.stack([term.total.detach().float().reshape(()) for term in objective.terms.values()]).sum()
        # one collective for all: the global counts, whether any rank saw a non-finite loss, and whether any rank's
        # loader found a damaged shard (its batch is padding that carries the message)
        data_error = batch.get(DATA_ERROR)
        flags = torch.stack([(~torch.isfinite(raw)).float(), raw.new_tensor(float(data_error is not None))])
        stats = torch.cat([denominators, flags.to(denominators.device)])
        stats = self.trainer.strategy.reduce(stats, reduce_op="sum") if self.trainer.world_size > 1 else stats
        global_denominators, bad_ranks, data_ranks = stats[:-2], int(stats[-2].item()), int(stats[-1].item())
        if data_ranks:
            self._data_failure(data_error, data_ranks, batch_idx)
        if bad_ranks:
            self._nonfinite(f"loss {raw.item()} on this rank ({bad_ranks} rank(s) non-finite)", batch_idx)
            # skip: a zero loss hanging off every parameter keeps DDP/FSDP collectives in step; the
            # optimizer step itself is dropped in configure_gradient_clipping
            self._bad_in_window = True
            return sum(p.sum() for p in self.parameters()) * 0.0
        loss = objective.loss(global_denominators)
        self._log_objective(objective, "train")
        shown = objective.mean(next(iter(objective.terms))) if len(objective.terms) == 1 else loss.detach()
        self.log("loss", shown, on_step=True, on_epoch=False, prog_bar=True, logger=False)
        return loss * self.trainer.world_size * self.trainer.accumulate_grad_batches

    def _log_objective(self, objective: Objective, prefix: str) -> None:
        """Log each term's mean (`<prefix>/<term>`; one term is `<prefix>/loss`) and each metric."""
        training = prefix == "train"

        def weight(count: torch.Tensor | int) -> int:  # validation averages by it; a training step logs as is
            return 1 if training else max(int(count), 1)

        for name, term in objective.terms.items():
            self.log(f"{prefix}/{name}", objective.mean(name), on_step=training, on_epoch=not training,
                     sync_dist=not training, batch_size=weight(term.count), prog_bar=not training)
        for name, (value, count) in objective.metrics.items():
            self.log(f"{prefix}/{name}", value, on_step=training, on_epoch=not training, sync_dist=not training,
                     batch_size=weight(count))

    def _data_failure(self, message: str | None, ranks: int, batch_idx: int) -> None:
        """Raise DataFailureError on every rank, naming what each failing rank found (every rank is in this step)."""
        messages = [message]
        if self.trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            messages = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(messages, message)  # all ranks got here from the same all-reduce
        found = "; ".join(m for m in messages if m) or f"{ranks} rank(s) found damaged data (see their logs)"
        raise DataFailureError(
            f"damaged training data at optimizer step {self.global_step}, batch {batch_idx} of epoch "
            f"{self.current_epoch}: {found}. Training stopped on every rank; no checkpoint was written for this step."
        )

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
        """Each term's and metric's validation mean over the held-out shards (all ranks), weighted by its count."""
        self._log_objective(self.objective(batch), "val")

    # ---- optimiser ------------------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW (decay on matrices only) + per-step warmup/decay schedule.

        The horizon comes from decay_steps or trainer.max_steps, never trainer.estimated_stepping_batches:
        that re-creates the train dataloader and drops the loader state restored from a checkpoint
        (Lightning issue 20550), which would break exact resume.
        """
        # the module, not only the decoder: a late-fusion connector trains too (frozen parameters are left out)
        # image_head_rows: no weight decay may reach the head's frozen text rows
        undecayed = [self.parts["model"].head.weight] if self.hparams.train_only else []
        optimizer = self.recipe.optimizer(self, undecayed)
        schedule = self.recipe.schedule(self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": build_scheduler(optimizer, schedule), "interval": "step"}}

    def on_train_start(self) -> None:
        """Say how many parameters train; after a resume under another world size, continue the epoch's batch count
        where the loader is."""
        self._step_at_start = self.trainer.global_step  # restored by now
        trainable, total = adapters.count_parameters(self)
        if self.hparams.train_only:  # the head is trainable as one matrix, but only its image-code rows move
            trainable = self.model_config.image_codes * self.parts["model"].head.weight.shape[1]
        rank_zero_info(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / max(total, 1):.3g}%)")
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
        if self.lora is not None:
            # an adapter checkpoint: the LoRA weights and where its base is, never the base itself
            trained = {name for name, p in self.named_parameters() if p.requires_grad}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trained}
            checkpoint[adapters.ADAPTER_KEY] = dict(self._adapter_record or {})

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Pick this rank's RNG state (applied at the first batch, after loaders have drawn their seeds); put an
        adapter checkpoint's base back under its adapter."""
        self._restore_base(checkpoint)
        self.skipped_steps = int(checkpoint.get("skipped_steps", 0))
        states = checkpoint.get("rng_states")
        if states is not None:
            rank = self.global_rank if states["torch"].shape[0] > self.global_rank else 0
            self._rng_to_restore = {k: v[rank] for k, v in states.items()}

    def _restore_base(self, checkpoint: dict[str, Any]) -> None:
        """An adapter checkpoint holds no base: read it from `--model.init_weights` given again or the recorded
        path, check its fingerprint, and add its weights to the state Lightning loads next."""
        record = checkpoint.get(adapters.ADAPTER_KEY)
        if record is None:
            return
        if self.lora is None:
            stored = checkpoint.get("hyper_parameters", {}).get("peft")
            raise ValueError(f"this checkpoint holds a LoRA adapter: resume it with the same --model.peft '{stored}'")
        model = self.parts["model"]
        where = str(self.trainer.ckpt_path) if self._trainer is not None else "the checkpoint"
        weights = adapters.checked_base(record, model, self._init_weights, where)
        for name, value in adapters.wrapped_names(model, weights).items():
            checkpoint["state_dict"].setdefault(f"model.{name}", value)
        self._adapter_record = dict(record)
