"""A Lightning callback that records the demo's training curves: text and image loss, real tokens, seconds."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L

from common.files import atomic_write_json


class LossRecorder(L.Callback):
    """Every `log_every` optimizer steps (default: the trainer's log_every_n_steps), keep the text and image
    losses; at the end write them as JSON."""

    def __init__(self, path: str, log_every: int | None = None) -> None:
        super().__init__()
        self.path, self.log_every = Path(path), log_every
        self.rows: dict[str, list] = {"step": [], "text": [], "image": [], "tokens": [], "seconds": []}
        self.tokens, self.start, self._resumed_seconds = 0, time.perf_counter(), 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Start the clock when training (not setup) starts; a resumed run continues its earlier time."""
        self.start = time.perf_counter() - self._resumed_seconds
        if self.log_every is None:
            self.log_every = trainer.log_every_n_steps

    # Saved in Lightning checkpoints, so a resumed run continues its curves instead of starting them over.
    def state_dict(self) -> dict:
        """The curves so far (plain lists and numbers)."""
        return {"rows": self.rows, "tokens": self.tokens, "seconds": time.perf_counter() - self.start}

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue the curves of the checkpointed run."""
        self.rows, self.tokens = state_dict["rows"], int(state_dict["tokens"])
        self._resumed_seconds = float(state_dict["seconds"])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        """Count the batch's real tokens (padding excluded) and sample the logged losses."""
        self.tokens += int((batch["document_ids"] >= 0).sum())
        step = trainer.global_step
        if step % self.log_every == 0 or step == 1:
            metrics = trainer.callback_metrics
            self.rows["step"].append(step)
            self.rows["text"].append(float(metrics.get("train/text_loss", float("nan"))))
            self.rows["image"].append(float(metrics.get("train/image_loss", float("nan"))))
            self.rows["tokens"].append(self.tokens)
            self.rows["seconds"].append(time.perf_counter() - self.start)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Write the curves and totals atomically."""
        self.rows["final"] = {"steps": trainer.global_step, "tokens": self.tokens, "seconds": time.perf_counter() - self.start}
        atomic_write_json(self.path, self.rows, indent=None)
