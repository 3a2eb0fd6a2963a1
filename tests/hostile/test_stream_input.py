"""Hostile input met by the token stream that feeds `fit`: NaN latents under valid checksums stop the stream (and `fit`,
exit 2) naming shard, document and key; a closed or dropped stream's background verifier ends and checks no more
shards; shards damaged after the manifest was written (ids beyond the vocabulary, a missing or truncated file) give
one sentence naming the file."""

from __future__ import annotations

import gc
import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from data_shards.datamodule import FusionDataModule
from data_shards.raw import ShardError
from data_shards.stream import DATA_ERROR, PackedTokenStream, make_dataloader
from data_shards.token_shards import TokenShard
from fusion_model import cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fusion_model" / "training"))
import fit_worker as fw  # noqa: E402

SEQ_LEN = 32
WAIT = 60  # seconds a test waits for a thread before failing (a bound on a hang, never a timing assertion)


# -- case 1: non-finite latents -------------------------------------------------------------------------------
@pytest.fixture
def nan_latents(tmp_path) -> Path:
    """One latent shard of 4 documents (one batch of 4 rows at SEQ_LEN) whose first image patch, in document 0
    (key 's0-d0'), is NaN; its checksums are those of the NaN bytes."""
    return fw.make_latent_token_dir(tmp_path / "tokens", n_docs=4, shards=1, nan_row=0)


def _says_nan_in_document_0(message: str, tokens: Path) -> bool:
    return all(part in message for part in (str(tokens / "shard-000.features.npy"), "document 0", "'s0-d0'",
                                            "NaN or an infinity", f"shards verify {tokens}"))


def test_the_stream_refuses_nan_latents_naming_shard_document_and_key(nan_latents):
    stream = PackedTokenStream(nan_latents, SEQ_LEN, 4, image_latents=True)
    with pytest.raises(ShardError) as caught:
        next(iter(stream))
    assert _says_nan_in_document_0(str(caught.value), nan_latents), caught.value


