"""Video shards: clips with sidecar captions -> raw shards (video files as they are, frames as PNG) -> parse, bad clips
skipped and listed or refused, and `shards tokenize` writing `<bov>` t*h*w codes `<eov>` with a video tokenizer."""

from __future__ import annotations

import io
import json
import tarfile
import types

import numpy as np
import pytest
import torch
from PIL import Image

from data_shards.pretokenize import pretokenize
from data_shards.raw import (
    RawShardWriter,
    ShardError,
    VideoFile,
    iter_raw_shard,
    iter_tar_samples,
    open_video,
    parse_document,
)
from data_shards.sources import video_folder, write_raw
from data_shards.token_shards import TokenShard
from fusion_model import cli
from tokenizer.video.clips import write_mp4


def moving_square(frames: int = 8, size: int = 16, seed: int = 0) -> np.ndarray:
    """A bright square sliding right over a smooth background: content that survives H.264."""
    rng = np.random.default_rng(seed)
    base = np.linspace(40, 120, size, dtype=np.float64)
    clip = np.empty((frames, size, size, 3), np.uint8)
    colour = rng.integers(150, 255, 3)
    for t in range(frames):
        frame = np.stack([np.add.outer(base, base) / 2] * 3, axis=-1)
        x = t % (size - 6)
        frame[5:11, x : x + 6] = colour
        clip[t] = frame.astype(np.uint8)
    return clip


def write_webm(frames: np.ndarray, path) -> None:
    import av

    with av.open(str(path), mode="w", format="webm") as container:
        stream = container.add_stream("libvpx-vp9", rate=8)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


@pytest.fixture
def clip_folder(tmp_path):
    """One clip of each kind with captions: a.mp4, b.webm, c.npy, d/ (PNG frames), e.npy (grey)."""
    folder = tmp_path / "clips"
    folder.mkdir()
    clips = {name: moving_square(seed=i) for i, name in enumerate("abcde")}
    write_mp4(clips["a"], folder / "a.mp4")
    write_webm(clips["b"], folder / "b.webm")
    np.save(folder / "c.npy", clips["c"])
    (folder / "d").mkdir()
    for t, frame in enumerate(clips["d"]):
        Image.fromarray(frame).save(folder / "d" / f"frame{t:02d}.png")
    np.save(folder / "e.npy", clips["e"][..., 0])
    for name in clips:
        (folder / f"{name}.txt").write_text(f"clip {name} moving right\n")
    return folder, clips


def test_video_folder_to_raw_shard_and_back_for_each_clip_kind(clip_folder, tmp_path):
    folder, clips = clip_folder
    manifest = write_raw(video_folder(folder), tmp_path / "raw")
    assert (manifest["documents"], manifest["videos"], manifest["images"], manifest["skipped_count"]) == (5, 5, 0, 0)
    shard = tmp_path / "raw" / manifest["shards"][0]["name"]
    with tarfile.open(shard) as tar:
        names = tar.getnames()
    assert "a.video0.mp4" in names and "b.video0.webm" in names  # the files' own bytes
    assert "c.video0.000000.png" in names and "d.video0.000007.png" in names and "e.video0.000000.png" in names
    assert not [n for n in names if n.endswith(".npy")]
    docs = dict(iter_raw_shard(shard))
    assert list(docs) == ["a", "b", "c", "d", "e"]
    assert docs["a"][0] == "clip a moving right"
    kind, payload, suffix = docs["a"][1]
    assert (kind, suffix) == ("video", ".mp4") and payload == (folder / "a.mp4").read_bytes()
    assert docs["b"][1][2] == ".webm" and docs["b"][1][1] == (folder / "b.webm").read_bytes()
    for name in "cd":  # lossless: PNG frames
        assert docs[name][1][0] == "video" and docs[name][1][2] == ".png"
        assert np.array_equal(open_video(docs[name][1], name), clips[name])
    grey = open_video(docs["e"][1], "e")
    assert np.array_equal(grey[..., 1], clips["e"][..., 0])
    for name in "ab":  # lossy codecs: close
        decoded = open_video(docs[name][1], name).astype(np.float64)
        assert decoded.shape == clips[name].shape
        assert 10 * np.log10(255**2 / np.mean((decoded - clips[name]) ** 2)) > 25
    assert open_video(docs["a"][1], "a", max_frames=3).shape[0] == 3
    assert open_video(docs["c"][1], "c", max_frames=3).shape[0] == 3


