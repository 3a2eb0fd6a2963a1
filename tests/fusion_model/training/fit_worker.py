"""Helpers for the training tests: tiny token shards, a recording callback, and a `train.py fit` subprocess entry.

Run as `python tests/fusion_model/training/fit_worker.py [fit options...]`: trains like `train.py fit`; add `recorder_arg(...)`
to write OUT_PREFIX.rank<R>.pt (losses, batches seen, final full weights) when training ends.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent

TINY = dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64, dropout=0.0)


def spawn_processes(fn, args: tuple, processes: int, timeout: float) -> None:
    """fn(rank, *args) in `processes` spawned processes; fails (and kills them) past `timeout` seconds."""
    context = torch.multiprocessing.start_processes(fn, args=args, nprocs=processes, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=5):  # raises when a process failed
            assert time.monotonic() < deadline, f"the {processes} processes did not finish within {timeout} s (a hang)"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def make_token_dir(path: Path, n_docs: int = 40, vocab_size: int = 256, seed: int = 0, shards: int = 2,
                   vocab_fingerprint: str = "vocab-test", image_fingerprint: str = "image-test") -> Path:
    """Token shards of random documents (lengths 4..40, ids >= 1; 0 is pad) with a valid manifest."""
    from data_shards.token_shards import write_manifest, write_token_shard

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    info = {"vocab_size": vocab_size, "vocab_fingerprint": vocab_fingerprint, "image_tokenizer_fingerprint": image_fingerprint}
    metas = []
    for s in range(shards):
        docs = [rng.integers(1, vocab_size, rng.integers(4, 41)).tolist() for _ in range(n_docs // shards)]
        keys = [f"s{s}-d{i}" for i in range(len(docs))]
        metas.append(write_token_shard(path, f"shard-{s:03d}", keys, docs, info))
    write_manifest(path, {**info, "pad_id": 0}, metas)
    return path


def make_conversation_token_dir(path: Path, shards: int = 2, per_shard: int = 12, seed: int = 0) -> Path:
    """Token shards in which two of every three documents are conversations (a prompt, then an answer of targets)
    and the rest plain documents (every token a target), with the target masks `shards tokenize` stores."""
    from data_shards.token_shards import CONVERSATION, TARGET, write_manifest, write_token_shard

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    info = {"vocab_size": 256, "vocab_fingerprint": "vocab-test", "image_tokenizer_fingerprint": "image-test"}
    metas = []
    for shard in range(shards):
        documents, targets = [], []
        for index in range(per_shard):
            length = int(rng.integers(4, 31))
            documents.append(rng.integers(1, 256, length).tolist())
            marks = np.full(length, TARGET, dtype=np.uint8)
            if index % 3:
                marks[:] = CONVERSATION
                marks[int(rng.integers(1, length - 1)):] |= TARGET  # the answer: from somewhere inside to the end
            targets.append(marks)
        keys = [f"s{shard}-d{i}" for i in range(per_shard)]
        conversations = sum(1 for index in range(per_shard) if index % 3)
        metas.append(write_token_shard(path, f"shard-{shard:03d}", keys, documents,
                                       {**info, "conversations": conversations}, targets=targets))
    write_manifest(path, {**info, "pad_id": 0, "target_roles": ["assistant"]}, metas)
    return path


# The latent shards' id layout inside the tiny vocabulary: pad 0, <boi> 3, <eoi> 4, <image> 6 (as a unified
# vocabulary numbers its specials); an image is 4 patches (a 2x2 latent grid, patch size 1) of 4 channels.
LATENT = {"boi_id": 3, "eoi_id": 4, "image_placeholder_id": 6, "channels": 4, "grid": [2, 2]}


def make_latent_token_dir(path: Path, n_docs: int = 40, vocab_size: int = 256, seed: int = 0, shards: int = 2,
                          nan_row: int | None = None) -> Path:
    """Token shards of continuous-image documents (Transfusion's): random text (ids >= 16) with 0-2 images of
    <boi>, 4 <image> placeholders, <eoi>, and random latent patches beside the ids, with a valid manifest.
    nan_row: this latent row of shard-000 is NaN, under valid checksums (what only a finiteness check finds)."""
    from data_shards.token_shards import LATENT_KIND, write_manifest, write_token_shard

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    info = {"vocab_size": vocab_size, "vocab_fingerprint": "vocab-test", "image_tokenizer_fingerprint": "kl-test"}
    patches = LATENT["grid"][0] * LATENT["grid"][1]
    metas = []
    for s in range(shards):
        docs, rows = [], 0
        for _ in range(n_docs // shards):
            doc = rng.integers(16, vocab_size, rng.integers(2, 10)).tolist()
            for _ in range(int(rng.integers(0, 3))):
                doc += [LATENT["boi_id"], *[LATENT["image_placeholder_id"]] * patches, LATENT["eoi_id"]]
                doc += rng.integers(16, vocab_size, rng.integers(1, 6)).tolist()
                rows += patches
            docs.append(doc)
        latents = rng.standard_normal((rows, LATENT["channels"])).astype(np.float16)
        if s == 0 and nan_row is not None:
            latents[nan_row, 0] = np.nan
        keys = [f"s{s}-d{i}" for i in range(len(docs))]
        metas.append(write_token_shard(path, f"shard-{s:03d}", keys, docs, info, features=latents))
    write_manifest(path, {**info, "pad_id": 0, "bos_id": 1, "eos_id": 2, "boi_id": LATENT["boi_id"],
                          "eoi_id": LATENT["eoi_id"], "image_placeholder_id": LATENT["image_placeholder_id"],
                          "feature_dim": LATENT["channels"], "feature_kind": LATENT_KIND,
                          "latent": {"channels": LATENT["channels"], "grid": LATENT["grid"], "patch_size": 1}}, metas)
    return path


def tiny_args(token_dir: Path, root: Path, max_steps: int, batch_size: int = 4, extra: list[str] | None = None) -> list[str]:
    """`train.py fit` options for a seconds-long CPU run of the tiny decoder (no progress bar, CSV only)."""
    args = [
        f"--config={REPO / 'configs/fusion/tiny.yaml'}",
        f"--data.train_dir={token_dir}", "--data.seq_len=32", f"--data.batch_size={batch_size}", "--data.num_workers=0",
        f"--trainer.max_steps={max_steps}", f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
        "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
        f"--trainer.logger=[{json.dumps({'class_path': 'lightning.pytorch.loggers.CSVLogger', 'init_args': {'save_dir': str(root)}})}]",
        f"--trainer.callbacks=[{json.dumps({'class_path': 'lightning.pytorch.callbacks.ModelCheckpoint', 'init_args': {'dirpath': str(root / 'ckpt'), 'every_n_train_steps': 1, 'save_top_k': -1, 'save_last': True}})}]",
        "--model.warmup_steps=2", "--model.lr=1e-2",
    ]
    args += [f"--model.config.{k}={'null' if v is None else v}" for k, v in TINY.items()]
    return args + list(extra or [])


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU copy of the weights (gathers FSDP2 DTensors; call on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sharded = any(hasattr(p, "full_tensor") for p in module.parameters())
    if not sharded:
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False))


class Recorder(L.Callback):
    """Records each batch's loss and input ids; saves them with the final weights when training ends."""

    def __init__(self, out_prefix: str, hang_after_step: int = -1) -> None:
        super().__init__()
        self.out_prefix, self.hang_after_step = out_prefix, hang_after_step
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.batches: list[torch.Tensor] = []
        self.document_ids: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch["input_ids"].clone())
        self.document_ids.append(batch["document_ids"].clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics  # one term logs train/loss; several log each term and the shown total
        self.losses.append(float(metrics["train/loss"] if "train/loss" in metrics else metrics["loss"]))
        self.steps.append(trainer.global_step)

    def on_train_end(self, trainer, pl_module) -> None:
        weights = full_state_dict(pl_module.model)  # the decoder's names as they are; a family's other parts prefixed
        for name, part in pl_module.named_children():
            if name != "model" and any(True for _ in part.parameters()):
                weights.update({f"{name}.{key}": value for key, value in full_state_dict(part).items()})
        payload = {"losses": self.losses, "steps": self.steps, "batches": self.batches,
                   "document_ids": self.document_ids, "weights": weights}
        torch.save(payload, f"{self.out_prefix}.rank{trainer.global_rank}.pt")


class HangingRecorder(Recorder):
    """A Recorder that blocks forever once the checkpoint of `hang_after_step` is on disk."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # the checkpoint of step hang_after_step was written at the end of the previous batch
        if trainer.global_step == self.hang_after_step:
            Path(f"{self.out_prefix}.hanging").write_text("ready to be killed")
            while True:  # the test kills this process with SIGKILL
                time.sleep(1)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)


def recorder_arg(out_prefix: str | Path, hang_after_step: int = -1) -> str:
    """The `--trainer.callbacks+=` option adding a (Hanging)Recorder."""
    cls = "fit_worker.HangingRecorder" if hang_after_step >= 0 else "fit_worker.Recorder"
    init = {"out_prefix": str(out_prefix), "hang_after_step": hang_after_step}
    return f"--trainer.callbacks+={json.dumps({'class_path': cls, 'init_args': init})}"


def run_in_process(args: list[str]):
    """Train in this process (the same code path as the subprocess); returns the LightningCLI object."""
    from fusion_model.cli.fit import fit_from_config

    return fit_from_config(None, args)


def leave_process_group() -> None:
    """End a spawned gloo rank that finished its work: wait for every rank, then exit at once (status 0).

    A normal exit lets interpreter teardown destroy tensors that gloo's worker threads still hold (FSDP2 keeps the
    process group alive past `destroy_process_group`); that needs the GIL while Python is going away and aborts the
    rank ("terminate called without an active exception", SIGABRT), about once per CI run even after a barrier
    and an explicit destroy. Everything the rank writes is saved and closed before this is called."""
    import torch.distributed as dist

    dist.barrier()  # no rank leaves while another still talks to it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fsdp2_steps(rank: int, world: int, port: int, config: dict, weights: str, batches: str, out: str) -> None:
    """Rank `rank` of `world` CPU processes (gloo): the decoder with `weights`, sharded as Family.parallelize shards
    it (FSDP2, each block, then the root), takes one AdamW step per batch of `batches` ({"steps": [[rank 0's
    batch, rank 1's, ...], ...]}); rank 0 saves each step's loss and full gradients and the final weights to `out`.
    Start it with torch.multiprocessing's spawn (see tests/fusion_model/training/test_mot_training.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fusion_model.config import FusionConfig
    from fusion_model.families.chameleon.family import ChameleonFamily
    from fusion_model.model import FusionModel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        decoder_config = FusionConfig.from_dict(config)
        model = FusionModel(decoder_config)
        model.load_state_dict(torch.load(weights, weights_only=True))
        ChameleonFamily(decoder_config).parallelize({"model": model}, init_device_mesh("cpu", (world,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        record: dict = {"losses": [], "grads": []}
        for step in torch.load(batches, weights_only=True)["steps"]:
            batch = step[rank]
            loss = model.loss(batch["input_ids"], batch["document_ids"])["loss"]
            loss.backward()  # FSDP2 averages the ranks' gradients: equal target counts make it the global mean
            record["losses"].append(loss.detach())
            record["grads"].append({name: p.grad.full_tensor() for name, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
        record["weights"] = full_state_dict(model)
        if rank == 0:
            torch.save(record, out)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_process_group()


def family_fsdp2_steps(rank: int, world: int, port: int, family_name: str, config: dict, options: dict,
                       weights: str, batches: str, out: str, lr: float = 1e-3) -> None:
    """Rank `rank` of `world` CPU processes (gloo): the family's parts with `weights` ({part: state dict}), sharded
    by the family's `parallelize` (FSDP2), take one AdamW step per batch of `batches` ({"steps": [[rank 0's batch,
    rank 1's, ...], ...]}) at `lr`, each rank's loss over the step's global counts (as the Lightning module divides);
    rank 0 saves each step's loss summed over ranks, the full gradients and the full weights after it
    (`part.name`) to `out`. Start it with spawn (tests/fusion_model/training/test_transfusion_fsdp.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fusion_model.config import FusionConfig
    from fusion_model.families import family_class
    from fusion_model.families.base import ObjectiveContext

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        family = family_class(family_name)(FusionConfig.from_dict(config), options)
        parts = family.build()
        for name, state in torch.load(weights, weights_only=True).items():
            parts[name].load_state_dict(state)
        family.parallelize(parts, init_device_mesh("cpu", (world,)))
        named = {f"{part}.{name}": p for part, module in parts.items() for name, p in module.named_parameters()}
        optimizer = torch.optim.AdamW(named.values(), lr=lr)
        record: dict = {"losses": [], "grads": [], "weights": []}
        for index, step in enumerate(torch.load(batches, weights_only=True)["steps"]):
            counted = [family.denominators(batch) for batch in step]
            objective = family.objective(parts, step[rank], ObjectiveContext(step=index))
            totals = torch.stack([sum(c[name] for c in counted) for name in objective.terms])
            loss = objective.loss(totals)
            (loss * world).backward()  # FSDP2 averages the ranks' gradients: this makes it their sum
            summed = loss.detach().clone()
            dist.all_reduce(summed)
            record["losses"].append(summed)
            record["grads"].append({name: p.grad.full_tensor() for name, p in named.items()})
            optimizer.step()
            optimizer.zero_grad()
            record["weights"].append({f"{part}.{key}": value for part, module in parts.items()
                                      for key, value in full_state_dict(module).items()})
        if rank == 0:
            torch.save(record, out)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_process_group()


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("FIT_THREADS", "1")))
    sys.path.insert(0, str(HERE))  # so the CLI can import fit_worker.Recorder
    from fusion_model.cli.fit import main

    sys.exit(main(sys.argv[1:]))
