"""Two processes as two simulated nodes (DDP and FSDP2 over gloo) train to the same weights as one process."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data_shards.stream import PackedTokenStream
from fusion_model.cli.fit import main

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_worker as fw  # noqa: E402

STRATEGIES = {
    "ddp": "ddp",
    "fsdp2": json.dumps({"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                         "init_args": {"save_distributed_checkpoint": False}}),
}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process, global batch 4, one full epoch."""
    root = tmp_path_factory.mktemp("single")
    tokens = fw.make_token_dir(root / "tokens")
    steps = len(PackedTokenStream(tokens, 32, 4, rank=0, world_size=1))  # 32 packed rows: 8 batches of 4
    assert main(fw.tiny_args(tokens, root, steps, batch_size=4, extra=[fw.recorder_arg(root / "rec")])) == 0
    return tokens, steps, torch.load(root / "rec.rank0.pt", weights_only=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pieces(batches: list[torch.Tensor], document_ids: list[torch.Tensor]) -> list[tuple[int, ...]]:
    """Every document piece found in the batches, as a tuple of its token ids."""
    found = []
    for ids, docs in zip(batches, document_ids):
        for row, doc_row in zip(ids.tolist(), docs.tolist()):
            for doc in sorted(set(doc_row) - {-1}):
                found.append(tuple(t for t, d in zip(row, doc_row) if d == doc))
    return sorted(found)


def _dataset_pieces(token_dir: Path, seq_len: int) -> list[tuple[int, ...]]:
    pieces = []
    for ids_file in sorted(token_dir.glob("*.ids.npy")):
        ids = np.load(ids_file).tolist()
        offsets = np.load(str(ids_file).replace(".ids.npy", ".offsets.npy")).tolist()
        for start, stop in zip(offsets[:-1], offsets[1:]):
            pieces += [tuple(ids[i : min(i + seq_len, stop)]) for i in range(start, stop, seq_len)]
    return sorted(pieces)


def _two_nodes(tokens: Path, root: Path, steps: int, strategy: str, extra: list[str] | None = None) -> list[dict]:
    """`train.py fit` as two processes (two simulated nodes, one device each, batch 2 per rank); checkpoints
    after every step in root/ckpt; returns each rank's recording (losses, batches, final weights)."""
    port = str(_free_port())
    children = []
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(root / "ckpt"), "every_n_train_steps": 1, "save_top_k": -1}}
    for node in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node), "FIT_THREADS": "1"}
        for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_JOB_ID"):  # a clean two-node launch
            env.pop(key, None)
        args = fw.tiny_args(tokens, root / f"node{node}", steps, batch_size=2, extra=[
            f"--trainer.callbacks=[{json.dumps(checkpoint)}]", fw.recorder_arg(root / "rec"),
            f"--trainer.strategy={STRATEGIES[strategy]}", "--trainer.num_nodes=2", "--trainer.devices=1",
            *(extra or []),
        ])
        children.append(subprocess.Popen([sys.executable, str(fw.HERE / "fit_worker.py"), *args], cwd=fw.REPO, env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        for child in children:
            _, err = child.communicate(timeout=400)
            assert child.returncode == 0, err[-3000:]
    finally:
        for child in children:
            child.kill()
    return [torch.load(root / f"rec.rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.fixture(scope="module")
def ddp(single, tmp_path_factory):
    """Two ranks over DDP, global batch 4 (2 per rank), the same epoch as `single`."""
    root = tmp_path_factory.mktemp("ddp")
    tokens, steps, _ = single
    return root, _two_nodes(tokens, root, steps, "ddp")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_two_nodes_train_to_the_weights_of_one_process_and_read_every_document_once(strategy, single, request, tmp_path):
    tokens, steps, reference = single
    if strategy == "ddp":
        tmp_path, ranks = request.getfixturevalue("ddp")
    else:
        ranks = _two_nodes(tokens, tmp_path, steps, strategy)

    for name, value in reference["weights"].items():  # rank 0 holds the full (gathered) weights
        torch.testing.assert_close(ranks[0]["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    assert all(b.shape == (2, 32) for r in ranks for b in r["batches"])
    seen = _pieces(ranks[0]["batches"] + ranks[1]["batches"], ranks[0]["document_ids"] + ranks[1]["document_ids"])
    assert seen == _pieces(reference["batches"], reference["document_ids"])  # the same global batches
    assert seen == _dataset_pieces(tokens, 32)  # every document (piece) exactly once in the epoch

    # the last checkpoint file holds the full weights, both ranks' RNG states, loadable with weights_only=True
    saved = torch.load(tmp_path / "ckpt" / f"epoch=0-step={steps}.ckpt", weights_only=True)
    assert saved["rng_states"]["torch"].shape[0] == 2 and saved["global_step"] == steps
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(saved["state_dict"][f"model.{name}"], value), name


# Resume under another world size. Global batch 4 throughout (2 ranks x 2 or 1 rank x 4), so the run that
# changes its world size at step K sees the same global batches as the runs that never did: its losses and
# weights must equal theirs up to float summation order. Tolerance: rtol 1e-5 / atol 1e-6 on each loss,
# atol 1e-5 on the final weights (the one-process vs two-process difference measured above is ~1e-7).
K = 3


def test_two_ranks_resumed_on_one_continue_the_epoch_with_the_same_losses(single, ddp, tmp_path):
    tokens, steps, reference = single
    ddp_root, ddp_ranks = ddp
    checkpoint = ddp_root / "ckpt" / f"epoch=0-step={K}.ckpt"
    assert main(fw.tiny_args(tokens, tmp_path, steps, batch_size=4, extra=[
        fw.recorder_arg(tmp_path / "rec"), f"--ckpt_path={checkpoint}"])) == 0
    resumed = torch.load(tmp_path / "rec.rank0.pt", weights_only=True)

    assert resumed["steps"] == list(range(K + 1, steps + 1)), "the epoch continues to its end, no step lost"
    torch.testing.assert_close(resumed["losses"], reference["losses"][K:], rtol=1e-5, atol=1e-6)
    for name, value in reference["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    before = [b for r in ddp_ranks for b in r["batches"][:K]], [d for r in ddp_ranks for d in r["document_ids"][:K]]
    seen = _pieces(before[0] + resumed["batches"], before[1] + resumed["document_ids"])
    assert seen == _dataset_pieces(tokens, 32), "every document piece exactly once across both jobs"


def test_one_rank_resumed_on_two_continue_the_epoch_with_the_same_losses(single, ddp, tmp_path):
    tokens, steps, reference = single
    _, ddp_ranks = ddp
    checkpoint = tokens.parent / "ckpt" / f"epoch=0-step={K}.ckpt"  # tiny_args saves every step of `single`
    ranks = _two_nodes(tokens, tmp_path, steps, "ddp", extra=[f"--ckpt_path={checkpoint}"])

    for rank, uninterrupted in zip(ranks, ddp_ranks):  # each rank gets the batches it would have had
        assert rank["steps"] == list(range(K + 1, steps + 1))
        assert all(torch.equal(a, b) for a, b in zip(rank["batches"], uninterrupted["batches"][K:]))
        torch.testing.assert_close(rank["losses"], uninterrupted["losses"][K:], rtol=1e-5, atol=1e-6)
    for name, value in reference["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    seen = _pieces(reference["batches"][:K] + ranks[0]["batches"] + ranks[1]["batches"],
                   reference["document_ids"][:K] + ranks[0]["document_ids"] + ranks[1]["document_ids"])
    assert seen == _dataset_pieces(tokens, 32), "every document piece exactly once across both jobs"

