"""`python train.py generate`: every option documented, a checkpoint + tokenizers in, PNG/JSON/HTML out."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fusion_model import cli
from fusion_model.checkpoint import save_model
from fusion_model.cli.generate import add_sampling_options, describe_samples, main, parser, sampling_config
from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel
from fusion_model.sampling import SamplingConfig
from tokenizer.vocab import train_unified_vocab

CORPUS = ["the cat sat on the mat", "a dog ran far away", "one two three four five six seven"] * 10


@pytest.fixture(scope="module")
def files(tiny_tokenizers):
    """The shared tiny vocabulary and image tokenizer (2x2 codes of 16; tests/fusion_model/conftest.py), and a
    decoder checkpoint beside them."""
    from tokenizer.vocab import UnifiedVocab

    vocab = UnifiedVocab.load(tiny_tokenizers / "tokenizer.json")
    torch.manual_seed(0)
    config = FusionConfig.from_preset("tiny", vocab_size=320, image_offset=vocab.image_offset, image_codes=16, max_seq_len=48)
    save_model(FusionModel(config), tiny_tokenizers / "model.ckpt")
    return tiny_tokenizers


def test_help_explains_every_option():
    for action in parser()._actions:
        assert action.help, f"option {action.option_strings} has no help"


def test_sampling_options_are_the_fields_of_sampling_config_with_their_types():
    actions = {a.dest: a for a in parser()._actions}
    hints = typing.get_type_hints(SamplingConfig)
    for field in dataclasses.fields(SamplingConfig):
        if field.name in ("image_grid", "video_grid"):  # taken from the image (or video) tokenizer
            assert field.name not in actions
            continue
        action = actions[field.name]
        if hints[field.name] is bool:
            assert action.const is (not field.default)
        else:
            assert action.type in typing.get_args(hints[field.name]) + (hints[field.name],), field.name
    assert actions["text_temperature"].option_strings == ["--text-temperature"]
    assert actions["stop_at_eos"].option_strings == ["--no-eos-stop"]


def test_a_new_sampling_field_gets_an_option_without_a_new_argparse_line():
    @dataclasses.dataclass
    class Extended(SamplingConfig):
        min_p: float = 0.0
        greedy_images: bool = False

    p = argparse.ArgumentParser()
    assert {"min_p", "greedy_images"} <= set(add_sampling_options(p, Extended))
    args = p.parse_args(["--min-p", "0.25", "--greedy-images"])
    assert (args.min_p, args.greedy_images, args.text_top_k) == (0.25, True, None)


def test_explicit_options_override_chameleon_defaults():
    def config(*extra):
        return sampling_config(parser().parse_args(["--checkpoint", "x.ckpt", *extra]))

    assert config() == SamplingConfig(seed=0)
    chameleon = config("--chameleon-defaults", "--text-temperature", "0.5", "--no-kv-cache")
    assert chameleon == SamplingConfig.chameleon(text_temperature=0.5, seed=0, use_kv_cache=False)
    two_stream = config("--chameleon-defaults", "--cfg-scale", "2")
    assert (two_stream.cfg_scale, two_stream.three_stream, two_stream.image_top_p) == (2.0, False, 0.9)


def test_generate_writes_images_json_and_html_from_a_checkpoint(files, tmp_path, capsys):
    out = tmp_path / "samples"
    argv = ["--checkpoint", str(files / "model.ckpt"), "--vocab", str(files / "tokenizer.json"),
            "--image-tokenizer", str(files / "vq"), "--prompt", "the cat", "--image", str(files / "photo.png"),
            "--prompt", "sat", "--mode", "image", "--num-samples", "3", "--batch-size", "2", "--cfg-scale", "2",
            "--image-top-k", "5", "--out", str(out)]
    assert main(argv) == 0
    body = json.loads((out / "samples.json").read_text())
    assert len(body["samples"]) == 3 and body["settings"]["cfg_scale"] == 2.0
    for sample in body["samples"]:
        assert [s.get("text") for s in sample["prompt"]] == ["the cat", None, "sat"]
        assert len(sample["ids"]) == 2 * 2 + 2  # <boi>, h·w codes, <eoi>
        (image,) = sample["output"]
        with Image.open(out / image["image"]) as png:
            assert png.size == (8, 8)
    assert "index.html" in capsys.readouterr().out
    # the same seed writes the same ids again
    assert main(argv + ["--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "samples.json").read_text())
    assert [s["ids"] for s in again["samples"]] == [s["ids"] for s in body["samples"]]


def test_text_mode_needs_no_image_tokenizer_and_reads_a_prompts_file(files, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "the dog"}\n\n{"segments": [{"text": "one two"}]}\n')
    out = tmp_path / "text"
    argv = ["--checkpoint", str(files / "model.ckpt"), "--vocab", str(files / "tokenizer.json"),
            "--prompts-file", str(prompts), "--mode", "text", "--max-new-tokens", "7", "--chameleon-defaults",
            "--out", str(out)]
    assert main(argv) == 0
    body = json.loads((out / "samples.json").read_text())
    assert [len(s["ids"]) <= 7 for s in body["samples"]] == [True, True]
    assert body["settings"]["repetition_penalty"] == 1.2


def test_bad_input_is_reported_with_what_to_do(files, tmp_path, capsys):
    common = ["--checkpoint", str(files / "model.ckpt"), "--out", str(tmp_path / "x")]
    other = train_unified_vocab(CORPUS, vocab_size=384, image_codes=16, num_specials=16)
    other.save(tmp_path / "other.json")
    common = ["generate", *common]
    assert cli.main(common + ["--vocab", str(tmp_path / "other.json"), "--mode", "text"]) == 2
    assert "vocab_size 320 but the vocabulary has 384" in capsys.readouterr().err
    assert cli.main(common + ["--vocab", str(files / "tokenizer.json"), "--image-tokenizer", str(files / "vq"),
                              "--image", str(tmp_path / "missing.png")]) == 2
    assert "missing.png" in capsys.readouterr().err
    assert cli.main(common + ["--mode", "text"]) == 2
    assert "--vocab is required" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": 1}\n')
    assert cli.main(common + ["--vocab", str(files / "tokenizer.json"), "--prompts-file", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    assert cli.main(common + ["--text-top-p", "1.5"]) == 2  # SamplingConfig's own check, before any loading
    assert "text_top_p=1.5 must be in (0, 1]" in capsys.readouterr().err


def test_a_transformers_export_loads_with_its_bundled_tokenizer_and_samples_the_same(files, tmp_path):
    from fusion_model.cli.convert import export_transformers

    export_transformers(str(files / "model.ckpt"), str(tmp_path / "hf"), vocab=str(files / "tokenizer.json"))
    common = ["--prompt", "the cat", "--mode", "text", "--max-new-tokens", "6", "--text-temperature", "0"]
    assert main(["--checkpoint", str(tmp_path / "hf"), "--out", str(tmp_path / "a")] + common) == 0
    assert main(["--checkpoint", str(files / "model.ckpt"), "--vocab", str(files / "tokenizer.json"),
                 "--out", str(tmp_path / "b")] + common) == 0
    ids = [json.loads((tmp_path / d / "samples.json").read_text())["samples"][0]["ids"] for d in ("a", "b")]
    assert ids[0] == ids[1] and len(ids[0]) > 0


def test_generate_prints_each_prompt_its_text_and_the_images_it_wrote(files, tmp_path, capsys):
    common = ["--checkpoint", str(files / "model.ckpt"), "--vocab", str(files / "tokenizer.json"),
              "--image-tokenizer", str(files / "vq"), "--prompt", "the cat"]
    out = tmp_path / "text"
    assert main(common + ["--mode", "text", "--max-new-tokens", "6", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    (sample,) = json.loads((out / "samples.json").read_text())["samples"]
    (generated,) = [entry["text"] for entry in sample["output"]]
    escaped = "".join(ch if ch.isprintable() or ch in "\n\t" else ascii(ch)[1:-1] for ch in generated)
    assert generated.strip() and f"[1/1] prompt: the cat\n      output: {escaped}\n" in printed
    assert all(ch.isprintable() or ch in "\n\t" for ch in printed)  # no \r or escape sequence reaches a log
    out = tmp_path / "images"
    assert main(common + ["--image", str(files / "photo.png"), "--mode", "image", "--num-samples", "2",
                          "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    shown = [line.split("<image: ")[1].rstrip(">") for line in printed.splitlines() if "output: <image: " in line]
    assert len(shown) == 2 and all(Path(path).is_file() for path in shown)
    assert {Path(path).parent for path in shown} == {out}
    assert f"prompt: the cat<image: {files / 'photo.png'}>" in printed
    assert f"2 samples, 2 generated image files in {out}" in printed


def test_long_texts_are_cut_in_the_summary_but_every_image_is_listed(tmp_path):
    body = {"samples": [{"index": 0, "output": [{"text": "a" * 30}, {"image": "sample_000_image_0.png"},
                                                 {"text": "b" * 30}]}]}
    (tmp_path / "samples.json").write_text(json.dumps(body))
    summary = describe_samples(tmp_path / "samples.json", max_chars=40)
    assert f"output: {'a' * 30}<image: {tmp_path / 'sample_000_image_0.png'}>{'b' * 10}… [20 more characters" in summary


def test_compile_is_an_option_and_combines_with_speculative_decoding_but_not_without_a_cache(files, tmp_path, capsys):
    config = sampling_config(parser().parse_args(["--checkpoint", "x.ckpt", "--compile", "--speculative-window", "4"]))
    assert config.compile is True and config.speculative_window == 4
    argv = ["generate", "--checkpoint", str(files / "model.ckpt"), "--vocab", str(files / "tokenizer.json"),
            "--image-tokenizer", str(files / "vq"), "--prompt", "the cat", "--mode", "image", "--compile",
            "--no-kv-cache", "--out", str(tmp_path / "x")]
    assert cli.main(argv) == 2
    assert "needs the KV cache" in capsys.readouterr().err


# the option of every float field (`float` or `float | None`): each must refuse a non-finite value
FLOAT_OPTIONS = [f"--{name.replace('_', '-')}" for name, hint in typing.get_type_hints(SamplingConfig).items()
                 if float in (hint, *typing.get_args(hint))]


@pytest.mark.parametrize("flag", FLOAT_OPTIONS)
def test_every_sampling_number_option_refuses_nan_naming_itself(flag):
    args = parser().parse_args(["--checkpoint", "x.ckpt", flag, "nan"])
    with pytest.raises(ValueError, match=f"=nan must be a finite number \\({flag}\\)"):
        sampling_config(args)


@pytest.mark.parametrize("flag, value", [("--cfg-scale", "nan"), ("--cfg-scale", "inf"),
                                         ("--image-temperature", "nan"), ("--repetition-penalty", "-inf")])
def test_a_non_finite_sampling_number_exits_2_with_one_line_before_the_model_loads(files, tmp_path, capsys,
                                                                                    monkeypatch, flag, value):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the sampling settings were checked")

    monkeypatch.setattr("fusion_model.cli.generate.load_family", no_loading)
    argv = ["generate", "--checkpoint", str(files / "model.ckpt"), "--vocab", str(files / "tokenizer.json"),
            "--image-tokenizer", str(files / "vq"), "--prompt", "the cat", "--mode", "image", f"{flag}={value}",
            "--out", str(tmp_path / "x")]  # (`--flag=-inf`: argparse reads a bare -inf as an option)
    assert cli.main(argv) == 2
    field = flag.removeprefix("--").replace("-", "_")
    assert capsys.readouterr().err == (
        f"train.py generate: SamplingConfig.{field}={float(value)!r} must be a finite number ({flag})\n")
    assert not (tmp_path / "x").exists()


def test_train_py_generate_with_cfg_scale_nan_exits_2_with_one_line(files, tmp_path):
    repo = Path(__file__).resolve().parents[3]
    argv = [sys.executable, str(repo / "train.py"), "generate", "--checkpoint", str(files / "model.ckpt"),
            "--vocab", str(files / "tokenizer.json"), "--image-tokenizer", str(files / "vq"), "--prompt", "the cat",
            "--mode", "image", "--cfg-scale", "nan", "--out", str(tmp_path / "x")]
    done = subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr == "train.py generate: SamplingConfig.cfg_scale=nan must be a finite number (--cfg-scale)\n"
    assert done.stdout == "" and not (tmp_path / "x").exists()


def test_a_continuous_image_tokenizer_is_refused_for_a_checkpoint_of_image_codes(files, tmp_path, capsys,
                                                                                 tiny_vq_config):
    import dataclasses

    from tokenizer.image import build_image_tokenizer

    continuous = build_image_tokenizer(dataclasses.replace(tiny_vq_config, bottleneck="kl"))
    assert continuous.kind == "continuous"
    continuous.save_pretrained(tmp_path / "kl")
    assert cli.main(["generate", "--checkpoint", str(files / "model.ckpt"), "--out", str(tmp_path / "x"),
                     "--vocab", str(files / "tokenizer.json"), "--image-tokenizer", str(tmp_path / "kl"),
                     "--mode", "image", "--prompt", "a cat"]) == 2
    err = capsys.readouterr().err
    assert "continuous" in err or "another image tokenizer" in err, err  # the kind, or the shards' fingerprint
    assert len(err.strip().splitlines()) == 1, err

    from fusion_model.sampling import SamplingConfig
    from fusion_model.sampling.generate import generate
    from tokenizer.vocab import UnifiedVocab

    with pytest.raises(ValueError, match="continuous one .* pass the VQ image tokenizer bundle"):
        # the model is never reached: the kind is checked first
        generate(None, UnifiedVocab.load(files / "tokenizer.json"), continuous, [["a cat"]], SamplingConfig())


def test_denoising_steps_are_refused_for_a_checkpoint_that_samples_codes(files, tmp_path, capsys):
    assert cli.main(["generate", "--checkpoint", str(files / "model.ckpt"), "--out", str(tmp_path / "x"),
                     "--vocab", str(files / "tokenizer.json"), "--mode", "text", "--denoising-steps", "20"]) == 2
    assert "--denoising-steps applies to a checkpoint whose images come from a diffusion model" in \
        capsys.readouterr().err


def _moving_square(frames: int = 8, size: int = 16) -> np.ndarray:
    clip = np.zeros((frames, size, size, 3), np.uint8)
    for t in range(frames):
        clip[t, 4:9, t:t + 5] = (230, 40, 40)
    return clip


def test_clips_are_written_as_gif_mp4_and_a_frame_strip_and_listed(tmp_path):
    from fusion_model.sampling.generate import Clip
    from fusion_model.sampling.output import _has_pyav, write_samples

    frames = _moving_square()
    samples = [["a red square", Clip(frames, torch.zeros(2, 4, 4, dtype=torch.long))]]
    paths = write_samples(tmp_path, samples, prompts=[["a red square moving right"]], ids=[[1, 2, 3]])
    (text, clip) = json.loads(paths["json"].read_text())["samples"][0]["output"]
    assert text == {"text": "a red square"}
    assert clip["frames"] == 8 and clip["size"] == [16, 16]
    with Image.open(tmp_path / clip["clip"]) as gif:
        assert gif.format == "GIF" and gif.n_frames == 8 and gif.size == (16, 16)
        gif.seek(7)
        assert np.array_equal(np.asarray(gif.convert("RGB")), frames[7])
    with Image.open(tmp_path / clip["strip"]) as strip:  # 8 frames side by side, 2-px gaps
        assert strip.size == (8 * 16 + 7 * 2, 16)
    if _has_pyav():
        from tokenizer.video.clips import read_clip

        decoded = read_clip(tmp_path / clip["mp4"])
        assert decoded.shape == frames.shape
    page = paths["html"].read_text()
    assert page.count("data:image/gif;base64,") == 1 and 'class="strip"' in page
    summary = describe_samples(paths["json"])
    assert f"<clip: {tmp_path / clip['clip']}" in summary and str(tmp_path / clip["strip"]) in summary
    assert "1 generated clips (GIF" in summary


def test_mode_video_needs_a_video_tokenizer(files):
    from fusion_model.sampling.generate import video_grid_setting
    from tokenizer.bundle import load_media_tokenizer

    image_tokenizer = load_media_tokenizer(files / "vq")
    with pytest.raises(ValueError, match="mode 'video' needs a video tokenizer"):
        video_grid_setting(SamplingConfig(mode="video"), image_tokenizer)
    assert video_grid_setting(SamplingConfig(mode="image"), image_tokenizer) == {}


@pytest.fixture(scope="module")
def video_files(tmp_path_factory):
    """A tiny random video tokenizer (16-px frames, 4-frame clips -> 1 x 4 x 4 codes of 16), a vocabulary with the
    video markers, and a decoder checkpoint of that layout."""
    from tokenizer.video import VideoTokenizer, VideoTokenizerConfig

    folder = tmp_path_factory.mktemp("video")
    torch.manual_seed(0)
    config = VideoTokenizerConfig(image_size=16, clip_frames=4, codebook_size=16, embed_dim=4, latent_channels=4,
                                  base_channels=8, channel_multiplier=(1, 2, 2), num_res_blocks=1,
                                  attn_resolutions=(), norm_groups=4)
    VideoTokenizer(config).eval().save_pretrained(folder / "video")
    vocab = train_unified_vocab(CORPUS, vocab_size=320, image_codes=16, video=True)
    vocab.save(folder / "tokenizer.json")
    model_config = FusionConfig.from_preset("tiny", vocab_size=320, image_offset=vocab.image_offset, image_codes=16,
                                            max_seq_len=48)
    save_model(FusionModel(model_config), folder / "model.ckpt")
    return folder


def test_generate_mode_video_writes_gif_mp4_and_a_frame_strip_and_prints_them(video_files, tmp_path, capsys):
    from tokenizer.bundle import load_media_tokenizer
    from tokenizer.vocab import UnifiedVocab

    out = tmp_path / "clips"
    argv = ["--checkpoint", str(video_files / "model.ckpt"), "--vocab", str(video_files / "tokenizer.json"),
            "--image-tokenizer", str(video_files / "video"), "--prompt", "the cat", "--mode", "video",
            "--num-samples", "2", "--cfg-scale", "2", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    vocab = UnifiedVocab.load(video_files / "tokenizer.json")
    tokenizer = load_media_tokenizer(video_files / "video")
    t, h, w = tokenizer.video_grid
    body = json.loads((out / "samples.json").read_text())
    assert body["settings"]["video_grid"] == [t, h, w]
    for sample in body["samples"]:
        ids = sample["ids"]
        assert ids[0] == vocab.bov_id and ids[-1] == vocab.eov_id and len(ids) == t * h * w + 2
        (clip,) = sample["output"]
        with Image.open(out / clip["clip"]) as gif:
            assert gif.n_frames == tokenizer.config.clip_frames and gif.size == (16, 16)
        # the GIF holds the frames decode_clips makes of the sampled codes
        codes = torch.tensor(ids[1:-1]).view(t, h, w) - vocab.image_offset
        from fusion_model.sampling.generate import clip_frames

        expected = clip_frames(tokenizer.decode_clips(codes[None])[0])
        with Image.open(out / clip["clip"]) as gif:
            gif.seek(1)
            assert np.abs(np.asarray(gif.convert("RGB")).astype(int) - expected[1]).max() <= 8  # GIF palette
        assert (out / clip["strip"]).is_file() and ("mp4" not in clip or (out / clip["mp4"]).is_file())
        assert f"<clip: {out / clip['clip']}" in printed
    assert "2 generated clips" in printed


def test_a_document_of_text_an_image_and_a_clip_decodes_into_each_kind(video_files):
    from fusion_model.sampling.generate import Clip, decode_outputs
    from tokenizer.bundle import load_media_tokenizer
    from tokenizer.vocab import UnifiedVocab

    vocab = UnifiedVocab.load(video_files / "tokenizer.json")
    tokenizer = load_media_tokenizer(video_files / "video")
    grid, video_grid = tuple(tokenizer.grid_shape), tuple(tokenizer.video_grid)
    image, clip = torch.randint(0, 16, grid), torch.randint(0, 16, video_grid)
    ids = vocab.encode_document(["the cat", image, "then", clip, "end"], bos=False)
    (segments,) = decode_outputs([ids], vocab, tokenizer, grid, video_grid)
    assert [type(s).__name__ for s in segments] == ["str", "Image", "str", "Clip", "str"]
    assert isinstance(segments[3], Clip) and torch.equal(segments[3].codes, clip)
    assert segments[3].frames.shape == (tokenizer.config.clip_frames, 16, 16, 3)
    # the image is its own decode, the clip's frames decode_clips' frames
    expected = tokenizer.decode(image[None])[0]
    assert np.asarray(segments[1]).shape == (16, 16, 3)
    assert np.abs(np.asarray(segments[1]).astype(int) - ((expected.permute(1, 2, 0) + 1) * 127.5).round().numpy()).max() <= 1