def test_mixed_documents_keep_images_and_clips_apart(tmp_path):
    clip = moving_square(frames=2)
    with RawShardWriter(tmp_path / "raw") as writer:
        writer.add("mixed", ["text", Image.new("RGB", (8, 8), "red"), clip, VideoFile(b"\x00mp4", ".mp4"), "end"])
    docs = dict(iter_raw_shard(tmp_path / "raw" / "shard-000000.tar"))
    segments = docs["mixed"]
    assert segments[0] == "text" and segments[4] == "end"
    assert segments[1][0] == "image" and len(segments[1]) == 2
    assert segments[2][0] == "video" and segments[2][2] == ".png" and len(segments[2][1]) == 2
    assert segments[3] == ("video", b"\x00mp4", ".mp4")
    manifest = json.loads((tmp_path / "raw" / "manifest.json").read_text())
    assert (manifest["images"], manifest["videos"], manifest["text_segments"]) == (1, 2, 2)


def test_writer_refuses_bad_clip_arrays_and_suffixes(tmp_path):
    with RawShardWriter(tmp_path / "raw") as writer:
        with pytest.raises(ValueError, match="uint8"):
            writer.add("f", [np.zeros((2, 4, 4, 3), np.float32)])
        with pytest.raises(ValueError, match=r"\(T, H, W, 3\)"):
            writer.add("g", [np.zeros((4, 4, 3), np.uint8)])
    with pytest.raises(ValueError, match="suffix"):
        VideoFile(b"", ".npy")


def test_parse_refuses_missing_or_gappy_clip_members():
    body = json.dumps({"segments": [{"video": 0}]}).encode()
    with pytest.raises(ShardError, match="references clip 0"):
        parse_document("s.tar", "k", {"json": body})
    with pytest.raises(ShardError, match="without gaps"):
        parse_document("s.tar", "k", {"json": body, "video0.000000.png": b"x", "video0.000002.png": b"y"})
    with pytest.raises(ShardError, match="several kinds"):
        parse_document("s.tar", "k", {"json": body, "video0.000000.png": b"x", "video0.mp4": b"y"})
    with pytest.raises(ShardError, match="not a video file"):
        parse_document("s.tar", "k", {"json": body, "video0.txt": b"x"})
    with pytest.raises(ShardError, match="segment 0"):
        parse_document("s.tar", "k", {"json": json.dumps({"segments": [{"video": "0"}]}).encode()})


def test_npy_members_stay_refused_in_raw_shards(tmp_path):
    path = tmp_path / "evil.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in (("k.json", b'{"segments": [{"video": 0}]}'), ("k.video0.npy", b"\x93NUMPY")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ShardError, match="pickled code"):
        list(iter_tar_samples(path))


def test_pickled_npy_clip_is_skipped_and_listed(tmp_path):
    folder = tmp_path / "clips"
    folder.mkdir()
    np.save(folder / "evil.npy", np.array([object()], dtype=object), allow_pickle=True)
    (folder / "evil.txt").write_text("evil")
    manifest = write_raw(video_folder(folder), tmp_path / "raw")
    assert manifest["documents"] == 0
    assert manifest["skipped"][0]["key"] == "evil" and "pickled" in manifest["skipped"][0]["reason"]


