"""Write sampled sequences to disk: one PNG per image, an animated GIF (and an MP4 where PyAV is installed) and
a frame strip PNG per clip, a JSON of ids and segments, and a self-contained HTML page (images, clips and strips
inlined as data URIs) showing each prompt and its continuation in order."""

from __future__ import annotations

import base64
import html
import io
import json
import os
from pathlib import Path
from typing import Any

from PIL import Image

from common.files import atomic_write_bytes, atomic_write_json, atomic_write_text


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _has_pyav() -> bool:
    """Whether PyAV (the MP4 writer) can be imported."""
    import importlib.util

    return importlib.util.find_spec("av") is not None


def write_clip(frames: Any, out_dir: Path, name: str, fps: float = 4) -> tuple[dict, bytes, bytes]:
    """A clip's files: `<name>.gif`, `<name>.mp4` (with PyAV) and `<name>_strip.png`; returns its JSON entry and
    the GIF's and the strip's bytes (for the HTML page)."""
    from tokenizer.video.clips import frame_strip, write_gif, write_mp4

    gif = write_gif(frames, out_dir / f"{name}.gif", fps=fps)
    strip = _png_bytes(frame_strip(frames))
    atomic_write_bytes(out_dir / f"{name}_strip.png", strip)
    count, height, width = (int(n) for n in frames.shape[:3])
    entry: dict[str, Any] = {"clip": gif.name, "strip": f"{name}_strip.png", "frames": count,
                             "size": [width, height]}
    if _has_pyav():
        entry["mp4"] = write_mp4(frames, out_dir / f"{name}.mp4", fps=max(1, round(fps))).name
    return entry, gif.read_bytes(), strip


def _describe(segments: list[Any], out_dir: Path, stem: str) -> tuple[list[dict], list[tuple[str, Any]]]:
    """Segments → JSON entries (images saved as PNG files, clips as GIF/MP4 and a strip) and (kind, value) items
    for the HTML page."""
    from fusion_model.sampling.generate import Clip

    entries: list[dict] = []
    shown: list[tuple[str, Any]] = []
    n_images = n_clips = 0
    for segment in segments:
        if isinstance(segment, str):
            entries.append({"text": segment})
            shown.append(("text", segment))
            continue
        if isinstance(segment, Clip):
            entry, gif, strip = write_clip(segment.frames, out_dir, f"{stem}_clip_{n_clips}")
            entries.append(entry)
            shown.append(("clip", (gif, strip)))
            n_clips += 1
            continue
        if isinstance(segment, Image.Image):
            image = segment
        else:  # a path given in a prompt
            from fusion_model.sampling.generate import load_prompt_image

            image = load_prompt_image(segment)
        name = f"{stem}_image_{n_images}.png"
        data = _png_bytes(image.convert("RGB"))
        atomic_write_bytes(out_dir / name, data)
        entry = {"image": name, "size": list(image.size)}
        if not isinstance(segment, Image.Image):
            entry["source"] = str(segment)
        entries.append(entry)
        shown.append(("image", data))
        n_images += 1
    return entries, shown


def _html_items(items: list[tuple[str, Any]]) -> str:
    parts = []
    for kind, value in items:
        if kind == "text":
            parts.append(f'<span class="text">{html.escape(value)}</span>')
        elif kind == "clip":  # the animation, then every frame side by side
            gif, strip = (base64.b64encode(v).decode("ascii") for v in value)
            parts.append(f'<div class="clip"><img src="data:image/gif;base64,{gif}" alt="clip">'
                         f'<img class="strip" src="data:image/png;base64,{strip}" alt="frames"></div>')
        else:
            uri = "data:image/png;base64," + base64.b64encode(value).decode("ascii")
            parts.append(f'<img src="{uri}" alt="image">')
    return "".join(parts) or '<span class="empty">(nothing)</span>'


def write_samples(
    out_dir: str | os.PathLike,
    samples: list[list[Any]],
    *,
    prompts: list[list[Any]] | None = None,
    ids: list[list[int]] | None = None,
    settings: dict | None = None,
    title: str = "Samples",
) -> dict[str, Path]:
    """Write `samples.json`, `index.html`, the PNGs and the clips' files into `out_dir`; returns the two main
    paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if prompts is not None and len(prompts) != len(samples):
        raise ValueError(f"got {len(prompts)} prompts for {len(samples)} samples; give one prompt per sample")
    if ids is not None and len(ids) != len(samples):
        raise ValueError(f"got {len(ids)} id lists for {len(samples)} samples; give one per sample")
    records, blocks = [], []
    for i, segments in enumerate(samples):
        record: dict[str, Any] = {"index": i}
        prompt_html = ""
        if prompts is not None:
            record["prompt"], shown = _describe(prompts[i], out, f"sample_{i:03d}_prompt")
            prompt_html = f'<div class="prompt">{_html_items(shown)}</div>'
        record["output"], shown = _describe(segments, out, f"sample_{i:03d}")
        if ids is not None:
            record["ids"] = [int(t) for t in ids[i]]
        records.append(record)
        blocks.append(f'<section><h2>#{i}</h2>{prompt_html}<div class="output">{_html_items(shown)}</div></section>')
    body = {"settings": settings or {}, "samples": records}
    json_path, html_path = out / "samples.json", out / "index.html"
    atomic_write_json(json_path, body)
    settings_html = html.escape(json.dumps(settings or {}, sort_keys=True))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; max-width: 60em; margin: 2em auto; }}
section {{ border-top: 1px solid #ccc; padding: .5em 0; }}
.prompt {{ color: #555; background: #f4f4f4; padding: .3em; margin-bottom: .3em; }}
.text {{ white-space: pre-wrap; }}
img {{ display: block; margin: .3em 0; image-rendering: pixelated; min-width: 128px; }}
.clip img {{ min-width: 128px; height: 128px; }}
.clip img.strip {{ min-width: 0; height: 64px; }}
code {{ font-size: 80%; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p><code>{settings_html}</code></p>
{chr(10).join(blocks)}
</body></html>
"""
    atomic_write_text(html_path, page)
    return {"json": json_path, "html": html_path}
