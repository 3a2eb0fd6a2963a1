"""PackedTokenStream: packing, exactly-once splitting over ranks x workers x epochs, exact resume, masks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from data_shards.raw import ShardError
from data_shards.stream import PackedTokenStream, document_causal_mask, make_dataloader, pack_rows


def _epoch_documents(token_dir, tok, *, world_size, workers, epochs, seq_len=32, batch_size=3):
    seen: list[Counter] = []
    counts = []
    for epoch in range(epochs):
        docs: Counter = Counter()
        for rank in range(world_size):
            stream = PackedTokenStream(token_dir, seq_len, batch_size, seed=1, rank=rank, world_size=world_size)
            loader = make_dataloader(stream, num_workers=workers)
            loader.set_epoch(epoch)
            batches = list(loader)
            counts.append(len(batches))
            assert len(batches) == len(loader) == len(stream)
            for batch in batches:
                docs.update(tok.rows_to_documents(batch))
        seen.append(docs)
    return seen, counts


def test_every_document_exactly_once_for_2_ranks_2_workers_2_epochs(tmp_path, tok):
    documents = tok.make_documents(56)  # 25 rows packed per shard: 5 batches per rank
    token_dir = tok.make_token_dir(tmp_path / "tokens", documents)
    seen, counts = _epoch_documents(token_dir, tok, world_size=2, workers=2, epochs=2)
    expected = Counter(tuple(d) for d in documents)
    assert seen[0] == expected and seen[1] == expected
    assert len(set(counts)) == 1, "every rank must get the same number of batches"
    assert counts[0] % 2 == 1, "an odd batch count also covers workers with unequal shares"


def test_epochs_shuffle_differently_and_deterministically(tmp_path, tok):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(40))
    stream = PackedTokenStream(token_dir, 32, 2, seed=3)
    first = [b["input_ids"] for b in stream]
    again = [b["input_ids"] for b in stream]
    stream.set_epoch(1)
    second = [b["input_ids"] for b in stream]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("world_size", [2, 3])
def test_uneven_data_gives_every_rank_the_same_number_of_batches(tmp_path, tok, world_size):
    # 5 documents that each fill a row: 5 rows cannot split evenly over 2 or 3 ranks x batch 2.
    documents = [[1 + i] * 30 for i in range(5)]
    token_dir = tok.make_token_dir(tmp_path / "tokens", documents)
    per_rank, docs = [], Counter()
    for rank in range(world_size):
        batches = list(PackedTokenStream(token_dir, 30, 2, rank=rank, world_size=world_size))
        per_rank.append(len(batches))
        for batch in batches:
            docs.update(tok.rows_to_documents(batch))
    assert len(set(per_rank)) == 1
    assert docs == Counter(tuple(d) for d in documents)


def test_rows_packed_with_document_ids_and_restarting_positions(tmp_path, tok):
    documents = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    token_dir = tok.make_token_dir(tmp_path / "tokens", documents)
    batch = next(iter(PackedTokenStream(token_dir, 16, 1, shuffle=False)))
    assert set(batch) == {"input_ids", "document_ids", "position_ids"}
    assert all(v.shape == (1, 16) and v.dtype == torch.long for v in batch.values())
    docs, positions = batch["document_ids"][0], batch["position_ids"][0]
    real = docs >= 0
    assert int(real.sum()) == 9
    for doc in docs[real].unique().tolist():
        assert positions[docs == doc].tolist() == list(range(int((docs == doc).sum())))
    assert (batch["input_ids"][0][~real] == tok.PAD_ID).all()
    assert sorted(tok.rows_to_documents(batch)) == sorted(tuple(d) for d in documents)


def test_long_documents_are_split_into_pieces_that_restart_positions(tmp_path, tok):
    long_doc = list(range(1, 26))  # 25 tokens, seq_len 10 -> pieces of 10, 10, 5
    token_dir = tok.make_token_dir(tmp_path / "tokens", [long_doc])
    batches = list(PackedTokenStream(token_dir, 10, 1, shuffle=False))
    pieces = sorted(p for b in batches for p in tok.rows_to_documents(b))
    assert pieces == sorted([tuple(long_doc[0:10]), tuple(long_doc[10:20]), tuple(long_doc[20:25])])
    for batch in batches:
        real = batch["document_ids"] >= 0
        assert batch["position_ids"][real].tolist() == list(range(int(real.sum())))


def test_mask_never_lets_a_token_attend_across_a_document_boundary(tmp_path, tok):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(30))
    for batch in PackedTokenStream(token_dir, 24, 4, seed=0):
        doc = batch["document_ids"]
        mask = document_causal_mask(doc)
        assert mask.shape == (4, 24, 24) and mask.dtype == torch.bool
        b, i, j = mask.nonzero(as_tuple=True)
        off_diagonal = i != j
        assert (doc[b, i] == doc[b, j])[off_diagonal].all(), "a query attends to another document"
        assert (doc[b, i] >= 0)[off_diagonal].all(), "padding takes part in attention"
        assert (j <= i).all(), "a query attends to the future"
        # and within a document, everything causal is allowed
        same = (doc[:, :, None] == doc[:, None, :]) & (doc >= 0)[:, :, None]
        assert (mask | ~(same & torch.ones(24, 24, dtype=torch.bool).tril())).all()


@pytest.mark.parametrize("workers, rank, world_size", [(0, 0, 1), (2, 0, 1), (2, 1, 2)])
def test_resume_yields_exactly_the_remaining_batches(tmp_path, tok, workers, rank, world_size):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(50 * world_size))

    def loader():
        stream = PackedTokenStream(token_dir, 24, 2, seed=5, rank=rank, world_size=world_size)
        return make_dataloader(stream, num_workers=workers)

    reference = loader()
    full = [list(reference), list(reference)]  # epochs 0 and 1 (a new iter() is the next epoch)
    n = len(full[0])
    assert n >= 5
    for cut in (1, n // 2, n - 1, n):
        resumed, rest = tok.resumed_rest(loader, cut)
        expected = full[0][cut:] if cut < n else full[1]
        assert len(rest) == len(expected)
        for got, want in zip(rest, expected):
            assert all(torch.equal(got[k], want[k]) for k in want)
        # and the pass after the resumed one is the next epoch, as without the interruption
        if cut < n:
            nxt = list(resumed)
            assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(nxt, full[1]))


def test_state_of_other_settings_is_refused_mid_epoch_and_starts_an_epoch_at_a_boundary(tmp_path, tok):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(20))
    two_ranks = make_dataloader(PackedTokenStream(token_dir, 24, 2, seed=5, rank=0, world_size=2))
    it = iter(two_ranks)
    next(it)
    mid = two_ranks.state_dict()
    list(it)
    end = two_ranks.state_dict()
    # another seed deals other rows (another world size alone is resumed: test_resume_world_size.py)
    one_rank = make_dataloader(PackedTokenStream(token_dir, 24, 2, seed=6, rank=0, world_size=1))
    with pytest.raises(ValueError, match="exact resume mid-epoch is impossible"):
        one_rank.load_state_dict(mid)
    with pytest.warns(UserWarning, match="starting epoch 1 afresh"):
        one_rank.load_state_dict(end)
    reference = make_dataloader(PackedTokenStream(token_dir, 24, 2, seed=6, rank=0, world_size=1))
    reference.set_epoch(1)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(one_rank, reference))


def test_ids_outside_the_vocabulary_are_reported_with_shard_and_key(tmp_path, tok):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(10))
    # corrupt one id on disk behind the manifest's back
    path = token_dir / "shard-000001.ids.npy"
    ids = np.load(path)
    ids[3] = 60000
    np.save(path, ids)
    with pytest.raises(ShardError, match=r"shard shard-000001, key 'doc-7'.*60000"):
        list(PackedTokenStream(token_dir, 32, 2))


def test_pack_rows_fits_every_piece_once_and_within_seq_len():
    lengths = np.random.default_rng(0).integers(1, 17, size=200)
    row_ptr, pieces = pack_rows(lengths, 16)
    assert sorted(pieces.tolist()) == list(range(200))
    fill = np.add.reduceat(lengths[pieces], row_ptr[:-1])
    assert fill.max() <= 16
    # best-fit decreasing needs at most 11/9 of the optimum + 1 rows (Johnson 1973); here the optimum is the
    # token lower bound, since short pieces fill every gap
    assert len(row_ptr) - 1 <= 11 / 9 * int(np.ceil(lengths.sum() / 16)) + 1


def test_packed_logits_equal_each_document_run_alone_in_the_model(tmp_path, tok):
    """Through the real decoder: a packed document's logits do not depend on its row-mates."""
    from fusion_model.config import FusionConfig
    from fusion_model.layers.attention_backends import build_mask, positions_from_documents
    from fusion_model.model import FusionModel

    rng = np.random.default_rng(0)
    documents = [rng.integers(1, 256, size=int(rng.integers(3, 20))).tolist() for _ in range(12)]
    token_dir = tok.make_token_dir(tmp_path / "tokens", documents)
    batch = next(iter(PackedTokenStream(token_dir, 48, 2, seed=0)))
    doc = batch["document_ids"]
    index = torch.arange(48)
    model_mask = build_mask(doc, doc, index, index)[:, 0]
    assert torch.equal(model_mask, document_causal_mask(doc)), "the model builds the same mask"
    real = doc >= 0
    assert torch.equal(positions_from_documents(doc)[real], batch["position_ids"][real])

    model = FusionModel(FusionConfig.from_preset("tiny", max_seq_len=48)).eval()
    with torch.no_grad():
        packed = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        for row in range(2):
            for d in doc[row][real[row]].unique().tolist():
                where = doc[row] == d
                alone = model(batch["input_ids"][row][where][None])
                torch.testing.assert_close(packed[row][where], alone[0], rtol=1e-4, atol=1e-4)


def test_token_keys_name_each_token_once_whatever_the_rank_or_epoch(tmp_path, tok):
    token_dir = tok.make_token_dir(tmp_path / "tokens", tok.make_documents(30))

    def keys_to_ids(world_size: int, epoch: int) -> dict[int, int]:
        found: dict[int, int] = {}
        for rank in range(world_size):
            stream = PackedTokenStream(token_dir, 16, 2, seed=1, rank=rank, world_size=world_size, token_keys=True)
            stream.set_epoch(epoch)
            for batch in stream:
                real = batch["document_ids"] >= 0
                assert bool((batch["token_keys"][~real] == -1).all())
                for key, token in zip(batch["token_keys"][real].tolist(), batch["input_ids"][real].tolist()):
                    assert found.setdefault(key, token) == token  # one key, one token
        return found

    one = keys_to_ids(1, 0)
    assert len(one) == sum(len(d) for d in tok.make_documents(30))  # every token has its own key
    assert keys_to_ids(2, 1) == one  # the same keys on 2 ranks, in another epoch's order
    plain = next(iter(PackedTokenStream(token_dir, 16, 2, seed=1, rank=0, world_size=1)))
    assert "token_keys" not in plain
