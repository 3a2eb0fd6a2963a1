"""The DataLoader over a PackedTokenStream that resumes exactly, and each optimizer step's loss denominators.

The loader counts the batches it hands over, so its `state_dict()` is the stream's position after exactly those
(`EpochLayout.position_state`), whatever the workers prefetched. Loading a state saved under another world size x
batch size renumbers the position; the loader reports the move as `resume_shift` (new position - saved position) so
a trainer that restored its own count of the epoch's batches can move it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader

from data_shards.packed_stream import PackedTokenStream

__all__ = ["ResumableDataLoader", "make_dataloader", "with_window_denominators"]


class ResumableDataLoader(DataLoader):
    """A DataLoader over a PackedTokenStream whose `state_dict()` is exact, with or without workers.

    It counts the batches handed to the consumer in the main process, so worker prefetching never
    shifts the state. Each new `iter()` starts the next epoch, except the first one and the first one
    after `load_state_dict` / `set_epoch`, which start at the stored position.

    Lightning 2.6 (read in loops/fit_loop.py, utilities/combined_loader.py, loops/fetchers.py): the fit
    loop saves `state_dict()` of every train DataLoader that has state_dict/load_state_dict into the
    checkpoint ("combined_loader") and calls `load_state_dict` in `FitLoop.setup_data` before creating the
    iterator. Because this loader has a `len`, Lightning does not prefetch a batch ahead (it prefetches
    only when the length is unknown), so the saved count equals the batches trained on. Lightning does not
    call `set_epoch` on an IterableDataset; the epoch advances here on each new `iter()`. Only rank 0's
    state is saved; every rank loads it, which is right because all ranks have the same `len` and consume
    in lock step. Under another world size x batch size the position is renumbered (`resume_shift`), and
Lightning's restored count of the epoch's batches must move with it or the epoch ends early (growing job)
or late (shrinking job): `align_batch_progress` in the training layer does that. Caveat (Lightning issue 20550, reproduced here with 2.6): if `configure_optimizers` calls
    `trainer.estimated_stepping_batches`, the train loader is set up before the checkpoint is restored,
    its state is silently dropped and the resumed run trains on the wrong batches; take the schedule
    horizon from `max_steps` (or `len(loader)`) instead.
    """

    def __init__(self, stream: PackedTokenStream, num_workers: int = 0, *, window: int = 1,
                 count: Callable[[dict], dict[str, torch.Tensor] | None] | None = None, share_errors: bool = False,
                 **kwargs) -> None:
        """window, count: read each optimizer step's `window` micro-batches (batch indices [k window, (k+1) window)
        of the epoch) ahead, and give each of them `window_denominators` = the sum of `count(batch)` over its
        step, so a loss can be divided by its count over the whole step (exact gradient accumulation).
        share_errors: a damaged shard yields a padding batch holding the message under DATA_ERROR (then the pass
        ends) instead of raising in this rank alone; the training step shares it with every rank."""
        if kwargs.get("persistent_workers"):
            raise ValueError("persistent_workers would keep stale positions in the workers; leave it off")
        stream.share_errors = share_errors
        # each iter() of a DataLoader draws its workers' base seed from `generator`, by default the global RNG: at
        # an epoch boundary that draw fell between a checkpoint and the next step, so a run resumed from an epoch's
        # last step continued dropout from another RNG state than the uninterrupted run. The stream needs no random
        # worker seeds (its batches are a function of its position), so the draw goes to a generator of its own.
        kwargs.setdefault("generator", torch.Generator().manual_seed(0))
        super().__init__(stream, batch_size=None, num_workers=num_workers, **kwargs)
        self._epoch, self._consumed, self._fresh = stream.epoch, 0, True
        self.window, self.count = max(int(window), 1), count
        # batches the position moved when a state saved under another world size x batch size was loaded
        self.resume_shift = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next `iter()` start at the beginning of `epoch`."""
        self.dataset.set_epoch(epoch)  # drops a resume layout of that epoch
        self._epoch, self._consumed, self._fresh = int(epoch), 0, True

    def __iter__(self) -> Iterator[dict]:
        if not self._fresh:
            self._epoch, self._consumed = self._epoch + 1, 0
        self._fresh = False
        if self._consumed >= len(self.dataset):  # resumed from the end of an epoch
            self._epoch, self._consumed = self._epoch + 1, 0
        self.dataset.set_position(self._epoch, self._consumed)
        batches = super().__iter__()
        if self.window > 1 and self.count is not None:
            batches = with_window_denominators(batches, self.window, self.count, self._consumed, len(self.dataset))
        for batch in batches:
            self._consumed += 1  # counted as handed over: read-ahead batches are not yet consumed
            yield batch

    def close(self) -> None:
        """End the stream's background shard checks (see `PackedTokenStream.close`)."""
        self.dataset.close()

    def state_dict(self) -> dict:
        """(epoch, batches consumed) plus a signature of the batch layout."""
        return self.dataset.position_state(self._epoch, self._consumed)

    def load_state_dict(self, state: dict) -> None:
        """Make the next `iter()` yield exactly the batches that followed `state`; sets `resume_shift`."""
        self.dataset.load_state_dict(state)
        self._epoch, self._consumed, self._fresh = self.dataset.epoch, self.dataset._start_batch, True
        same_epoch = self._epoch == int(state["epoch"])
        self.resume_shift = self._consumed - int(state["batches_consumed"]) if same_epoch else 0


def with_window_denominators(batches: Iterable[dict], window: int,
                             count: Callable[[dict], dict[str, torch.Tensor] | None], first_index: int = 0,
                             epoch_length: int | None = None) -> Iterator[dict]:
    """The batches in order, each optimizer step's `window` micro-batches read before the first of them is handed
    on, each given `window_denominators`: the sum over its step of `count(batch)` (a dict of tensors; None: no
    counts, the batches pass unchanged). Steps are aligned to the epoch's batch index, as Lightning's accumulation
    is (batch `first_index` is the first handed on; the epoch's last step may be shorter), so a resume at any step
    boundary reads the same steps."""

    def attach(pending: list[dict]) -> list[dict]:
        counts = [count(batch) for batch in pending]
        if not pending or any(c is None for c in counts):
            return pending
        totals = {name: sum(c[name].float() for c in counts) for name in counts[0]}
        return [{**batch, "window_denominators": dict(totals)} for batch in pending]

    pending: list[dict] = []
    for batch in batches:
        pending.append(batch)
        index = first_index + len(pending)  # the epoch's batch count once this one is handed on
        if index % window == 0 or (epoch_length is not None and index >= epoch_length):
            yield from attach(pending)
            first_index, pending = index, []
    yield from attach(pending)


def make_dataloader(stream: PackedTokenStream, num_workers: int = 0, **kwargs) -> ResumableDataLoader:
    """A DataLoader with exact `state_dict()` / `load_state_dict()` resume (batches are built by the stream);
    `window` and `count` as in ResumableDataLoader."""
    return ResumableDataLoader(stream, num_workers=num_workers, **kwargs)
