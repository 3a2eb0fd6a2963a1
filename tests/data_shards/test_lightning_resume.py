"""The loader's state travels in a Lightning checkpoint and a resumed fit sees exactly the batches that were left.

What Lightning 2.6 does (loops/fit_loop.py, utilities/combined_loader.py, loops/fetchers.py): the fit loop
stores `state_dict()` of every train DataLoader that has state_dict/load_state_dict under
checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"], and restores it in `FitLoop.setup_data`
before the iterator is created. A loader with a length is not prefetched, so the stored count is exact.
Lightning issue 20550: calling `trainer.estimated_stepping_batches` in `configure_optimizers` sets the
loader up before the restore and the state is dropped; don't (use max_steps or len(loader)).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from data_shards.stream import PackedTokenStream, make_dataloader


class _Recorder(L.LightningModule):
    """A tiny model that remembers every batch it trained on."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 4)
        self.head = torch.nn.Linear(4, 1)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())
        return self.head(self.embed(batch["input_ids"])).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(tmp_path, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, **kwargs)


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__`", "ignore:Be aware that when using `ckpt_path`")
def test_loader_state_survives_a_lightning_checkpoint_mid_epoch(tmp_path, tok):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(40))

    def loader():
        return make_dataloader(PackedTokenStream(token_dir, 16, 2, seed=7), num_workers=2)

    n = len(loader())
    assert n >= 6
    reference = _Recorder()
    _trainer(tmp_path / "a", max_epochs=2, enable_checkpointing=False).fit(reference, loader())
    assert len(reference.seen) == 2 * n

    cut = n + 3  # in the middle of the second epoch
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=cut, save_top_k=-1)
    first = _Recorder()
    _trainer(tmp_path / "b", max_steps=cut + 2, callbacks=[checkpoint]).fit(first, loader())
    path = tmp_path / "ckpt" / f"epoch=1-step={cut}.ckpt"
    saved = torch.load(path, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert saved[0]["epoch"] == 1 and saved[0]["batches_consumed"] == 3

    resumed = _Recorder()
    _trainer(tmp_path / "c", max_epochs=2, enable_checkpointing=False).fit(resumed, loader(), ckpt_path=path)
    together = first.seen[:cut] + resumed.seen
    assert len(together) == len(reference.seen)
    assert all(torch.equal(a, b) for a, b in zip(together, reference.seen))
