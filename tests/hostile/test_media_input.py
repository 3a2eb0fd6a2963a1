"""Awkward media on the way into shards and tokenizers: long clips validated in bounded memory, `.npy` headers that
claim more than the file holds, frames too small for a tokenizer, folders of the wrong kind, and odd files (empty
or audio-only videos, text posing as a PNG, 16-bit / CMYK / palette / EXIF-rotated images): each is skipped and
named, or refused in one line with exit 2 and nothing written."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import numpy.lib.format as npy_format
import pytest
import torch
from PIL import Image

from data_shards.raw import RawShardWriter, VideoFile, iter_raw_shard, open_video
from data_shards.sources import video_folder
from fusion_model import cli
from tokenizer.image.preprocess import ImageLoadError, open_image
from tokenizer.video.clips import ClipLoadError, read_clip, write_mp4
from tokenizer.video.lightning import ClipFiles


def gradient_clip(frames: int, size: int = 16) -> np.ndarray:
    """uint8 (frames, size, size, 3): a smooth ramp brightening over time (small to encode, valid for any size)."""
    ramp = np.linspace(20, 200, size, dtype=np.float64)
    clip = np.empty((frames, size, size, 3), np.uint8)
    for t in range(frames):
        clip[t] = np.clip(np.add.outer(ramp, ramp)[..., None] / 2 + t, 0, 255).astype(np.uint8)
    return clip


def with_caption(path: Path, text: str = "a caption") -> Path:
    """`path` with its sidecar caption NAME.txt written beside it."""
    (path.parent / f"{path.stem if path.suffix else path.name}.txt").write_text(text)
    return path


def skipped_reasons(raw: Path) -> dict[str, str]:
    """The raw manifest's skipped samples: key -> reason."""
    return {s["key"]: s["reason"] for s in json.loads((raw / "manifest.json").read_text())["skipped"]}


def write_npy_header(path: Path, shape: tuple[int, ...], payload: bytes = b"\0" * 64, version=(1, 0)) -> Path:
    """A `.npy` file whose header claims `shape` (uint8) followed by only `payload`."""
    with path.open("wb") as handle:
        header = {"descr": "|u1", "fortran_order": False, "shape": shape}
        if version == (1, 0):
            npy_format.write_array_header_1_0(handle, header)
        else:
            npy_format.write_array_header_2_0(handle, header)
        handle.write(payload)
    return path


# ---- 1. a long video file is validated frame by frame --------------------------------------------------------------


def _ingest_peak(folder: Path) -> int:
    """Peak traced bytes (numpy buffers included) of ingesting the one clip in `folder`."""
    tracemalloc.start()
    try:
        samples = list(video_folder(folder))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(samples) == 1 and samples[0].skip_reason is None and isinstance(samples[0].segments[1], VideoFile)
    return peak


def test_validating_a_video_file_at_ingest_takes_memory_independent_of_its_length(tmp_path):
    peaks = {}
    for frames in (40, 160):
        folder = tmp_path / f"f{frames}"
        folder.mkdir()
        write_mp4(np.repeat(gradient_clip(1, size=64), frames, axis=0), with_caption(folder / "clip.mp4"))
        peaks[frames] = _ingest_peak(folder)
    # whole-clip decoding held every frame (twice, while stacking): 4x the frames took 4x the memory (534 kB, then
    # 2.06 MB); streamed, both peaks are some 20 kB of Python objects and the file's bytes, so allow that much noise
    assert peaks[160] < 1.5 * peaks[40] + 50_000, peaks
    assert peaks[160] < 20 * 64 * 64 * 3, peaks  # a few frames' worth, not 160


def test_a_video_file_past_the_pixel_cap_is_skipped_without_holding_its_frames(tmp_path, monkeypatch):
    monkeypatch.setattr("tokenizer.video.clips.MAX_CLIP_BYTES", 30 * 16 * 16 * 3)  # 30 frames of 16x16
    folder = tmp_path / "clips"
    folder.mkdir()
    write_mp4(gradient_clip(40), with_caption(folder / "long.mp4"))
    (sample,) = video_folder(folder)
    assert sample.skip_reason.startswith(f"{folder / 'long.mp4'}: decodes to more than")


