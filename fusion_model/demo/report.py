"""The demo's self-contained HTML report: every image and plot is inlined as a base64 PNG."""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

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


def tile(images: np.ndarray, columns: int, pad: int = 2) -> np.ndarray:
    """Tile uint8 images (N, H, W, 3) into one grid image, `columns` per row, with white gaps."""
    n, h, w, c = images.shape
    rows = max(1, -(-n // columns))
    out = np.full((rows * (h + pad) + pad, columns * (w + pad) + pad, c), 255, dtype=np.uint8)
    for i, image in enumerate(images):
        r, k = divmod(i, columns)
        out[pad + r * (h + pad):pad + r * (h + pad) + h, pad + k * (w + pad):pad + k * (w + pad) + w] = image
    return out


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
    """Write the report atomically (tmp file + os.replace) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            + (f"<p>{summary}</p>" if summary else "") + "".join(sections) + "</body></html>")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
