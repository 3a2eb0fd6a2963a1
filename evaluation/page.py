"""The sample page of an evaluation: one self-contained HTML file (images inlined) with the figures and, per group
(skill), each prompt, what the model made and what the checker read."""

from __future__ import annotations

import base64
import html
import io
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from PIL import Image

from common.files import atomic_write_text
from evaluation.base import PageSample

_STYLE = """body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{border:1px solid #ccc;
padding:2px 6px;font-size:13px}.grid{display:flex;flex-wrap:wrap;gap:6px}.cell{width:138px;font-size:11px}
.cell img{width:128px;height:128px;image-rendering:pixelated;border:3px solid #999}.ok img{border-color:#2a2}
.bad img{border-color:#c22}pre{font-size:12px;background:#f4f4f4;padding:6px}"""


def _data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _cell(sample: PageSample) -> str:
    verdict = {True: "ok", False: "bad", None: ""}[sample.correct]
    parts = [f'<div class="cell {verdict}">']
    if sample.image is not None:
        parts.append(f'<img src="{_data_uri(sample.image)}" alt="">')
    parts.append(f"<div><b>{html.escape(sample.prompt)}</b></div>")
    if sample.text:
        parts.append(f"<div>&rarr; {html.escape(sample.text)}</div>")
    if sample.note:
        parts.append(f"<div><i>{html.escape(sample.note)}</i></div>")
    return "".join(parts) + "</div>"


def write_page(path: str | Path, title: str, results: dict[str, Any], samples: list[PageSample],
               per_group: int = 24) -> Path:
    """Write the page: results.json's figures as preformatted JSON, then up to `per_group` samples of each group."""
    groups: dict[str, list[PageSample]] = defaultdict(list)
    for sample in samples:
        groups[sample.group].append(sample)
    body = [f"<h1>{html.escape(title)}</h1>", "<p>Green border: the checker accepts the sample; red: it does not.</p>",
            f"<pre>{html.escape(json.dumps(results['figures'], indent=1))}</pre>"]
    for group, rows in groups.items():
        body.append(f"<h2>{html.escape(group)}</h2><div class='grid'>")
        body += [_cell(s) for s in rows[:per_group]]
        body.append("</div>")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>")
    return atomic_write_text(path, page)
