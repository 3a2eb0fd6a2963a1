"""Mid-epoch resume under another world size (or batch size): every row of the epoch exactly once in all."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch

from data_shards.stream import PackedTokenStream, make_dataloader

SEQ_LEN = 24


def _loader(token_dir, rank, world_size, batch_size=2, workers=0):
    stream = PackedTokenStream(token_dir, SEQ_LEN, batch_size, seed=5, rank=rank, world_size=world_size)
    return make_dataloader(stream, num_workers=workers)


def _run(tok, token_dir, world_size, counts, *, batch_size=2, state=None, workers=0):
    """Each rank consumes counts[rank] batches (None = to the end of the epoch), after loading `state`.

    Returns (documents seen, per-rank states, per-rank batch counts, per-rank loaders).
    """
    docs: Counter = Counter()
    states, taken, loaders = [], [], []
    for rank in range(world_size):
        loader = _loader(token_dir, rank, world_size, batch_size, workers)
        if state is not None:
            loader.load_state_dict(state)
        it = iter(loader)
        count = 0
        while count != counts[rank] and (batch := next(it, None)) is not None:
            docs.update(tok.rows_to_documents(batch))
            count += 1
        states.append(loader.state_dict())
        taken.append(count)
        loaders.append(loader)
    return docs, states, taken, loaders


@pytest.mark.parametrize("old, new, k", [(2, 1, 3), (1, 2, 5), (2, 3, 4), (3, 2, 2), (2, 3, 0), (2, 1, 1)])
def test_every_row_once_across_a_world_size_change(tmp_path, tok, old, new, k):
    documents = tok.make_documents(90)
    token_dir = tok.make_token_dir(tmp_path / "tokens", documents)
    before, states, _, _ = _run(tok, token_dir, old, [k] * old)
    assert len({s["rows_consumed"] for s in states}) == 1, "ranks in lock step agree on the global position"
    after, _, counts, loaders = _run(tok, token_dir, new, [None] * new, state=states[0])
    assert before + after == Counter(tuple(d) for d in documents), "each row exactly once in the epoch"
    length = len(_loader(token_dir, 0, new))
    assert all(len(loader) == length for loader in loaders), "len() is that of the new world size"
    assert len(set(counts)) == 1, "every new rank gets the same number of batches"
    # the remainder is as short as the rows left allow, then the next epoch is the plain one
    left = len(documents) and sum(after.values())
    assert left == 0 or counts[0] <= length
    nxt = [list(loader) for loader in loaders]
    fresh = [_loader(token_dir, rank, new) for rank in range(new)]
    for loader in fresh:
        loader.set_epoch(1)
    for got, want in zip(nxt, [list(loader) for loader in fresh]):
        assert len(got) == len(want) == length
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, want))


def test_remaining_batches_equal_len_minus_the_renumbered_position(tmp_path, tok):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(90))
    _, states, _, _ = _run(tok, token_dir, 2, [3, 3])
    one = _loader(token_dir, 0, 1)
    one.load_state_dict(states[0])
    rows_left = states[0]["num_rows"] - states[0]["rows_consumed"]
    assert len(list(one)) == -(-rows_left // 2)
    assert one.state_dict()["batches_consumed"] == len(one)


def test_same_world_size_resume_from_the_new_state_is_bit_exact(tmp_path, tok):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(90))
    _, states, _, _ = _run(tok, token_dir, 2, [2, 2])
    # 2 -> 3 ranks: rank 1 of 3 runs the rest uninterrupted, and stopped after 2 batches and resumed
    whole, cut = _loader(token_dir, 1, 3), _loader(token_dir, 1, 3)
    whole.load_state_dict(states[0])
    cut.load_state_dict(states[0])
    assert cut.dataset._resume is not None, "8 rows consumed: not where 3 ranks x 2 rows would be, so re-dealt"
    reference = list(whole)
    it = iter(cut)
    head = [next(it), next(it)]
    mid = cut.state_dict()
    resumed = _loader(token_dir, 1, 3, workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(mid)
    together = head + list(resumed)
    assert len(together) == len(reference)
    assert all(torch.equal(a[key], b[key]) for a, b in zip(together, reference) for key in a)


def test_two_changes_in_one_epoch_and_a_batch_size_change(tmp_path, tok):
    documents = tok.make_documents(120)
    token_dir = tok.make_token_dir(tmp_path / "tokens", documents)
    first, states, _, _ = _run(tok, token_dir, 2, [2, 2])
    second, states, _, _ = _run(tok, token_dir, 3, [2, 2, 2], state=states[0], workers=2)
    third, _, counts, _ = _run(tok, token_dir, 1, [None], batch_size=5, state=states[0])
    assert first + second + third == Counter(tuple(d) for d in documents)


@pytest.mark.parametrize("new", [1, 2, 3])
def test_unequal_counts_are_merged_from_every_rank_state(tmp_path, tok, new):
    documents = tok.make_documents(90)
    token_dir = tok.make_token_dir(tmp_path / "tokens", documents)
    before, states, _, _ = _run(tok, token_dir, 2, [2, 5])
    merged = PackedTokenStream.merge_states(states)
    assert merged["batches_consumed"] == 2 and len(merged["rows_taken"]) == 3 * 2  # rank 1's 3 extra batches
    after, _, counts, _ = _run(tok, token_dir, new, [None] * new, state=merged)
    assert before + after == Counter(tuple(d) for d in documents)
    assert len(set(counts)) == 1
    with pytest.raises(ValueError, match="each of ranks 0..1"):
        PackedTokenStream.merge_states(states[:1])


def test_the_loader_reports_how_far_its_position_moved(tmp_path, tok):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(90))
    _, states, _, _ = _run(tok, token_dir, 1, [8])
    grown = _loader(token_dir, 0, 2)
    grown.load_state_dict(states[0])
    assert grown.resume_shift == -4, "8 batches of one rank are 4 batches of two"
    same = _loader(token_dir, 0, 1)
    same.load_state_dict(states[0])
    assert same.resume_shift == 0


@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__`", "ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("old, new", [(2, 1), (1, 2)])
def test_lightning_continues_the_epoch_under_another_world_size(tmp_path, tok, old, new):
    """Rank 0 of an `old`-rank job (simulated: the stream is told the world size) checkpoints after k steps;
    rank 0 of a `new`-rank job resumes from it. With align_batch_progress, Lightning's restored batch count
    follows the loader: rank 0 trains exactly its share of the rows no rank consumed, the epoch ends with the
    loader (not early when the job grew), batch_idx continues from the renumbered position, and epoch 1 is
    the plain one."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fusion_model.training.lightning_module import align_batch_progress

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(1, 1)
            self.seen: list[dict] = []
            self.batch_indices: list[int] = []

        def on_train_start(self):
            align_batch_progress(self.trainer)

        def training_step(self, batch, batch_idx):
            self.seen.append(batch)
            self.batch_indices.append(batch_idx)
            return self.head(batch["input_ids"][..., None].float()).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def trainer(root, **kwargs):
        return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, **kwargs)

    documents = tok.make_documents(90)
    token_dir = tok.make_token_dir(tmp_path / "tokens", documents)
    k = 5
    first = Recorder()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=k, save_top_k=-1)
    trainer(tmp_path / "a", max_steps=k, callbacks=[checkpoint]).fit(first, _loader(token_dir, 0, old))
    resumed = Recorder()
    trainer(tmp_path / "b", max_epochs=2, enable_checkpointing=False).fit(
        resumed, _loader(token_dir, 0, new), ckpt_path=tmp_path / "ckpt" / f"epoch=0-step={k}.ckpt")

    plain = _loader(token_dir, 0, new)
    length = len(plain)
    rows_left = plain.dataset.num_rows - k * old * 2
    remainder = -(-rows_left // (new * 2))
    assert len(resumed.seen) == remainder + length, "the rest of epoch 0 (rank 0's share), then all of epoch 1"
    assert resumed.batch_indices[:remainder] == list(range(length - remainder, length))
    before, states, _, _ = _run(tok, token_dir, old, [k] * old)  # all old ranks' first k batches
    assert before == sum((Counter(tok.rows_to_documents(b)) for b in first.seen), Counter()) + \
        _run(tok, token_dir, old, [0] + [k] * (old - 1))[0], "rank 0 trained on its own first k batches"
    others, _, _, _ = _run(tok, token_dir, new, [0] + [None] * (new - 1), state=states[0])  # other new ranks
    seen = before + others + sum((Counter(tok.rows_to_documents(b)) for b in resumed.seen[:remainder]), Counter())
    assert seen == Counter(tuple(d) for d in documents), "epoch 0: every row once across both jobs"
    plain.set_epoch(1)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(resumed.seen[remainder:], plain))

