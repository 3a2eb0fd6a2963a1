"""Answer-only training on conversation shards through `train.py fit`: two DDP processes train to the weights of one
process, and a run killed mid-epoch resumes bit for bit (the dense harnesses of test_distributed and test_resume, on
shards whose target masks leave the prompts out of the loss)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fusion_model.cli.fit import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_worker as fw  # noqa: E402
import test_distributed as td  # noqa: E402  (module attributes only: its tests stay collected in their own file)
import test_resume as tr  # noqa: E402


def test_two_ddp_processes_train_on_conversations_to_the_weights_of_one_process(tmp_path, one_thread):
    tokens = fw.make_conversation_token_dir(tmp_path / "tokens")
    steps = 4
    single = tmp_path / "single"
    assert main(fw.tiny_args(tokens, single, steps, batch_size=4, extra=[fw.recorder_arg(single / "rec")])) == 0
    reference = torch.load(single / "rec.rank0.pt", weights_only=True)
    ranks = td._two_nodes(tokens, tmp_path / "ddp", steps, "ddp")
    for name, value in reference["weights"].items():  # the tolerance of test_distributed
        torch.testing.assert_close(ranks[0]["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    seen = td._pieces(ranks[0]["batches"] + ranks[1]["batches"], ranks[0]["document_ids"] + ranks[1]["document_ids"])
    assert seen == td._pieces(reference["batches"], reference["document_ids"])  # the same global batches


def test_resume_after_sigkill_is_bit_exact_on_conversations(tmp_path):
    tr.resume_after_sigkill_matches_an_uninterrupted_run(tmp_path,
                                                         tokens=fw.make_conversation_token_dir(tmp_path / "tokens"))
