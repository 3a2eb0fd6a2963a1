"""The Transfusion family through `train.py fit` on continuous-image shards: options from the manifest, a SIGKILL
resume bit for bit, and two DDP processes training to the weights of one."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fusion_model.cli.fit import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_worker as fw  # noqa: E402
import test_distributed as td  # noqa: E402  (module attributes only: its tests stay collected in their own file)
import test_resume as tr  # noqa: E402

TRANSFUSION = ("--model.family=transfusion",)


def test_fit_takes_the_latent_layout_from_the_shards_and_logs_both_terms(tmp_path, one_thread):
    tokens = fw.make_latent_token_dir(tmp_path / "tokens")
    root = tmp_path / "run"
    assert main(fw.tiny_args(tokens, root, 3, extra=[*TRANSFUSION, fw.recorder_arg(root / "rec")])) == 0
    checkpoint = torch.load(root / "ckpt" / "last.ckpt", weights_only=True)
    options = checkpoint["hyper_parameters"]["family_options"]
    assert options["latent_channels"] == 4 and options["patch_size"] == 1
    assert options["image_placeholder_id"] == fw.LATENT["image_placeholder_id"]
    assert any(key.startswith("patches.") for key in checkpoint["state_dict"])
    header = next(iter(sorted(root.rglob("metrics.csv")))).read_text().splitlines()[0]
    assert "train/text" in header and "train/diffusion" in header, header
    recorded = torch.load(root / "rec.rank0.pt", weights_only=True)
    assert all(torch.isfinite(torch.tensor(loss)) for loss in recorded["losses"])


def test_resume_after_sigkill_is_bit_exact_with_transfusion(tmp_path):
    tr.resume_after_sigkill_matches_an_uninterrupted_run(
        tmp_path, extra=TRANSFUSION, tokens=fw.make_latent_token_dir(tmp_path / "tokens"))


def test_two_ddp_processes_train_transfusion_to_the_weights_of_one_process(tmp_path, one_thread):
    tokens = fw.make_latent_token_dir(tmp_path / "tokens")
    steps = 4
    single = tmp_path / "single"
    assert main(fw.tiny_args(tokens, single, steps, batch_size=4,
                             extra=[*TRANSFUSION, fw.recorder_arg(single / "rec")])) == 0
    reference = torch.load(single / "rec.rank0.pt", weights_only=True)
    ranks = td._two_nodes(tokens, tmp_path / "ddp", steps, "ddp", extra=list(TRANSFUSION))
    assert any(name.startswith("patches.") for name in reference["weights"])
    for name, value in reference["weights"].items():  # the tolerance of test_distributed
        torch.testing.assert_close(ranks[0]["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    seen = td._pieces(ranks[0]["batches"] + ranks[1]["batches"], ranks[0]["document_ids"] + ranks[1]["document_ids"])
    assert seen == td._pieces(reference["batches"], reference["document_ids"])  # the same global batches
