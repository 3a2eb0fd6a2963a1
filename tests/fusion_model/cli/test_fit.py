"""`train.py fit`: --print_config, start-up validation errors, non-finite loss handling, per-step logging."""

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fusion_model import cli
from fusion_model.cli.fit import main
from fusion_model.config import FusionConfig
from fusion_model.training.lightning_module import FusionLightningModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import fit_worker as fw  # noqa: E402

TINY_YAML = str(fw.REPO / "configs/fusion/tiny.yaml")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return fw.make_token_dir(tmp_path_factory.mktemp("tokens") / "train")


def _printed_config(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_print_config_shows_presets_and_command_line_overrides(capsys, tmp_path):
    printed = _printed_config(["--config", TINY_YAML, "--model.lr=0.125", "--data.seq_len=48",
                               "--model.config.vocab_size=512", "--model.config.dropout=0.25"], capsys)
    assert "lr: 0.125" in printed and "seq_len: 48" in printed
    assert "lr_schedule: exponential" in printed and "gradient_clip_val: 1.0" in printed
    assert "fusion_model.training.checkpointing.AtomicCheckpointIO" in printed
    # the decoder as the user wrote it: the preset's name plus the fields changed, each settable on its own
    assert yaml.safe_load(printed)["model"]["config"] == {"preset": "tiny", "vocab_size": 512, "dropout": 0.25}
    rerun = tmp_path / "printed.yaml"
    rerun.write_text(printed)
    assert _printed_config(["--config", str(rerun)], capsys) == printed  # what it prints runs again as is


def test_a_config_field_of_the_wrong_type_or_name_is_refused_when_parsed(capsys):
    for bad in ("--model.config.vocab_size=many", "--model.config.preset=huge", "--model.config.bogus=1"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--config", TINY_YAML, bad, "--print_config"])
        assert exit_info.value.code != 0, bad
        assert bad.split("=")[0].removeprefix("--model.config.") in capsys.readouterr().err, bad


def test_shared_flags_stand_for_the_lightning_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", TINY_YAML, "--checkpoint", "runs/x/last.ckpt", "--vocab=runs/vocab/tokenizer.json",
              "--image-tokenizer", "runs/tok", "--print_config"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "ckpt_path: runs/x/last.ckpt" in printed
    assert "vocab: runs/vocab/tokenizer.json" in printed and "image_tokenizer: runs/tok" in printed


@pytest.mark.parametrize("preset", ["chameleon-7b", "chameleon-34b", "small"])
def test_presets_parse_and_carry_the_papers_recipe(preset, capsys):
    printed = _printed_config(["--config", str(fw.REPO / f"configs/fusion/{preset}.yaml")], capsys)
    assert "weight_decay: 0.1" in printed and "eps: 1.0e-05" in printed
    decoder = FusionConfig.from_dict(yaml.safe_load(printed)["model"]["config"])
    assert decoder.z_loss_coef == 1e-5
    if preset.startswith("chameleon"):
        assert "seq_len: 4096" in printed and "warmup_steps: 4000" in printed and decoder.vocab_size == 65536
        assert "fusion_model.training.checkpointing.AtomicModelParallelStrategy" in printed  # sharded saves renamed into place


ARCHITECTURE = ("dim", "n_layers", "n_heads", "kv_heads", "hidden_dim", "vocab_size", "max_seq_len", "norm_placement",
                "qk_norm", "z_loss_coef", "rope_theta", "norm_eps")


@pytest.mark.parametrize("path", sorted((fw.REPO / "configs/fusion").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_fusion_config_is_its_python_preset_plus_recipe_overrides_only(path, capsys):
    written = yaml.safe_load(_printed_config(["--config", str(path)], capsys))["model"]["config"]
    assert written["preset"] == path.stem  # configs/fusion/<name>.yaml trains the decoder PRESETS[<name>]
    decoder, preset = FusionConfig.from_dict(written), FusionConfig.from_preset(path.stem)
    assert {k: getattr(decoder, k) for k in ARCHITECTURE} == {k: getattr(preset, k) for k in ARCHITECTURE}
    assert decoder.num_parameters() == preset.num_parameters()
    overrides = {k: v for k, v in written.items() if k != "preset"}
    assert not set(overrides) & {*ARCHITECTURE, "n_kv_heads", "ffn_dim"}, "the architecture is the preset's alone"
    restated = {k for k, v in overrides.items() if getattr(preset, k) == v}
    assert not restated, f"{path.name} restates the preset's {sorted(restated)}"
    if path.stem == "chameleon-7b":
        assert decoder.num_parameters() == 7_013_666_816  # transformers' ChameleonModel, language model only


def _fit_error(args, capsys) -> str:
    assert cli.main(["fit", *args]) == 2  # bad input: one line naming what to change, exit code 2
    return capsys.readouterr().err


def test_no_shards_found_names_the_directory(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _fit_error(fw.tiny_args(empty, tmp_path, 2), capsys)
    assert "no token shards found" in err and str(empty) in err and "shards tokenize" in err


def test_model_vocab_size_must_match_the_shards(tokens, tmp_path, capsys):
    err = _fit_error(fw.tiny_args(tokens, tmp_path, 2, extra=["--model.config.vocab_size=512"]), capsys)
    assert "256-entry vocabulary" in err and "--model.config.vocab_size 256" in err


def test_seq_len_beyond_max_positions(tokens, tmp_path, capsys):
    err = _fit_error(fw.tiny_args(tokens, tmp_path, 2, extra=["--data.seq_len=128"]), capsys)
    assert "data.seq_len=128 exceeds" in err and "max_seq_len=64" in err


def test_shards_from_another_vocabulary_or_image_tokenizer(tmp_path, capsys):
    from tokenizer.image import ImageTokenizer, ImageTokenizerConfig
    from tokenizer.vocab import train_unified_vocab

    vocab = train_unified_vocab(["a gray square number", "and some words"] * 50, vocab_size=512, image_codes=64)
    vocab_path = tmp_path / "tokenizer.json"
    vocab.save(vocab_path)
    image_dir = tmp_path / "image_tokenizer"
    image_tokenizer = ImageTokenizer(ImageTokenizerConfig.from_preset("demo-64"))
    image_tokenizer.save_pretrained(image_dir)
    other = fw.make_token_dir(tmp_path / "other", vocab_size=512)  # fingerprints of some other tokenizers
    same_vocab = fw.make_token_dir(tmp_path / "same", vocab_size=512, vocab_fingerprint=vocab.fingerprint())
    from fusion_model.cli.fit import fit_from_config

    # no image block given: fit takes the vocabulary's (older manifests, like these, do not record it)
    built = fit_from_config(None, fw.tiny_args(same_vocab, tmp_path, 2, extra=[
        "--model.config.vocab_size=512", f"--data.vocab={vocab_path}"]), run=False)
    assert (built.model.model_config.image_offset, built.model.model_config.image_codes) == (vocab.image_offset, 64)
    model = ["--model.config.vocab_size=512", f"--model.config.image_offset={vocab.image_offset}", "--model.config.image_codes=64"]
    err = _fit_error(fw.tiny_args(other, tmp_path, 2, extra=[*model, f"--data.vocab={vocab_path}"]), capsys)
    assert "another vocabulary" in err and vocab.fingerprint() in err and "vocab-test" in err
    err = _fit_error(fw.tiny_args(same_vocab, tmp_path, 2, extra=[*model, f"--data.vocab={vocab_path}",
                                                                    f"--data.image_tokenizer={image_dir}"]), capsys)
    assert "another image tokenizer" in err and image_tokenizer.fingerprint() in err and "image-test" in err
    err = _fit_error(fw.tiny_args(same_vocab, tmp_path, 2, extra=[f"--data.vocab={vocab_path}"]), capsys)
    assert "512-entry vocabulary" in err  # the model still has the preset's 256 entries


def _nan_at_step(monkeypatch, step: int) -> None:
    original = FusionLightningModule.objective

    def objective(self, batch):
        out = original(self, batch)
        if self.training and self.global_step == step:
            out.terms["loss"].total = out.terms["loss"].total * float("nan")
        return out

    monkeypatch.setattr(FusionLightningModule, "objective", objective)


def test_nonfinite_loss_stops_naming_step_and_batch_and_keeps_the_last_good_checkpoint(tokens, tmp_path, capsys, monkeypatch):
    _nan_at_step(monkeypatch, 3)
    assert main(fw.tiny_args(tokens, tmp_path, 6)) == 1
    err = capsys.readouterr().err
    assert "non-finite loss nan" in err and "optimizer step 3, batch 3 of epoch 0" in err
    assert str(tmp_path / "ckpt" / "last.ckpt") in err
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt"))[-2:] == ["epoch=0-step=3.ckpt", "last.ckpt"]
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())


def test_nonfinite_gradient_norm_stops_too(tokens, tmp_path, capsys, monkeypatch):
    clip = torch.nn.utils.clip_grad_norm_
    calls = []

    def clip_with_inf_at_step_2(params, max_norm, *args, **kwargs):
        calls.append(1)
        norm = clip(params, max_norm, *args, **kwargs)
        return norm * float("inf") if len(calls) == 3 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_with_inf_at_step_2)
    assert main(fw.tiny_args(tokens, tmp_path, 5)) == 1
    err = capsys.readouterr().err
    assert "non-finite gradient norm inf at optimizer step 2, batch 2 of epoch 0" in err
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 2


def test_nonfinite_loss_skip_policy_drops_the_update_and_counts_it(tokens, tmp_path, monkeypatch):
    _nan_at_step(monkeypatch, 3)
    assert main(fw.tiny_args(tokens, tmp_path, 5, extra=["--model.nonfinite=skip"])) == 0
    before, after, end = (torch.load(tmp_path / "ckpt" / f"epoch=0-step={s}.ckpt", weights_only=True) for s in (3, 4, 5))
    for name, value in before["state_dict"].items():
        assert torch.equal(value, after["state_dict"][name]), name  # the skipped step changed nothing
    assert not torch.equal(after["state_dict"]["model.head.weight"], end["state_dict"]["model.head.weight"])
    assert (before["skipped_steps"], after["skipped_steps"], end["skipped_steps"]) == (0, 1, 1)


def test_every_step_logs_losses_lr_grad_norm_throughput_and_validation(tokens, tmp_path):
    val = fw.make_token_dir(tmp_path / "val", n_docs=8, seed=1)
    logger = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path), "name": "csv"}},
              {"class_path": "lightning.pytorch.loggers.TensorBoardLogger", "init_args": {"save_dir": str(tmp_path), "name": "tb"}}]
    callbacks = [{"class_path": "fusion_model.training.callbacks.ThroughputMonitor", "init_args": {"peak_flops": 1e12}}]
    args = fw.tiny_args(tokens, tmp_path, 4, extra=[
        f"--data.val_dir={val}", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=2",
        f"--trainer.logger={json.dumps(logger)}", f"--trainer.callbacks={json.dumps(callbacks)}",
        "--trainer.enable_checkpointing=false",
    ])
    assert main(args) == 0
    rows = list(csv.DictReader(open(next((tmp_path / "csv").rglob("metrics.csv")))))
    train = [r for r in rows if r.get("train/loss")]
    assert [int(r["step"]) for r in train] == [0, 1, 2, 3]
    for key in ("train/loss", "train/text_loss", "train/image_loss", "train/z_loss", "train/lr", "train/grad_norm",
                "train/tokens_per_s", "train/mfu"):
        values = [float(r[key]) for r in rows if r.get(key)]
        assert len(values) == 4 and all(v == v for v in values), key
    assert [float(r["train/lr"]) for r in rows if r.get("train/lr")][:2] == pytest.approx([5e-3, 1e-2])
    assert 0 < min(float(r["train/mfu"]) for r in rows if r.get("train/mfu"))
    assert len([r for r in rows if r.get("val/loss")]) == 2
    assert list((tmp_path / "tb").rglob("events.out.tfevents.*"))


