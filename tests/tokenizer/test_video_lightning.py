"""Training the video tokenizer: `train.py tokenizer fit --config configs/tokenizer/video-demo-32.yaml --data.source
DIR` on .npy clips of moving squares made here logs per-frame PSNR and codebook usage and writes a bundle that the
shared loader opens as kind "video"; `export` turns its checkpoint into the same bundle; bad clips are skipped."""

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from fusion_model.cli.tokenizer import is_video_run, main
from tokenizer.bundle import load_media_tokenizer
from tokenizer.video.lightning import ClipFiles, VideoDataModule, fit_video_tokenizer

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tokenizer"


def moving_squares(n: int, frames: int = 8, size: int = 32, seed: int = 0) -> np.ndarray:
    """uint8 (n, frames, size, size, 3): a coloured square moving in one of 4 directions on a dark background."""
    rng = np.random.default_rng(seed)
    clips = np.zeros((n, frames, size, size, 3), np.uint8)
    for i in range(n):
        dy, dx = [(0, 1), (0, -1), (1, 0), (-1, 0)][i % 4]
        side, y, x = 8, *rng.integers(8, size - 16, 2)
        clips[i] = rng.integers(0, 60, 3)
        for t in range(frames):
            clips[i, t, y + dy * t : y + dy * t + side, x + dx * t : x + dx * t + side] = rng.integers(150, 256, 3)
    return clips


def write_clips(folder: Path, n: int, **kwargs) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, clip in enumerate(moving_squares(n, **kwargs)):
        np.save(folder / f"clip{i:03d}.npy", clip)
    return folder


def test_cli_fit_on_clips_logs_frame_psnr_and_usage_and_writes_a_video_bundle(tmp_path):
    clips = write_clips(tmp_path / "clips", 12, frames=10)
    root = tmp_path / "run"
    assert main(["fit", "--config", str(CONFIGS / "video-demo-32.yaml"), "--data.source", str(clips),
                 "--data.batch_size", "2", "--data.val_every", "4", "--data.train_samples", "0",
                 "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.log_every_n_steps", "1",
                 "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
                 "--trainer.default_root_dir", str(root)]) == 0
    tokenizer = load_media_tokenizer(root / "tokenizer")
    assert tokenizer.kind == "video" and tokenizer.video_grid == (2, 8, 8) and tokenizer.grid_shape == (8, 8)
    assert tokenizer.config.name == "video-demo-32"
    assert tokenizer.encode_clips(moving_squares(1)).shape == (1, 2, 8, 8)
    rows = list(csv.DictReader((root / "csv" / "version_0" / "metrics.csv").open()))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"train/psnr", "train/usage", "val/psnr", "val/psnr_frame0", "val/psnr_frame7", "val/psnr_repeat_first",
            "val/usage", "val/perplexity", "val/codes_used"} <= logged
    assert list((root / "tb" / "version_0" / "images").glob("*.png"))
    checkpoint = next(root.rglob("*.ckpt"))
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "exported")]) == 0
    assert load_media_tokenizer(tmp_path / "exported").fingerprint() == tokenizer.fingerprint()


def test_video_runs_are_recognised_by_their_preset(tmp_path):
    assert is_video_run(["--config", str(CONFIGS / "video-demo-32.yaml")])
    assert is_video_run(["--model.preset=video-demo-32"])
    assert not is_video_run(["--config", str(CONFIGS / "demo-64.yaml")])
    assert not is_video_run(["--config", str(CONFIGS / "video-demo-32.yaml"), "--model.preset", "demo-64"])
    assert not is_video_run([])


def test_clip_folder_split_windows_and_bad_clips(tmp_path):
    folder = write_clips(tmp_path / "clips", 6, frames=12)
    np.save(folder / "short.npy", moving_squares(1, frames=4)[0])  # fewer frames than a training clip
    (folder / "broken.npy").write_bytes(b"\x93NUMPY broken")
    data = VideoDataModule(source=str(folder), image_size=32, clip_frames=8, batch_size=2, val_every=4)
    data.setup()
    assert len(data.val_set) == 2 and len(data.train_set) == 6  # every 4th of the 8 sorted files is held out
    batch = next(iter(data.train_dataloader()))
    assert batch.shape == (2, 8, 3, 32, 32) and batch.min() >= -1 and batch.max() <= 1
    for i in range(len(data.train_set)):
        data.train_set[i]
    for i in range(len(data.val_set)):
        data.val_set[i]
    assert {Path(name).name for name in data.skipped()} == {"broken.npy", "short.npy"}
    strict = ClipFiles([folder / "short.npy"], 32, 8, train=False, skip_bad=False)
    with pytest.raises(ValueError, match="fewer than the 8"):
        strict[0]
    with pytest.raises(ValueError, match="--data.source is required"):
        VideoDataModule().setup()


def test_fit_video_tokenizer_on_tensors_reports_held_out_psnr():
    clips = torch.from_numpy(moving_squares(6)).permute(0, 1, 4, 2, 3).float() / 127.5 - 1
    tokenizer, summary = fit_video_tokenizer(clips[:4], batch_size=2, max_steps=2, val_clips=clips[4:])
    assert summary["steps"] == 2 and not tokenizer.training
    assert {"psnr", "psnr_repeat_first", "usage", "perplexity"} <= set(summary)
    assert np.isfinite(summary["psnr"]) and 0 < summary["usage"] <= 1


def test_video_configs_name_a_video_preset_and_match_its_data_fields():
    import yaml

    from tokenizer.video import VIDEO_PRESETS, VideoTokenizerConfig

    paths = sorted(CONFIGS.glob("video-*.yaml"))
    assert paths
    for path in paths:
        config = yaml.safe_load(path.read_text())
        assert config["model"]["preset"] in VIDEO_PRESETS, path.name
        tokenizer = VideoTokenizerConfig.from_preset(config["model"]["preset"],
                                                     **(config["model"].get("overrides") or {}))
        assert config["data"]["image_size"] == tokenizer.image_size, path.name
        assert config["data"]["clip_frames"] == tokenizer.clip_frames, path.name