# ---- 2. .npy headers are read before any allocation ----------------------------------------------------------------


def test_npy_clip_whose_header_claims_a_huge_shape_is_skipped_by_name(tmp_path, capsys):
    folder = tmp_path / "clips"
    folder.mkdir()
    write_npy_header(with_caption(folder / "huge.npy"), (10**7, 32, 32, 3))
    np.save(with_caption(folder / "good.npy"), gradient_clip(4))
    raw = tmp_path / "raw"
    assert cli.main(["shards", "write", "--out", str(raw), "--video-folder", str(folder)]) == 0
    assert "wrote 1 documents (0 images, 1 clips)" in capsys.readouterr().out
    reason = skipped_reasons(raw)["huge"]
    assert reason.startswith(f"{folder / 'huge.npy'}: its header claims shape (10000000, 32, 32, 3)")
    assert "cut it into clips" in reason


def test_strict_write_refuses_a_huge_npy_header_in_one_line_and_leaves_no_folder(tmp_path, capsys):
    folder = tmp_path / "clips"
    folder.mkdir()
    write_npy_header(with_caption(folder / "huge.npy"), (10**7, 32, 32, 3))
    out = tmp_path / "raw"
    assert cli.main(["shards", "write", "--out", str(out), "--video-folder", str(folder), "--strict"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "sample 'huge' rejected" in err and "huge.npy" in err
    assert not out.exists()


def test_npy_header_claiming_more_than_the_file_holds_is_refused_as_truncated(tmp_path):
    path = write_npy_header(tmp_path / "cut.npy", (8, 16, 16, 3), payload=b"\0" * 100, version=(2, 0))
    with pytest.raises(ClipLoadError, match=r"cut\.npy: truncated: its header claims shape \(8, 16, 16, 3\)"):
        read_clip(path)
    with pytest.raises(ClipLoadError, match=r"inside\.tar:cut: truncated"):
        read_clip(path.read_bytes(), name="inside.tar:cut", suffix=".npy")


def test_tokenizer_fit_skips_a_huge_npy_header_and_names_it(tmp_path):
    write_npy_header(tmp_path / "huge.npy", (10**7, 32, 32, 3))
    np.save(tmp_path / "good.npy", gradient_clip(8, size=32))
    clips = ClipFiles([tmp_path / "huge.npy", tmp_path / "good.npy"], 32, 8, train=False)
    assert clips[0].shape == (8, 3, 32, 32)
    assert list(clips.skipped) == [str(tmp_path / "huge.npy")]


# ---- 3. frames smaller than the tokenizer's minimum ----------------------------------------------------------------


def test_clips_with_frames_under_the_image_minimum_are_skipped_at_ingest_like_images(tmp_path, capsys):
    folder = tmp_path / "clips"
    folder.mkdir()
    np.save(with_caption(folder / "tiny.npy"), gradient_clip(8, size=3))
    write_mp4(gradient_clip(8, size=4), with_caption(folder / "small.mp4"))
    frames = folder / "frames"
    frames.mkdir()
    Image.new("RGB", (3, 3)).save(frames / "000.png")
    with_caption(frames)
    np.save(with_caption(folder / "good.npy"), gradient_clip(8))
    raw = tmp_path / "raw"
    assert cli.main(["shards", "write", "--out", str(raw), "--video-folder", str(folder)]) == 0
    assert "wrote 1 documents (0 images, 1 clips)" in capsys.readouterr().out
    reasons = skipped_reasons(raw)
    assert set(reasons) == {"tiny", "small", "frames"}
    assert reasons["tiny"].startswith(f"{folder / 'tiny.npy'} (frames): 3x3 is too small (shortest side < 8 px)")
    assert reasons["small"].startswith(f"{folder / 'small.mp4'} (frames): 4x4 is too small")
    assert reasons["frames"].startswith(f"{frames} (frames): 3x3 is too small")
    images = tmp_path / "images"  # the same minimum as --image-folder's
    images.mkdir()
    Image.new("RGB", (3, 3)).save(with_caption(images / "tiny.png"))
    assert cli.main(["shards", "write", "--out", str(tmp_path / "raw_images"), "--image-folder", str(images)]) == 0
    assert "3x3 is too small (shortest side < 8 px)" in skipped_reasons(tmp_path / "raw_images")["tiny"]


@pytest.fixture(scope="module")
def video_bundle(tmp_path_factory) -> tuple[Path, Path]:
    """(tokenizer.json with video markers, a tiny video tokenizer bundle: 16-px frames, 4-frame clips)."""
    from tokenizer.video import VideoTokenizer, VideoTokenizerConfig
    from tokenizer.vocab import train_unified_vocab

    root = tmp_path_factory.mktemp("video_bundle")
    vocab = train_unified_vocab(["a caption", "a tiny clip"] * 50, vocab_size=512, image_codes=32, video=True)
    vocab_path = vocab.save(root / "tokenizer.json")
    torch.manual_seed(0)
    config = VideoTokenizerConfig(image_size=16, clip_frames=4, codebook_size=32, embed_dim=4, latent_channels=4,
                                  base_channels=8, channel_multiplier=(1, 2), num_res_blocks=1, attn_resolutions=(),
                                  norm_groups=4)
    VideoTokenizer(config).save_pretrained(root / "video")
    return vocab_path, root / "video"


def _tokenize(raw: Path, out: Path, vocab: Path, bundle: Path) -> int:
    return cli.main(["shards", "tokenize", str(raw), "--out", str(out), "--vocab", str(vocab), "--image-tokenizer",
                     str(bundle), "--no-progress", "--workers", "1", "--device", "cpu"])


def test_tokenize_names_the_shard_and_key_of_a_clip_with_too_small_frames(tmp_path, capsys, video_bundle):
    with RawShardWriter(tmp_path / "raw") as writer:  # written before ingest refused such clips
        writer.add("tiny", ["a tiny clip", gradient_clip(4, size=3)])
    assert _tokenize(tmp_path / "raw", tmp_path / "tok", *video_bundle) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "shard shard-000000.tar, key 'tiny': " in err and "3x3 is too small" in err
    assert "<PIL image>" not in err
    assert not (tmp_path / "tok").exists()  # a refused run leaves no empty output folder


def test_tokenizer_fit_skips_a_clip_with_too_small_frames_and_names_it(tmp_path):
    np.save(tmp_path / "tiny.npy", gradient_clip(8, size=3))
    np.save(tmp_path / "good.npy", gradient_clip(8, size=32))
    clips = ClipFiles([tmp_path / "tiny.npy", tmp_path / "good.npy"], 32, 8, train=False)
    assert clips[0].shape == (8, 3, 32, 32)
    assert "3x3 is too small" in clips.skipped[str(tmp_path / "tiny.npy")]


def test_generate_names_a_prompt_image_that_is_too_small_before_loading_the_model(tmp_path, monkeypatch):
    from fusion_model.cli.generate import parser, run

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the prompt images were checked")

    monkeypatch.setattr("fusion_model.cli.generate.load_family", no_loading)
    Image.new("RGB", (3, 3)).save(tmp_path / "tiny.png")
    args = parser().parse_args(["--checkpoint", str(tmp_path / "model.ckpt"), "--prompt", "look",
                                "--image", str(tmp_path / "tiny.png"), "--out", str(tmp_path / "out")])
    with pytest.raises(ValueError, match=r"^prompt image .*tiny\.png: 3x3 is too small"):
        run(args)
    assert not (tmp_path / "out").exists()


# ---- 4. a folder of the wrong kind ---------------------------------------------------------------------------------


def refused_write(tmp_path, capsys, flag: str, folder) -> str:
    """`shards write FLAG FOLDER`'s one-line refusal (exit 2, no output folder)."""
    out = tmp_path / "raw"
    assert cli.main(["shards", "write", "--out", str(out), flag, str(folder)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()
    return err



def test_video_folder_of_images_exits_2_saying_what_it_found(tmp_path, capsys):
    folder = tmp_path / "pngs"
    folder.mkdir()
    for i in range(12):
        Image.new("RGB", (16, 16)).save(with_caption(folder / f"{i}.png"))
    err = refused_write(tmp_path, capsys, "--video-folder", folder)
    assert f"--video-folder {folder}: no clips found" in err and "12 .png files: use --image-folder" in err


def test_image_folder_of_videos_exits_2_saying_what_it_found(tmp_path, capsys):
    folder = tmp_path / "mp4s"
    folder.mkdir()
    for i in range(3):
        write_mp4(gradient_clip(4), with_caption(folder / f"{i}.mp4"))
    err = refused_write(tmp_path, capsys, "--image-folder", folder)
    assert f"--image-folder {folder}: no images found" in err and "3 .mp4 files: use --video-folder" in err


def test_an_empty_media_folder_exits_2_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "raw"
    for flag in ("--image-folder", "--video-folder"):
        assert cli.main(["shards", "write", "--out", str(out), flag, str(tmp_path / "empty")]) == 2
        assert "it holds no files" in capsys.readouterr().err
        assert not out.exists()


# ---- other awkward media -------------------------------------------------------------------------------------------


def _audio_only_mp4(path: Path) -> Path:
    import av

    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for _ in range(4):
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def test_empty_audio_only_and_one_frame_clips_are_skipped_or_kept_by_name(tmp_path, capsys):
    folder = tmp_path / "clips"
    folder.mkdir()
    with_caption(folder / "empty.mp4").write_bytes(b"")
    _audio_only_mp4(with_caption(folder / "audio.mp4"))
    write_mp4(gradient_clip(1), with_caption(folder / "one.mp4"))
    raw = tmp_path / "raw"
    assert cli.main(["shards", "write", "--out", str(raw), "--video-folder", str(folder)]) == 0
    assert "wrote 1 documents (0 images, 1 clips)" in capsys.readouterr().out
    reasons = skipped_reasons(raw)
    assert reasons["empty"] == f"{folder / 'empty.mp4'}: empty file (0 bytes); remove it or write it again"
    assert reasons["audio"] == f"{folder / 'audio.mp4'}: the file has no video stream; remove it or re-encode it"
    (key, segments), = iter_raw_shard(raw / "shard-000000.tar")
    assert key == "one" and open_video(segments[1], "one").shape == (1, 16, 16, 3)


def test_awkward_images_go_through_write_and_tokenize_or_are_skipped_by_name(tmp_path, capsys, video_bundle):
    folder = tmp_path / "images"
    folder.mkdir()
    with_caption(folder / "text.png").write_text("not a png at all\n")
    deep = (np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 257).astype(np.uint16)
    Image.fromarray(deep).save(with_caption(folder / "deep.png"))  # 16-bit grey
    Image.new("CMYK", (16, 16), (0, 255, 255, 0)).save(with_caption(folder / "cmyk.jpg"))
    Image.new("RGB", (16, 16), "green").convert("P", palette=Image.Palette.ADAPTIVE).save(
        with_caption(folder / "palette.png"))
    rotated = Image.new("RGB", (24, 12), "blue")
    exif = rotated.getexif()
    exif[0x0112] = 6  # EXIF orientation: rotate 90 degrees on display
    rotated.save(with_caption(folder / "rotated.jpg"), exif=exif)
    raw = tmp_path / "raw"
    assert cli.main(["shards", "write", "--out", str(raw), "--image-folder", str(folder)]) == 0
    assert "wrote 4 documents (4 images)" in capsys.readouterr().out
    assert skipped_reasons(raw)["text"].startswith(f"{folder / 'text.png'}: not an image file PIL can read")
    documents = dict(iter_raw_shard(raw / "shard-000000.tar"))
    assert open_image(documents["rotated"][1][1]).size == (12, 24)  # stored upright
    assert open_image(documents["cmyk"][1][1]).getpixel((0, 0))[0] > 200  # red, not inverted
    with pytest.raises(ImageLoadError, match="not an image file"):
        open_image(folder / "text.png")
    assert _tokenize(raw, tmp_path / "tok", *video_bundle) == 0  # a video tokenizer encodes images as well
    assert "4 documents" in capsys.readouterr().out
