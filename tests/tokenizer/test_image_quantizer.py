"""The quantizer: EMA codebook updates only in training, usage/perplexity statistics, and EMA codebooks that
stay identical across DDP ranks fed different data."""

import socket
import subprocess
import sys

import torch

from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.image.quantizer import Quantizer, codebook_stats


def _config(mode: str) -> ImageTokenizerConfig:
    return ImageTokenizerConfig(image_size=16, base_channels=8, channel_multiplier=(1,), latent_channels=8,
                                norm_groups=8, codebook_size=16, quantizer=mode)


def test_codebook_moves_in_training_and_stays_put_in_eval():
    quantizer = Quantizer(_config("chameleon"))
    before = quantizer.codebook.clone()
    quantizer.eval()
    out = quantizer(torch.randn(2, 8, 4, 4))
    assert torch.equal(quantizer.codebook, before) and out.codes.shape == (2, 4, 4)
    quantizer.train()
    out = quantizer(torch.randn(2, 8, 4, 4) + 3.0)
    assert not torch.equal(quantizer.codebook, before)
    assert out.loss > 0  # commitment term, weighted by beta


def test_improved_mode_uses_unit_norm_low_dimensional_codes():
    quantizer = Quantizer(_config("improved")).train()
    out = quantizer(torch.randn(2, 8, 4, 4))  # k-means init on the first batch, then EMA
    assert quantizer.codebook.shape == (16, 8)
    torch.testing.assert_close(quantizer.codebook.norm(dim=-1), torch.ones(16))
    torch.testing.assert_close(out.quantized.norm(dim=1), torch.ones(2, 4, 4))


def test_codebook_stats_usage_and_perplexity():
    uniform = codebook_stats(torch.arange(8).repeat(3), 16)
    assert uniform["usage"] == 0.5 and uniform["codes_used"] == 8
    assert abs(uniform["perplexity"] - 8.0) < 1e-9
    collapsed = codebook_stats(torch.zeros(10, dtype=torch.long), 16)
    assert collapsed["usage"] == 1 / 16 and abs(collapsed["perplexity"] - 1.0) < 1e-9


# One DDP rank, run as its own interpreter (`python -c`): no fork after torch has started its threads, and
# a timeout ends a hung rank instead of the suite.
RANK = r"""
import os, sys
import torch
import torch.distributed as dist
from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.image.quantizer import Quantizer, set_codebook_sync

rank, world, port, out_dir, sync = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1"
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=world)
try:
    torch.manual_seed(0)  # same initial weights on every rank, as DDP guarantees
    config = ImageTokenizerConfig(image_size=16, base_channels=8, channel_multiplier=(1,), latent_channels=8,
                                  norm_groups=8, codebook_size=16, quantizer="improved")
    quantizer = Quantizer(config).train()
    assert set_codebook_sync(quantizer, sync) is sync
    generator = torch.Generator().manual_seed(100 + rank)  # different data per rank
    for _ in range(3):
        quantizer(torch.randn(2, 8, 4, 4, generator=generator) + rank)
    torch.save(quantizer.codebook.clone(), os.path.join(out_dir, f"rank{rank}.pt"))
except BaseException:
    dist.destroy_process_group()
    raise
# a finished rank leaves without interpreter teardown, where gloo's threads sometimes abort it (SIGABRT);
# see tests/fusion_model/training/fit_worker.py:leave_process_group
dist.barrier()
sys.stdout.flush()
os._exit(0)
"""


def _run_ranks(world: int, out_dir: str, sync: bool, timeout: float = 180) -> None:
    port = str(_free_port())
    children = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(world), port, out_dir, "1" if sync else "0"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    try:
        for child in children:
            _, err = child.communicate(timeout=timeout)
            assert child.returncode == 0, err[-3000:]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ema_codebooks_stay_identical_across_ddp_ranks_only_when_synchronised(tmp_path):
    books = {}
    for sync in (True, False):
        out = tmp_path / str(sync)
        out.mkdir()
        _run_ranks(2, str(out), sync)
        books[sync] = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]
    torch.testing.assert_close(books[True][0], books[True][1], rtol=0, atol=1e-6)
    assert not torch.allclose(books[False][0], books[False][1])  # the control: unsynchronised ranks drift apart
