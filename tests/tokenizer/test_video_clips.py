"""tokenizer.video.clips: read and write clips (npy, PyAV video, frame folders, GIF) and refuse bad ones by name."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from PIL import Image

from tokenizer.video.clips import (
    CLIP_SUFFIXES,
    ClipLoadError,
    frame_strip,
    list_clip_files,
    read_clip,
    write_gif,
    write_mp4,
)


def smooth_clip(frames: int = 8, height: int = 32, width: int = 48, seed: int = 0) -> np.ndarray:
    """Smooth colour gradients moving across frames: content a lossy codec keeps well."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    phases = rng.uniform(0, 2 * np.pi, 3)
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for t in range(frames):
        for c in range(3):
            wave = np.sin((x + 2 * t) / width * np.pi + phases[c]) * np.cos(y / height * np.pi / 2 + c)
            out[t, :, :, c] = np.clip(128 + 100 * wave, 0, 255).astype(np.uint8)
    return out


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def write_webm(frames: np.ndarray, path) -> None:
    with av.open(str(path), mode="w", format="webm") as container:
        stream = container.add_stream("libvpx-vp9", rate=8)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "10", "b": "0"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_npy_round_trip_is_exact_and_grey_becomes_rgb(tmp_path):
    clip = smooth_clip()
    np.save(tmp_path / "a.npy", clip)
    assert np.array_equal(read_clip(tmp_path / "a.npy"), clip)
    grey = clip[..., 0]
    np.save(tmp_path / "g.npy", grey)
    got = read_clip(tmp_path / "g.npy")
    assert got.shape == (*grey.shape, 3) and np.array_equal(got[..., 2], grey)
    buffer = io.BytesIO()
    np.save(buffer, clip)
    assert np.array_equal(read_clip(buffer.getvalue(), name="inside.tar:a", suffix=".npy"), clip)
    assert read_clip(tmp_path / "a.npy", max_frames=3).shape[0] == 3


def test_npy_refusals_name_the_file(tmp_path):
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(ClipLoadError, match=r"objects\.npy.*pickled"):
        read_clip(tmp_path / "objects.npy")
    np.save(tmp_path / "float.npy", np.zeros((2, 4, 4, 3), np.float32))
    with pytest.raises(ClipLoadError, match=r"float\.npy.*uint8"):
        read_clip(tmp_path / "float.npy")
    np.save(tmp_path / "shape.npy", np.zeros((4, 4), np.uint8))
    with pytest.raises(ClipLoadError, match=r"shape\.npy.*\(T, H, W, 3\)"):
        read_clip(tmp_path / "shape.npy")
    (tmp_path / "cut.npy").write_bytes((tmp_path / "float.npy").read_bytes()[:100])
    with pytest.raises(ClipLoadError, match=r"cut\.npy"):
        read_clip(tmp_path / "cut.npy")
    with pytest.raises(ClipLoadError, match="suffix"):
        read_clip(b"abc")


def test_mp4_round_trip_is_close_on_smooth_content(tmp_path):
    clip = smooth_clip(frames=8, height=32, width=48)
    path = write_mp4(clip, tmp_path / "clip.mp4", fps=8)
    got = read_clip(path)
    assert got.shape == clip.shape and got.dtype == np.uint8
    assert psnr(got, clip) > 25
    assert np.array_equal(read_clip(path.read_bytes(), suffix="mp4"), got)  # bytes as stored in a tar
    assert read_clip(path, max_frames=2).shape[0] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_mp4_of_odd_size_is_padded_to_even(tmp_path):
    clip = smooth_clip(frames=4, height=17, width=23)
    got = read_clip(write_mp4(clip, tmp_path / "odd.mp4"))
    assert got.shape == (4, 18, 24, 3)
    assert psnr(got[:, :17, :23], clip) > 25


def test_webm_round_trip(tmp_path):
    clip = smooth_clip(frames=6, height=32, width=32, seed=1)
    write_webm(clip, tmp_path / "clip.webm")
    got = read_clip(tmp_path / "clip.webm")
    assert got.shape == clip.shape and psnr(got, clip) > 25


def test_frame_folder_reads_frames_in_name_order(tmp_path):
    clip = smooth_clip(frames=5)
    folder = tmp_path / "frames"
    folder.mkdir()
    for t, frame in enumerate(clip):
        Image.fromarray(frame).save(folder / f"{t:03d}.png")
    (folder / "notes.txt").write_text("ignored")
    assert np.array_equal(read_clip(folder), clip)
    Image.fromarray(clip[0][:8]).save(folder / "999.png")
    with pytest.raises(ClipLoadError, match=r"999\.png.*one size"):
        read_clip(folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ClipLoadError, match="PNG or JPEG"):
        read_clip(empty)


def test_gif_round_trip_and_frame_strip(tmp_path):
    clip = np.zeros((4, 16, 20, 3), np.uint8)
    for t in range(4):  # few flat colours: GIF's palette keeps them exactly
        clip[t, :, : 5 * (t + 1)] = (255, 0, 0)
        clip[t, :, 5 * (t + 1) :] = (0, 0, 255)
    path = write_gif(clip, tmp_path / "clip.gif", fps=4)
    with Image.open(path) as gif:
        assert gif.n_frames == 4
        frames = []
        for t in range(4):
            gif.seek(t)
            frames.append(np.asarray(gif.convert("RGB")))
    assert np.array_equal(np.stack(frames), clip)
    strip = frame_strip(clip, gap=2)
    assert strip.size == (4 * 20 + 3 * 2, 16)
    assert np.array_equal(np.asarray(strip)[:, 22:42], clip[1])


@pytest.mark.parametrize("corruption", ["truncated", "random"])
def test_corrupt_mp4_raises_naming_the_file(tmp_path, corruption):
    good = write_mp4(smooth_clip(), tmp_path / "good.mp4").read_bytes()
    data = good[: len(good) // 3] if corruption == "truncated" else np.random.default_rng(0).bytes(5000)
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(data)
    with pytest.raises(ClipLoadError, match=r"bad\.mp4"):
        read_clip(bad)
    with pytest.raises(ClipLoadError, match=r"shard-000000\.tar:bad"):
        read_clip(data, name="shard-000000.tar:bad", suffix=".mp4")


def test_unknown_suffix_and_missing_file(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ClipLoadError, match="unknown clip type"):
        read_clip(tmp_path / "x.txt")
    with pytest.raises(ClipLoadError, match="no such file"):
        read_clip(tmp_path / "missing.mp4")


def test_list_clip_files_finds_clips_and_frame_folders(tmp_path):
    np.save(tmp_path / "b.npy", smooth_clip(frames=2))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.webm").write_bytes(b"x")
    (tmp_path / "sub" / "c.txt").write_text("caption")
    frames = tmp_path / "sub" / "a_frames"
    frames.mkdir()
    Image.fromarray(smooth_clip(frames=1)[0]).save(frames / "0.png")
    (tmp_path / "cover.png").write_bytes(b"")  # a stray image at the root is no clip
    assert list_clip_files(tmp_path) == sorted([tmp_path / "b.npy", tmp_path / "sub" / "c.webm", frames])
    assert ".mp4" in CLIP_SUFFIXES and ".webm" in CLIP_SUFFIXES and ".npy" in CLIP_SUFFIXES
    with pytest.raises(FileNotFoundError):
        list_clip_files(tmp_path / "nope")
