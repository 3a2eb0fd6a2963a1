"""The Mixture-of-Transformers block (`--model.config.block mot`) through training: upcycling a dense checkpoint,
the export refusal, exact resume, DDP = one process, FSDP2 with a text-only rank, the stability monitor and z-loss,
and `train.py fit` from the command line. The harnesses are the dense tests' (fit_worker, test_resume,
test_distributed, test_monitors), run with a MoT decoder."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from fusion_model import cli
from fusion_model.checkpoint import load_model, save_model
from fusion_model.cli.fit import main
from fusion_model.config import FusionConfig
from fusion_model.hf_convert import to_transformers
from fusion_model.model import FusionModel
from fusion_model.training import lightning_module
from fusion_model.training.lightning_module import FusionLightningModule
from fusion_model.training.monitors import PARAMETER_GROUPS, InstabilityWarning, StabilityMonitor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_worker as fw  # noqa: E402
import test_distributed as td  # noqa: E402  (module attributes only: its tests stay collected in their own file)
import test_monitors as tm  # noqa: E402
import test_resume as tr  # noqa: E402

# fit_worker's shards hold random ids 1..255: ids 192..255 are the image block, so every batch mixes modalities
IMAGE_OFFSET, IMAGE_CODES = 192, 64
MOT = ("--model.config.block=mot", f"--model.config.image_offset={IMAGE_OFFSET}",
       f"--model.config.image_codes={IMAGE_CODES}")


def tiny(**overrides) -> FusionConfig:
    """fit_worker's tiny decoder (the one `tiny_args` trains) with the image block above."""
    fields = {k: v for k, v in fw.TINY.items() if k != "dropout"}
    return FusionConfig.from_preset("tiny", **{**fields, "image_offset": IMAGE_OFFSET, "image_codes": IMAGE_CODES,
                                               **overrides})


