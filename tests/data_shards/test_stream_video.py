"""The packed stream never cuts a video clip (`<bov>` ... `<eov>`) of a manifest that declares video; a clip longer
than seq_len is refused by name; resume stays bit-exact with clip documents."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data_shards.plan import plan_shard, read_index, shard_rows, video_markers, whole_images
from data_shards.raw import ShardError
from data_shards.stream import PackedTokenStream, make_dataloader
from data_shards.token_shards import TokenShard

# The tiny id layout (as a unified vocabulary with video numbers its specials): pad 0, <s> 1, </s> 2, <boi> 3,
# <eoi> 4, <bov> 7, <eov> 8; image codes 16..47; text 48..
VOCAB_SIZE, BOV, EOV, CODES, TEXT = 256, 7, 8, (16, 48), 48
VIDEO_GRID = (2, 2, 3)  # a clip: <bov>, 12 codes, <eov> = 14 ids
CLIP_IDS = VIDEO_GRID[0] * VIDEO_GRID[1] * VIDEO_GRID[2] + 2


def make_clip_documents(count: int, seed: int = 0, clip_codes: int = CLIP_IDS - 2) -> list[list[int]]:
    """Documents of text with 0-3 clips (and sometimes a VQ image after one)."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(count):
        doc = [TEXT + i % (VOCAB_SIZE - TEXT)]
        doc += rng.integers(TEXT, VOCAB_SIZE, int(rng.integers(0, 12))).tolist()
        for _ in range(int(rng.integers(0, 4))):
            doc += [BOV, *rng.integers(*CODES, clip_codes).tolist(), EOV]
            doc += rng.integers(TEXT, VOCAB_SIZE, int(rng.integers(0, 6))).tolist()
            if rng.random() < 0.3:
                doc += [3, *rng.integers(*CODES, 4).tolist(), 4]
        docs.append(doc)
    return docs


def make_clip_token_dir(tok, path: Path, documents: list[list[int]], per_shard: int = 9, declare: bool = True) -> Path:
    """Token shards of clip documents (keys clip-doc-<i>) and a manifest that declares video (bov_id, eov_id,
    video_grid) unless `declare` is False; `tok` is the data_shards conftest's builders fixture."""
    header = {"bos_id": 1, "eos_id": 2, "boi_id": 3, "eoi_id": 4, "image_offset": CODES[0],
              "image_codes": CODES[1] - CODES[0]}
    if declare:
        header.update(bov_id=BOV, eov_id=EOV, video_grid=list(VIDEO_GRID))
    return tok.make_token_dir(path, documents, per_shard, VOCAB_SIZE, header, key="clip-doc-{}", shard="clips-{:04d}",
                              vocab_fingerprint="test-vocab-video")


