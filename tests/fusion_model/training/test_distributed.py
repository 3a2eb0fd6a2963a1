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


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_two_nodes_train_to_the_weights_of_one_process_and_read_every_document_once(strategy, single, tmp_path):
    tokens, steps, reference = single
    port = str(_free_port())
    children = []
    checkpoint = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",  # one save, at the end
                  "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": steps, "save_top_k": 1}}
    for node in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node), "FIT_THREADS": "1"}
        for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "SLURM_JOB_ID"):  # a clean two-node launch
            env.pop(key, None)
        args = fw.tiny_args(tokens, tmp_path / f"node{node}", steps, batch_size=2, extra=[
            f"--trainer.callbacks=[{json.dumps(checkpoint)}]", fw.recorder_arg(tmp_path / "rec"),
            f"--trainer.strategy={STRATEGIES[strategy]}", "--trainer.num_nodes=2", "--trainer.devices=1",
        ])
        children.append(subprocess.Popen([sys.executable, str(fw.HERE / "fit_worker.py"), *args], cwd=fw.REPO, env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for child in children:
        _, err = child.communicate(timeout=400)
        assert child.returncode == 0, err[-3000:]
    ranks = [torch.load(tmp_path / f"rec.rank{r}.pt", weights_only=True) for r in (0, 1)]

    for name, value in reference["weights"].items():  # rank 0 holds the full (gathered) weights
        torch.testing.assert_close(ranks[0]["weights"][name], value, rtol=0, atol=1e-5, msg=name)
    assert all(b.shape == (2, 32) for r in ranks for b in r["batches"])
    seen = _pieces(ranks[0]["batches"] + ranks[1]["batches"], ranks[0]["document_ids"] + ranks[1]["document_ids"])
    assert seen == _pieces(reference["batches"], reference["document_ids"])  # the same global batches
    assert seen == _dataset_pieces(tokens, 32)  # every document (piece) exactly once in the epoch

    # one checkpoint file with the full weights, both ranks' RNG states, loadable with weights_only=True
    saved = torch.load(tmp_path / "ckpt" / f"epoch=0-step={steps}.ckpt", weights_only=True)
    assert saved["rng_states"]["torch"].shape[0] == 2 and saved["global_step"] == steps
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(saved["state_dict"][f"model.{name}"], value), name
