"""The README's pipeline, typed as written, on pictures, clips and text made here: every command in its command-line
block runs (small sizes via documented flags appended), in a fresh folder, output to files, exit code 0."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# documented flags that make each step seconds-long (appended: the last value of a flag wins)
SMALL = {
    "tokenizer fit": ["--trainer.max_steps", "4", "--trainer.max_time", "null", "--data.batch_size", "4",
                      "--trainer.val_check_interval", "4", "--data.val_samples", "4"],
    "vocab": ["--vocab-size", "1024"],
    "fit": ["--trainer.max_steps", "3", "--data.batch_size", "2", "--data.seq_len", "64",
            "--trainer.val_check_interval", "null"],
    "generate": ["--num-samples", "1"],
    "eval": ["--prompts-per-skill", "1", "--samples-per-prompt", "1", "--understanding-items", "3",
             "--text-documents", "2", "--cfg-scale", "1"],
}
SKIPPED = {"convert import": "needs a transformers Chameleon folder (HF_DIR); tests/fusion_model/test_hf_export.py",
           "experiment": "needs a finished demo; tests/experiments/ runs them on a smoke demo"}
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40)}


def readme_commands() -> list[str]:
    """The commands of the README's command-line block, continuation lines joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## The command line"):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    block = block[: block.index("```")]
    lines = re.sub(r"\\\n\s*", " ", block).splitlines()
    return [shlex.join(shlex.split(line, comments=True)) for line in lines if shlex.split(line, comments=True)]


def step_of(command: str) -> str:
    """'tokenizer fit', 'shards write', 'fit', ... for `python train.py <step> ...`."""
    words = shlex.split(command)[2:]
    return " ".join(words[:2]) if words[0] in {"tokenizer", "shards", "convert"} else words[0]


def make_user_data(root: Path) -> None:
    """A captioned folder of drawn shapes (the images) and a text corpus of sentences about them."""
    from PIL import Image, ImageDraw

    rng = random.Random(0)
    folder = root / "my_images"
    folder.mkdir()
    sentences = []
    for index in range(24):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(["circle", "square"])
        image = Image.new("RGB", (80, 80), (245, 245, 240))
        box = [rng.randint(5, 25), rng.randint(5, 25), rng.randint(50, 75), rng.randint(50, 75)]
        draw = ImageDraw.Draw(image)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
        name = "cat" if index == 0 else f"shape{index:02d}"  # the README's example picture is my_images/cat.png
        image.save(folder / f"{name}.png")
        caption = f"a {colour} {shape} on a white page"
        (folder / f"{name}.txt").write_text(caption)
        sentences.append(f"Here is {caption}. The {shape} is {colour}, drawn by hand.")
    (root / "my_corpus.txt").write_text("\n".join(sentences * 10) + "\n")


