"""The stream's shard-level epoch plan (issue #33): a rank opens and verifies only its shards, the row plan file,
exactly-once reading and exact resume with small shuffle windows, and a damaged shard caught on first open."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from data_shards import plan as plan_module
from data_shards.plan import plan_path, write_plan
from data_shards.raw import ShardError
from data_shards.stream import DATA_ERROR, PackedTokenStream, make_dataloader
from data_shards.token_shards import TokenShard
from fusion_model import cli

SEQ_LEN = 24
WINDOW = 6  # rows shuffled together: a few shards' worth, so a rank's range spans few windows


def _many_shards(tmp_path, tok, documents=240, per_shard=4):
    """60 small shards (about 2 rows each at SEQ_LEN): enough that 4 ranks read disjoint parts."""
    docs = tok.make_documents(documents)
    return tok.make_token_dir(tmp_path / "tokens", docs, per_shard=per_shard), docs


def _stream(token_dir, rank=0, world_size=1, batch_size=2, **kwargs):
    return PackedTokenStream(token_dir, SEQ_LEN, batch_size, seed=3, rank=rank, world_size=world_size,
                             shuffle_window=WINDOW, **kwargs)


@pytest.fixture(autouse=True)
def notices(monkeypatch):
    """The index and row-plan lines on stderr for these few shards too (printed from NOTICE_SHARDS shards on)."""
    monkeypatch.setattr(plan_module, "NOTICE_SHARDS", 0)


@pytest.fixture
def verified(monkeypatch, tmp_path):
    """Names of this test's shards whose files were size + sha256 checked, in order (background checks included).
    Only shards under this test's tmp_path count: an earlier test's stream may still be checking its own shards in
    its background thread when this one starts."""
    names: list[str] = []
    original = TokenShard.verify_files

    def spy(self):
        if Path(tmp_path) in Path(self.path(".offsets.npy")).parents:
            names.append(self.name)
        return original(self)

    monkeypatch.setattr(TokenShard, "verify_files", spy)
    return names


def _shards_of(stream, batches, epoch=0):
    return {s for b in batches for row in stream.batch_pieces(epoch, b) for s, _, _ in row}


def test_rank_0_of_4_verifies_only_its_shards(tmp_path, tok, verified):
    token_dir, _ = _many_shards(tmp_path, tok)
    write_plan(token_dir, SEQ_LEN)
    stream = _stream(token_dir, rank=0, world_size=4)
    total = len(stream.shard_names)
    assert verified == [], "building the stream opens no shard"
    mine = {stream.shard_names[s] for s in stream.rank_shards(0)}
    assert len(mine) <= total // 3, "the test needs a rank whose shards are a small part of the data"
    reference = _stream(token_dir, rank=0, world_size=4, verify_ahead=False)
    first_two = {reference.shard_names[s] for s in _shards_of(reference, [0, 1])}
    verified.clear()

    it = iter(stream)
    next(it)
    assert set(verified) <= first_two, "only the shards of its first batch and of the one it makes next"
    assert {stream.shard_names[s] for s in stream.shards_opened} <= first_two

    list(it)
    assert set(stream.shard_names[s] for s in stream.shards_opened) <= mine, "it opens only its own shards"
    assert verified, "the spy sees this test's checks"
    assert set(verified) <= mine, "and checks only those"
    assert len(verified) == len(set(verified)), "each shard is hashed once"
    assert len(verified) < total / 2


@pytest.mark.parametrize("world_size, workers", [(1, 0), (3, 2), (4, 1), (5, 0)])
def test_every_document_once_per_epoch_with_shuffle_windows(tmp_path, tok, world_size, workers):
    token_dir, docs = _many_shards(tmp_path, tok, documents=120)
    for epoch in (0, 1):
        seen, lengths = Counter(), set()
        for rank in range(world_size):
            loader = make_dataloader(_stream(token_dir, rank, world_size), num_workers=workers)
            loader.set_epoch(epoch)
            batches = list(loader)
            lengths.add(len(batches))
            for batch in batches:
                seen.update(tok.rows_to_documents(batch))
        assert seen == Counter(tuple(d) for d in docs)
        assert len(lengths) == 1, "every rank gets the same number of batches"


def test_global_batches_depend_on_world_size_times_batch_size_only(tmp_path, tok):
    """2 ranks x 2 rows read the global batches of 1 rank x 4 rows (what the DDP = one process test relies on)."""
    token_dir, _ = _many_shards(tmp_path, tok, documents=80)
    one = list(_stream(token_dir, 0, 1, batch_size=4))
    two = [list(_stream(token_dir, rank, 2, batch_size=2)) for rank in range(2)]
    assert len(one) == len(two[0]) == len(two[1])
    for whole, a, b in zip(one, *two):
        assert torch.equal(whole["input_ids"], torch.cat([a["input_ids"], b["input_ids"]]))


def test_accumulated_micro_batches_read_the_rows_of_one_big_batch_in_order(tmp_path, tok):
    """2 micro-batches of 2 per step (accumulate 2) read one batch of 4, split in two; on 2 ranks too."""
    token_dir, docs = _many_shards(tmp_path, tok, documents=80)
    big = list(_stream(token_dir, 0, 1, batch_size=4))
    small = list(_stream(token_dir, 0, 1, batch_size=2, accumulate=2))
    assert len(small) == 2 * len(big)
    assert torch.equal(torch.cat([b["input_ids"] for b in small]), torch.cat([b["input_ids"] for b in big]))
    two = [list(_stream(token_dir, rank, 2, batch_size=1, accumulate=2)) for rank in range(2)]
    for step, whole in enumerate(big):
        parts = [b["input_ids"] for rank in two for b in rank[2 * step : 2 * step + 2]]
        assert torch.equal(torch.cat(parts), whole["input_ids"])


def test_resume_with_accumulation_is_bit_exact_and_changing_it_reads_every_row_once(tmp_path, tok):
    token_dir, docs = _many_shards(tmp_path, tok, documents=120)
    reference = list(_stream(token_dir, 1, 2, accumulate=3))
    live = make_dataloader(_stream(token_dir, 1, 2, accumulate=3))
    it = iter(live)
    head = [next(it) for _ in range(6)]  # two optimizer steps
    state = live.state_dict()
    resumed = make_dataloader(_stream(token_dir, 1, 2, accumulate=3), num_workers=2)
    resumed.load_state_dict(state)
    together = head + list(resumed)
    assert len(together) == len(reference)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(together, reference) for k in a)

    seen = Counter()
    for rank in range(2):
        loader = make_dataloader(_stream(token_dir, rank, 2, accumulate=3))
        it = iter(loader)
        for _ in range(3):
            seen.update(tok.rows_to_documents(next(it)))
        state = loader.state_dict()
    for rank in range(3):  # 3 ranks, no accumulation, batch 1
        loader = make_dataloader(_stream(token_dir, rank, 3, batch_size=1))
        loader.load_state_dict(state)
        for batch in loader:
            seen.update(tok.rows_to_documents(batch))
    assert seen == Counter(tuple(d) for d in docs)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_bit_exact_with_shuffle_windows(tmp_path, tok, workers):
    token_dir, _ = _many_shards(tmp_path, tok, documents=120)
    reference = list(make_dataloader(_stream(token_dir, 1, 3)))
    for cut in (1, len(reference) // 2):
        live = make_dataloader(_stream(token_dir, 1, 3))
        it = iter(live)
        head = [next(it) for _ in range(cut)]
        state = live.state_dict()
        resumed = make_dataloader(_stream(token_dir, 1, 3), num_workers=workers)
        resumed.load_state_dict(state)
        assert resumed.dataset._resume is None, "same settings: the uninterrupted layout"
        together = head + list(resumed)
        assert len(together) == len(reference)
        assert all(torch.equal(a[k], b[k]) for a, b in zip(together, reference) for k in a)


def _read(tok, token_dir, world_size, counts, state=None, batch_size=2):
    docs, states = Counter(), []
    for rank in range(world_size):
        loader = make_dataloader(_stream(token_dir, rank, world_size, batch_size))
        if state is not None:
            loader.load_state_dict(state)
        it, count = iter(loader), 0
        while count != counts[rank] and (batch := next(it, None)) is not None:
            docs.update(tok.rows_to_documents(batch))
            count += 1
        states.append(loader.state_dict())
    return docs, states


def test_unequal_progress_merged_and_resumed_under_another_world_size(tmp_path, tok):
    token_dir, docs = _many_shards(tmp_path, tok, documents=120)
    before, states = _read(tok, token_dir, 4, [1, 4, 2, 3])
    merged = PackedTokenStream.merge_states(states)
    assert merged["batches_consumed"] == 1 and len(merged["rows_taken"]) == (3 + 1 + 2) * 2
    assert merged["rows_consumed"] == 4 * 2 + len(merged["rows_taken"])
    middle, states = _read(tok, token_dir, 3, [2, 2, 2], state=merged)
    after, _ = _read(tok, token_dir, 2, [None, None], state=states[0], batch_size=3)
    assert before + middle + after == Counter(tuple(d) for d in docs), "every row once across three jobs"


def test_a_state_of_the_old_row_layout_is_refused_mid_epoch_with_a_sentence(tmp_path, tok):
    token_dir, _ = _many_shards(tmp_path, tok, documents=60)
    loader = make_dataloader(_stream(token_dir))
    it = iter(loader)
    next(it)
    old = {k: v for k, v in loader.state_dict().items() if k not in ("layout", "consumed")}
    old["order_signature"] = old["signature"] = "from-layout-1"
    with pytest.raises(ValueError, match="row layout 1.*packs rows per shard.*impossible"):
        make_dataloader(_stream(token_dir)).load_state_dict(old)
    fresh = make_dataloader(_stream(token_dir))
    with pytest.warns(UserWarning, match="starting epoch 1 afresh"):
        fresh.load_state_dict({**old, "batches_consumed": old["num_batches"]})


def _damage(token_dir, name):
    path = token_dir / f"{name}.ids.npy"
    data = bytearray(path.read_bytes())
    data[-2] ^= 1  # the low byte of the last id: still inside the vocabulary, only the checksum tells
    path.write_bytes(bytes(data))
    return path


def test_a_damaged_shard_is_caught_on_first_open_before_any_of_its_rows_is_used(tmp_path, tok):
    token_dir, _ = _many_shards(tmp_path, tok, documents=120)
    probe = _stream(token_dir, token_keys=True)
    order = probe.shard_order(0)[0].tolist()
    bad = order[len(order) // 2]  # read in the middle of the epoch, not by the first batches
    path = _damage(token_dir, probe.shard_names[bad])
    stream = _stream(token_dir, token_keys=True)
    used = []
    with pytest.raises(ShardError, match=str(path)):
        for batch in stream:
            keys = batch["token_keys"][batch["token_keys"] >= 0]
            used += (keys >> 40).unique().tolist()
    assert used and bad not in used, "no row of the damaged shard reached a batch"

    # under the loader with share_errors (what training uses), the rank hands the step a flagged padding batch
    loader = make_dataloader(_stream(token_dir, token_keys=True), share_errors=True)
    batches = list(loader)
    assert DATA_ERROR in batches[-1] and str(path) in batches[-1][DATA_ERROR]
    assert not any(DATA_ERROR in b for b in batches[:-1])
    assert bool((batches[-1]["document_ids"] == -1).all()), "the flagged batch holds no data"


def test_shards_plan_writes_the_files_the_stream_reads_without_opening_a_shard_or_parsing_the_manifest(
        tmp_path, tok, monkeypatch, capsys):
    token_dir, _ = _many_shards(tmp_path, tok, documents=40)
    assert cli.main(["shards", "plan", str(token_dir), "--seq-len", str(SEQ_LEN), "--workers", "2"]) == 0
    rows = np.load(plan_path(token_dir, SEQ_LEN), allow_pickle=False)
    index = plan_module.read_index(token_dir)
    assert list(index.names) == [f"shard-{i:06d}" for i in range(10)] and len(rows) == 10
    assert rows.tolist() == plan_module.compute_row_counts(token_dir, index, SEQ_LEN), "2 processes = 1"
    manifest = json.loads((token_dir / "manifest.json").read_text())
    assert index.header == {k: v for k, v in manifest.items() if k != "shards"}
    capsys.readouterr()
    opened, parsed = [], []
    original = TokenShard.__init__
    monkeypatch.setattr(TokenShard, "__init__", lambda self, *a, **k: (opened.append(a), original(self, *a, **k))[1])
    monkeypatch.setattr(plan_module, "read_manifest", lambda *a: parsed.append(a))
    stream = _stream(token_dir)
    assert opened == [] and parsed == [] and stream.num_rows == int(rows.sum())
    assert stream.shard_names[3] == "shard-000003" and stream.manifest["vocab_size"] == tok.VOCAB_SIZE
    assert "row plan" not in capsys.readouterr().err


def test_a_missing_plan_or_index_is_made_with_one_line_and_written(tmp_path, tok, capsys):
    token_dir, docs = _many_shards(tmp_path, tok, documents=40)
    rows = _stream(token_dir).num_rows
    err = capsys.readouterr().err
    assert "index.json is missing" in err and "is missing" in err.split("row plan:")[1] and "shards plan" in err
    assert plan_path(token_dir, SEQ_LEN).is_file() and plan_module.index_path(token_dir).is_file()
    modes = {path.name: path.stat().st_mode & 0o777 for path in (token_dir / "plans").iterdir()}
    assert len(set(modes.values())) == 1, f"every file of the index readable as a plain open() makes it: {modes}"
    assert _stream(token_dir).num_rows == rows and capsys.readouterr().err == ""

    # damaged counts are not used: recomputed and written again
    path = plan_path(token_dir, SEQ_LEN)
    good = path.read_bytes()
    path.write_bytes(good[:-8])
    assert _stream(token_dir).num_rows == rows
    assert "unreadable" in capsys.readouterr().err and path.read_bytes() == good


def test_another_manifest_makes_a_new_index_and_plan(tmp_path, tok, capsys):
    token_dir, docs = _many_shards(tmp_path, tok, documents=40)
    before = _stream(token_dir)
    capsys.readouterr()
    # the same bytes written again (a copy, a touch): the stat differs, the sha256 keeps the index
    manifest_file = token_dir / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_bytes(manifest_file.read_bytes())
    assert _stream(token_dir).num_rows == before.num_rows and capsys.readouterr().err == ""

    # fewer shards: the index is stale, made again, and the counts are those of the new manifest's shards
    manifest_file.write_text(json.dumps({**manifest, "shards": manifest["shards"][:-1]}))
    after = _stream(token_dir)
    err = capsys.readouterr().err
    assert "made from another manifest.json" in err and "row plan" in err
    assert len(after.shard_names) == len(before.shard_names) - 1 and after.num_rows < before.num_rows
    assert after.order_signature() != before.order_signature(), "a loader state of the old data does not resume"


def test_a_read_only_dataset_reads_its_manifest_each_start_and_says_so(tmp_path, tok, capsys, monkeypatch):
    token_dir, _ = _many_shards(tmp_path, tok, documents=40)
    expected = _stream(token_dir)
    for path in (token_dir / "plans").iterdir():
        path.unlink()

    def read_only(path, array):  # what a dataset on a read-only mount answers (root writes through chmod 555)
        raise PermissionError(13, "Read-only file system", str(path))

    monkeypatch.setattr(plan_module, "_atomic_save", read_only)
    capsys.readouterr()
    stream = _stream(token_dir)
    err = capsys.readouterr().err
    assert "cannot write" in err and "Read-only file system" in err
    assert stream.num_rows == expected.num_rows and stream.order_signature() == expected.order_signature()
    assert list((token_dir / "plans").iterdir()) == []
    copy = pickle.loads(pickle.dumps(stream))
    assert copy.shard_names[2] == expected.shard_names[2] and len(copy.shard_names) == 10, "workers get the names"
    assert next(iter(copy))["input_ids"].equal(next(iter(expected))["input_ids"])


def test_a_plan_whose_counts_disagree_with_a_shard_is_refused_at_its_open(tmp_path, tok, monkeypatch):
    token_dir, _ = _many_shards(tmp_path, tok, documents=40)
    counts = plan_module.compute_row_counts(token_dir, plan_module.read_index(token_dir), SEQ_LEN)
    write_plan(token_dir, SEQ_LEN, counts=[c + 1 for c in counts])  # right shards, wrong counts (edited by hand)
    with pytest.raises(ShardError, match="the plan is stale.*shards plan"):
        list(_stream(token_dir))


def test_shard_rows_pack_each_piece_once_within_the_shard(tmp_path, tok):
    offsets = np.array([0, 5, 5, 30, 33, 80], dtype=np.int64)  # an empty document and two longer than SEQ_LEN
    rows = plan_module.shard_rows(offsets, SEQ_LEN)
    covered = sorted((int(s), int(s + n)) for s, n in zip(rows.piece_start, rows.piece_len))
    assert covered == [(0, 5), (5, 29), (29, 30), (30, 33), (33, 57), (57, 80)]
    fill = np.add.reduceat(rows.piece_len[rows.row_pieces], rows.row_ptr[:-1])
    assert fill.max() <= SEQ_LEN and sorted(rows.row_pieces.tolist()) == list(range(6))
