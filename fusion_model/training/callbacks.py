"""Training callbacks: throughput and MFU, sample writing, a time budget, plain-text progress lines."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import lightning as L
import torch
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.utilities import rank_zero_info

from fusion_model.training.flops import matmul_peak_flops, sync


class ThroughputMonitor(L.Callback):
    """Logs `train/tokens_per_s` (all ranks) and `train/mfu` after every optimizer step.

    MFU = model FLOPs per token (the family's flops_per_token(seq_len), forward + backward: the decoder's plus
    what the family runs around it) x tokens/s, divided by `peak_flops` per device x world size. Without a
    configured peak it measures one with a matmul in the training dtype at the start of fit (a lower bound of the
    datasheet peak, so the MFU is an upper bound).
    """

    def __init__(self, peak_flops: float | None = None) -> None:
        super().__init__()
        self.peak_flops = peak_flops
        self._window_start: float | None = None
        self._window_tokens = 0
        self._last_step = -1

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Measure the peak once if none was configured."""
        if self.peak_flops is None:
            dtype = torch.bfloat16 if "bf16" in str(trainer.precision) else torch.float32
            self.peak_flops = matmul_peak_flops(dtype, pl_module.device)
        self._last_step = trainer.global_step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        """Start the clock at the first micro-batch of an optimizer step."""
        if self._window_start is None:
            sync(pl_module.device)
            self._window_start = time.perf_counter()
            self._window_tokens = 0
        self._window_tokens += batch["input_ids"].numel()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        """When an optimizer step just finished, log its throughput."""
        if trainer.global_step == self._last_step or self._window_start is None:
            return  # still accumulating
        self._last_step = trainer.global_step
        sync(pl_module.device)
        seconds = time.perf_counter() - self._window_start
        self._window_start = None
        tokens_per_s = self._window_tokens * trainer.world_size / max(seconds, 1e-9)
        seq_len = batch["input_ids"].shape[1]
        # the family's count: Transfusion's patch projections and timestep MLP are FLOPs the decoder's count lacks
        flops_per_token = pl_module.family.flops_per_token(seq_len)
        mfu = flops_per_token * tokens_per_s / (self.peak_flops * trainer.world_size)
        pl_module.log_dict({"train/tokens_per_s": tokens_per_s, "train/mfu": mfu}, on_step=True, on_epoch=False)


