"""Training through Lightning: `train.py tokenizer fit` on the built-in photos writes logs, an image grid, a
checkpoint and a bundle; `export` turns the checkpoint into the same bundle; the GAN and perceptual path steps."""

import csv
import io
import tarfile
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file

from fusion_model import cli
from fusion_model.cli.tokenizer import main
from tokenizer.image import ImageTokenizer, ImageTokenizerConfig
from tokenizer.image.lightning import ImageDataModule, ImageTokenizerModule
from tokenizer.image.losses import _VGG16_CONVS
from tokenizer.image.train import fit_image_tokenizer

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "tokenizer"


def test_cli_fit_logs_metrics_and_grid_then_export_matches_the_bundle(tmp_path):
    root = tmp_path / "run"
    code = main(["fit", "--model.preset", "demo-64", "--data.image_size", "64", "--data.batch_size", "4",
                 "--data.val_samples", "4", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                 "--trainer.check_val_every_n_epoch", "null", "--trainer.enable_progress_bar", "false",
                 "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(root)])
    assert code == 0
    bundle = root / "tokenizer"  # <default_root_dir>/tokenizer, whatever the logger version
    tokenizer = ImageTokenizer.from_pretrained(bundle)
    assert tokenizer.config.image_size == 64 and tokenizer.grid_shape == (4, 4)
    rows = list(csv.DictReader((root / "csv" / "version_0" / "metrics.csv").open()))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"val/psnr", "val/usage", "val/perplexity", "val/recon"} <= logged
    assert list((root / "tb" / "version_0" / "images").glob("*.png"))
    checkpoint = next((root / "tb" / "version_0" / "checkpoints").glob("*.ckpt"))
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "exported")]) == 0
    assert ImageTokenizer.from_pretrained(tmp_path / "exported").fingerprint() == tokenizer.fingerprint()
    # --checkpoint resumes (through AtomicCheckpointIO, weights_only=True) and trains on to the new max_steps
    resumed = tmp_path / "resumed"
    assert main(["fit", "--model.preset", "demo-64", "--data.image_size", "64", "--data.batch_size", "4",
                 "--data.val_samples", "4", "--trainer.max_steps", "3", "--trainer.limit_val_batches", "0",
                 "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
                 "--trainer.default_root_dir", str(resumed), "--checkpoint", str(checkpoint)]) == 0
    assert int(torch.load(next((resumed / "tb").rglob("*.ckpt")), weights_only=True)["global_step"]) == 3


def test_export_refuses_a_missing_or_foreign_checkpoint(tmp_path, capsys):
    export = ["tokenizer", "export", "--out", str(tmp_path / "out"), "--checkpoint"]
    assert cli.main([*export, str(tmp_path / "none.ckpt")]) == 2
    assert "none.ckpt" in capsys.readouterr().err
    torch.save({"state_dict": {}, "hyper_parameters": {"config": {"d_model": 8}}}, tmp_path / "fusion.ckpt")
    assert cli.main([*export, str(tmp_path / "fusion.ckpt")]) == 2
    assert "not an image tokenizer checkpoint" in capsys.readouterr().err
    torch.save({"state_dict": {}, "callback": ImageTokenizerConfig()}, tmp_path / "pickled.ckpt")
    assert cli.main([*export, str(tmp_path / "pickled.ckpt")]) == 2  # never unpickled
    assert "weights_only=True" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_tokenizer_cli_writes_atomic_checkpoints_and_takes_the_shared_checkpoint_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "demo-64.yaml"), "--checkpoint", "some.ckpt", "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "fusion_model.training.checkpointing.AtomicCheckpointIO" in printed and "ckpt_path: some.ckpt" in printed
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    assert "--checkpoint X = --ckpt_path X" in " ".join(capsys.readouterr().out.split())


