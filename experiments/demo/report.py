"""The demo's self-contained HTML report: every image and plot is inlined as a base64 PNG."""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from common.files import atomic_write_text
from experiments.demo.settings import DemoConfig

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .6em 0; } td, th { border: 1px solid #ccc; padding: .3em .7em; }
th { background: #f3f3f3; text-align: left; } .num { text-align: right; font-variant-numeric: tabular-nums; }
.grid { display: flex; flex-wrap: wrap; gap: .8em; } .card { text-align: center; font-size: .85em; }
.ok { color: #17733a; } .bad { color: #b3261e; } img.px { image-rendering: pixelated; }
pre { background: #f6f6f6; padding: .8em; overflow-x: auto; font-size: .85em; }
"""


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Float images (B, 3, H, W) in [-1, 1] -> uint8 (B, H, W, 3)."""
    x = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


def png_base64(image: np.ndarray | Image.Image) -> str:
    """A `data:` URI holding the image as PNG."""
    pil = image if isinstance(image, Image.Image) else Image.fromarray(image)
    buffer = io.BytesIO()
    pil.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_tag(image: np.ndarray | Image.Image, width: int | None = None, title: str = "") -> str:
    """An <img> element with the image inlined."""
    size = f' width="{width}"' if width else ""
    return f'<img class="px" src="{png_base64(image)}"{size} title="{html.escape(title)}" alt="{html.escape(title)}">'


def plot_tag(curves: dict[str, Sequence[tuple[int, float]]], title: str, ylabel: str = "loss") -> str:
    """Line plot (one line per named curve of (step, value) points) as an inlined PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=110)
    for name, points in curves.items():
        if len(points):
            steps, values = zip(*points)
            ax.plot(steps, values, label=name, linewidth=1.3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return f'<img src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode("ascii")}" alt="{html.escape(title)}">'


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """An HTML table; numbers are right-aligned."""
    def cell(value: object) -> str:
        if isinstance(value, float):
            return f'<td class="num">{value:,.3f}</td>' if abs(value) < 100 else f'<td class="num">{value:,.0f}</td>'
        if isinstance(value, int):
            return f'<td class="num">{value:,}</td>'
        return f"<td>{html.escape(str(value))}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def section(title: str, body: str, note: str = "") -> str:
    """One titled section."""
    return f"<h2>{html.escape(title)}</h2>" + (f"<p>{html.escape(note)}</p>" if note else "") + body


def config_block(config: dict) -> str:
    """The configuration as pretty-printed JSON."""
    return f"<pre>{html.escape(json.dumps(config, indent=2, default=str))}</pre>"


def write_html(path: str | Path, title: str, sections: Sequence[str], summary: str = "") -> Path:
    """Write the report atomically and return its path."""
    text = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            + (f"<p>{summary}</p>" if summary else "") + "".join(sections) + "</body></html>")
    return atomic_write_text(path, text)


def mark(ok: bool) -> str:
    """A green tick or a red cross."""
    return '<span class="ok">&#10003;</span>' if ok else '<span class="bad">&#10007;</span>'


def _card(image: np.ndarray, label: str, width: int = 64) -> str:
    return f'<div class="card">{image_tag(image, width)}<br>{label}</div>'


def _reading(predicted: int) -> str:
    """What the classifier read in a generated image; -1 marks a sample that made no whole image."""
    return f"reads {predicted}" if predicted >= 0 else "no image"


def evaluation_section(records: dict[str, dict]) -> str:
    """The evaluation table, with the training tokens and minutes behind it."""
    gen, train = records["generate"], records["train"]
    rows = [
        ("understanding: caption names the held-out digit", gen["understanding_accuracy"], 0.10, 0.90,
         gen["understanding_count"]),
        ("generation: classifier recognises the captioned digit", gen["generation_accuracy"], 0.10, 0.80,
         gen["generation_count"]),
        ("interleaved: answer image shows a + b", gen["interleaved_accuracy"], 0.10, "-", gen["interleaved_count"]),
        *([("generation at temperature 1, no top-k, no guidance (cfg 1)", gen["generation_accuracy_t1_cfg1"], 0.10,
            "-", gen["generation_count"])] if "generation_accuracy_t1_cfg1" in gen else []),
        ("classifier on real held-out digits (sanity)", gen["classifier_accuracy_real"], 0.10, "-", "-"),
        ("classifier on tokenizer reconstructions (sanity)", gen["classifier_accuracy_reconstructed"], 0.10, "-", "-"),
    ]
    body = table(["held-out evaluation", "accuracy", "chance", "target", "examples"], rows)
    body += distribution_table(gen)
    body += table(["training", "value"], [
        ("decoder training tokens", int(train["tokens"])),
        ("decoder optimizer steps", int(train["steps"])),
        ("decoder training minutes", float(train["minutes"])),
        ("decoder parameters", int(train["parameters"])),
        ("tokens / second", float(train["tokens_per_second"])),
        *([("held-out caption loss (nats per text token)", float(gen["text_loss"]))]
          if gen.get("text_loss") is not None else []),
    ])
    sampling = gen["sampling"]
    note = (f"Images sampled at temperature {sampling['temperature']}, top-k {sampling['top_k']}, classifier-free "
            f"guidance {sampling['cfg_scale']} (unconditional branch: <s> <boi>), the interleaved answer images "
            "too; captions and worded sums decoded greedily. "
            "The classifier is a CNN trained by the demo on real training digits only. Scored by the digits "
            "evaluation suite (train.py eval --suite digits; the rerun command of the generate stage below).")
    return section("Evaluation (held-out digits, never seen in training)", body, note)


def distribution_table(gen: dict) -> str:
    """Fréchet distance and per-caption diversity, each with what a lower or higher value means ('' for a record
    written before these scores existed)."""
    if "frechet_distance" not in gen:
        return ""
    sampling = gen["sampling"]
    ours = f"T {sampling['temperature']}, top-k {sampling['top_k']}, cfg {sampling['cfg_scale']}"
    rows = [
        (f"Fréchet distance to real digits, {ours}", float(gen["frechet_distance"]),
         "lower = generated digits match real ones in mean and spread of features"),
        ("Fréchet distance to real digits, T 1, cfg 1", float(gen["frechet_distance_t1_cfg1"]),
         "the same for plain sampling from the model"),
        ("Fréchet distance, real held-out subset of the same size", float(gen["frechet_distance_real"]),
         "floor: what a perfect generator scores with this few images"),
        ("Fréchet distance, tokenizer reconstructions of that subset", float(gen["frechet_distance_reconstructed"]),
         "what a generator limited only by the image tokenizer would score"),
        (f"diversity within a caption, {ours}", float(gen["diversity"]),
         "higher = more varied samples per caption; near 0 = near copies of one digit"),
        ("diversity within a caption, T 1, cfg 1", float(gen["diversity_t1_cfg1"]),
         "the same for plain sampling from the model"),
        ("diversity within a class, real held-out digits", float(gen["diversity_real"]),
         "reference: how varied real digits of one class are"),
    ]
    note = (f"<p>Measured on the classifier's 128 penultimate activations. Fréchet distance (as FID) against "
            f"{gen['frechet_reference_count']} held-out real digits; diversity is the mean pairwise feature distance "
            "between the images of one caption, averaged over the ten captions.</p>")
    return note + table(["distribution (classifier features)", "value", "meaning"], rows)


def tokenizer_section(record: dict, originals: torch.Tensor, reconstructions: torch.Tensor, psnrs: torch.Tensor) -> str:
    """Originals over their reconstructions, each with its PSNR, plus codebook usage."""
    top, bottom = to_uint8(originals), to_uint8(reconstructions)
    cards = "".join(_card(np.concatenate([a, np.full((2, a.shape[1], 3), 255, np.uint8), b]), f"{float(p):.1f} dB")
                    for a, b, p in zip(top, bottom, psnrs))
    summary = table(["image tokenizer (held-out digits)", "value"], [
        ("PSNR (dB, mean over held-out)", float(record["psnr_db"])),
        ("codebook entries used", f"{record['codebook_used']} / {record['codebook_size']}"),
        ("code perplexity", float(record["code_perplexity"])),
        ("training minutes", float(record["minutes"])),
        ("training images", int(record["train_images"])),
    ])
    return section("Image tokenizer: originals (top) vs reconstructions (bottom)", summary + f'<div class="grid">{cards}</div>',
                   "Each 64-px digit is 4 x 4 = 16 codes from a 512-entry codebook.")


def loss_section(losses: dict) -> str:
    """Text and image training losses as one plot each."""
    steps = losses["step"]
    text = plot_tag({"text tokens": list(zip(steps, losses["text"]))}, "text loss (cross-entropy on caption / word tokens)")
    image = plot_tag({"image tokens": list(zip(steps, losses["image"]))}, "image loss (cross-entropy on image codes)")
    return section("Training losses", text + "<br>" + image)


def generation_section(images: torch.Tensor, targets: np.ndarray, predicted: np.ndarray, per_caption: int,
                       shown: int, captions: list[str]) -> str:
    """A row of generated images per caption, each marked with the classifier's reading (-1: no image)."""
    pixels = to_uint8(images)
    rows = []
    for digit in range(10):
        idx = np.flatnonzero(targets == digit)[:shown]
        cards = "".join(_card(pixels[i], f"{mark(predicted[i] == digit)} {_reading(int(predicted[i]))}", 56)
                        for i in idx)
        correct = int((predicted[targets == digit] == digit).sum())
        rows.append(f"<tr><td>{html.escape(captions[digit])}<br>({correct}/{per_caption} recognised)</td>"
                    f'<td><div class="grid">{cards}</div></td></tr>')
    return section("Images generated from captions", "<table>" + "".join(rows) + "</table>")


def captions_section(images: torch.Tensor, texts: list[str], labels: np.ndarray, shown: int,
                     parse) -> str:
    """Held-out images with the caption the model wrote for each."""
    pixels = to_uint8(images[:shown])
    cards = "".join(_card(p, f"{mark(parse(t) == int(y))} &ldquo;{html.escape(t)}&rdquo;", 64)
                    for p, t, y in zip(pixels, texts, labels))
    return section("Captions written for held-out images", f'<div class="grid">{cards}</div>')


def interleaved_section(a_images: torch.Tensor, b_images: torch.Tensor, answers: torch.Tensor, pairs: np.ndarray,
                        predicted: np.ndarray, shown: int, texts: list[str] | None = None) -> str:
    """`calculate <a> plus <b> equals <generated text> <generated image>` documents, with the classifier's reading
    of the answer image (-1: no image)."""
    rows = []
    for i in range(min(shown, len(pairs))):
        a, b, c = (to_uint8(t[i:i + 1])[0] for t in (a_images, b_images, answers))
        ok = int(predicted[i]) == int(pairs[i].sum())
        reading = ("generated image " if predicted[i] >= 0 else "") + _reading(int(predicted[i]))
        written = html.escape(texts[i]) if texts else ""
        rows.append(f"<tr><td>calculate</td><td>{image_tag(a, 48)}</td><td>plus</td><td>{image_tag(b, 48)}</td><td>equals</td>"
                    f"<td><i>{written}</i></td><td>{image_tag(c, 48)}</td><td>{mark(ok)} {int(pairs[i][0])} + "
                    f"{int(pairs[i][1])}: {reading}</td></tr>")
    return section("Interleaved arithmetic (prompt: two held-out digit images; the model writes the sum in words "
                   "(italic), then the answer image)", "<table>" + "".join(rows) + "</table>")


def timings_section(records: dict[str, dict], config: DemoConfig) -> str:
    """Seconds per stage, and the whole configuration."""
    preset = (f" --config {config.source}" if config.source else "") + f" --out {config.out_dir}"
    rows = [(name, float(rec["seconds"]), rec.get("finished_at", ""),
             f"python train.py demo{preset} --stage {name} --force {name}" + (f"  |  {rec['command']}" if "command" in rec else ""))
            for name, rec in records.items()]
    rows.append(("total", float(sum(r[1] for r in rows)), "", ""))
    note = "A finished stage is reused when the demo runs again; each can be rerun alone with the command shown."
    return section("Configuration and timings", table(["stage", "seconds", "finished", "rerun alone"], rows)
                   + config_block({k: v for k, v in dataclasses.asdict(config).items() if k != "source"}), note)