def corrupt_folder(tmp_path):
    folder = tmp_path / "clips"
    folder.mkdir()
    write_mp4(moving_square(), folder / "good.mp4")
    good = (folder / "good.mp4").read_bytes()
    (folder / "broken.mp4").write_bytes(good[: len(good) // 3])
    (folder / "noise.mp4").write_bytes(np.random.default_rng(0).bytes(4000))
    np.save(folder / "short.npy", moving_square(frames=2))
    (folder / "nocaption.npy").write_bytes(b"")
    for name in ("good", "broken", "noise", "short"):
        (folder / f"{name}.txt").write_text(name)
    return folder


def test_corrupt_clips_are_skipped_and_listed_or_refused_by_name(tmp_path, capsys):
    folder = corrupt_folder(tmp_path)
    raw = tmp_path / "raw"
    assert cli.main(["shards", "write", "--out", str(raw), "--video-folder", str(folder),
                     "--min-clip-frames", "4"]) == 0
    out = capsys.readouterr().out
    assert "wrote 1 documents (0 images, 1 clips) in 1 shards" in out and "skipped 4" in out
    skipped = {s["key"]: s["reason"] for s in json.loads((raw / "manifest.json").read_text())["skipped"]}
    assert set(skipped) == {"broken", "noise", "short", "nocaption"}
    assert "broken.mp4" in skipped["broken"] and "noise.mp4" in skipped["noise"]
    assert "2 frames, fewer than --min-clip-frames 4" in skipped["short"]
    assert "no caption file nocaption.txt" in skipped["nocaption"]
    assert cli.main(["shards", "write", "--out", str(tmp_path / "strict"), "--video-folder", str(folder),
                     "--strict"]) == 2
    err = capsys.readouterr().err
    assert "sample 'broken' rejected: " in err and "broken.mp4: truncated, corrupt or undecodable video" in err
    assert "without --strict" in err
    assert not (tmp_path / "strict" / "manifest.json").exists()
    assert cli.main(["shards", "inspect", str(raw), "--show", "1"]) == 0
    assert "<video .mp4" in capsys.readouterr().out


# ---- tokenize with a duck-typed video tokenizer and vocabulary (the real ones are other modules' work) ----

BOV, EOV, BOI, EOI, BOS, EOS = 1, 2, 3, 4, 5, 6
OFFSET = 100


class FakeVideoVocab:
    """The parts of UnifiedVocab pretokenize uses, with video markers: text = its bytes + 10 (one id each)."""

    pad_id, bos_id, eos_id, boi_id, eoi_id, image_placeholder_id = 0, BOS, EOS, BOI, EOI, 7
    bov_id, eov_id, image_offset, image_codes, vocab_size = BOV, EOV, OFFSET, 64, OFFSET + 64
    has_video = True

    def fingerprint(self) -> str:
        return "fake-video-vocab"

    def encode_document(self, segments, bos=True, eos=True, grid_shape=None):
        ids = [BOS] if bos else []
        for segment in segments:
            if isinstance(segment, str):
                ids += [10 + (b % 80) for b in segment.encode()]
            else:
                codes = torch.as_tensor(segment)
                start, end = (BOV, EOV) if codes.ndim == 3 else (BOI, EOI)
                ids += [start, *(codes.flatten() + OFFSET).tolist(), end]
        return ids + ([EOS] if eos else [])


class FakeVideoTokenizer:
    """encode_clips: code = (mean of the clip's first frame // 4) at every position of a (t, h, w) grid."""

    kind = "video"
    device = "cpu"
    temporal_factor = 4
    video_grid = (2, 2, 3)
    grid_shape = (2, 3)
    config = types.SimpleNamespace(clip_frames=8, embed_dim=4)

    def __init__(self):
        self.calls: list[list[tuple]] = []

    def fingerprint(self) -> str:
        return "fake-video-tokenizer"

    def encode_clips(self, clips, **kwargs):
        self.calls.append([tuple(c.shape) for c in clips])
        assert all(c.dtype == np.uint8 and c.shape[0] == self.config.clip_frames for c in clips)
        return torch.stack([torch.full(self.video_grid, int(c[0].mean()) // 4, dtype=torch.long) for c in clips])

    def encode(self, images, **kwargs):
        return torch.stack([torch.full(self.grid_shape, 1, dtype=torch.long) for _ in images])


def test_tokenize_writes_bov_codes_eov_and_records_video_grid(clip_folder, tmp_path):
    folder, clips = clip_folder
    write_raw(video_folder(folder), tmp_path / "raw")
    tokenizer = FakeVideoTokenizer()
    manifest = pretokenize(tmp_path / "raw", tmp_path / "tok", FakeVideoVocab(), tokenizer, flip_probability=0.0,
                           progress=False)
    assert manifest["video_grid"] == [2, 2, 3] and manifest["grid_shape"] == [2, 3]
    assert manifest["clip_frames"] == 8 and manifest["bov_id"] == BOV and manifest["eov_id"] == EOV
    assert manifest["documents"] == 5 and manifest["images"] == 0 and manifest["clips"] == 5
    assert manifest["shards"][0]["clips"] == 5
    shard = TokenShard(tmp_path / "tok", manifest["shards"][0]["name"], manifest["vocab_size"])
    meta = json.loads((tmp_path / "tok" / f"{shard.name}.meta.json").read_text())
    assert meta["clips"] == 5
    for i, key in enumerate(shard.keys):
        ids = shard.ids[shard.offsets[i] : shard.offsets[i + 1]].astype(np.int64).tolist()
        start = ids.index(BOV)
        assert ids[start + 1 + 12] == EOV and ids[-1] == EOS
        codes = np.array(ids[start + 1 : start + 13]) - OFFSET
        assert len(set(codes.tolist())) == 1
        if key in "cde":  # lossless clips: the code is the exact first-frame mean
            source = clips[key] if key != "e" else np.repeat(clips["e"][..., :1], 3, axis=-1)
            assert codes[0] == int(source[0].mean()) // 4
    assert sum(len(call) for call in tokenizer.calls) == 5


def test_long_clips_keep_their_first_frames_and_short_ones_are_refused(tmp_path):
    long_clip = moving_square(frames=12)
    with RawShardWriter(tmp_path / "raw") as writer:
        writer.add("long", ["twelve frames", long_clip])
    tokenizer = FakeVideoTokenizer()
    pretokenize(tmp_path / "raw", tmp_path / "tok", FakeVideoVocab(), tokenizer, progress=False)
    assert tokenizer.calls == [[(8, 16, 16, 3)]]
    with RawShardWriter(tmp_path / "raw2") as writer:
        writer.add("short", ["three frames", moving_square(frames=3)])
    with pytest.raises(ShardError, match=r"key 'short'.*3 frames.*clip_frames 8"):
        pretokenize(tmp_path / "raw2", tmp_path / "tok2", FakeVideoVocab(), FakeVideoTokenizer(), progress=False)


def test_clips_need_a_video_tokenizer_and_a_vocabulary_with_video_markers(tmp_path):
    with RawShardWriter(tmp_path / "raw") as writer:
        writer.add("clip", ["caption", moving_square(frames=8)])
    with pytest.raises(ShardError, match="no image tokenizer"):
        pretokenize(tmp_path / "raw", tmp_path / "t1", FakeVideoVocab(), None, progress=False)
    image_only = FakeVideoTokenizer()
    image_only.encode_clips = None
    with pytest.raises(ShardError, match="not a video tokenizer"):
        pretokenize(tmp_path / "raw", tmp_path / "t2", FakeVideoVocab(), image_only, progress=False)
    no_video = FakeVideoVocab()
    no_video.has_video = False
    with pytest.raises(ShardError, match="no video markers"):
        pretokenize(tmp_path / "raw", tmp_path / "t3", no_video, FakeVideoTokenizer(), progress=False)


def test_undecodable_clip_at_tokenize_names_shard_and_key(tmp_path):
    with RawShardWriter(tmp_path / "raw") as writer:
        writer.add("bad", ["caption", VideoFile(b"not a video at all" * 50, ".mp4")])
    with pytest.raises(ShardError, match=r"shard-000000\.tar, key 'bad'"):
        pretokenize(tmp_path / "raw", tmp_path / "tok", FakeVideoVocab(), FakeVideoTokenizer(), progress=False)


def test_caption_clip_pairs_flip_like_caption_image_pairs(tmp_path):
    with RawShardWriter(tmp_path / "raw") as writer:
        writer.add("pair", ["caption", moving_square(frames=8)])
    manifest = pretokenize(tmp_path / "raw", tmp_path / "tok", FakeVideoVocab(), FakeVideoTokenizer(),
                           flip_probability=1.0, progress=False)
    shard = TokenShard(tmp_path / "tok", manifest["shards"][0]["name"], manifest["vocab_size"])
    ids = shard.ids.astype(np.int64).tolist()
    assert ids[:2] == [BOS, BOV] and ids[1 + 13] == EOV  # [clip, caption]: the clip first


def test_documents_mix_text_images_and_clips(tmp_path):
    with RawShardWriter(tmp_path / "raw") as writer:
        writer.add("mixed", ["look", Image.new("RGB", (16, 16), "red"), "then", moving_square(frames=8), "end"])
    manifest = pretokenize(tmp_path / "raw", tmp_path / "tok", FakeVideoVocab(), FakeVideoTokenizer(),
                           progress=False)
    assert (manifest["images"], manifest["documents"]) == (1, 1)
    ids = TokenShard(tmp_path / "tok", manifest["shards"][0]["name"], manifest["vocab_size"]).ids.astype(int).tolist()
    boi, bov = ids.index(BOI), ids.index(BOV)
    assert boi < bov and ids[boi + 7] == EOI and ids[bov + 13] == EOV  # 2x3 image codes, then 2x2x3 clip codes