def mixed_ids(rows: int = 2, length: int = 24, seed: int = 0, text_only: bool = False) -> torch.Tensor:
    """Random ids: alternating runs of 6 text ids (1..191) and 6 image codes, or text only."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(1, IMAGE_OFFSET, (rows, length), generator=generator)
    if text_only:
        return text
    image = torch.randint(IMAGE_OFFSET, IMAGE_OFFSET + IMAGE_CODES, (rows, length), generator=generator)
    return torch.where((torch.arange(length) % 12) >= 6, image, text)


def init_weights_module(config: FusionConfig, dense_path: Path) -> FusionLightningModule:
    """The Lightning module for `config` after a zero-step fit from `dense_path`: the init-weights load of `fit`."""
    module = FusionLightningModule(config.to_dict(), init_weights=str(dense_path), decay_steps=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    ids = mixed_ids()
    trainer.fit(module, torch.utils.data.DataLoader([{"input_ids": ids, "document_ids": torch.zeros_like(ids)}],
                                                    batch_size=None))
    return module


@pytest.fixture
def info_lines(monkeypatch) -> list[str]:
    """The lines the Lightning module reports through rank_zero_info (stderr in a run; caught here without depending
    on how earlier tests left the logging configuration)."""
    lines: list[str] = []
    monkeypatch.setattr(lightning_module, "rank_zero_info", lambda message, *args, **kwargs: lines.append(message))
    return lines


# ---- upcycling -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options, norm_placement", [({}, "pre"), ({"attention": False, "norms": False}, "pre"),
                                                     ({}, "swin")])
def test_an_upcycled_model_computes_the_dense_models_logits(options, norm_placement, tmp_path, info_lines):
    torch.manual_seed(0)
    dense = FusionModel(tiny(norm_placement=norm_placement)).eval()
    with torch.no_grad():  # norms off their initial identity: a norm loaded into the wrong place would show
        for p in dense.parameters():
            if p.dim() < 2:
                p.add_(0.3 * torch.randn_like(p))
    save_model(dense, tmp_path / "dense.ckpt")
    upcycled = init_weights_module(tiny(norm_placement=norm_placement, block="mot", block_options=options),
                                   tmp_path / "dense.ckpt").model.eval()
    assert [line for line in info_lines if "upcycled" in line] == [
        f"model.init_weights {tmp_path / 'dense.ckpt'}: upcycled the dense weights into the mot block (each "
        "modality's copy starts as the dense weight)"]
    assert any(".image." in name for name, _ in upcycled.named_parameters())  # really weights per modality
    ids = torch.cat([mixed_ids(), mixed_ids(1, seed=1, text_only=True)])
    with torch.no_grad():
        torch.testing.assert_close(upcycled(ids), dense(ids))
    # the copies are separate parameters: training one modality's leaves the other's as it was
    image, text = upcycled.layers[0].mlp["image"].down.weight, upcycled.layers[0].mlp["text"].down.weight
    assert image.data_ptr() != text.data_ptr() and torch.equal(image, text)


@pytest.mark.parametrize("have, want, difference", [
    (dict(block="mot"), dict(), "block: mot vs dense"),  # MoT weights cannot start a dense model
    (dict(), dict(block="mot", dim=64), "dim: 32 vs 64"),  # the block may differ, nothing else
    (dict(block="mot", block_options={"ffn": False}), dict(block="mot"), "block_options: {'ffn': False} vs {}"),
])
def test_any_other_architecture_difference_is_still_refused(have, want, difference, tmp_path):
    save_model(FusionModel(tiny(**have)), tmp_path / "have.ckpt")
    with pytest.raises(ValueError, match="holds another architecture") as refused:
        init_weights_module(tiny(**want), tmp_path / "have.ckpt")
    assert difference in str(refused.value) and "--model.config null" in str(refused.value)


def test_fit_upcycles_a_dense_run_from_the_command_line_and_its_first_loss_is_the_dense_ones(tmp_path, info_lines,
                                                                                            one_thread):
    tokens = fw.make_token_dir(tmp_path / "tokens")
    layout = list(MOT[1:])
    assert main(fw.tiny_args(tokens, tmp_path / "dense", 2, extra=layout)) == 0
    dense_checkpoint = tmp_path / "dense" / "ckpt" / "last.ckpt"
    assert main(fw.tiny_args(tokens, tmp_path / "mot", 1, extra=[
        *MOT, '--model.config.block_options={"norms": false}', f"--model.init_weights={dense_checkpoint}",
        fw.recorder_arg(tmp_path / "rec")])) == 0
    assert any("upcycled the dense weights into the mot block" in line for line in info_lines)
    first = torch.load(tmp_path / "rec.rank0.pt", weights_only=True)
    batch = first["batches"][0]
    with torch.no_grad():  # the first step's loss comes from the upcycled weights, before any update
        expected = load_model(dense_checkpoint).loss(batch, first["document_ids"][0])["loss"]
    torch.testing.assert_close(torch.tensor(first["losses"][0]), expected)
    trained = load_model(tmp_path / "mot" / "ckpt" / "last.ckpt").config
    assert (trained.block, trained.block_options) == ("mot", {"norms": False})


# ---- interop ---------------------------------------------------------------------------------------------------
def test_convert_export_refuses_a_mot_checkpoint_in_one_sentence_before_writing_anything(tmp_path, capsys):
    save_model(FusionModel(tiny(block="mot")), tmp_path / "mot.ckpt")
    argv = ["convert", "export", "--checkpoint", str(tmp_path / "mot.ckpt"), "--out", str(tmp_path / "hf")]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        f"train.py convert: {tmp_path / 'mot.ckpt'}: transformers' Chameleon holds only dense layers (one set of "
        "weights for every token), not this decoder's 'mot' block, so it cannot be exported (sample it with "
        "`train.py generate`)\n")
    assert not (tmp_path / "hf").exists()
    # the writer itself refuses too, before it makes the folder
    with pytest.raises(ValueError, match="^to_transformers: transformers' Chameleon holds only dense layers"):
        to_transformers(load_model(tmp_path / "mot.ckpt"), tmp_path / "direct")
    assert not (tmp_path / "direct").exists()


def test_convert_import_stays_dense():
    pytest.importorskip("transformers", reason="transformers (dev extra) is the reference")
    from fusion_model.hf_convert import config_from_transformers, to_transformers_config

    dense = tiny()
    hf_config = to_transformers_config(dense, {f"IMGIMG{i}": IMAGE_OFFSET + i for i in range(IMAGE_CODES)})
    assert config_from_transformers(hf_config).block == "dense"


# ---- training invariants ------------------------------------------------------------------------------------------
def test_resume_after_sigkill_is_bit_exact_with_mot(tmp_path):
    tr.resume_after_sigkill_matches_an_uninterrupted_run(tmp_path, extra=MOT)


def test_two_ddp_processes_train_a_mot_decoder_to_the_weights_of_one_process(tmp_path, one_thread):
    tokens = fw.make_token_dir(tmp_path / "tokens")
    steps = 4
    single = tmp_path / "single"
    assert main(fw.tiny_args(tokens, single, steps, batch_size=4, extra=[*MOT, fw.recorder_arg(single / "rec")])) == 0
    reference = torch.load(single / "rec.rank0.pt", weights_only=True)
    ranks = td._two_nodes(tokens, tmp_path / "ddp", steps, "ddp", extra=list(MOT))
    assert any(".image." in name for name in reference["weights"])
    for name, value in reference["weights"].items():  # the tolerance of test_distributed
        torch.testing.assert_close(ranks[0]["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    seen = td._pieces(ranks[0]["batches"] + ranks[1]["batches"], ranks[0]["document_ids"] + ranks[1]["document_ids"])
    assert seen == td._pieces(reference["batches"], reference["document_ids"])  # the same global batches


def test_fsdp2_with_a_text_only_rank_completes_and_equals_one_process_on_the_whole_batch(tmp_path, one_thread):
    config = tiny(block="mot", z_loss_coef=1e-3)
    torch.manual_seed(0)
    reference = FusionModel(config)
    torch.save(reference.state_dict(), tmp_path / "weights.pt")

    def row(ids: torch.Tensor) -> dict[str, torch.Tensor]:  # one document per row: both ranks count 23 targets
        return {"input_ids": ids, "document_ids": torch.zeros_like(ids)}

    # rank 0 sees text and image codes, rank 1 text only: its backward must still reach the image weights
    steps = [[row(mixed_ids(1, seed=s)), row(mixed_ids(1, seed=10 + s, text_only=True))] for s in range(2)]
    torch.save({"steps": steps}, tmp_path / "batches.pt")
    fw.spawn_processes(fw.fsdp2_steps, (2, td._free_port(), config.to_dict(), str(tmp_path / "weights.pt"),
                            str(tmp_path / "batches.pt"), str(tmp_path / "fsdp2.pt")), processes=2, timeout=240)
    sharded = torch.load(tmp_path / "fsdp2.pt", weights_only=True)

    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step, (mixed, text) in enumerate(steps):
        whole = {key: torch.cat([mixed[key], text[key]]) for key in mixed}
        reference.loss(whole["input_ids"], whole["document_ids"])["loss"].backward()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(sharded["grads"][step][name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
        if step == 0:  # the image weights' gradient is rank 0's half alone: the text-only rank adds exact zeros
            image = {n: p.grad.clone() for n, p in reference.named_parameters() if ".image." in n}
            alone = FusionModel(config)
            alone.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
            (alone.loss(mixed["input_ids"], mixed["document_ids"])["loss"] / 2).backward()
            parameters = dict(alone.named_parameters())
            assert image and all(float(g.abs().max()) > 0 for g in image.values())
            for name, gradient in image.items():
                torch.testing.assert_close(gradient, parameters[name].grad, rtol=1e-5, atol=1e-7, msg=name)
        optimizer.step()
        optimizer.zero_grad()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(sharded["weights"][name], value, rtol=0, atol=1e-6, msg=name)


def test_the_stability_monitor_and_z_loss_work_with_mot(one_thread):
    batches = [tm.packed_batch(seed) for seed in range(4)]  # text and image runs, padding

    def run(callbacks: list) -> tm.MemoryLogger:
        torch.manual_seed(0)
        module = FusionLightningModule(tm.tiny_config(block="mot"), lr=1e-2, warmup_steps=1)
        L.seed_everything(0, verbose=False)
        return tm.fit(module, batches, callbacks)

    plain = run([])
    monitor = StabilityMonitor(every_n_steps=1)
    logged = run([monitor, InstabilityWarning()])
    assert logged.series("train/loss") == plain.series("train/loss")  # monitoring changes nothing
    z_loss = logged.series("train/z_loss")
    assert len(z_loss) == 4 and all(value > 0 for value in z_loss.values())
    # the monitor's z-loss (its own forward and chunked log Z) is the loss's, on the same weights and batch
    torch.testing.assert_close(torch.tensor(list(logged.series("stability/z_loss").values())),
                               torch.tensor(list(z_loss.values())), rtol=1e-5, atol=0)
    latest = monitor.latest
    for name in ("attn_logit_max/layer_0", "attn_logit_max/layer_1", "block_rms/layer_1", "image/log_z_mean",
                 *(f"grad_norm/{group}" for group in PARAMETER_GROUPS)):
        assert torch.isfinite(torch.tensor(latest[f"stability/{name}"])), name


# ---- the command line ---------------------------------------------------------------------------------------------
def test_fit_help_says_what_block_and_block_options_accept(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--model.config.block chooses the decoder layer: dense (default), mot" in text
    assert "--model.config.block_options '{ffn: true, attention: true, norms: true}'" in text