class SampleWriter(L.Callback):
    """Every `every_n_steps` optimizer steps, samples a continuation of each prompt (fusion_model.sampling.generate) and
    rank 0 writes them to `<log_dir>/samples/step<N>/` (samples.json, index.html, PNGs of generated images)."""

    def __init__(
        self,
        tokenizer: str,
        prompts: list[str] | None = None,
        image_tokenizer: str | None = None,
        every_n_steps: int = 1000,
        mode: str | None = None,
        max_new_tokens: int | None = 64,
        seed: int = 0,
    ) -> None:
        """tokenizer: tokenizer.json; image_tokenizer: its save_pretrained dir (needed to decode images);
        mode: "text" / "image" / "interleaved" (default: interleaved with an image tokenizer, else text)."""
        super().__init__()
        self.tokenizer_path, self.image_tokenizer_path = tokenizer, image_tokenizer
        self.prompts = prompts or [""]
        self.every_n_steps, self.max_new_tokens, self.seed = every_n_steps, max_new_tokens, seed
        self.mode = mode or ("interleaved" if image_tokenizer else "text")
        self._last_written = -1

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Load the tokenizers once."""
        from tokenizer.vocab import UnifiedVocab

        self.vocab = UnifiedVocab.load(self.tokenizer_path)
        self.image_tokenizer = None
        if self.image_tokenizer_path:
            from tokenizer.image import ImageTokenizer

            self.image_tokenizer = ImageTokenizer.from_pretrained(self.image_tokenizer_path).to(pl_module.device)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        """At the interval, every rank samples (FSDP needs all ranks in the forward); rank 0 writes."""
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps or step == self._last_written:
            return
        self._last_written = step
        from fusion_model.sampling import SamplingConfig
        from fusion_model.sampling.generate import generate
        from fusion_model.sampling.output import write_samples

        # a seeded generator inside `generate`: the training RNG streams (dropout) are left untouched
        config = SamplingConfig(mode=self.mode, max_new_tokens=self.max_new_tokens, seed=self.seed)
        prompts = [[text] if text else [] for text in self.prompts]
        was_training = pl_module.training
        pl_module.eval()
        with torch.no_grad():
            samples, ids = generate(pl_module.model, self.vocab, self.image_tokenizer, prompts, config, return_ids=True)
        pl_module.train(was_training)
        if trainer.is_global_zero:
            out_dir = Path(trainer.log_dir or trainer.default_root_dir) / "samples" / f"step{step:08d}"
            write_samples(out_dir, samples, prompts=prompts, ids=ids, settings={"step": step, **config.__dict__},
                          title=f"Samples at step {step}")


class TimeBudget(L.Callback):
    """Fits the run to a wall-clock budget: sets max_steps and the lr schedule's horizon to the steps that fit in
    `minutes` at the measured step rate, so the decay finishes on time instead of being cut off by
    `trainer.max_time` part-way down.

    The rate is first measured over steps `skip_steps`..`measure_steps`, then again over each doubling window
    (steps 40-80, 80-160, ...) while the run is in its first `refine_until` of the horizon: early steps are
    often slower or faster than the rest, and a change of horizon there barely moves the lr (a cosine is still
    within 20% of its peak at 30% of the way). A slow run that has not reached `measure_steps` after `patience`
    of the budget takes its rate from the steps done since the first one (a 65,536-entry vocabulary on a CPU
    makes a step take tens of seconds). Warmup is capped at half the horizon so the decay always happens. The
    horizon is saved in checkpoints; a resumed run keeps it and measures no more. Keep `trainer.max_time` as the
    hard stop.
    """

    def __init__(self, minutes: float, measure_steps: int = 40, skip_steps: int = 5, safety: float = 0.97,
                 refine_until: float = 0.3, patience: float = 0.05, max_steps: int | None = None) -> None:
        """max_steps: the configured step limit, never exceeded (the horizon is the smaller of it and the budget's)."""
        super().__init__()
        self.max_steps = max_steps if max_steps and max_steps > 0 else None
        if measure_steps <= skip_steps:
            raise ValueError(f"TimeBudget: measure_steps ({measure_steps}) must exceed skip_steps ({skip_steps})")
        self.seconds, self.measure_steps, self.skip_steps = minutes * 60.0, measure_steps, skip_steps
        self.safety, self.refine_until, self.patience = safety, refine_until, patience
        self.horizon: int | None = None
        self.settled = False  # True once the horizon may no longer change (refined, or a resumed run)
        self._train_start = 0.0
        self._first: tuple[int, float] | None = None  # (step, time) after the first optimizer step
        self._window: tuple[int, float] | None = None  # (step, time) where the current measuring window began
        self._next_check = measure_steps
        self._recipe_warmups: list[int] | None = None

    def state_dict(self) -> dict:
        """The chosen horizon (None until measured)."""
        return {"horizon": self.horizon}

    def load_state_dict(self, state_dict: dict) -> None:
        """Keep the horizon of the checkpointed run."""
        self.horizon = state_dict.get("horizon")
        self.settled = self.horizon is not None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Start the clock; a resumed run re-applies its horizon."""
        self._train_start = time.perf_counter()
        if self.horizon is not None:
            self._apply(trainer, self.horizon)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        """Open the first window at skip_steps; at the end of each window, set the horizon from its rate."""
        step = trainer.global_step
        if self.settled:
            return
        now = time.perf_counter()
        if self._first is None and step > 0:
            self._first = (step, now)
        if step == self.skip_steps and self._window is None:
            self._window = (step, now)
        elif step == self._next_check and self._window is not None:
            if self.horizon is not None and step > self.refine_until * self.horizon:
                self.settled = True
                return
            self._set_horizon(trainer, step, now, self._window)
        elif (self.horizon is None and self._first is not None and step > self._first[0]
              and now - self._train_start >= self.patience * self.seconds):
            self._set_horizon(trainer, step, now, self._first)  # slow steps: do not wait for measure_steps

    def _set_horizon(self, trainer: L.Trainer, step: int, now: float, since: tuple[int, float]) -> None:
        per_step = (now - since[1]) / (step - since[0])
        remaining = self.seconds - (now - self._train_start)
        first = self.horizon is None
        self.horizon = max(step + 1, step + int(self.safety * remaining / per_step))
        if self.max_steps is not None:
            self.horizon = min(self.horizon, self.max_steps)
        self._apply(trainer, self.horizon)
        if first:
            rank_zero_info(f"time budget: the lr schedule ends at step {self.horizon} ({per_step:.3g} s per step, "
                           f"{self.seconds / 60:.3g} minutes{', max_steps ' + str(self.max_steps) if self.max_steps else ''})")
        self._window, self._next_check = (step, now), 2 * step

    def _apply(self, trainer: L.Trainer, horizon: int) -> None:
        trainer.fit_loop.epoch_loop.max_steps = horizon
        schedules = [schedule for config in trainer.lr_scheduler_configs
                     for schedule in getattr(config.scheduler, "lr_lambdas", []) if hasattr(schedule, "decay_steps")]
        if self._recipe_warmups is None:
            self._recipe_warmups = [int(getattr(schedule, "warmup_steps", 0)) for schedule in schedules]
        for schedule, warmup in zip(schedules, self._recipe_warmups):
            schedule.decay_steps = horizon
            if hasattr(schedule, "warmup_steps"):  # warmup takes at most half the horizon: the decay must happen
                schedule.warmup_steps = min(warmup, horizon // 2)


def stdout_is_terminal() -> bool:
    """Whether stdout is an interactive terminal (a progress bar reads well), not a log file or a pipe."""
    try:
        return sys.stdout is not None and sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or already closed
        return False


def _first_tensor(batch) -> torch.Tensor | None:
    """The first tensor in a batch that is a tensor, or a dict / list / tuple holding tensors."""
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _batch_items(batch) -> tuple[int, str]:
    """(count, unit) for throughput: tokens of `input_ids` when the batch has them, else its samples."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel(), "tok/s"
    first = _first_tensor(batch)
    return (int(first.shape[0]) if first is not None and first.dim() else 0), "samples/s"


def _duration(seconds: float) -> str:
    """H:MM:SS, whole seconds."""
    return str(timedelta(seconds=int(max(seconds, 0.0))))


def _rate(per_second: float) -> str:
    """Thousands separated for large rates, three digits for small ones (3.47 images/s)."""
    return f"{per_second:,.0f}" if per_second >= 100 else f"{per_second:.3g}"


class PlainTextProgress(L.Callback):
    """Prints one plain-text progress line on global rank 0, at the first step, then at most every
    `every_seconds`, and a last one when training ends, to stdout (or `stream`), flushed:

        step 120/2000 (6%) | epoch 0 | loss 3.214 | 1,234 tok/s | lr 2.0e-03 | 0:01:05 elapsed | ETA 0:17:02

    For output that goes to a log file (a cluster job, nohup), where a progress bar's carriage returns and
    colours arrive as minutes of silence and then garbage. The total is read at every line, so a horizon that
    `TimeBudget` changes shows up; without max_steps the ETA is the time left of `trainer.max_time`.
    Throughput counts `input_ids` tokens of all ranks, or samples (first tensor's batch size) without them.
    """

    def __init__(self, every_seconds: float = 30.0, stream: TextIO | None = None) -> None:
        super().__init__()
        if every_seconds < 0:
            raise ValueError(f"PlainTextProgress: every_seconds must be >= 0, got {every_seconds}")
        self.every_seconds, self.stream = every_seconds, stream
        self._start = 0.0
        self._start_step = 0
        self._items = 0  # tokens (or samples) of all ranks since the start of training
        self._unit = "tok/s"
        self._last: tuple[float, int] | None = None  # (time, items) at the last line
        self._first: tuple[float, int] | None = None  # (time, step) at the first line: steady-rate baseline
        self._last_step = -1
        self._epoch = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Start the clock (a resumed run counts from its own start)."""
        self._start, self._start_step = time.perf_counter(), trainer.global_step
        self._items, self._last, self._first, self._last_step = 0, None, None, -1
        self._epoch = trainer.current_epoch

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        """Count the batch; after an optimizer step, print a line when the interval has passed."""
        if not trainer.is_global_zero:
            return
        self._epoch = trainer.current_epoch  # at the end Lightning has counted a cut-off epoch as finished
        count, self._unit = _batch_items(batch)
        self._items += count * trainer.world_size
        step, now = trainer.global_step, time.perf_counter()
        if step == self._last_step or step == self._start_step:
            return  # still accumulating micro-batches of this optimizer step
        if self._last is not None and now - self._last[0] < self.every_seconds:
            return
        since_time, since_items = self._last or (self._start, 0)
        throughput = (self._items - since_items) / max(now - since_time, 1e-9)
        self._write(self._line(trainer, now, throughput, with_eta=True))
        self._last, self._last_step = (now, self._items), step
        if self._first is None:
            self._first = (now, step)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The last line: where training stopped, with the average throughput of the run."""
        if trainer.is_global_zero:
            now = time.perf_counter()
            throughput = self._items / max(now - self._start, 1e-9)
            self._write("done: " + self._line(trainer, now, throughput, with_eta=False))

    def _line(self, trainer: L.Trainer, now: float, throughput: float, *, with_eta: bool) -> str:
        step, total = trainer.global_step, self._total_steps(trainer)
        parts = [f"step {step:,}/{total:,} ({100 * step / total:.0f}%)" if total else f"step {step:,}",
                 f"epoch {self._epoch}"]
        metrics = trainer.callback_metrics
        loss = metrics.get("train/loss", metrics.get("loss"))
        if loss is not None:
            parts.append(f"loss {float(loss):.4g}")
        if "train/psnr" in metrics:  # the image tokenizer's loss mixes terms; its PSNR is what users follow
            parts.append(f"psnr {float(metrics['train/psnr']):.2f} dB")
        if self._items:
            parts.append(f"{_rate(throughput)} {self._unit}")
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.1e}")
        parts.append(f"{_duration(now - self._start)} elapsed")
        eta = self._eta(trainer, now, step, total) if with_eta else None
        if eta is not None:
            parts.append(f"ETA {_duration(eta)}")
        return " | ".join(parts)

    @staticmethod
    def _total_steps(trainer: L.Trainer) -> int | None:
        """The step horizon as the loop sees it now (TimeBudget moves the epoch loop's), None when unbounded."""
        total = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "max_steps", None)
        if total is None or total < 0:
            total = trainer.max_steps
        return total if total is not None and total > 0 else None

    def _eta(self, trainer: L.Trainer, now: float, step: int, total: int | None) -> float | None:
        """Seconds left: steps left at the steady step rate, capped by what is left of `trainer.max_time`."""
        estimates = []
        if total is not None:
            since_time, since_step = self._first if self._first and step > self._first[1] else (
                self._start, self._start_step)
            if step > since_step:
                estimates.append(max(total - step, 0) * (now - since_time) / (step - since_step))
        for callback in trainer.callbacks:
            if isinstance(callback, Timer) and callback.time_remaining() is not None:
                estimates.append(max(callback.time_remaining(), 0.0))
        return min(estimates) if estimates else None

    def _write(self, line: str) -> None:
        stream = self.stream or sys.stdout
        print(line, file=stream, flush=True)
