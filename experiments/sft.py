"""`python train.py experiment sft`: supervised fine-tuning of the demo's pretrained decoder on chat conversations.

Chameleon's recipe (arXiv 2405.09818, section 3.2) fine-tunes the pretrained model on conversations with the loss on
the answers only and balanced categories. Here, from the demo's pretrained decoder, vocabulary and VQ tokenizer,
seven arms answer the same held-out conversations (`evaluation/chat_data.py`: visual chat, image generation,
interleaved "draw the next digit", text-only):
- `pretrained`: the demo's decoder prompted in the chat template without fine-tuning;
- `answer_only`: SFT with the loss on the assistant's turns only (Chameleon's);
- `all_tokens`: the same data and steps with the loss on every token (`--data.answer_only false`);
- `unbalanced`: answer-only SFT on as many conversations in an unbalanced mix (90% text answers);
- `lora_r4`, `lora_r16`: answer-only SFT of a LoRA adapter on every projection (`--model.peft`, alpha = 2 x rank),
  merged into the decoder for answering;
- `head_only`: answer-only SFT of the output head's image-code rows alone (`--model.train_only image_head_rows`).
Every SFT arm trains for the same optimizer steps from the same seed; all but `unbalanced` read the same token
shards, so they see the same batches in the same order. Each trained arm's step is also measured: trainable
parameters, AdamW bytes, the peak of live tensor bytes of one step (fusion_model/training/live_memory.py's LivePeak) and seconds per
step. Everything runs through the commands users run: `train.py shards
write --chat`, `shards tokenize --train-roles assistant`, `train.py fit --config configs/fusion/demo.yaml --config
configs/fusion/post/sft.yaml --model.init_weights ...`, and `train.py eval --suite chat` (`evaluation/chat.py`:
the held-out conversations answered through the family's `generate` in the chat template, scored per category,
images by the demo's independent digit classifier, text by exact match of the digit's name, with the rate of answers
of the wrong modality). The experiment adds the held-out pretraining loss before and after (forgetting). Writes
`<out>/results.json`, `<out>/results.md`, `<out>/samples.html` and each arm's suite output in `<out>/<arm>/eval`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import lightning as L
import numpy as np
import torch

from common.files import atomic_write_json, atomic_write_text
from evaluation import chat_data
from evaluation.chat import text_answer_is_right
from experiments.demo.datasets import (
    DIGIT_WORDS,
    arithmetic_document,
    arithmetic_pairs,
    caption_document,
    pick_by_label,
    to_model_images,
)
from experiments.demo.settings import FIT_CONFIG, REPO_ROOT, DemoConfig, load_config
from experiments.demo.stages import (
    digits_for,
    load_image_tokenizer,
    load_vocab,
    require_outputs,
    run_experiment_command,
)

SFT_CONFIG = REPO_ROOT / "configs" / "fusion" / "post" / "sft.yaml"


class Arm(NamedTuple):
    """One SFT arm: its training conversations, whether the loss is on the answers only, and what trains (every
    weight, a LoRA adapter: `--model.peft`, or the head's image-code rows: `--model.train_only`)."""

    split: str
    answer_only: bool
    peft: dict | None = None
    train_only: str | None = None

    @property
    def method(self) -> str:
        """full, lora or head (what the optimizer updates)."""
        return "lora" if self.peft else "head" if self.train_only else "full"


def _lora(rank: int) -> dict:
    # alpha = 2 x rank: the update's scale alpha/rank is 2 at both ranks, so one lr serves both (the usual choice)
    return {"rank": rank, "alpha": 2 * rank, "dropout": 0.0, "targets": "all"}


# arm -> its training; None: no fine-tuning (the pretrained decoder). The PEFT arms read the balanced answer-only
# shards with the same seed as `answer_only`: the same batches in the same order.
ARMS: dict[str, Arm | None] = {
    "pretrained": None,
    "answer_only": Arm("train", True),
    "all_tokens": Arm("train", False),
    "unbalanced": Arm("train_unbalanced", True),
    "lora_r4": Arm("train", True, peft=_lora(4)),
    "lora_r16": Arm("train", True, peft=_lora(16)),
    "head_only": Arm("train", True, train_only="image_head_rows"),
}
PEAK_STEPS = 5  # the peak measurement's fit: step 0 makes AdamW's states, step 1 is measured, steps 2-4 are timed


@dataclass
class SFTExperimentConfig:
    """The experiment's settings; defaults are the full run (10-12 minutes on a shared 2-core host after the demo)."""

    demo: str = "full"  # the demo preset whose finished outputs are reused
    demo_dir: str | None = None  # default: that preset's out_dir
    out_dir: str = "runs/sft"
    steps: int = 500  # optimizer steps of every SFT arm (the demo's batches: 8 rows x 256 tokens)
    train_conversations: int = 6000  # per training set (balanced and unbalanced alike)
    held_out_per_category: int = 100  # held-out conversations of each category
    # configs/fusion/post/sft.yaml's lr is Chameleon's 1e-5, for 7B/34B models; the demo's 1.1M-parameter decoder
    # pretrained at 2e-3 decaying to 2e-4, so SFT starts near where pretraining ended (docs/results/sft.md: 1e-5)
    lr: float = 3e-4  # the full-weight arms' (answer_only, all_tokens, unbalanced) and head_only's
    # LoRA's: a low-rank update from B = 0 moves slower per step than full fine-tuning; 1e-3 (3.3x the full arms',
    # inside the 2e-4..1e-3 usually used for LoRA on small models), the same for both ranks (alpha / rank = 2)
    lora_lr: float = 1e-3
    head_lr: float | None = None  # head_only's lr (None: lr)
    warmup_steps: int = 20
    held_out_documents: int = 200  # captioned held-out digits (+ a quarter as many arithmetic documents): forgetting
    samples_shown: int = 4  # conversations per category on the sample page
    seed: int = 0
    reuse: bool = False  # keep an arm whose record exists with the same options (resume an interrupted run)
    arms: list[str] | None = None  # the SFT arms to train (default: all of ARMS); `pretrained` always answers
    extra_fit: list[str] = field(default_factory=list)  # more `train.py fit` options for every SFT arm


def smoke_config(demo_dir: str | None = None, out_dir: str = "runs/sft-smoke") -> SFTExperimentConfig:
    """The smoke mode: the smoke demo's outputs, a few steps and conversations (about a minute)."""
    return SFTExperimentConfig(demo="smoke", demo_dir=demo_dir, out_dir=out_dir, steps=6, train_conversations=200,
                               held_out_per_category=6, held_out_documents=20, samples_shown=2,
                               extra_fit=["--data.batch_size=4", "--trainer.log_every_n_steps=1"])


# ---------------------------------------------------------------- data


class SplitPictures(Mapping):
    """The digits of one split as 64-px uint8 RGB pictures (the demo's shards' PNGs), made on demand by index."""

    def __init__(self, digits: np.ndarray, size: int) -> None:
        self.digits, self.size = digits, size

    def __getitem__(self, index: int) -> np.ndarray:
        from experiments.demo.report import to_uint8

        return to_uint8(to_model_images(self.digits[index : index + 1], self.size))[0]

    def __len__(self) -> int:
        return len(self.digits)

    def __iter__(self):
        return iter(range(len(self.digits)))


def run_cli(argv: list[str]) -> None:
    """One `train.py ...` command in this process (the whole command table); a non-zero exit raises."""
    from experiments.commands import main

    code = main(argv)
    if code:
        raise RuntimeError(f"`python train.py {' '.join(argv)}` exited with {code}")


def chat_shards(jsonl: Path, folder: Path, demo_dir: Path) -> Path:
    """`train.py shards write --chat` then `shards tokenize --train-roles assistant`; returns the token shards."""
    for sub in ("raw", "tokens"):
        if (folder / sub).exists():
            shutil.rmtree(folder / sub)  # cheap and deterministic: always remade
    run_cli(["shards", "write", "--out", str(folder / "raw"), "--chat", str(jsonl)])
    run_cli(["shards", "tokenize", str(folder / "raw"), "--out", str(folder / "tokens"),
             "--vocab", str(demo_dir / "vocab" / "tokenizer.json"),
             "--image-tokenizer", str(demo_dir / "tokenizer" / "model"), "--train-roles", "assistant",
             "--workers", "1", "--no-progress"])
    return folder / "tokens"


def pretraining_documents(demo: DemoConfig, tokenizer, vocab, count: int, seed: int) -> list[list[int]]:
    """Held-out pretraining documents as ids, made as the demo makes its own but from its held-out digits: captioned
    digits (caption first or image first, alternately, as the demo's 0.5 flip does) and arithmetic documents."""
    digits = digits_for(demo)
    labels = digits.test_labels
    with torch.no_grad():
        codes = tokenizer.encode(to_model_images(digits.test_images, demo.data.image_size))
    rng = np.random.default_rng(seed)
    documents = []
    for i in range(min(count, len(labels))):
        segments = caption_document(int(labels[i]), int(rng.integers(0, 4)), codes[i])
        documents.append(vocab.encode_document(segments[::-1] if i % 2 else segments))
    pairs = arithmetic_pairs(rng, max(1, count // 4))
    picks = [pick_by_label(labels, wanted, rng) for wanted in (pairs[:, 0], pairs[:, 1], pairs.sum(axis=1))]
    for a, b, c in zip(*picks):
        documents.append(vocab.encode_document(arithmetic_document(codes[a], codes[b], codes[c], int(labels[a]),
                                                                   int(labels[b]))))
    return documents


@torch.no_grad()
def document_loss(model, documents: list[list[int]], pad_id: int, batch_size: int = 32) -> dict:
    """The model's mean next-token loss over the documents: every target, text targets and image targets."""
    model.eval()
    sums = {"text": 0.0, "image": 0.0}
    counts = {"text": 0, "image": 0}
    for begin in range(0, len(documents), batch_size):
        chunk = documents[begin : begin + batch_size]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        doc = torch.full((len(chunk), width), -1, dtype=torch.long)
        for row, tokens in enumerate(chunk):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            doc[row, : len(tokens)] = 0
        out = model.loss(ids, doc)
        for part in ("text", "image"):
            n = int(out[f"n_{part}_targets"])
            sums[part] += float(out[f"{part}_loss"]) * n
            counts[part] += n
    total = sum(counts.values())
    return {"all": (sums["text"] + sums["image"]) / max(total, 1),
            **{part: sums[part] / max(counts[part], 1) for part in sums}, "targets": total, **{
                f"{part}_targets": counts[part] for part in counts}}


# ---------------------------------------------------------------- training (train.py fit)


class TargetCounter(L.Callback):
    """Counts what an SFT run trained on: real (non-padding) positions and loss targets (`target_mask` true, or
    every real position when the batch carries none); written to `path` at the end."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path, self.positions, self.targets, self.rows = Path(path), 0, 0, 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        """Add the batch's counts."""
        real = batch["document_ids"] >= 0
        mask = batch.get("target_mask")
        self.positions += int(real.sum())
        self.targets += int((real & mask.bool()).sum()) if mask is not None else int(real.sum())
        self.rows += int(real.shape[0])

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Write the counts."""
        atomic_write_json(self.path, {"positions": self.positions, "targets": self.targets, "rows": self.rows})


def arm_lr(config: SFTExperimentConfig, arm: Arm) -> float:
    """The learning rate of an arm's family: LoRA's, head-only's or the full arms'."""
    if arm.method == "lora":
        return config.lora_lr
    if arm.method == "head" and config.head_lr is not None:
        return config.head_lr
    return config.lr


def arm_options(arm: Arm) -> list[str]:
    """What an arm adds to `train.py fit`: --model.peft or --model.train_only (nothing for full SFT)."""
    if arm.peft:
        return [f"--model.peft={json.dumps(arm.peft)}"]
    if arm.train_only:
        return [f"--model.train_only={arm.train_only}"]
    return []


class StepPeak(L.Callback):
    """What one training step of a run costs: the peak of live tensor bytes over optimizer step `measured` (after
    AdamW's states exist), measured with fusion_model/training/live_memory.py's `LivePeak` (a dispatch mode that counts every
    tensor storage alive: parameters, gradients, AdamW states, the batch, activations; CPU keeps no allocator
    statistics), the AdamW state and gradient bytes then, the trainable parameters, and the wall time of each step
    after it (without the dispatch mode); written to `path` at the end."""

    def __init__(self, path: str, measured: int = 1) -> None:
        super().__init__()
        self.path, self.measured = Path(path), measured
        self.record: dict = {"step_seconds": []}
        self._mode, self._start = None, None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Count the trainable parameters as the module reports them (head-only: the image-code rows)."""
        from fusion_model.families.adapters import count_parameters

        trainable, total = count_parameters(pl_module)
        in_optimizer = trainable
        if pl_module.hparams.get("train_only"):  # the head is one trainable matrix; only its image rows move
            trainable = pl_module.model_config.image_codes * pl_module.parts["model"].head.weight.shape[1]
        self.record.update(trainable_parameters=trainable, total_parameters=total,
                           optimizer_parameters=in_optimizer)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        """Start the live-tensor count on the measured step, the clock on the later ones."""
        if trainer.global_step == self.measured:
            from fusion_model.training.live_memory import LivePeak

            self._mode = LivePeak()
            states = [v for state in trainer.optimizers[0].state.values() for v in state.values() if torch.is_tensor(v)]
            for tensor in [*pl_module.parameters(), *(p.grad for p in pl_module.parameters() if p.grad is not None),
                           *states, *(v for v in batch.values() if torch.is_tensor(v))]:
                self._mode.register(tensor)
            self._mode.measure()
            self._mode.__enter__()
        elif trainer.global_step > self.measured:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        """Stop the count (and read the AdamW state and gradient bytes), or the clock."""
        from fusion_model.training.live_memory import storage_bytes

        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            states = [v for state in trainer.optimizers[0].state.values() for v in state.values() if torch.is_tensor(v)]
            self.record.update(peak_bytes=int(self._mode.peak), optimizer_state_bytes=storage_bytes(states),
                               gradient_bytes=storage_bytes(p.grad for p in pl_module.parameters()
                                                            if p.grad is not None),
                               parameter_bytes=storage_bytes(pl_module.parameters()))
            self._mode = None
        elif self._start is not None:
            self.record["step_seconds"].append(time.perf_counter() - self._start)
            self._start = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Write the record."""
        atomic_write_json(self.path, self.record)


def fit_options(config: SFTExperimentConfig, folder: Path, demo_dir: Path, token_dir: Path, vocab,
                answer_only: bool, lr: float | None = None, extra: list[str] | None = None,
                callbacks: list[dict] | None = None, steps: int | None = None) -> list[str]:
    """The `train.py fit` options of one SFT arm: the SFT recipe over the demo's config, the demo's decoder as the
    start, the demo's architecture (a later --config replaces model.config whole), the arm's lr, the steps, and
    `extra` (the arm's --model.peft / --model.train_only). `callbacks` / `steps` replace the run's own (the peak
    measurement's short fit)."""
    steps = config.steps if steps is None else steps
    callbacks = callbacks if callbacks is not None else [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(folder / "checkpoints"), "save_last": True,
                       "every_n_train_steps": steps}},
        {"class_path": "experiments.demo.recorder.LossRecorder", "init_args": {"path": str(folder / "losses.json")}},
        {"class_path": "experiments.sft.TargetCounter", "init_args": {"path": str(folder / "targets.json")}},
    ]
    return [
        f"--config={SFT_CONFIG}",
        "--model.config.preset=demo", f"--model.config.vocab_size={vocab.vocab_size}",
        f"--model.config.image_offset={vocab.image_offset}", f"--model.config.image_codes={vocab.image_codes}",
        f"--model.init_weights={demo_dir / 'train' / 'model.ckpt'}",
        f"--data.answer_only={'true' if answer_only else 'false'}",
        f"--model.lr={config.lr if lr is None else lr}", f"--model.warmup_steps={config.warmup_steps}",
        f"--seed_everything={config.seed}", f"--trainer.max_steps={steps}", "--trainer.max_time=null",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={folder}", f"--trainer.logger.init_args.save_dir={folder}",
        f"--data.train_dir={token_dir}", f"--data.seed={config.seed}",
        f"--data.vocab={demo_dir / 'vocab' / 'tokenizer.json'}",
        f"--data.image_tokenizer={demo_dir / 'tokenizer' / 'model'}",
        *[f"--trainer.callbacks+={json.dumps(c)}" for c in callbacks], *(extra or []), *config.extra_fit,
    ]


def fit_arm(name: str, config: SFTExperimentConfig, out_dir: Path, demo_dir: Path, token_dir: Path, vocab,
            arm: Arm, log: Callable[[str], None]) -> tuple[torch.nn.Module, dict]:
    """Train one SFT arm through `train.py fit` (or reuse a finished one); its decoder (LoRA merged) and training
    record."""
    from fusion_model.checkpoint import load_model
    from fusion_model.cli.fit import fit_from_config

    folder = out_dir / name
    answer_only = arm.answer_only
    options = fit_options(config, folder, demo_dir, token_dir, vocab, answer_only, arm_lr(config, arm),
                          arm_options(arm))
    saved = folder / "record.json"
    if config.reuse and saved.is_file():
        record = json.loads(saved.read_text())
        if record["options"] == options and Path(record["checkpoint"]).is_file():
            log(f"  {name}: reusing the finished run")
            return load_model(record["checkpoint"]).eval(), record
    if folder.exists():
        shutil.rmtree(folder)  # every run starts fresh: the comparison is of fixed step counts
    log(f"  {name}: {config.steps} steps (loss on {'the answers only' if answer_only else 'every token'}, "
        f"{arm.method}, lr {arm_lr(config, arm):g}) ...")
    cli = fit_from_config(FIT_CONFIG, options)
    module = cli.model.eval()
    model = module.model.eval()
    if arm.peft:  # the adapter folded into its base: a plain decoder, as `generate` and `convert export` make it
        from fusion_model.families.adapters import merge_lora

        model = merge_lora(model).eval()
    final = json.loads((folder / "losses.json").read_text())
    counts = json.loads((folder / "targets.json").read_text())
    seq_len = int(cli.datamodule.seq_len)
    flops_per_token = module.model_config.flops_per_token(seq_len)
    positions = int(module.decoder_positions)
    from fusion_model.checkpoint import save_model

    checkpoint = save_model(model, folder / "model.ckpt")
    record = {
        "steps": int(final["final"]["steps"]), "seconds": float(final["final"]["seconds"]),
        "tokens": int(counts["positions"]), "loss_targets": int(counts["targets"]), "rows": int(counts["rows"]),
        "decoder_positions": positions, "seq_len": seq_len, "batch_size": int(cli.datamodule.batch_size),
        "flops_per_token": flops_per_token, "flops": flops_per_token * positions,
        "tokens_per_second": int(counts["positions"]) / max(float(final["final"]["seconds"]), 1e-9),
        "final_train_loss": {"text": final["text"][-1] if final["text"] else None,
                             "image": final["image"][-1] if final["image"] else None},
        "answer_only": answer_only, "token_dir": str(token_dir), "checkpoint": str(checkpoint), "options": options,
    }
    atomic_write_json(saved, record)
    log(f"  {name}: {record['steps']} steps, {record['tokens']:,} tokens ({record['loss_targets']:,} loss targets) "
        f"in {record['seconds']:.0f} s")
    return model, record


def measure_arm(name: str, config: SFTExperimentConfig, out_dir: Path, demo_dir: Path, token_dir: Path, vocab,
                arm: Arm, training: dict, log: Callable[[str], None]) -> dict:
    """The cost of one training step of an arm's configuration: a short `train.py fit` with the arm's options
    (PEAK_STEPS steps, `StepPeak` measuring step 1) into `<arm>/peak`; with the run's own seconds per step and
    AdamW's bytes (2 x 4 B per parameter the optimizer holds, besides the measured state bytes)."""
    from fusion_model.cli.fit import fit_from_config

    folder = out_dir / name / "peak"
    saved = out_dir / name / "peak.json"
    callbacks = [{"class_path": "experiments.sft.StepPeak", "init_args": {"path": str(folder / "peak.json")}}]
    options = fit_options(config, folder, demo_dir, token_dir, vocab, arm.answer_only, arm_lr(config, arm),
                          arm_options(arm), callbacks=callbacks, steps=PEAK_STEPS)
    measured = None
    if config.reuse and saved.is_file():
        kept = json.loads(saved.read_text())
        measured = kept["measured"] if kept.get("options") == options else None
    if measured is None:
        if folder.exists():
            shutil.rmtree(folder)
        fit_from_config(FIT_CONFIG, options)
        measured = json.loads((folder / "peak.json").read_text())
        shutil.rmtree(folder)  # its checkpoints and logs are of no use
        atomic_write_json(saved, {"options": options, "measured": measured})
    timed = measured["step_seconds"]
    cost = {**{k: v for k, v in measured.items() if k != "step_seconds"},
            "method": arm.method, "lr": arm_lr(config, arm), "peft": arm.peft, "train_only": arm.train_only,
            "optimizer_bytes": 8 * measured["optimizer_parameters"],
            "seconds_per_step": training["seconds"] / max(training["steps"], 1),
            "timed_step_seconds": timed, "timed_seconds_per_step": float(np.median(timed)) if timed else None}
    log(f"  {name}: {cost['trainable_parameters']:,} trainable parameters, peak {cost['peak_bytes'] / 2**20:.2f} MiB "
        f"live tensors, {cost['seconds_per_step']:.3f} s/step in the run")
    return cost


# ---------------------------------------------------------------- answering and scoring


def evaluate_arm(name: str, checkpoint: Path, model, ctx: _Context) -> dict:
    """The `chat` suite on the arm's checkpoint (`evaluation.run.evaluate`: the held-out conversations answered
    through the family's `generate`, scored per category; results.json and the sample page in `<out>/<arm>/eval`),
    plus the held-out pretraining loss (forgetting)."""
    from evaluation.base import EvalSettings
    from evaluation.chat import ChatOptions
    from evaluation.run import evaluate

    g = ctx.demo.generate
    settings = EvalSettings(seed=ctx.config.seed, temperature=g.temperature, top_k=g.top_k, cfg_scale=g.cfg_scale,
                            batch_size=64)
    options = ChatOptions(demo_dir=str(ctx.demo_dir), conversations=str(ctx.conversations))
    start = time.perf_counter()
    scored = evaluate(checkpoint, "chat", vocab=ctx.demo_dir / "vocab" / "tokenizer.json",
                      media_tokenizer=ctx.demo_dir / "tokenizer" / "model", out=ctx.out_dir / name / "eval",
                      settings=settings, options=options, progress=lambda line: None)
    seconds = time.perf_counter() - start
    figures = scored["figures"]
    forgetting = document_loss(model, ctx.documents, ctx.vocab.pad_id)
    generated = figures["generated_tokens"]
    return {**{k: figures[k] for k in ("categories", "mean_accuracy", "image_when_none_asked",
                                       "text_only_when_image_asked", "answers")},
            "held_out_pretraining_loss": forgetting, "answer_seconds": seconds, "generated_tokens": generated,
            "generated_tokens_per_second": generated / max(seconds, 1e-9),
            "page": str(ctx.out_dir / name / "eval" / "index.html")}


# ---------------------------------------------------------------- the experiment


@dataclass
class _Context:
    """What every arm's evaluation shares."""

    config: SFTExperimentConfig
    demo: DemoConfig
    demo_dir: Path
    out_dir: Path
    vocab: object
    conversations: Path  # the held-out JSONL the chat suite answers (its .labels.json beside it)
    documents: list  # held-out pretraining documents (forgetting)


def run(config: SFTExperimentConfig, log: Callable[[str], None] = print, demo: DemoConfig | None = None) -> dict:
    """Write the conversations, train the SFT arms, answer and score every arm; returns (and writes) the results.

    `demo`: the settings the demo in `demo_dir` ran with (default: the preset's): its held-out digits must be the
    ones it held out."""
    from experiments.demo.stages import load_decoder

    demo = demo or load_config(config.demo)
    demo_dir = Path(config.demo_dir or demo.out_dir).resolve()
    out_dir = Path(config.out_dir).resolve()
    require_outputs(demo_dir, config.demo, ("tokenizer/model", "vocab/tokenizer.json", "train/model.ckpt",
                                            "generate/classifier.pt"),
                    "pretrained decoder, tokenizer, vocabulary and classifier")
    out_dir.mkdir(parents=True, exist_ok=True)
    start, threads = time.perf_counter(), torch.get_num_threads()  # read now: a fit may change it for itself
    vocab, tokenizer = load_vocab(demo_dir), load_image_tokenizer(demo_dir)

    log("[1/5] conversations from the demo's digits (training digits for training, held-out for evaluation)")
    digits = digits_for(demo)
    size = demo.data.image_size
    pictures = {"train": SplitPictures(digits.train_images, size), "held_out": SplitPictures(digits.test_images, size)}
    chat = chat_data.write_chat_data(out_dir / "chat", digits.train_labels, digits.test_labels, pictures,
                                    train_conversations=config.train_conversations,
                                    held_out_per_category=config.held_out_per_category, seed=config.seed)

    log("[2/5] token shards (train.py shards write --chat, shards tokenize --train-roles assistant)")
    shards = {name: chat_shards(getattr(chat, name), out_dir / "shards" / name, demo_dir)
              for name in ("train", "train_unbalanced")}

    ctx = _Context(config, demo, demo_dir, out_dir, vocab, chat.held_out,
                   pretraining_documents(demo, tokenizer, vocab, config.held_out_documents, config.seed))

    log("[3/5] training (train.py fit --config configs/fusion/demo.yaml --config configs/fusion/post/sft.yaml)")
    models: dict[str, torch.nn.Module] = {"pretrained": load_decoder(demo_dir)}
    training: dict[str, dict] = {}
    unknown = sorted(set(config.arms or ()) - set(ARMS))
    if unknown:
        raise ValueError(f"--arms {unknown}: the arms are {list(ARMS)}")
    chosen = {name: arm for name, arm in ARMS.items()
              if arm is None or config.arms is None or name in config.arms}
    for name, arm in chosen.items():
        if arm is not None:
            models[name], training[name] = fit_arm(name, config, out_dir, demo_dir, shards[arm.split], vocab, arm,
                                                   log)
    log("       one step of each arm's configuration: peak of live tensor bytes (fusion_model/training/live_memory.py's LivePeak)")
    for name, arm in chosen.items():
        if arm is not None:
            training[name]["cost"] = measure_arm(name, config, out_dir, demo_dir, shards[arm.split], vocab, arm,
                                                 training[name], log)

    log("[4/5] answering the held-out conversations (train.py eval --suite chat)")
    checkpoints = {"pretrained": demo_dir / "train" / "model.ckpt",
                   **{name: Path(record["checkpoint"]) for name, record in training.items()}}
    results: dict[str, dict] = {}
    for name, model in models.items():
        results[name] = evaluate_arm(name, checkpoints[name], model.eval(), ctx)
        log(f"  {name}: " + ", ".join(f"{c} {r['accuracy']:.0%}" for c, r in results[name]["categories"].items())
            + f"; held-out pretraining loss {results[name]['held_out_pretraining_loss']['all']:.3f}")

    log("[5/5] results")
    record = {"config": dataclasses.asdict(config), "demo_dir": str(demo_dir), "out_dir": str(out_dir),
              "sft_config": str(SFT_CONFIG.relative_to(REPO_ROOT)), "arms": {k: v and v._asdict() for k, v in chosen.items()},
              "training": training, "results": results,
              "data": {"train": counts_of(chat.folder, "train"), "train_unbalanced": counts_of(chat.folder,
                                                                                               "train_unbalanced"),
                       "held_out": counts_of(chat.folder, "held_out"),
                       "held_out_pretraining_documents": len(ctx.documents)},
              "minutes": (time.perf_counter() - start) / 60, "threads": threads,
              "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    record["samples"] = str(write_samples(record, out_dir / "samples.html", chat.folder, config.samples_shown))
    atomic_write_json(out_dir / "results.json", record)
    atomic_write_text(out_dir / "results.md", results_table(record))
    log(results_table(record))
    log(f"results: {out_dir / 'results.md'}, samples: {record['samples']} ({record['minutes']:.1f} minutes)")
    return record


def counts_of(folder: Path, name: str) -> dict[str, int]:
    """Conversations per category of one written split."""
    rows = chat_data.read_labels(folder, name)
    return {c: sum(r.category == c for r in rows) for c in chat_data.CATEGORIES}


# ---------------------------------------------------------------- outputs


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def results_table(record: dict) -> str:
    """The results as Markdown tables: accuracy per category, wrong-modality rates and forgetting, training cost."""
    results, training = record["results"], record["training"]
    categories = list(chat_data.CATEGORIES)
    lines = ["| arm | " + " | ".join(categories) + " | mean | interleaved sentence | image when none asked | "
             "text-only when image asked |", "|---" * (len(categories) + 5) + "|"]
    for arm, r in results.items():
        cells = [_pct(r["categories"].get(c, {}).get("accuracy")) for c in categories]
        sentence = r["categories"].get("interleaved", {}).get("sentence_accuracy")
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {_pct(r['mean_accuracy'])} | {_pct(sentence)} | "
                     f"{_pct(r['image_when_none_asked'])} | {_pct(r['text_only_when_image_asked'])} |")
    lines += ["", "| arm | held-out pretraining loss | text | image | change (all) |", "|---" * 5 + "|"]
    before = results["pretrained"]["held_out_pretraining_loss"]["all"]
    for arm, r in results.items():
        loss = r["held_out_pretraining_loss"]
        lines.append(f"| {arm} | {loss['all']:.4f} | {loss['text']:.4f} | {loss['image']:.4f} | "
                     f"{loss['all'] - before:+.4f} |")
    lines += ["", "| arm | steps | tokens | loss targets | training FLOPs | tokens/s | seconds | answers: tokens/s |",
              "|---" * 8 + "|"]
    for arm, r in results.items():
        t = training.get(arm)
        if t is None:
            lines.append(f"| {arm} | 0 | 0 | 0 | 0 | - | - | {r['generated_tokens_per_second']:,.0f} |")
            continue
        lines.append(f"| {arm} | {t['steps']} | {t['tokens']:,} | {t['loss_targets']:,} | {t['flops']:.3g} | "
                     f"{t['tokens_per_second']:,.0f} | {t['seconds']:.0f} | {r['generated_tokens_per_second']:,.0f} |")
    lines += ["", "| arm | trains | lr | trainable parameters | AdamW bytes (8 B x parameters held) | AdamW state "
              "bytes (measured) | gradient bytes | peak live tensor bytes (one step) | s/step (run) | s/step (timed "
              "again) |", "|---" * 10 + "|"]
    for arm in results:
        c = (training.get(arm) or {}).get("cost")
        if c is None:
            lines.append(f"| {arm} | nothing | - | 0 | 0 | 0 | 0 | - | - | - |")
            continue
        timed = "-" if c["timed_seconds_per_step"] is None else f"{c['timed_seconds_per_step']:.3f}"
        what = {"full": "every weight", "head": "head's image-code rows",
                "lora": "LoRA r{rank} alpha {alpha:g} ({targets})".format(**c["peft"]) if c["peft"] else "LoRA"}
        lines.append(f"| {arm} | {what[c['method']]} | {c['lr']:g} | {c['trainable_parameters']:,} of "
                     f"{c['total_parameters']:,} | {c['optimizer_bytes']:,} | {c['optimizer_state_bytes']:,} | "
                     f"{c['gradient_bytes']:,} | {c['peak_bytes']:,} ({c['peak_bytes'] / 2**20:.2f} MiB) | "
                     f"{c['seconds_per_step']:.3f} | {timed} |")
    data, config = record["data"], record["config"]
    held = data["held_out"]
    lines += ["", f"Held-out conversations per category: {held}; training conversations: balanced {data['train']}, "
              f"unbalanced {data['train_unbalanced']}. Accuracy: text answers by exact match of the digit's name "
              f"(no image), image answers by the demo's classifier reading the answer's first image (interleaved: "
              f"the image; 'interleaved sentence': the sentence after it names the digit). Forgetting: mean "
              f"next-token loss on {data['held_out_pretraining_documents']} pretraining-style documents of held-out "
              f"digits. Every SFT arm: {config['steps']} steps at the lr in the last table (configs/fusion/post/sft.yaml: "
              f"1e-5{'' if config['lr'] == 1e-5 else ', overridden for the small demo decoder'}). Training FLOPs = "
              f"FLOPs/token x real (non-padding) positions run (the answer-only loss costs the same forward and "
              f"backward). {record['minutes']:.1f} minutes on "
              f"{record['threads']} thread(s). Cost of a step: a {PEAK_STEPS}-step `train.py fit` of each arm's "
              f"options; its step 1 (after AdamW's states exist) under fusion_model/training/live_memory.py's LivePeak (the peak "
              f"of live tensor storages: parameters, gradients, AdamW states, batch, activations; CPU fp32), steps "
              f"2-{PEAK_STEPS - 1} timed ('timed again': their median, all arms back to back); 's/step (run)': the "
              f"arm's training seconds / steps. Head-only's trainable parameters are the head's image-code rows; "
              f"AdamW holds the whole head matrix (its text rows' gradient is zeroed), so its bytes count every row."]
    return "\n".join(lines) + "\n"


def write_samples(record: dict, path: Path, chat_folder: Path, shown: int) -> Path:
    """`samples.html`: for each category, the first held-out prompts and every arm's answer side by side (its text
    and the digit the classifier read in its image), marked right or wrong; each arm's `train.py eval` page (linked)
    shows the answers' images."""
    import html

    from experiments.demo import report

    results = record["results"]
    conversations = chat_data.read_labels(chat_folder, "held_out")
    sections = []
    for category in chat_data.CATEGORIES:
        picks = [i for i, c in enumerate(conversations) if c.category == category][:shown]
        rows = []
        for i in picks:
            c = conversations[i]
            prompt = " ".join(report.image_tag(np.asarray(_open(chat_folder / p)), 48) if isinstance(p, Path)
                              else html.escape(p) for p in chat_data.user_parts(c))
            cells = [f"<td>{prompt}<br><small>answer: {DIGIT_WORDS[c.answer]}</small></td>"]
            for r in results.values():
                given = r["answers"][i]
                read = given["image_read"]
                body = (f"[image read as {DIGIT_WORDS[read]}] " if read is not None else
                        "[unfinished image] " if given["opened_image"] else "")
                body += html.escape(given["text"] or "") or "<i>(no text)</i>"
                ok = read == c.answer if chat_data.ASKS_FOR_IMAGE[category] else text_answer_is_right(
                    given["text"], given["opened_image"], c.answer)
                cells.append(f"<td>{report.mark(bool(ok))} {body}</td>")
            rows.append("<tr>" + "".join(cells) + "</tr>")
        if rows:
            header = "<tr><th>prompt</th>" + "".join(
                f'<th><a href="{html.escape(Path(r["page"]).relative_to(path.parent).as_posix())}">'
                f"{html.escape(arm)}</a></th>" for arm, r in results.items()) + "</tr>"
            sections.append(report.section(category, f"<table>{header}{''.join(rows)}</table>"))
    return report.write_html(path, "SFT on the demo's digits: held-out conversations and each arm's answer",
                             sections, "Each arm's name links to its `train.py eval --suite chat` page, which shows "
                             "the answers' images.")


def _open(path: Path):
    from PIL import Image

    return Image.open(path).convert("RGB")


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The `train.py experiment sft` options."""
    defaults = SFTExperimentConfig()
    parser = argparse.ArgumentParser(prog="train.py experiment sft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="a few steps and conversations on the smoke demo's outputs (runs/demo-smoke), "
                             "about a minute")
    parser.add_argument("--demo", default=None, help=f"the demo preset whose outputs are reused (default: "
                        f"{defaults.demo}; smoke with --smoke)")
    parser.add_argument("--demo-dir", default=None, help="the finished demo's folder (default: the preset's out_dir)")
    parser.add_argument("--out", default=None, help=f"output folder (default: {defaults.out_dir}; "
                        "runs/sft-smoke with --smoke)")
    for name in ("steps", "train_conversations", "held_out_per_category", "warmup_steps", "held_out_documents",
                 "samples_shown", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default: {getattr(defaults, name)}")
    parser.add_argument("--lr", type=float, default=None, help=f"SFT learning rate (default: {defaults.lr}; "
                        "configs/fusion/post/sft.yaml's 1e-5 is for billions of parameters)")
    parser.add_argument("--lora-lr", type=float, default=None,
                        help=f"the LoRA arms' learning rate (default: {defaults.lora_lr})")
    parser.add_argument("--head-lr", type=float, default=None,
                        help="head_only's learning rate (default: --lr's)")
    parser.add_argument("--arms", default=None, help=f"comma-separated SFT arms to train (default: all: "
                        f"{','.join(k for k, v in ARMS.items() if v)}); the pretrained decoder always answers")
    parser.add_argument("--reuse", action="store_true",
                        help="keep arms already trained with the same options (resume an interrupted experiment)")
    parser.add_argument("--threads", default="auto", help="torch threads: auto = the cores other processes leave idle")
    return parser


def config_from_args(args: argparse.Namespace) -> SFTExperimentConfig:
    """The experiment's settings: the full run's or the smoke mode's, with the options given replacing theirs."""
    base = smoke_config() if args.smoke else SFTExperimentConfig()
    given = {"demo": args.demo, "demo_dir": args.demo_dir, "out_dir": args.out, "lr": args.lr,
             "lora_lr": args.lora_lr, "head_lr": args.head_lr,
             "reuse": args.reuse or None,
             "arms": [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None,
             **{name: getattr(args, name) for name in ("steps", "train_conversations", "held_out_per_category",
                                                       "warmup_steps", "held_out_documents", "samples_shown",
                                                       "seed")}}
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python train.py experiment sft`."""
    return run_experiment_command("sft", argv, build_parser, config_from_args, run)