def test_image_folder_skips_and_counts_bad_files(tmp_path):
    for i in range(4):
        Image.fromarray(np.full((40, 36, 3), 40 * i, np.uint8)).save(tmp_path / f"{i}.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    data = ImageDataModule(source=str(tmp_path), image_size=32, batch_size=2, val_every=3)
    data.setup("fit")
    batches = list(data.train_dataloader()) + list(data.val_dataloader())
    assert all(b.shape[1:] == (3, 32, 32) for b in batches)
    assert list(data.skipped()) == [str(tmp_path / "broken.png")]
    strict = ImageDataModule(source=str(tmp_path), image_size=32, batch_size=2, skip_bad_images=False, val_every=100)
    strict.setup("fit")
    with pytest.raises(ValueError, match="broken.png"):
        list(strict.train_dataloader())


def test_gan_and_perceptual_losses_train_the_discriminator_after_its_start_step(tmp_path):
    state = {}
    for index, cin, cout in _VGG16_CONVS:
        state[f"features.{index}.weight"] = torch.randn(cout, cin, 3, 3) * (2 / (9 * cin)) ** 0.5
        state[f"features.{index}.bias"] = torch.zeros(cout)
    save_file(state, str(tmp_path / "vgg.safetensors"))
    module = ImageTokenizerModule(
        preset="demo-64", overrides={"base_channels": 8, "norm_groups": 8, "image_size": 32},
        perceptual_weight=0.1, perceptual_weights=str(tmp_path / "vgg.safetensors"),
        disc_weight=0.5, disc_start=1, disc_width=8, disc_layers=2,
    )
    before = [p.detach().clone() for p in module.discriminator.parameters()]
    images = torch.rand(8, 3, 32, 32) * 2 - 1
    loader = torch.utils.data.DataLoader(images, batch_size=4)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", limit_val_batches=0)
    trainer.fit(module, train_dataloaders=loader)
    assert int(module.steps_done) == 2
    assert {"train/perceptual", "train/g_loss", "train/d_loss", "train/disc_weight"} <= set(trainer.callback_metrics)
    assert any(not torch.equal(a, b) for a, b in zip(before, module.discriminator.parameters()))
    assert all(not k.startswith("_perceptual") for k in module.state_dict())  # frozen VGG stays out of checkpoints


def test_fit_image_tokenizer_from_a_tensor_returns_an_eval_tokenizer():
    images = torch.rand(8, 3, 64, 64) * 2 - 1
    tokenizer, info = fit_image_tokenizer(images, preset="demo-64", batch_size=4, max_steps=2, progress=False,
                                          val_images=images[:4])
    assert info["steps"] == 2 and "val_usage" in info and not tokenizer.training
    with pytest.raises(ValueError, match="64-px"):
        fit_image_tokenizer(torch.rand(4, 3, 32, 32), preset="demo-64", max_steps=1)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_tokenizer_config_names_a_preset_whose_size_matches_its_data(path):
    config = yaml.safe_load(path.read_text())
    model = config["model"]
    from tokenizer.video import VIDEO_PRESETS, VideoTokenizerConfig

    config_class = VideoTokenizerConfig if model["preset"] in VIDEO_PRESETS else ImageTokenizerConfig
    tokenizer_config = config_class.from_preset(model["preset"], **(model.get("overrides") or {}))
    assert tokenizer_config.image_size == config["data"]["image_size"]
    if config_class is VideoTokenizerConfig:  # the clips it trains on are as long as the clips it encodes
        assert tokenizer_config.clip_frames == config["data"]["clip_frames"]


def test_raw_shards_give_every_image_of_every_document_and_skip_bad_ones(tmp_path):
    import webdataset as wds

    def png(value: int) -> bytes:
        buffer = io.BytesIO()
        Image.fromarray(np.full((24, 40, 3), value, np.uint8)).save(buffer, "PNG")
        return buffer.getvalue()

    with wds.TarWriter(str(tmp_path / "shard-000000.tar")) as sink:
        sink.write({"__key__": "doc0", "json": b'{"segments": [{"image": 0}, {"image": 1}]}',
                    "0.png": png(10), "1.png": png(200)})
        sink.write({"__key__": "doc1", "json": b'{"segments": [{"image": 0}]}', "0.jpg": b"not a jpeg"})
    data = ImageDataModule(source=str(tmp_path / "shard-*.tar"), image_size=16, batch_size=2)
    data.setup("fit")
    (train,) = list(data.train_dataloader())
    (val,) = list(data.val_dataloader())
    assert train.shape == (2, 3, 16, 16)
    torch.testing.assert_close(val[:, 0, 0, 0], torch.tensor([10, 200]) / 127.5 - 1)  # center crops, in order
    assert any("doc1.0.jpg" in name for name in data.skipped())


def test_a_data_source_that_is_a_shell_command_or_url_is_refused_and_never_run(tmp_path, capsys, monkeypatch):
    marker = tmp_path / "marker"
    common = ["tokenizer", "fit", "--model.preset", "demo-64", "--data.image_size", "64", "--trainer.max_steps", "1",
              "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path / "run")]
    for source in (f"pipe:touch {marker}", f"pipe:touch {marker}; cat x.tar", "http://127.0.0.1:9/shard.tar"):
        assert cli.main([*common, "--data.source", source]) == 2
        err = capsys.readouterr().err
        assert "is a command or URL, not a path" in err and "never run" in err
    # a local file whose name looks like a command is opened as a file, never executed
    monkeypatch.chdir(tmp_path)  # where a command run by the shell would leave its marker
    (tmp_path / "shards").mkdir()
    tarfile.open(tmp_path / "shards" / f"pipe:touch {marker.name}.tar", "w").close()  # a valid, empty tar
    data = ImageDataModule(source=str(tmp_path / "shards" / "*.tar"), image_size=16, batch_size=2)
    data.setup("fit")
    assert data.train_set.urls[0].startswith("/")
    list(data.train_set)  # an empty tar: no images, and no command
    assert not marker.exists() and not list(tmp_path.glob("marker*"))


def test_a_checkpoint_url_is_refused_before_anything_is_fetched(tmp_path, capsys):
    code = cli.main(["tokenizer", "fit", "--model.preset", "demo-64", "--data.image_size", "64",
                     "--trainer.max_steps", "1", "--trainer.accelerator", "cpu", "--trainer.default_root_dir",
                     str(tmp_path / "run"), "--checkpoint", "http://127.0.0.1:9/evil.ckpt"])
    assert code == 2
    assert "is a URL" in capsys.readouterr().err


def test_fewer_training_images_than_one_batch_is_refused_instead_of_looping_forever(tmp_path, capsys):
    for i in range(4):
        Image.fromarray(np.full((32, 32, 3), 40 * i, np.uint8)).save(tmp_path / f"img{i}.png")
    code = cli.main(["tokenizer", "fit", "--model.preset", "demo-64", "--data.source", str(tmp_path),
                     "--data.image_size", "64", "--data.batch_size", "8", "--trainer.max_steps", "2",
                     "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert "number 3" in err and "data.batch_size is 8" in err and "--data.batch_size" in err


@pytest.mark.parametrize("source", ["tar", "folder of tars"])
def test_shards_with_fewer_images_than_one_batch_are_refused_like_a_folder(tmp_path, capsys, source):
    """A tar (or img2dataset's folder of tars) holding 1 image with batch 2: exit 2 and the folder's sentence, not a
    run that never takes a step."""
    import webdataset as wds

    buffer = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(buffer, "PNG")
    (tmp_path / "data").mkdir()
    with wds.TarWriter(str(tmp_path / "data" / "00000.tar")) as sink:
        sink.write({"__key__": "000000000", "jpg": buffer.getvalue(), "txt": b"a grey square"})
    where = str(tmp_path / "data" / "00000.tar") if source == "tar" else str(tmp_path / "data")
    code = cli.main(["tokenizer", "fit", "--model.preset", "demo-64", "--data.source", where,
                     "--data.image_size", "64", "--data.batch_size", "2", "--trainer.max_steps", "2",
                     "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert "number 1" in err and "data.batch_size is 2" in err and "--data.batch_size" in err


def test_a_folder_of_tars_trains_on_the_images_inside_them(tmp_path):
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "00000.tar")) as sink:
        for index in range(3):
            buffer = io.BytesIO()
            Image.fromarray(np.full((24, 24, 3), 60 * index, np.uint8)).save(buffer, "PNG")
            sink.write({"__key__": f"{index:09d}", "png": buffer.getvalue(), "txt": b"a square"})
    data = ImageDataModule(source=str(tmp_path), image_size=16, batch_size=3)
    data.setup("fit")
    (train,) = list(data.train_dataloader())
    assert train.shape == (3, 3, 16, 16)


def test_tokenizer_help_is_instant_and_names_presets_and_options(capsys):
    assert cli.main(["tokenizer", "--help"]) == 0
    out = capsys.readouterr().out
    for expected in ("demo-64", "photos-64", "--data.source", "--threads", "--trainer.max_time", "<default_root_dir>/tokenizer"):
        assert expected in out
    assert cli.main(["tokenizer", "train"]) == 2
    assert "unknown tokenizer command 'train'" in capsys.readouterr().err
