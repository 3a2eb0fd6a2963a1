"""The real `train.py fit` path on one GPU (`python -m bench.gpu_fit`, run by `bench/gpu.sh` after `bench.gpu`): per
case (chameleon dense, MoT, answer-only conversations, LoRA from saved weights, transfusion, llava stage 1, FSDP2
on one device, torch.compile) a few bf16-mixed steps of a ~100M decoder through `fusion_model.cli.fit`, in this
process, on token shards written here. Each row: exit status, steps done, whether every loss was finite, seconds per
step, torch.cuda.max_memory_allocated, and `train.py plan`'s predicted total for the same options (their ratio).
`--dry-run`: the same path on CPU in fp32 at the tiny preset, 2 steps, memory from the plan only (measured null)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import numpy as np
import torch

from bench.harness import write_result

REPO = Path(__file__).resolve().parents[1]
# the Chameleon presets' FSDP2 strategy (configs/fusion/chameleon-7b.yaml), one atomic .ckpt file
FSDP2 = json.dumps({"class_path": "fusion_model.training.checkpointing.AtomicModelParallelStrategy",
                    "init_args": {"save_distributed_checkpoint": False}})
LORA = "{rank: 8, targets: all}"
# the shards' id layout: pad, bos, eos, <boi>, <eoi>, <image> (the placeholder), text from 16, then the image block
PAD, BOS, EOS, BOI, EOI, IMAGE, TEXT_START = 0, 1, 2, 3, 4, 5, 16


@dataclass(frozen=True)
class Scale:
    """Sizes of one mode: the decoder (model.config overrides), the data, the steps."""

    decoder: dict
    vocab_size: int
    image_offset: int
    image_codes: int
    patches: int  # image codes (or latent patches) per image
    grid: tuple[int, int]  # the latent grid of a transfusion image (patches = its product)
    channels: int  # latent channels
    feature_dim: int  # llava's pre-quantisation feature width
    seq_len: int
    batch_size: int
    steps: int
    warmup: int  # steps left out of the seconds-per-step median (first-step compilation, allocator)
    documents: int
    doc_text: tuple[int, int]  # text tokens per document, low and high


GPU = Scale(decoder={"preset": "medium", "dim": 768, "n_layers": 12, "n_heads": 12, "dropout": 0.0},
            vocab_size=8192, image_offset=4096, image_codes=4096, patches=64, grid=(8, 8), channels=8,
            feature_dim=64, seq_len=1024, batch_size=8, steps=12, warmup=3, documents=384, doc_text=(64, 500))
DRY = Scale(decoder={"preset": "tiny", "dropout": 0.0}, vocab_size=256, image_offset=128, image_codes=64,
            patches=4, grid=(2, 2), channels=4, feature_dim=8, seq_len=32, batch_size=2, steps=2, warmup=0,
            documents=24, doc_text=(4, 20))


@dataclass(frozen=True)
class Case:
    name: str
    shards: str  # codes | conversation | features | latent
    options: tuple[str, ...] = ()
    lora: bool = False  # start from weights this script saves (init_weights), train LoRA on them
    what: str = ""


CASES = (
    Case("chameleon_dense", "codes", what="chameleon, dense blocks"),
    Case("chameleon_mot", "codes", ("--model.config.block=mot",), what="chameleon, Mixture-of-Transformers blocks"),
    Case("chameleon_conversation", "conversation", what="chameleon on conversation shards (answer-only loss)"),
    Case("chameleon_lora", "codes", (f"--model.peft={LORA}",), lora=True,
         what="chameleon, LoRA rank 8 on every projection, base from --model.init_weights"),
    Case("transfusion", "latent", ("--model.family=transfusion",), what="transfusion on latent shards"),
    Case("llava_stage1", "features", ("--model.family=llava", "--model.family_options={stage: 1}"),
         what="llava stage 1 (connector only) on code shards with synthetic pre-quantisation features"),
    Case("chameleon_fsdp2", "codes", (f"--trainer.strategy={FSDP2}",),
         what="chameleon dense under ModelParallelStrategy (FSDP2) on one device"),
    Case("chameleon_compile", "codes", ("--model.compile=true",), what="chameleon dense, --model.compile true"),
)


# ---- token shards --------------------------------------------------------------------------------------------

def _text(rng: np.random.Generator, scale: Scale, low: int | None = None) -> list[int]:
    lo, hi = scale.doc_text
    return rng.integers(TEXT_START, scale.image_offset, int(rng.integers(low or lo, hi + 1))).tolist()


def write_shards(path: Path, kind: str, scale: Scale, seed: int = 0) -> Path:
    """Two token shards of random documents with a valid manifest: `codes` (text and code images), `conversation`
    (the same, two in three with an answer-only target mask), `features` (codes plus one float16 feature row per
    code position, as `shards tokenize --features` writes), `latent` (text and <image> placeholders with latent
    patch rows, Transfusion's)."""
    from data_shards.token_shards import CONVERSATION, LATENT_KIND, TARGET, write_manifest, write_token_shard

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    info = {"vocab_size": scale.vocab_size, "vocab_fingerprint": "bench-vocab",
            "image_tokenizer_fingerprint": "bench-latent" if kind == "latent" else "bench-image"}
    metas = []
    for shard in range(2):
        documents, targets, rows = [], [], 0
        for index in range(scale.documents // 2):
            document = [BOS, *_text(rng, scale)]
            for _ in range(int(rng.integers(0, 3))):
                if kind == "latent":
                    document += [BOI, *[IMAGE] * scale.patches, EOI]
                else:
                    codes = rng.integers(scale.image_offset, scale.image_offset + scale.image_codes, scale.patches)
                    document += [BOI, *codes.tolist(), EOI]
                rows += scale.patches
                document += _text(rng, scale, low=1)[: max(1, scale.doc_text[1] // 4)]
            document.append(EOS)
            documents.append(document)
            marks = np.full(len(document), TARGET, dtype=np.uint8)
            if kind == "conversation" and index % 3:
                marks[:] = CONVERSATION
                marks[int(rng.integers(1, len(document) - 1)):] |= TARGET  # the answer: from inside to the end
            targets.append(marks)
        extra: dict = {}
        features = None
        if kind == "latent":
            features = rng.standard_normal((rows, scale.channels)).astype(np.float16)
        elif kind == "features":
            features = rng.standard_normal((rows, scale.feature_dim)).astype(np.float16)
            extra["images"] = sum(1 for d in documents if BOI in d)
        if kind == "conversation":
            extra["conversations"] = sum(1 for index in range(len(documents)) if index % 3)
        keys = [f"s{shard}-d{i}" for i in range(len(documents))]
        metas.append(write_token_shard(path, f"shard-{shard:03d}", keys, documents, {**info, **extra},
                                       features=features, targets=targets if kind == "conversation" else None))
    header = {**info, "pad_id": PAD, "bos_id": BOS, "eos_id": EOS, "boi_id": BOI, "eoi_id": EOI,
              "image_placeholder_id": IMAGE}
    if kind == "latent":
        header |= {"feature_dim": scale.channels, "feature_kind": LATENT_KIND,
                   "latent": {"channels": scale.channels, "grid": list(scale.grid), "patch_size": 1}}
    else:
        header |= {"image_offset": scale.image_offset, "image_codes": scale.image_codes}
    if kind == "features":
        header["feature_dim"] = scale.feature_dim
    if kind == "conversation":
        header["target_roles"] = ["assistant"]
    write_manifest(path, header, metas)
    return path


# ---- one fit ---------------------------------------------------------------------------------------------------

class StepClock(L.Callback):
    """Seconds and loss of every training step (synchronised on CUDA, so a step's time is its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self._start = 0.0

    @staticmethod
    def _sync(pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(pl_module)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(pl_module)
        self.seconds.append(time.perf_counter() - self._start)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None:
            metrics = trainer.callback_metrics
            loss = metrics.get("train/loss", metrics.get("loss"))
        self.losses.append(float(loss) if loss is not None else math.nan)


def fit_args(case: Case, scale: Scale, shards: Path, root: Path, dry_run: bool, init_weights: Path | None) -> list[str]:
    """`train.py fit` options of a case (the plan reads the same ones)."""
    clock = {"class_path": f"{__name__ if __name__ != '__main__' else 'bench.gpu_fit'}.StepClock"}
    args = [
        f"--config={REPO / 'configs/fusion/tiny.yaml'}",
        f"--trainer.accelerator={'cpu' if dry_run else 'gpu'}", "--trainer.devices=1",
        f"--trainer.precision={'32-true' if dry_run else 'bf16-mixed'}",
        f"--trainer.max_steps={scale.steps}", f"--trainer.default_root_dir={root}",
        "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.val_check_interval=null", "--trainer.limit_val_batches=0",
        "--trainer.log_every_n_steps=1", f"--trainer.callbacks=[{json.dumps(clock)}]",
        f"--data.train_dir={shards}", f"--data.seq_len={scale.seq_len}", f"--data.batch_size={scale.batch_size}",
        "--data.num_workers=0", "--model.warmup_steps=2", "--model.lr=1e-3",
    ]
    args += [f"--model.config.{key}={value}" for key, value in scale.decoder.items()]
    if init_weights is not None:
        args.append(f"--model.init_weights={init_weights}")
    return args + list(case.options)


def decoder_config(scale: Scale):
    """The decoder `fit` builds from the codes shards (the layout fit derives from their manifest)."""
    from fusion_model.config import FusionConfig

    overrides = {k: v for k, v in scale.decoder.items() if k != "preset"}
    return FusionConfig.from_preset(scale.decoder["preset"], vocab_size=scale.vocab_size,
                                    image_offset=scale.image_offset, image_codes=scale.image_codes, **overrides)


def planned_total(argv: list[str]) -> int:
    """`train.py plan`'s total (peak bytes per device) for fit options `argv`, computed as fusion_model/cli/plan.py
    computes it (fit's parser and derivations, nothing built)."""
    import yaml

    from data_shards.datamodule import FusionDataModule
    from fusion_model.cli import FIT_SHARED_FLAGS, translate_shared_flags
    from fusion_model.cli.lightning_options import take_option
    from fusion_model.cli.plan import PlanCLI
    from fusion_model.training.lightning_module import FusionLightningModule

    peft, argv = take_option(argv, "--model.peft", None)
    train_only, argv = take_option(argv, "--model.train_only", None)
    PlanCLI.device_memory = None
    PlanCLI.what_if = {"peft": yaml.safe_load(peft) if peft else None, "train_only": train_only}
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        cli = PlanCLI(FusionLightningModule, FusionDataModule, args=translate_shared_flags(argv, FIT_SHARED_FLAGS),
                      run=False, seed_everything_default=0)
    return int(cli.plan.total)


@contextlib.contextmanager
def _cheap_compile(dry_run: bool):
    """On the dry run, torch.compile (which --model.compile calls per block) with the aot_eager backend: dynamo
    and AOTAutograd trace forward and backward as on the GPU, without inductor's C++ build (45 s on CPU)."""
    if not dry_run:
        yield
        return
    real = torch.compile

    def compile_aot_eager(*args, **kwargs):
        kwargs.setdefault("backend", "aot_eager")
        return real(*args, **kwargs)

    torch.compile = compile_aot_eager
    try:
        yield
    finally:
        torch.compile = real


def _dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tail(error: BaseException, lines: int = 12) -> str:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip().splitlines()
    return "\n".join(text[-lines:])


@dataclass
class Row:
    case: str
    what: str
    exit_status: int | None = None
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    losses_finite: bool = False
    step_s: float | None = None
    tokens_per_s: float | None = None
    wall_s: float = 0.0
    measured_bytes: int | None = None  # peak allocated during the fit, less what earlier cases left allocated
    leftover_bytes: int | None = None  # allocated when the fit started (earlier cases' remains; 0 when all freed)
    dynamo_graphs: int = 0  # graphs torch.compile built during the fit (flex attention's and --model.compile's)
    predicted_bytes: int | None = None
    ratio: float | None = None  # measured / predicted
    plan_error: str | None = None
    error: str | None = None


def run_case(case: Case, scale: Scale, shards: Path, work: Path, dry_run: bool) -> Row:
    """_run_case with the process environment restored after it: a strategy's launcher sets MASTER_PORT,
    LOCAL_RANK, ..., seeding PL_GLOBAL_SEED; left set, they would reach the next case and any subprocess."""
    environment = dict(os.environ)
    try:
        return _run_case(case, scale, shards, work, dry_run)
    finally:
        os.environ.clear()
        os.environ.update(environment)


def _run_case(case: Case, scale: Scale, shards: Path, work: Path, dry_run: bool) -> Row:
    """Plan, then train one case in this process; every failure becomes the row's error (exit status as train.py's)."""
    from fusion_model.checkpoint import save_model
    from fusion_model.cli.fit import fit_from_config
    from fusion_model.cli.lightning_options import end_process_group
    from fusion_model.training.lightning_module import NonFiniteLossError

    row = Row(case.name, case.what)
    root = work / "runs" / case.name
    started = time.perf_counter()
    init = None
    try:
        if case.lora:
            from fusion_model.model import FusionModel

            torch.manual_seed(0)
            init = save_model(FusionModel(decoder_config(scale)), work / "init.ckpt")
        args = fit_args(case, scale, shards, root, dry_run, init)
    except Exception as error:  # noqa: BLE001 - the row says what broke; the next case still runs
        row.exit_status, row.error = 1, _tail(error)
        return row
    try:
        row.predicted_bytes = planned_total(args)
    except Exception as error:  # noqa: BLE001 - the plan is advice; the fit still runs
        row.plan_error = _tail(error, 6)
    _free()
    cuda = not dry_run and torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        row.leftover_bytes = int(torch.cuda.memory_allocated())
    graphs = _dynamo_graphs()
    cli = None
    try:
        with _cheap_compile(dry_run):
            cli = fit_from_config(None, args)
        row.exit_status = 0
    except NonFiniteLossError as error:
        row.exit_status, row.error = 1, _tail(error)
    except (ValueError, SystemExit) as error:  # bad input: train.py exits 2 (jsonargparse's refusal is SystemExit)
        code = getattr(error, "code", 2)
        row.exit_status, row.error = (2 if isinstance(error, ValueError) else int(code or 0)), _tail(error)
    except Exception as error:  # noqa: BLE001 - a GPU-only failure (OOM, a kernel) is this row's result
        row.exit_status, row.error = 1, _tail(error)
    finally:
        with contextlib.suppress(Exception):
            end_process_group()
    row.wall_s = round(time.perf_counter() - started, 2)
    row.dynamo_graphs = _dynamo_graphs() - graphs
    if cuda:
        row.measured_bytes = int(torch.cuda.max_memory_allocated()) - row.leftover_bytes
    trainer = getattr(cli, "trainer", None)
    clock = next((c for c in getattr(trainer, "callbacks", []) if type(c).__name__ == "StepClock"), None)
    if trainer is not None:
        row.steps = int(trainer.global_step)
    if clock is not None:
        row.losses = [round(x, 5) for x in clock.losses]
        row.losses_finite = bool(clock.losses) and all(math.isfinite(x) for x in clock.losses)
        timed = clock.seconds[scale.warmup:] or clock.seconds
        if timed:
            row.step_s = statistics.median(timed)
            row.tokens_per_s = scale.batch_size * scale.seq_len / row.step_s
    if row.exit_status == 0 and not row.losses_finite:
        row.exit_status, row.error = 1, row.error or f"losses not all finite: {row.losses}"
    if row.measured_bytes and row.predicted_bytes:
        row.ratio = row.measured_bytes / row.predicted_bytes
    del cli, trainer, clock
    _free()
    return row


# ---- output ----------------------------------------------------------------------------------------------------

def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def table(rows: list[Row]) -> str:
    head = f"{'case':<24} {'exit':>4} {'steps':>5} {'finite':>6} {'s/step':>8} {'tok/s':>9} {'meas MiB':>9} " \
           f"{'plan MiB':>9} {'ratio':>6} {'graphs':>6} {'wall s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        step = "-" if r.step_s is None else f"{r.step_s:.4f}"
        rate = "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.0f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
        lines.append(f"{r.case:<24} {r.exit_status if r.exit_status is not None else '-':>4} {r.steps:>5} "
                     f"{'yes' if r.losses_finite else 'no':>6} {step:>8} {rate:>9} {_mib(r.measured_bytes):>9} "
                     f"{_mib(r.predicted_bytes):>9} {ratio:>6} {r.dynamo_graphs:>6} {r.wall_s:>7.1f}")
    for r in rows:
        if r.error:
            lines.append(f"\n{r.case}: {r.error}")
        if r.plan_error:
            lines.append(f"\n{r.case} (plan): {r.plan_error}")
    return "\n".join(lines)


def figures_of(rows: list[Row]) -> dict:
    """The harness's figure format: per case that ran, its numbers (the renderer reads these)."""
    figures: dict = {}
    for r in rows:
        if r.exit_status != 0:
            continue
        entry: dict = {}
        if r.step_s is not None:
            entry["step_s"] = {"value": r.step_s, "unit": "s"}
            entry["tokens_per_s"] = {"value": r.tokens_per_s, "unit": "tok/s"}
        if r.measured_bytes is not None:
            entry["peak_memory"] = {"value": r.measured_bytes, "unit": "B"}
        if r.predicted_bytes is not None:
            entry["planned_memory"] = {"value": r.predicted_bytes, "unit": "B"}
        if r.ratio is not None:
            entry["measured_over_planned"] = {"value": r.ratio, "unit": "x"}
        figures[r.case] = entry
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny preset, 2 steps: no CUDA call")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all): "
                        + ", ".join(c.name for c in CASES))
    parser.add_argument("--results-dir", default=None, help="default bench/results; a temp dir with --dry-run")
    parser.add_argument("--steps", type=int, default=None, help="training steps per case")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench.gpu_fit: no CUDA device; run with --dry-run to check it on CPU", file=sys.stderr)
        return 2
    wanted = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = sorted(set(wanted) - {c.name for c in CASES})
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {[c.name for c in CASES]}")
    cases = [c for c in CASES if not wanted or c.name in wanted]
    scale = DRY if args.dry_run else GPU
    if args.steps:
        scale = Scale(**{**scale.__dict__, "steps": args.steps, "warmup": min(scale.warmup, args.steps - 1)})
    started = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpu-fit-") as tmp:
        work = Path(tmp)
        out_dir = args.results_dir or (str(work / "results") if args.dry_run else None)
        shards: dict[str, Path] = {}
        config = {"device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(0),
                  "dry_run": args.dry_run, "torch": torch.__version__,
                  "precision": "32-true" if args.dry_run else "bf16-mixed", "decoder": scale.decoder,
                  "parameters": decoder_config(scale).num_parameters(), "seq_len": scale.seq_len,
                  "batch_size": scale.batch_size, "steps": scale.steps,
                  "step_s": f"median over steps after the first {scale.warmup}",
                  "ratio": "torch.cuda.max_memory_allocated during the fit (less what was allocated at its "
                           "start) / train.py plan's total (peak per device)"}

        def save() -> Path:
            config["total_s"] = round(time.perf_counter() - started, 1)
            body = {"figures": figures_of(rows), "config": config, "cases": [r.__dict__ for r in rows]}
            return write_result("gpu_fit", body, out_dir)

        for case in cases:
            print(f"gpu_fit: {case.name} ({case.what}) at {time.perf_counter() - started:.0f} s", flush=True)
            try:
                if case.shards not in shards:
                    shards[case.shards] = write_shards(work / f"tokens-{case.shards}", case.shards, scale)
                row = run_case(case, scale, shards[case.shards], work, args.dry_run)
            except Exception as error:  # noqa: BLE001 - never lose the other rows
                row = Row(case.name, case.what, exit_status=1, error=_tail(error))
            rows.append(row)
            print(f"gpu_fit: {case.name}: exit {row.exit_status}, {row.steps} steps, {row.wall_s} s", flush=True)
            path = save()
        print(table(rows))
        kept = "" if out_dir != str(work / "results") else " (a temporary folder: --results-dir keeps it)"
        print(f"gpu_fit: wrote {path}{kept} in {config['total_s']} s")
    return 0 if rows and all(r.exit_status == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