def make_user_chats(root: Path) -> None:
    """Conversations about the drawn shapes in the chat-messages convention: a question about a picture (answered in
    words), a request for a picture (answered with one), a question in words alone, and a two-turn chat."""
    rng = random.Random(2)
    pictures = sorted((root / "my_images").glob("*.png"))
    lines = []
    for index, picture in enumerate(pictures):
        caption = (root / "my_images" / f"{picture.stem}.txt").read_text()
        image = {"type": "image", "path": f"my_images/{picture.name}"}
        kind = index % 4
        if kind == 0:
            messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image]},
                        {"role": "assistant", "content": caption}]
        elif kind == 1:
            messages = [{"role": "user", "content": f"Draw {caption}."},
                        {"role": "assistant", "content": [image]}]
        elif kind == 2:
            messages = [{"role": "system", "content": "You answer in one sentence."},
                        {"role": "user", "content": f"Which colour is {caption}?"},
                        {"role": "assistant", "content": f"It is {caption.split()[1]}."}]
        else:
            messages = [{"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]},
                        {"role": "assistant", "content": caption},
                        {"role": "user", "content": "Draw it again."},
                        {"role": "assistant", "content": [{"type": "text", "text": "Here it is:"}, image]}]
        lines.append(json.dumps({"messages": messages}))
    rng.shuffle(lines)
    (root / "my_chats.jsonl").write_text("\n".join(lines) + "\n")


MOVES = {"left": (-3, 0), "right": (3, 0), "up": (0, -3), "down": (0, 3)}


def make_user_clips(root: Path) -> None:
    """A captioned folder of clips of a drawn shape moving, in every form a user may have: .mp4 files, folders of
    PNG frames and .npy arrays (8 frames of 64x48, not square), and one .mp4 that is not a video at all."""
    import numpy as np
    from PIL import Image, ImageDraw

    from tokenizer.video.clips import write_mp4

    rng = random.Random(1)
    folder = root / "my_clips"
    folder.mkdir()
    for index in range(12):
        colour, shape, move = rng.choice(list(COLOURS)), rng.choice(["circle", "square"]), rng.choice(list(MOVES))
        frames = []
        for t in range(8):
            image = Image.new("RGB", (64, 48), (245, 245, 240))
            x, y = 25 + MOVES[move][0] * t, 17 + MOVES[move][1] * t
            (ImageDraw.Draw(image).ellipse if shape == "circle" else ImageDraw.Draw(image).rectangle)(
                [x, y, x + 14, y + 14], fill=COLOURS[colour])
            frames.append(np.asarray(image))
        name = f"clip{index:02d}"
        if index % 3 == 0:
            write_mp4(np.stack(frames), folder / f"{name}.mp4")
        elif index % 3 == 1:
            (folder / name).mkdir()
            for t, frame in enumerate(frames):
                Image.fromarray(frame).save(folder / name / f"{t:03d}.png")
        else:
            np.save(folder / f"{name}.npy", np.stack(frames))
        (folder / f"{name}.txt").write_text(f"a {colour} {shape} moving {move}")
    (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video" * 20)
    (folder / "broken.txt").write_text("a clip that does not decode")


def test_the_readme_commands_run_as_written_on_new_data(tmp_path):
    commands = readme_commands()
    assert [step_of(c) for c in commands][:15] == ["tokenizer fit", "vocab", "shards write", "shards tokenize",
                                                    "shards verify", "fit", "fit", "generate", "shards write",
                                                    "shards tokenize", "fit", "generate", "plan", "fit",
                                                    "convert import"]
    make_user_data(tmp_path)
    make_user_chats(tmp_path)
    make_user_clips(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "train.py").symlink_to(REPO / "train.py")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outputs, late_fusion, caption, mixture, transfusion, diffused, video, chat = {}, "", "", "", "", "", {}, {}
    for index, command in enumerate(commands):
        step = step_of(command)
        if step in SKIPPED:
            continue
        argv = [sys.executable, *shlex.split(command)[1:], *SMALL.get(step, [])]
        if step in ("tokenizer fit", "fit"):
            argv += ["--threads", "1"]
        if step == "fit" and "runs/tokens-video" in command:
            argv += ["--data.seq_len", "160"]  # a row holds a whole clip: <bov>, 2x8x8 codes, <eov>
        if step == "fit" and "runs/tokens-chat" in command:
            argv += ["--data.seq_len", "256"]  # a row holds a whole conversation: never cut, dropped when longer
        log = tmp_path / f"{index:02d}-{step.replace(' ', '-')}.log"
        with log.open("w") as out:  # output to a file, as on a cluster
            result = subprocess.run(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600)
        text = log.read_text()
        assert result.returncode == 0, f"{command}\n{text[-3000:]}"
        outputs.setdefault(step, text)  # the first run of each step (fit runs three times: early, MoT, late fusion)
        if "--model.config.block mot" in command:
            mixture = text
        if "configs/fusion/late/" in command:
            late_fusion = text
        if "--model.family transfusion" in command:
            transfusion = text
        if step == "generate" and "runs/small-transfusion/" in command:
            diffused = text
        if step == "generate" and "runs/late/" in command:
            caption = text
        if "video" in command:
            video[step] = text
        if "runs/small-lora" in command:
            chat["lora"] = text
        elif "chat" in command:
            chat[step] = text

    assert (tmp_path / "runs/tokenizer/tokenizer/config.json").is_file()
    assert "512 image codes" in outputs["vocab"]
    assert "step 1/3" in outputs["fit"] and "done: step 3/3" in outputs["fit"], "plain progress lines in the log"
    assert "\r" not in outputs["fit"] and "\x1b" not in outputs["fit"]
    assert "all " in outputs["shards verify"] and " are good" in outputs["shards verify"]
    images = re.findall(r"<image: ([^>]+)>", outputs["generate"])
    assert images and all((tmp_path / path).is_file() or Path(path).is_file() for path in images)
    assert (tmp_path / "out/hf-chameleon/config.json").is_file()
    assert list((tmp_path / "runs/tokens-features").glob("*.features.npy")), "shards tokenize --features"
    # the Mixture-of-Transformers run starts from the dense run's weights, and says so
    assert "upcycled the dense weights into the mot block" in mixture and "done: step 3/3" in mixture, mixture[-2000:]
    assert (tmp_path / "runs/small-mot/checkpoints/last.ckpt").is_file()
    assert "done: step 3/3" in late_fusion and (tmp_path / "runs/late/llava-stage1/checkpoints/last.ckpt").is_file()
    # the late-fusion checkpoint captions the picture through the same generate: text out, no image files
    assert "prompt: <image: my_images/cat.png>a photo of" in caption and "output: " in caption, caption
    assert "generate: 1 samples, 0 generated image files" in caption, caption
    # Transfusion: a continuous tokenizer's latents in the shards, trained with the diffusion loss beside the text's
    assert (tmp_path / "runs/tokenizer-kl/tokenizer/config.json").is_file()
    latents = json.loads((tmp_path / "runs/tokens-latents/manifest.json").read_text())
    assert latents["feature_kind"] == "latent" and latents["latent"]["channels"] == 8, latents
    assert "done: step 3/3" in transfusion and (tmp_path / "runs/small-transfusion/checkpoints/last.ckpt").is_file()
    drawn = re.findall(r"<image: ([^>]+)>", diffused)
    assert drawn and all((tmp_path / path).is_file() for path in drawn), diffused[-2000:]
    # post-training: conversations in, the answers' loss only, starting from the dense run, then a chat
    assert "24 documents" in chat["shards write"] or "conversations" in chat["shards write"], chat["shards write"]
    chats = json.loads((tmp_path / "runs/tokens-chat/manifest.json").read_text())
    assert chats["conversations"] == 24 and chats["target_roles"] == ["assistant"], chats
    assert list((tmp_path / "runs/tokens-chat").glob("*.targets.npy"))
    assert "done: step 3/3" in chat["fit"] and (tmp_path / "runs/small-sft/checkpoints/last.ckpt").is_file()
    assert "memory plan per device" in outputs["plan"] and "fits (" in outputs["plan"], outputs["plan"]
    assert "LoRA adapters" in outputs["plan"], outputs["plan"]
    lora = tmp_path / "runs/small-lora/checkpoints/last.ckpt"
    assert "done: step 3/3" in chat["lora"] and "trainable parameters" in chat["lora"] and lora.is_file()
    assert lora.stat().st_size < (tmp_path / "runs/small-sft/checkpoints/last.ckpt").stat().st_size / 4  # no base
    answered = json.loads((tmp_path / "runs/chat/samples.json").read_text())
    assert answered["conversations"][0]["messages"][0]["role"] == "user", answered
    assert answered["conversations"][0]["messages"][-1]["role"] == "assistant", answered
    # video: the clips' tokenizer, a vocabulary with <bov>/<eov>, clip shards (the broken clip skipped and named),
    # the same fit, and a clip sampled from a caption, written as GIF, MP4 and a frame strip
    assert "video tokenizer bundle (2x8x8 codes per 8-frame clip)" in video["tokenizer fit"], video["tokenizer fit"]
    assert "video markers: <bov>" in video["vocab"], video["vocab"]
    assert "12 clips" in video["shards write"] and "skipped 1" in video["shards write"], video["shards write"]
    manifest = json.loads((tmp_path / "runs/tokens-video/manifest.json").read_text())
    assert manifest["video_grid"] == [2, 8, 8], manifest
    assert "done: step 3/3" in video["fit"], video["fit"][-2000:]
    clips = re.findall(r"<clip: ([^>]+)>", video["generate"])
    files = [path.strip() for listed in clips for path in listed.split(",")]
    assert files and all((tmp_path / path).is_file() for path in files), video["generate"][-2000:]
    assert {Path(path).suffix for path in files} == {".gif", ".mp4", ".png"}, files
    # evaluation: every skill scored with its ceilings, the fingerprints recorded, a page written
    scored = json.loads((tmp_path / "runs/eval-scenes/results.json").read_text())
    assert set(scored["figures"]["generation"]) == {"single_object", "two_objects", "counting", "colours", "position",
                                                   "colour_attribution"}, scored["figures"]
    assert scored["fingerprints"]["checkpoint"] and (tmp_path / "runs/eval-scenes/index.html").is_file()
    assert "eval: wrote runs/eval-scenes/results.json" in outputs["eval"], outputs["eval"][-2000:]


@pytest.mark.parametrize("command", readme_commands())
def test_every_readme_command_is_a_real_step(command):
    from experiments.commands import SUBCOMMANDS  # every command: the cli layer's and the demo's

    assert shlex.split(command)[:2] == ["python", "train.py"] and shlex.split(command)[2] in SUBCOMMANDS
