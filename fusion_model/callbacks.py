"""Training callbacks: tokens/s and MFU logging per optimizer step, and periodic sample writing."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L
import torch


def measure_peak_flops(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 5) -> float:
    """Achieved FLOP/s of a square matmul on `device` in `dtype`: the MFU denominator when no peak is configured."""
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up (kernel selection, allocation)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ThroughputMonitor(L.Callback):
    """Logs `train/tokens_per_s` (all ranks) and `train/mfu` after every optimizer step.

    MFU = model FLOPs per token (config.flops_per_token(seq_len), forward + backward) x tokens/s, divided by
    `peak_flops` per device x world size. Without a configured peak it measures one with a matmul in the
    training dtype at the start of fit (a lower bound of the datasheet peak, so the MFU is an upper bound).
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
            self.peak_flops = measure_peak_flops(pl_module.device, dtype)
        self._last_step = trainer.global_step

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        """Start the clock at the first micro-batch of an optimizer step."""
        if self._window_start is None:
            _sync(pl_module.device)
            self._window_start = time.perf_counter()
            self._window_tokens = 0
        self._window_tokens += batch["input_ids"].numel()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        """When an optimizer step just finished, log its throughput."""
        if trainer.global_step == self._last_step or self._window_start is None:
            return  # still accumulating
        self._last_step = trainer.global_step
        _sync(pl_module.device)
        seconds = time.perf_counter() - self._window_start
        self._window_start = None
        tokens_per_s = self._window_tokens * trainer.world_size / max(seconds, 1e-9)
        seq_len = batch["input_ids"].shape[1]
        flops_per_token = pl_module.model_config.flops_per_token(seq_len)
        mfu = flops_per_token * tokens_per_s / (self.peak_flops * trainer.world_size)
        pl_module.log_dict({"train/tokens_per_s": tokens_per_s, "train/mfu": mfu}, on_step=True, on_epoch=False)


class SampleWriter(L.Callback):
    """Every `every_n_steps` optimizer steps, rank 0 writes a few unconditional samples under `<log_dir>/samples/`."""

    def __init__(self, every_n_steps: int = 1000, num_samples: int = 2, max_new_tokens: int = 64, tokenizer: str | None = None) -> None:
        super().__init__()
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples
        self.max_new_tokens = max_new_tokens
        self.tokenizer = tokenizer

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        """Write samples at the configured interval (greedy-free: plain sampling at temperature 1)."""
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps or not trainer.is_global_zero or step == getattr(self, "_done", -1):
            return
        self._done = step
        out_dir = Path(trainer.log_dir or trainer.default_root_dir) / "samples"
        out_dir.mkdir(parents=True, exist_ok=True)
        ids = self._sample(pl_module)
        lines = [" ".join(map(str, row)) for row in ids.tolist()]
        if self.tokenizer is not None:
            from tokenizer.vocab import UnifiedVocab

            vocab = UnifiedVocab.load(self.tokenizer)
            lines = [repr(vocab.decode_document(row)) for row in ids]
        (out_dir / f"step{step:08d}.txt").write_text("\n".join(lines) + "\n")

    @torch.no_grad()
    def _sample(self, pl_module: L.LightningModule) -> torch.Tensor:
        """Ancestral sampling from `<s>` (id given by the model config's bos or 1), no KV cache: short and simple."""
        was_training = pl_module.training
        pl_module.eval()
        bos = getattr(pl_module.model_config, "bos_id", 1)
        ids = torch.full((self.num_samples, 1), bos, dtype=torch.long, device=pl_module.device)
        for _ in range(self.max_new_tokens):
            logits = pl_module.model(ids)[:, -1].float()
            ids = torch.cat([ids, torch.multinomial(torch.softmax(logits, -1), 1)], dim=1)
        pl_module.train(was_training)
        return ids.cpu()