def test_the_training_loader_hands_the_nan_latents_error_to_the_step(nan_latents):
    loader = make_dataloader(PackedTokenStream(nan_latents, SEQ_LEN, 4, image_latents=True), share_errors=True)
    batch = next(iter(loader))
    assert _says_nan_in_document_0(batch[DATA_ERROR], nan_latents), batch[DATA_ERROR]
    assert not batch["image_latents"].isnan().any(), "the flagged batch carries no data"


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_fit_on_nan_latents_exits_2_with_one_line_naming_the_shard(nan_latents, tmp_path, capsys, one_thread, policy):
    args = fw.tiny_args(nan_latents, tmp_path / "run", 1, extra=["--model.family=transfusion",
                                                               f"--model.nonfinite={policy}", "--threads=1"])
    code = cli.main(["fit", *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train.py fit:")]
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and _says_nan_in_document_0(lines[0], nan_latents), err[-3000:]
    assert "model.lr" not in lines[0], "it blames the data, not the learning rate"


def test_verify_names_the_same_document(nan_latents):
    from data_shards.token_shards import verify_token_dir

    _, problems = verify_token_dir(nan_latents)
    assert len(problems) == 1 and _says_nan_in_document_0(problems[0][1], nan_latents), problems


# -- case 2: the background verifier ends with its stream ----------------------------------------------------
@pytest.fixture
def many_shards(tmp_path) -> Path:
    """60 small shards: a batch of 8 rows draws from several, and the next batch from others."""
    return fw.make_token_dir(tmp_path / "tokens", n_docs=240, shards=60)


def _stream(tokens: Path, **kwargs) -> PackedTokenStream:
    return PackedTokenStream(tokens, SEQ_LEN, 8, seed=3, **kwargs)


def _batch_shards(tokens: Path, batch: int) -> set[str]:
    reference = _stream(tokens, verify_ahead=False)
    names = {reference.shard_names[s] for row in reference.batch_pieces(0, batch) for s, _, _ in row}
    reference.close()
    return names


class VerifySpy:
    """Records which of this test's shards get size + sha256 checked, and by which thread; a check of a shard outside
    `free` waits for `release` (so the test decides when the verifier may go on)."""

    def __init__(self, monkeypatch, root: Path, free: set[str] | None = None) -> None:
        self.checked: list[str] = []
        self.threads: list[threading.Thread] = []
        self.blocked, self.release = threading.Event(), threading.Event()
        original = TokenShard.verify_files

        def spy(shard: TokenShard) -> None:
            if root in Path(shard.path(".ids.npy")).parents:
                self.checked.append(shard.name)
                self.threads.append(threading.current_thread())
                if free is not None and shard.name not in free:
                    self.blocked.set()
                    self.release.wait(WAIT)
            return original(shard)

        monkeypatch.setattr(TokenShard, "verify_files", spy)

    def assert_threads_end(self) -> None:
        for thread in set(self.threads):
            thread.join(WAIT)
            assert not thread.is_alive(), f"{thread.name} outlives its stream"


def test_a_dropped_streams_verifier_checks_no_more_shards_and_ends(many_shards, tmp_path, monkeypatch):
    first = _batch_shards(many_shards, 0)
    assert len(_batch_shards(many_shards, 1) - first) >= 2, "the test needs a next batch of several new shards"
    spy = VerifySpy(monkeypatch, tmp_path, free=first)
    stream = _stream(many_shards)
    batches = iter(stream)
    next(batches)  # checks the first batch's shards, and queues the next batch's in the background
    assert spy.blocked.wait(WAIT), "the verifier started on the next batch's shards"
    del batches, stream  # dropped mid-epoch, as a loader recreated each epoch drops its stream
    gc.collect()
    spy.release.set()
    spy.assert_threads_end()
    ahead = [name for name in spy.checked if name not in first]
    assert len(ahead) == 1, f"only the check running when the stream was dropped finishes, not {ahead}"


def test_a_closed_streams_verifier_ends_and_checks_no_more_shards(many_shards, tmp_path, monkeypatch):
    spy = VerifySpy(monkeypatch, tmp_path)
    stream = _stream(many_shards)
    batches = iter(stream)
    next(batches)
    stream.close()
    spy.assert_threads_end()  # so nothing is checked after close
    assert set(spy.checked) <= _batch_shards(many_shards, 0) | _batch_shards(many_shards, 1)


def test_the_data_modules_teardown_closes_its_streams(many_shards, tmp_path, monkeypatch):
    spy = VerifySpy(monkeypatch, tmp_path)
    module = FusionDataModule(train_dir=str(many_shards), seq_len=SEQ_LEN, batch_size=8, num_workers=0, seed=3)
    loader = module.train_dataloader()
    next(iter(loader))
    module.teardown("fit")
    assert spy.threads, "the stream checked its shards in a background thread"
    spy.assert_threads_end()
    del loader


# -- other hostile shards ---------------------------------------------------------------------------------------
def _first_shard(tokens: Path) -> str:
    return _stream(tokens, verify_ahead=False).shard_names[0]


def _lower_vocab_size(tokens: Path, keep_max_id: bool) -> None:
    """The manifest says vocab_size 20 while the shard holds ids up to 255 (without max_id: a manifest of before
    that field, whose shards only the stream's id check can catch)."""
    manifest = json.loads((tokens / "manifest.json").read_text())
    manifest["vocab_size"] = 20
    for entry in manifest["shards"]:
        if not keep_max_id:
            entry.pop("max_id")
    (tokens / "manifest.json").write_text(json.dumps(manifest))


def test_a_manifest_whose_shard_exceeds_its_vocab_size_is_refused_at_start_naming_it(tmp_path):
    tokens = fw.make_token_dir(tmp_path / "tokens", n_docs=4, shards=1)
    _lower_vocab_size(tokens, keep_max_id=True)
    with pytest.raises(ShardError, match=r"manifest.json: shard shard-000 holds id \d+ >= vocab_size 20"):
        _stream(tokens)


def test_ids_beyond_the_vocabulary_name_the_shard_and_key(tmp_path):
    tokens = fw.make_token_dir(tmp_path / "tokens", n_docs=4, shards=1)
    _lower_vocab_size(tokens, keep_max_id=False)
    with pytest.raises(ShardError) as caught:
        next(iter(_stream(tokens)))
    message = str(caught.value)
    assert "shard-000.ids.npy" in message and ">= vocab_size 20" in message and "key 's0-d" in message, message


@pytest.mark.parametrize("suffix", [".ids.npy", ".features.npy"])
def test_a_file_truncated_after_the_manifest_names_the_file(tmp_path, suffix):
    tokens = fw.make_latent_token_dir(tmp_path / "tokens", n_docs=4, shards=1)
    path = tokens / f"shard-000{suffix}"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(ShardError) as caught:
        next(iter(PackedTokenStream(tokens, SEQ_LEN, 4, image_latents=True)))
    assert str(path) in str(caught.value) and "shards tokenize" in str(caught.value), caught.value


@pytest.mark.parametrize("suffix", [".ids.npy", ".meta.json", ".features.npy", ".keys.json"])
def test_a_file_removed_after_the_manifest_is_named_first(tmp_path, suffix):
    tokens = fw.make_latent_token_dir(tmp_path / "tokens", n_docs=4, shards=1)
    PackedTokenStream(tokens, SEQ_LEN, 4, image_latents=True)  # the index is written while the shard is whole
    path = tokens / f"shard-000{suffix}"
    path.unlink()
    with pytest.raises(ShardError) as caught:
        next(iter(PackedTokenStream(tokens, SEQ_LEN, 4, image_latents=True)))
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "shards tokenize" in message, message


def test_fit_on_a_truncated_shard_exits_2_with_one_line(tmp_path, capsys, one_thread):
    tokens = fw.make_token_dir(tmp_path / "tokens", n_docs=4, shards=1)
    path = tokens / "shard-000.ids.npy"
    path.write_bytes(path.read_bytes()[:-8])
    code = cli.main(["fit", *fw.tiny_args(tokens, tmp_path / "run", 1, extra=["--threads=1"])])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("train.py fit:")]
    assert code == 2 and len(lines) == 1 and str(path) in lines[0], err[-3000:]
    assert "Traceback" not in err


def test_an_empty_shard_names_the_shard(tmp_path):
    from data_shards.token_shards import write_manifest, write_token_shard

    tokens = tmp_path / "tokens"
    info = {"vocab_size": 256, "vocab_fingerprint": "v", "image_tokenizer_fingerprint": "none"}
    metas = [write_token_shard(tokens, "full", ["a"], [[5] * 40], info), write_token_shard(tokens, "empty", [], [], info)]
    write_manifest(tokens, {**info, "pad_id": 0}, metas)
    with pytest.raises(ShardError) as caught:
        list(PackedTokenStream(tokens, SEQ_LEN, 1))
    assert "empty" in str(caught.value) and "shards tokenize" in str(caught.value), caught.value
    assert np.load(tokens / "empty.offsets.npy").tolist() == [0]
