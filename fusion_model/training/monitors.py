"""Training-stability monitors: attention logits, block output norms, output log Z, gradient norms and update ratios
every N steps (StabilityMonitor), and an early warning when they grow too fast (InstabilityWarning).

The quantities are the early signs of the divergences that Chameleon's QK-norm, swin norm and z-loss prevent:
attention-logit growth and output logits drifting away from log-probabilities (Wortsman et al. 2023, "Small-scale
proxies for large-scale Transformer training instabilities", arXiv 2309.14322), and the growth of each block's
output norm (Chameleon, arXiv 2405.09818, section 2.3).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from fusion_model.layers import attention_backends as attn_lib
from fusion_model.layers import roles
from fusion_model.layers.loss import next_token_targets, target_weights
from fusion_model.layers.rope import rope_cos_sin
from fusion_model.model import FusionModel

PARAMETER_GROUPS = ("embeddings", "attention", "mlp", "norms", "output_head")
PREFIX = "stability"
# elements of one chunk of scores or logits (fp32: 64 MiB), so that no (T x T) or (tokens x vocab) tensor is whole
CHUNK_ELEMENTS = 1 << 24
COUNT = "targets"  # per-modality target counts: combine means over ranks, never logged


# the group of each role (`fusion_model.layers.roles`): QK-norm's weights are norms, though they live inside attention
GROUP_OF_ROLE = {roles.EMBEDDING: "embeddings", roles.ATTENTION: "attention", roles.ATTENTION_OUTPUT: "attention",
                 roles.MLP: "mlp", roles.MLP_OUTPUT: "mlp", roles.NORM: "norms", roles.OUTPUT_HEAD: "output_head",
                 roles.ADAPTER: "adapter"}  # LoRA's A and B (--model.peft): a group of their own, beside "other"


def parameter_groups(model: torch.nn.Module) -> dict[str, str]:
    """{parameter name: group} of a FusionModel's parameters, from the roles its modules declare: embeddings,
    attention, mlp, norms (RMSNorm, QK-norm), output_head; a parameter of no such role (a wrapper's extra one) is
    "other"."""
    return {name: GROUP_OF_ROLE.get(role, "other") for name, _, role in roles.parameter_roles(model)}


def max_attention_logit(q: torch.Tensor, k: torch.Tensor, document_ids: torch.Tensor,
                        runs: torch.Tensor | None = None, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Max of q·k/sqrt(head_dim) over batch, heads and the (query, key) pairs the attention mask allows.

    q (B, H, T, hd) and k (B, H_kv, T, hd) as the attention kernel sees them (after QK-norm and RoPE); the mask is
    `attention.build_mask`'s (same document, causal, padding attends to itself, image runs both ways when given).
    Computed in fp32 (autocast off: bf16 would round the very logits it measures) over chunks of queries, so the
    (T, T) scores never exist whole.
    """
    batch, heads, length, head_dim = q.shape
    if k.shape[2] != length:
        raise ValueError(f"max_attention_logit: {k.shape[2]} keys for {length} queries; call it without a KV cache")
    with torch.autocast(q.device.type, enabled=False):
        return _masked_max(q, k, document_ids, runs, chunk_elements)


def _masked_max(q: torch.Tensor, k: torch.Tensor, document_ids: torch.Tensor, runs: torch.Tensor | None,
                chunk_elements: int) -> torch.Tensor:
    batch, heads, length, head_dim = q.shape
    keys = k.float().repeat_interleave(heads // k.shape[1], dim=1).transpose(-1, -2)
    queries = q.float() * head_dim**-0.5
    index = torch.arange(length, device=q.device)
    chunk = max(1, chunk_elements // max(1, batch * heads * length))
    best = torch.full((), -math.inf, device=q.device)
    for start in range(0, length, chunk):
        stop = min(length, start + chunk)
        # without bidirectional image runs no query sees a later key: the keys end at the chunk's last query
        end = length if runs is not None else stop
        scores = queries[:, :, start:stop] @ keys[..., :end]
        allowed = attn_lib.build_mask(document_ids[:, start:stop], document_ids[:, :end], index[start:stop],
                                      index[:end], None if runs is None else runs[:, start:stop],
                                      None if runs is None else runs[:, :end])
        best = torch.maximum(best, scores.masked_fill_(~allowed, -math.inf).amax())
    return best


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(this rank's part of a tensor, whether it is a shard): FSDP2 keeps DTensors, whose shards sum over ranks."""
    to_local = getattr(tensor, "to_local", None)
    return (to_local(), True) if callable(to_local) else (tensor, False)


class StabilityMonitor(L.Callback):
    """Every `every_n_steps` optimizer steps, logs to the trainer's loggers (TensorBoard, CSV) under `stability/`:

    - `attn_logit_max/layer_NN` (and `/all_layers`): max over heads and allowed positions of q·k/sqrt(head_dim)
      after QK-norm and RoPE, before the softmax;
    - `block_rms/layer_NN`: RMS of the residual stream after each block (non-padding tokens);
    - `text/logit_mean`, `text/log_z_mean`, `image/...`: mean output logit and mean log Z (logsumexp) at text and
      image target positions; `z_loss` (as the loss adds it) and `log_z_sq_mean` (unweighted, also without z-loss);
    - `grad_norm/<group>`: gradient norm per parameter group (`PARAMETER_GROUPS`; `adapter` for LoRA's weights and
      `other` when present; frozen parameters have none) before clipping, as the module's
      `train/grad_norm` counts it;
    - `update_ratio/<group>`: ||w_after - w_before|| / ||w_before|| of the optimizer step.

    The per-modality losses are the module's `train/text_loss` and `train/image_loss`. The forward statistics come
    from one extra no-grad forward (eval mode: no dropout, so the training RNG streams are untouched) on the first
    micro-batch of a monitored step, before its training forward, with the same weights and precision context; the
    update ratio keeps a copy of the parameters from just before the optimizer step until just after it. Nothing
    runs on other steps. Under DDP the forward statistics are gathered over ranks (max for maxima, mean otherwise).
    Metrics are logged at the step index Lightning gives that step's `train/loss`; `latest` holds the last ones.
    """

    def __init__(self, every_n_steps: int = 50, update_ratio: bool = True) -> None:
        """update_ratio: False skips the copy of the parameters (its memory) and the `update_ratio/*` metrics."""
        super().__init__()
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"StabilityMonitor: every_n_steps must be a positive integer, got {every_n_steps!r}")
        self.every_n_steps, self.update_ratio = every_n_steps, update_ratio
        self.latest: dict[str, float] = {}
        self.latest_step = -1
        self._pending: dict[str, torch.Tensor] = {}
        self._measured_step = -1
        self._before: list[torch.Tensor] | None = None
        self._raw_grad_sq: dict[str, torch.Tensor] = {}
        self._groups: dict[str, str] = {}
        self._sharded = False
        self._observer = None
        self._attention_inputs: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._attention_maxima: dict[int, torch.Tensor] = {}
        self._listeners: list[Callable[[L.Trainer, int, dict[str, float]], None]] = []

    def add_listener(self, listener: Callable[[L.Trainer, int, dict[str, float]], None]) -> None:
        """Call `listener(trainer, step, metrics)` after each logged point (InstabilityWarning reads them so)."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    # ---- when -----------------------------------------------------------------------------------------
    def _due(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        """On the first micro-batch of a monitored step, measure the forward statistics."""
        step = trainer.global_step
        if not self._due(step) or step == self._measured_step:
            return
        self._measured_step = step
        weights = [float(getattr(pl_module.hparams, name, 1.0)) for name in ("text_weight", "image_weight")]
        with trainer.precision_plugin.forward_context():
            self._pending = self.forward_statistics(pl_module.model, batch, *weights)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        """Gradient norms per group (before clipping) and a copy of the weights for the update ratio."""
        if not self._due(trainer.global_step) or self._measured_step != trainer.global_step:
            return
        named = self._trained(pl_module)
        self._groups = parameter_groups(pl_module.model)
        self._raw_grad_sq, self._sharded = self._group_sums(
            ((name, p.grad.detach()) for name, p in named if p.grad is not None), self._groups
        )
        if self.update_ratio:
            self._before = [p.detach().clone() for _, p in named]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        """After the optimizer step of a monitored step: finish the update ratios, reduce over ranks and log."""
        step = trainer.global_step - 1  # the step that just finished
        if step != self._measured_step or not self._pending:
            return  # not monitored, still accumulating, or already logged
        values = self._gather(trainer, self._pending)
        values.update(self._gradient_statistics(trainer, pl_module))
        self._pending, self._before, self._raw_grad_sq = {}, None, {}
        names = list(values)
        numbers = torch.stack([values[name].float() for name in names]).tolist() if names else []  # one transfer
        self.latest = dict(zip(names, numbers))
        self.latest_step = step
        for logger in trainer.loggers:
            logger.log_metrics(self.latest, step=step)
        for listener in self._listeners:
            listener(trainer, step, self.latest)

    # ---- the forward statistics --------------------------------------------------------------------------
    @torch.no_grad()
    def forward_statistics(self, model: FusionModel, batch: dict[str, torch.Tensor], text_weight: float = 1.0,
                           image_weight: float = 1.0) -> dict[str, torch.Tensor]:
        """The forward quantities of one batch (0-dim tensors by metric name), in eval mode, without gradients.

        Runs forward_hidden's steps itself (the blocks as they are called in training, compiled or sharded), so
        that each block's output is seen without a hook: a hook inside a compiled block would change its graph.
        """
        input_ids, document_ids = batch["input_ids"], batch.get("document_ids")
        if document_ids is None:
            document_ids = torch.zeros_like(input_ids)
        config = model.config
        runs = None
        if config.image_bidirectional:  # continuous-image placeholders are image positions too (Transfusion)
            runs = attn_lib.image_runs(input_ids, config.image_offset, config.image_codes, config.image_placeholder_id)
        real = (document_ids >= 0)[..., None]
        width = len(str(config.n_layers - 1))
        if self._observer is None:
            # one object for the whole run: a compiled block guards on it, and calls it eagerly instead of tracing
            self._observer = torch.compiler.disable(self._observe)
        self._attention_inputs, self._attention_maxima = (document_ids, runs), {}
        found: dict[str, torch.Tensor] = {}
        attentions = [block.attn for block in model.layers]
        was_training = model.training
        unshard = getattr(model, "unshard", None)  # FSDP2: the root's own parameters (embedding, norm, head)
        try:
            for attention in attentions:
                attention.observer = self._observer
            model.eval()
            if callable(unshard):
                unshard()
            ctx, position_ids = model.attention_context(input_ids, document_ids, batch.get("position_ids"), None)
            x = model.embed(input_ids)
            cos, sin = rope_cos_sin(position_ids, config.head_dim, config.rope_theta, x.dtype)
            for layer, block in enumerate(model.layers):
                x = block(x, cos, sin, ctx)
                squares = x.float().pow(2).mean(-1, keepdim=True)
                found[f"block_rms/layer_{layer:0{width}d}"] = ((squares * real).sum() / real.sum().clamp_min(1)).sqrt()
            found.update(self._output_statistics(model, model.norm(x), input_ids, document_ids, text_weight, image_weight,
                                                 batch.get("target_mask")))
        finally:
            for attention in attentions:
                attention.observer = None
            model.train(was_training)
            if callable(unshard):
                model.reshard()
        maxima = self._attention_maxima
        self._attention_inputs, self._attention_maxima = None, {}
        for layer, value in maxima.items():
            found[f"attn_logit_max/layer_{layer:0{width}d}"] = value
        found["attn_logit_max/all_layers"] = torch.stack(list(maxima.values())).max()
        return {f"{PREFIX}/{name}": value.detach().float() for name, value in found.items()}

    def _observe(self, attention: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, ctx) -> None:
        """Attention's observer: the masked max logit of this layer (q, k are dropped right after)."""
        document_ids, runs = self._attention_inputs
        self._attention_maxima[attention.layer] = max_attention_logit(q, k, document_ids, runs)

    @staticmethod
    def _output_statistics(model: FusionModel, hidden: torch.Tensor, input_ids: torch.Tensor,
                           document_ids: torch.Tensor, text_weight: float, image_weight: float,
                           target_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Mean logit and mean log Z at text / image targets (NaN without such targets, with their counts), the
        z-loss as the loss computes it and the unweighted mean log Z², in chunks of targets; with `target_mask` (a
        conversation's answers) only the targets the loss is taken on."""
        config = model.config
        targets, valid = next_token_targets(input_ids, document_ids, target_mask=target_mask)
        flat, targets = hidden[:, :-1][valid], targets[valid]
        is_image, _ = target_weights(targets, config.image_offset, config.image_codes, 1.0, 1.0)
        head = model.head.weight
        chunk = max(1, CHUNK_ELEMENTS // head.shape[0])
        # per modality: count, sum of each target's mean logit, sum of log Z, sum of log Z^2
        sums = torch.zeros(2, 4, device=hidden.device)
        for start in range(0, len(targets), chunk):
            logits = (flat[start : start + chunk] @ head.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            rows = torch.stack([torch.ones_like(lse), logits.mean(-1), lse, lse.pow(2)], dim=1)
            sums.index_add_(0, is_image[start : start + chunk].long(), rows)
        found = {}
        for index, name in enumerate(("text", "image")):
            count = sums[index, 0]
            found[f"{name}/{COUNT}"] = count
            found[f"{name}/logit_mean"] = sums[index, 1] / count  # NaN without targets: not logged
            found[f"{name}/log_z_mean"] = sums[index, 2] / count
        found["log_z_sq_mean"] = sums[:, 3].sum() / sums[:, 0].sum().clamp_min(1)
        weights = torch.tensor([text_weight, image_weight], device=sums.device)
        found["z_loss"] = config.z_loss_coef * (sums[:, 3] * weights).sum() / (sums[:, 0] * weights).sum().clamp_min(1e-12)
        return found

    # ---- gradients and updates -------------------------------------------------------------------------
    @staticmethod
    def _group_sums(named_tensors, groups: dict[str, str]) -> tuple[dict[str, torch.Tensor], bool]:
        """Sum of squares per parameter group (`groups`: name -> group) of this rank's (part of the) tensors, and
        whether any is a shard."""
        sums: dict[str, torch.Tensor] = {}
        sharded = False
        for name, tensor in named_tensors:
            local, is_shard = _local(tensor)
            sharded |= is_shard
            group = groups[name]
            square = local.float().pow(2).sum()
            sums[group] = sums[group] + square if group in sums else square
        return sums, sharded

    def _gradient_statistics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, torch.Tensor]:
        """Gradient norm and update ratio per group, reduced over shards when FSDP2 holds them."""
        groups = [g for g in (*PARAMETER_GROUPS, "adapter", "other") if g in self._raw_grad_sq]
        if not groups:
            return {}
        grad_sq = torch.stack([self._raw_grad_sq[g] for g in groups])
        named = self._trained(pl_module)
        rows = [grad_sq]
        if self._before is not None:
            weight_sq, _ = self._group_sums(((name, old) for (name, _), old in zip(named, self._before)), self._groups)
            update_sq, _ = self._group_sums(((name, p.detach() - old) for (name, p), old in zip(named, self._before)),
                                            self._groups)
            zero = grad_sq.new_zeros(())
            rows += [torch.stack([weight_sq.get(g, zero) for g in groups]),
                     torch.stack([update_sq.get(g, zero) for g in groups])]
        stacked = torch.stack(rows)
        if self._sharded and trainer.world_size > 1:
            stacked = trainer.strategy.reduce(stacked, reduce_op="sum")
        grad_norms = stacked[0].sqrt()
        # With accumulation, FusionLightningModule rescales the summed gradients by one factor in
        # configure_gradient_clipping, after this hook: its logged train/grad_norm is that rescaled total, so the
        # groups take the same factor.
        logged = trainer.callback_metrics.get("train/grad_norm")
        total = grad_norms.pow(2).sum().sqrt()
        if trainer.accumulate_grad_batches > 1 and logged is not None and torch.isfinite(logged) and total > 0:
            grad_norms = grad_norms * (logged.to(total) / total)
        found = {f"{PREFIX}/grad_norm/{g}": grad_norms[i] for i, g in enumerate(groups)}
        if len(rows) == 3:
            ratios = stacked[2].sqrt() / stacked[1].sqrt().clamp_min(1e-30)
            found.update({f"{PREFIX}/update_ratio/{g}": ratios[i] for i, g in enumerate(groups)})
        return found

    @staticmethod
    def _trained(pl_module: L.LightningModule) -> list[tuple[str, torch.Tensor]]:
        """The decoder's trained parameters by name (a frozen base under LoRA or head-only training is not copied)."""
        return [(name, p) for name, p in pl_module.model.named_parameters() if p.requires_grad]

    @staticmethod
    def _gather(trainer: L.Trainer, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Combine the ranks' forward statistics (max for attention maxima, target-weighted means per modality, mean
        otherwise); drop the statistics of a modality without targets, and the counts."""
        if trainer.world_size > 1:
            names = sorted(values)
            everyone = trainer.strategy.all_gather(torch.stack([values[name] for name in names]))  # (world, metrics)
            columns = {name: everyone[:, i] for i, name in enumerate(names)}
            combined = {}
            for name, column in columns.items():
                count = columns.get(_count_name(name))
                if "attn_logit_max" in name:
                    combined[name] = column.max()
                elif name.endswith(COUNT):
                    combined[name] = column.sum()
                elif count is not None:  # a rank without such targets holds NaN there
                    combined[name] = (torch.where(count > 0, column, 0.0) * count).sum() / count.sum()
                else:
                    combined[name] = column.mean()
            values = combined
        return {name: value for name, value in values.items() if not name.endswith(COUNT)
                and (_count_name(name) is None or values[_count_name(name)] > 0)}


def _count_name(name: str) -> str | None:
    """The target count a per-modality statistic is a mean over (None for other metrics)."""
    parts = name.split("/")
    if len(parts) == 3 and parts[1] in ("text", "image") and parts[2] != COUNT:
        return f"{parts[0]}/{parts[1]}/{COUNT}"
    return None


class InstabilityWarning(L.Callback):
    """Early warning on a StabilityMonitor's metrics: warns on rank zero, naming the step, the layer and the quantity,
    when the max attention logit or the block output RMS of a layer grows more than `growth_factor` times within
    `window` monitor points, when the mean log Z at text or image targets leaves [-log_z_bound, log_z_bound], or
    when a monitored value is no longer finite. With `save_checkpoint` it also saves
    `<default_root_dir>/checkpoints/warning-step=N.ckpt` right after step N's update (at most once per `window`
    monitor points).

    Growth counts only past a floor (`min_attn_logit`, `min_block_rms`): early in training both grow many-fold
    from their initial values as a matter of course, while logits of tens make the softmax one-hot and lose
    precision in bf16. Each layer's series warns at most once per window. FusionLightningModule's stop on a
    non-finite loss is unchanged; this fires before it.
    """

    def __init__(self, growth_factor: float = 2.0, window: int = 10, min_attn_logit: float = 30.0,
                 min_block_rms: float = 30.0, log_z_bound: float = 30.0, save_checkpoint: bool = False) -> None:
        """window: monitor points (StabilityMonitor.every_n_steps steps each) over which growth is measured."""
        super().__init__()
        if not growth_factor > 1.0:
            raise ValueError(f"InstabilityWarning: growth_factor must be > 1, got {growth_factor!r}")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"InstabilityWarning: window must be a positive integer, got {window!r}")
        if not log_z_bound > 0:
            raise ValueError(f"InstabilityWarning: log_z_bound must be > 0, got {log_z_bound!r}")
        self.growth_factor, self.window, self.log_z_bound = growth_factor, window, log_z_bound
        self.floors = {"attn_logit_max": min_attn_logit, "block_rms": min_block_rms}
        self.save_checkpoint = save_checkpoint
        self.events: list[dict[str, Any]] = []  # every warning: step, quantity, layer, value, message
        self._points = 0
        self._last_save_point: int | None = None
        self._history: dict[str, deque] = {}
        self._outside: dict[str, bool] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Listen to the StabilityMonitor's points (right after each is logged, whatever the callbacks' order)."""
        monitors = [callback for callback in trainer.callbacks if isinstance(callback, StabilityMonitor)]
        if not monitors:
            raise ValueError("InstabilityWarning reads a StabilityMonitor's metrics: add "
                             "fusion_model.training.monitors.StabilityMonitor to trainer.callbacks too")
        monitors[0].add_listener(self.on_monitor_point)

    def on_monitor_point(self, trainer: L.Trainer, step: int, metrics: dict[str, float]) -> None:
        """Warn about one point; save a checkpoint when asked to."""
        self._points += 1
        events = self.check(step, metrics)
        for event in events:
            rank_zero_warn(event["message"])
        self.events += events
        due = self._last_save_point is None or self._points - self._last_save_point >= self.window
        if events and self.save_checkpoint and due:
            # every rank decides alike (the monitor's values are gathered), as a sharded save needs all of them
            self._last_save_point = self._points
            trainer.save_checkpoint(Path(trainer.default_root_dir) / "checkpoints" / f"warning-step={step}.ckpt",
                                    weights_only=False)  # full, to resume from just before the warning

    def check(self, step: int, metrics: dict[str, float]) -> list[dict[str, Any]]:
        """The warnings that one monitor point raises (and update the windows)."""
        events = []
        for name, value in metrics.items():
            parts = name.split("/")
            quantity, where = parts[1] if len(parts) > 1 else name, parts[-1]
            if quantity in self.floors and where.startswith("layer_"):
                layer = int(where.removeprefix("layer_"))
                if not math.isfinite(value):
                    events.append(self._event(step, quantity, layer, value, f"{quantity} is {value}"))
                    continue
                history = self._history.setdefault(name, deque(maxlen=self.window + 1))
                history.append(value)
                then = history[0]
                # compared with the oldest point of the window, full or not: a fast blow-up warns at once
                if len(history) > 1 and value >= self.floors[quantity] and value > self.growth_factor * then > 0:
                    events.append(self._event(step, quantity, layer, value,
                                              f"{quantity} grew {value / then:.2f}x over the last {len(history) - 1} "
                                              f"monitor points ({then:.4g} -> {value:.4g})"))
                    history.clear()
                    history.append(value)
            elif quantity in ("text", "image") and where == "log_z_mean":
                outside = not math.isfinite(value) or abs(value) > self.log_z_bound
                if outside and not self._outside.get(name, False):
                    events.append(self._event(step, f"{quantity} log_z_mean", "output", value,
                                              f"mean log Z at {quantity} targets is {value:.4g}, past "
                                              f"+-{self.log_z_bound:g}: the output logits drift from log-probabilities"))
                self._outside[name] = outside
        return events

    @staticmethod
    def _event(step: int, quantity: str, layer: int | str, value: float, what: str) -> dict[str, Any]:
        where = f"layer {layer}" if isinstance(layer, int) else f"the {layer} layer"
        message = (f"InstabilityWarning: step {step}, {where}: {what}. Training may diverge; consider a lower "
                   "learning rate, model.config.qk_norm, model.config.z_loss_coef or norm_placement swin.")
        return {"step": step, "quantity": quantity, "layer": layer, "value": value, "message": message}