def test_sample_writer_writes_samples_at_its_interval(tmp_path):
    from tokenizer.vocab import train_unified_vocab

    vocab = train_unified_vocab(["a gray square number", "and some words"] * 50, vocab_size=512, image_codes=64)
    vocab.save(tmp_path / "tokenizer.json")
    tokens = fw.make_token_dir(tmp_path / "tokens", vocab_size=512, vocab_fingerprint=vocab.fingerprint())
    writer = {"class_path": "fusion_model.training.callbacks.SampleWriter",
              "init_args": {"tokenizer": str(tmp_path / "tokenizer.json"), "prompts": ["a gray", ""], "every_n_steps": 2,
                            "max_new_tokens": 6}}
    args = fw.tiny_args(tokens, tmp_path, 3, extra=["--model.config.vocab_size=512", f"--model.config.image_offset={vocab.image_offset}",
                                                    "--model.config.image_codes=64", f"--data.vocab={tmp_path / 'tokenizer.json'}",
                                                    f"--trainer.callbacks={json.dumps([writer])}", "--trainer.enable_checkpointing=false"])
    assert main(args) == 0
    written = sorted(p.parent.name for p in tmp_path.rglob("samples/*/samples.json"))
    assert written == ["step00000002"]
    samples = json.loads(next(tmp_path.rglob("samples.json")).read_text())["samples"]
    assert len(samples) == 2 and all(1 <= len(s["ids"]) <= 6 for s in samples)


def test_the_shards_image_block_is_checked_without_a_vocabulary(tmp_path, capsys):
    shards = fw.make_token_dir(tmp_path / "tokens")
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest.update(image_offset=8, image_codes=64, bos_id=1, eos_id=2)  # as `shards tokenize` records the layout
    (shards / "manifest.json").write_text(json.dumps(manifest))
    err = _fit_error(fw.tiny_args(shards, tmp_path, 2, extra=["--model.config.image_offset=8",
                                                              "--model.config.image_codes=32"]), capsys)
    assert "model.config.image_codes=32" in err and "image_codes 64" in err and str(shards) in err
    assert "set --model.config.image_offset 8 --model.config.image_codes 64" in err
    from fusion_model.cli.fit import fit_from_config

    # the preset has no image block at all: fit takes the shards' (tiny_args gives vocab_size, not the block)
    built = fit_from_config(None, fw.tiny_args(shards, tmp_path, 2), run=False).model.model_config
    assert (built.image_offset, built.image_codes) == (8, 64)
    assert main(fw.tiny_args(shards, tmp_path, 1, extra=["--model.config.image_offset=8",
                                                         "--model.config.image_codes=64"])) == 0