def clip_spans(ids: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every `<bov>` ... `<eov>` in ids (an unclosed one runs to the end)."""
    spans, start = [], None
    for i, t in enumerate(ids):
        if t == BOV:
            start = i
        elif t == EOV and start is not None:
            spans.append((start, i + 1))
            start = None
    if start is not None:
        spans.append((start, len(ids)))
    return spans


def assert_rows_keep_clips_whole(batch: dict) -> int:
    """Every row's documents hold only whole clips: each <bov> has its codes and <eov> in the same piece, and no
    piece starts inside a clip. Returns the clips seen."""
    seen = 0
    for ids, docs in zip(batch["input_ids"].tolist(), batch["document_ids"].tolist()):
        for doc in set(docs) - {-1}:
            piece = [t for t, d in zip(ids, docs) if d == doc]
            for start, end in clip_spans(piece):
                assert end - start == CLIP_IDS and piece[end - 1] == EOV, f"a clip cut: {piece[start:end]}"
                seen += 1
            # a piece that starts inside a clip would show codes then an <eov> before any <bov>
            first_eov = piece.index(EOV) if EOV in piece else len(piece)
            assert BOV in piece[:first_eov] or EOV not in piece, f"a piece starts inside a clip: {piece}"
    return seen


def test_manifest_declares_video_with_its_markers(tmp_path, tok):
    token_dir = make_clip_token_dir(tok, tmp_path / "t", make_clip_documents(5))
    header = read_index(token_dir).header
    assert video_markers(header) == (BOV, EOV) and header["video_grid"] == list(VIDEO_GRID)
    assert video_markers({"bov_id": None, "eov_id": None}) is None and video_markers({}) is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), seq_len=st.integers(CLIP_IDS, 80), count=st.integers(1, 12))
def test_pieces_never_cut_a_clip(seed, seq_len, count):
    documents = make_clip_documents(count, seed)
    flat = np.array([t for d in documents for t in d], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in documents])]).astype(np.int64)
    header = {"bov_id": BOV, "eov_id": EOV, "video_grid": list(VIDEO_GRID)}
    rows = shard_rows(offsets, seq_len, whole_images(flat, header, offsets), clips=True)
    pieces = sorted(zip(rows.piece_start.tolist(), rows.piece_len.tolist()))
    assert all(0 < n <= seq_len for _, n in pieces)
    # the pieces tile every document, and no clip straddles two pieces
    assert sum(n for _, n in pieces) == len(flat)
    cuts = {s for s, _ in pieces}
    for d, doc in enumerate(documents):
        for start, end in clip_spans(doc):
            inside = set(range(int(offsets[d]) + start + 1, int(offsets[d]) + end))
            assert not cuts & inside, f"seq_len {seq_len}: a piece starts inside the clip at {start} of document {d}"
    # every row within seq_len, every piece once
    assert sorted(rows.row_pieces.tolist()) == list(range(len(pieces)))
    for r in range(rows.num_rows):
        members = rows.row_pieces[rows.row_ptr[r] : rows.row_ptr[r + 1]]
        assert int(rows.piece_len[members].sum()) <= seq_len


def test_a_clip_left_open_ends_with_its_document():
    ids = np.array([TEXT, BOV, 20, 21, TEXT, TEXT, TEXT, BOV, 20, EOV], dtype=np.int64)
    offsets = np.array([0, 4, 10], dtype=np.int64)
    no_cut = whole_images(ids, {"bov_id": BOV, "eov_id": EOV}, offsets)
    assert no_cut.tolist() == [False, False, True, True, False, False, False, False, True, True]


@pytest.mark.parametrize("seq_len", [CLIP_IDS, 17, 24, 40])
def test_the_stream_never_cuts_a_clip(tmp_path, tok, seq_len):
    documents = make_clip_documents(30, seed=seq_len)
    token_dir = make_clip_token_dir(tok, tmp_path / "t", documents)
    clips = sum(len(clip_spans(d)) for d in documents)
    assert clips > 10 and max(map(len, documents)) > seq_len, "documents longer than a row, with clips to cut"
    stream = PackedTokenStream(token_dir, seq_len, 3, seed=1)
    assert sum(assert_rows_keep_clips_whole(batch) for batch in stream) == clips


def test_without_the_declaration_clips_are_cut_every_seq_len(tmp_path, tok):
    # the rule is the manifest's: the same ids in a manifest without bov_id / eov_id pack as before (cut every
    # seq_len), and some clip is then split
    documents = make_clip_documents(30, seed=3)
    token_dir = make_clip_token_dir(tok, tmp_path / "t", documents, declare=False)
    stream = PackedTokenStream(token_dir, CLIP_IDS, 3, seed=1)
    with pytest.raises(AssertionError, match="cut|inside a clip"):
        for batch in stream:
            assert_rows_keep_clips_whole(batch)


def test_a_clip_longer_than_seq_len_is_refused_naming_shard_document_and_key(tmp_path, tok):
    documents = make_clip_documents(12, seed=4)
    documents[10] = [TEXT, TEXT, BOV, *[20] * 30, EOV, TEXT]  # a 32-id clip in shard clips-0001
    token_dir = make_clip_token_dir(tok, tmp_path / "t", documents, per_shard=9)
    with pytest.raises(ShardError, match=r"video clip of 32 ids .* at id \d+ of document 1 \(key 'clip-doc-10'\) of "
                                         r"shard clips-0001 is longer than seq_len 20.*seq_len >= 32"):
        PackedTokenStream(token_dir, 20, 2)
    # long enough, it packs
    assert len(PackedTokenStream(token_dir, 32, 2)) > 0
    # the stream's own table of a shard names it too (a plan computed elsewhere, a shard opened here)
    shard = TokenShard(token_dir, "clips-0001", VOCAB_SIZE)
    with pytest.raises(ShardError, match="key 'clip-doc-10'"):
        plan_shard(shard, read_index(token_dir).header, 31)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_bit_exact_with_clip_documents(tmp_path, tok, workers):
    token_dir = make_clip_token_dir(tok, tmp_path / "t", make_clip_documents(60, seed=9))

    def loader():
        return make_dataloader(PackedTokenStream(token_dir, 24, 2, seed=5), num_workers=workers)

    reference = loader()
    full = [list(reference), list(reference)]
    n = len(full[0])
    assert n >= 5
    for cut in (1, n // 2, n):
        _, rest = tok.resumed_rest(loader, cut)
        expected = full[0][cut:] if cut < n else full[1]
        assert len(rest) == len(expected)
        for got, want in zip(rest, expected):
            assert all(torch.equal(got[k], want[k]) for k in want)
            assert_rows_keep_clips_whole(got)


def _real_rows(batch: dict) -> list[tuple[int, ...]]:
    """The rows of a batch that hold data (padding rows dropped)."""
    return [tuple(r) for r, d in zip(batch["input_ids"].tolist(), batch["document_ids"].tolist()) if max(d) >= 0]


def test_resume_under_another_world_size_reads_every_row_once(tmp_path, tok):
    token_dir = make_clip_token_dir(tok, tmp_path / "t", make_clip_documents(60, seed=11))
    one = make_dataloader(PackedTokenStream(token_dir, 24, 2, seed=2, rank=0, world_size=1))
    every_row = [r for b in one for r in _real_rows(b)]
    live = make_dataloader(PackedTokenStream(token_dir, 24, 2, seed=2, rank=0, world_size=1))
    it = iter(live)
    first = [r for _ in range(3) for r in _real_rows(next(it))]
    state = live.state_dict()
    rest = []
    for rank in range(2):
        resumed = make_dataloader(PackedTokenStream(token_dir, 24, 2, seed=2, rank=rank, world_size=2))
        resumed.load_state_dict(state)
        for batch in resumed:
            assert_rows_keep_clips_whole(batch)
            rest += _real_rows(batch)
    assert sorted(first + rest) == sorted(every_row)
