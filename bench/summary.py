"""The summary that opens BENCHMARKS.md: one row per result file in bench/results, with its headline figure, the
goal it is measured against, the machine it ran on and links to its detail.

Every number comes from the result files. `HEADLINES` only says which stored figure is a benchmark's headline and
how to read it; a goal is the one the result file records (the figure's `goal`, else the config's `goal`), else the
constant the benchmark's module defines, else "—". A result file without an entry here still gets a row: its first
side-by-side ratio, or "—".
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

START_MARKER = "<!-- summary:start -->"
END_MARKER = "<!-- summary:end -->"
MISSING = "—"


@dataclass(frozen=True)
class Part:
    """One figure of a headline: `path` is dotted into the result's `figures` (the whole file when it has none)."""

    path: str
    label: str  # read after the number: what it is, against what
    unit: str = "×"  # "×": a ratio, "%": a fraction shown as a percentage, else the unit of a difference
    over: str | None = None  # a second path: the part shows path ÷ over (a ratio the file does not store itself)
    minus: str | None = None  # a second path: the part shows path − minus, in `unit`


@dataclass(frozen=True)
class Headline:
    """A benchmark's headline: its parts (the first one bold, with its spread), and how to find and show its goal."""

    parts: tuple[Part, ...] = ()
    note: str = ""  # shown instead of a figure when the benchmark has no ratio to headline
    goal_format: str = "{}"  # applied to a numeric goal
    goal_constant: tuple[str, str] | None = None  # (module, name) in bench/ when the result file records no goal


HEADLINES: dict[str, Headline] = {
    "data": Headline(
        (Part("stream_vs_demo_train_step", "tokens/s the packed stream delivers vs what the demo decoder trains "
                                           "through"),),
        goal_format="≥ {:g}×"),
    "decoder": Headline(
        (Part("medium.eager", "vs transformers Chameleon, training step, medium preset, eager"),
         Part("medium.compiled", "compiled"))),
    "gpu": Headline(
        (Part("train_step_1b.mfu_vs_measured_matmul", "MFU of the ~1.1B bf16 training step vs the measured matmul "
                                                      "peak", unit="%"),
         Part("image_512px_7b.batch_1.bandwidth_bound_fraction", "of the bandwidth bound, 7B-shaped image decode, "
                                                                 "batch 1", unit="%"))),
    "image_tokenizer": Headline(
        (Part("encode_vs_transformers", "vs transformers ChameleonVQVAE, encode, same weights"),)),
    "limits": Headline(note="no ratio: this machine's matmul peak and copy bandwidth, the denominators of the MFU "
                            "and bandwidth-bound figures"),
    "memory": Headline(
        (Part("worst_ratio_off", "largest |plan ÷ measured peak − 1| of `train.py plan` over the configurations",
              unit="%"),),
        goal_format="≤ {:.0%}", goal_constant=("bench.bench_memory", "GOAL")),
    "mot": Headline(
        (Part("train_half_image.mot_time_over_dense", "MoT / dense training-step time at equal active parameters, "
                                                      "half image codes"),
         Part("decode_mixed_batch8.eager.mot_time_over_dense", "decode time, rows of both modalities, batch 8"))),
    "revision": Headline(
        (Part("after_over_before_speed.train_step_speed", "training-step speed of this tree vs the `before` tree"),
         Part("after_over_before_speed.text_decode_speed", "text decode"),
         Part("after_over_before_speed.image_decode_speed", "guided image decode"))),
    "sampling": Headline(
        (Part("medium.text_batch1.compiled_vs_transformers", "vs transformers `generate`, medium text decode, "
                                                             "batch 1, compiled"),
         Part("medium.text_batch8.compiled_vs_transformers", "batch 8"))),
    "scale": Headline(
        (Part("after.first_batch_100x_over_1x", "one rank's time to its first batch at 100× the data ÷ at 1×"),
         Part("after.peak_rss_100x_over_1x", "peak RSS")),
        goal_format="≤ {:g}× at 100×", goal_constant=("bench.bench_scale", "GOAL_RATIO")),
    "scale_train": Headline(
        (Part("train_tokens_per_wall_second_after_over_before_ratio", "training tokens/s after ÷ before the "
                                                                      "shard-granular stream, wall"),
         Part("train_tokens_per_cpu_second_after_over_before_ratio", "per CPU second"))),
    "speculative": Headline(
        (Part("demo_settings.window4.time_speedup_vs_plain", "vs plain decoding, window 4, the demo's trained model "
                                                             "at its sampling settings"),
         Part("demo_settings.window4.forwards_speedup_vs_plain", "in forwards"))),
    "stability": Headline(
        (Part("chameleon.lr_sensitivity", "learning-rate sensitivity of Chameleon's recipe vs neither QK-norm nor "
                                          "z-loss (lower is steadier)", over="neither.lr_sensitivity"),)),
    "tokenizer_quality": Headline(
        (Part("photos.preset.psnr_db", "held-out PSNR vs a plain VQ-VAE at equal CPU time, photos",
              unit="dB", minus="photos.plain_vqvae.psnr_db"),
         Part("digits.preset.psnr_db", "digits", unit="dB", minus="digits.plain_vqvae.psnr_db"))),
    "transfusion": Headline(
        (Part("train_step.transfusion_time_over_chameleon", "Transfusion / Chameleon training-step time, same "
                                                            "decoder"),
         Part("image_sampling.transfusion_time_over_chameleon", "time per guided image"))),
    "vocab": Headline(
        (Part("bpe_train", "vs bare `tokenizers`, BPE training"), Part("encode_batch", "batch encode"),
         Part("encode_document", "document encode"))),
}


# ---------------------------------------------------------------- anchors


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


class Anchors:
    """Anchors of a document's headings in order, numbered like GitHub's when a title repeats (`x`, `x-1`, …)."""

    def __init__(self) -> None:
        self.used: dict[str, int] = {}

    def add(self, title: str) -> str:
        base = slug(title)
        count = self.used.get(base, 0)
        self.used[base] = count + 1
        return base if count == 0 else f"{base}-{count}"


# ---------------------------------------------------------------- reading results


def load_all(directory: Path) -> dict[str, dict]:
    """Every readable JSON object in `directory` by file stem, figures or not (revision.json has none)."""
    results = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            body = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            print(f"bench: skipping unreadable result {path}: {error}", file=sys.stderr)
            continue
        if isinstance(body, dict):
            results[path.stem] = body
    return results


def _lookup(root: object, path: str) -> object:
    for key in path.split("."):
        if not isinstance(root, dict) or key not in root:
            return None
        root = root[key]
    return root


def _number(node: object) -> tuple[float, float | None, float | None] | None:
    """(value, q25, q75) of a figure: a paired result's median speedup, a `{"value": …}` figure or a bare number."""
    if isinstance(node, dict) and "speedup_median" in node:
        node = {"value": node["speedup_median"], "q25": node.get("speedup_q25"), "q75": node.get("speedup_q75")}
    if isinstance(node, dict):
        value, q25, q75 = node.get("value"), node.get("q25"), node.get("q75")
    else:
        value, q25, q75 = node, None, None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    spread = all(isinstance(q, (int, float)) and not isinstance(q, bool) for q in (q25, q75))
    return float(value), (float(q25) if spread else None), (float(q75) if spread else None)


def _show(value: float, unit: str) -> str:
    if unit == "×":
        return f"{value:.2f}×"
    if unit == "%":
        return f"{100 * value:.1f}%"
    return f"{value:+.2f} {unit}"


def _part_text(figures: object, part: Part, first: bool) -> str | None:
    found = _number(_lookup(figures, part.path))
    if found is None:
        return None
    value, q25, q75 = found
    spread = ""
    for other, combine in ((part.over, lambda a, b: a / b), (part.minus, lambda a, b: a - b)):
        if other is not None:
            second = _number(_lookup(figures, other))
            if second is None or (part.over is not None and second[0] == 0):
                return None
            value, q25, q75 = combine(value, second[0]), None, None
    if first and q25 is not None and q75 is not None:
        spread = f" (IQR {_show(q25, part.unit)}–{_show(q75, part.unit)})"
    number = _show(value, part.unit)
    return (f"**{number}**" if first else number) + f" {part.label}{spread}"


def _first_paired(figures: object, prefix: str = "") -> Part | None:
    """The first side-by-side comparison in a result without a headline entry, labelled by its figure's path."""
    if not isinstance(figures, dict):
        return None
    for key, value in figures.items():
        if isinstance(value, dict) and "speedup_median" in value:
            return Part(f"{prefix}{key}", f"`{prefix}{key}`")
        found = _first_paired(value, f"{prefix}{key}.")
        if found is not None:
            return found
    return None


def headline_text(name: str, body: dict) -> str:
    """The headline cell of one result: its parts, or a note, or "—"."""
    figures = body.get("figures", body)
    spec = HEADLINES.get(name)
    if spec is None:
        part = _first_paired(figures)
        spec = Headline((part,) if part else (), note="" if part else "no side-by-side ratio in this result")
    texts = [_part_text(figures, part, first=i == 0) for i, part in enumerate(spec.parts)]
    shown = [text for text in texts if text is not None]
    if not shown:
        text = f"{MISSING} ({spec.note})" if spec.note else MISSING
    elif texts[0] is None:
        text = f"{MISSING} (`{spec.parts[0].path}` not in this result); " + "; ".join(shown)
    else:
        text = "; ".join(shown)
    return text + (" (smoke run)" if body.get("smoke") else "")


def goal_text(name: str, body: dict) -> str:
    """The goal a result records (its headline figure's `goal`, else its config's), else its module's constant."""
    spec = HEADLINES.get(name, Headline())
    figures = body.get("figures", body)
    goal = None
    if spec.parts:
        figure = _lookup(figures, spec.parts[0].path)
        goal = figure.get("goal") if isinstance(figure, dict) else None
    if goal is None and isinstance(body.get("config"), dict):
        goal = body["config"].get("goal")
    if goal is None and spec.goal_constant is not None:
        module, constant = spec.goal_constant
        goal = getattr(importlib.import_module(module), constant, None)
    if goal is None:
        return MISSING
    if isinstance(goal, (int, float)) and not isinstance(goal, bool):
        return spec.goal_format.format(goal)
    return str(goal).replace("<=", "≤").replace(">=", "≥")


def machine_text(body: dict, machine_id: Callable[[dict], str | None]) -> str:
    """Where a result ran: the GPU, or the CPU with its cores, and the torch threads; "—" when the file has none."""
    machine = body.get("machine")
    if not isinstance(machine, dict) or not machine:
        return MISSING
    device = machine.get("cuda") or f"{machine.get('processor', '?')}, {machine.get('cpu_count', '?')} cores"
    threads = machine.get("threads")
    text = device + (f", {threads} thread{'s' if threads != 1 else ''}" if threads is not None else "")
    key = machine_id(machine)
    return text + (f" ({key})" if key else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_summary(directory: Path, detail: dict[str, list[tuple[str, str]]],
                   machine_id: Callable[[dict], str | None] = lambda machine: None) -> list[str]:
    """The summary table's lines (between the markers): one row per JSON result file in `directory`.

    `detail` maps a result's name to (text, anchor) links of its sections in the document; a result without one
    links to its file. `machine_id` names a machine as the document's machine list does (M1, M2, …)."""
    results = load_all(directory)
    lines = [START_MARKER, "## Summary", ""]
    if not results:
        return [*lines, "No benchmark results yet: run `python -m bench`.", "", END_MARKER]
    lines += [
        "One row per result file in `bench/results/`: its headline figure, the goal the result or its benchmark",
        "records (— where neither states one), where it ran and when; every figure, with its spread, is in the",
        "detail. A ratio reads as its label says: \"vs X\" is ours over X (for speed, > 1 means ours is faster);",
        "\"A / B time\" divides times (< 1 means A is faster). IQR: the inter-quartile range over the pairs.",
        "",
        "| Benchmark | Headline | Goal | Machine | Measured | Detail |",
        "|---|---|---|---|---|---|",
    ]
    for name, body in results.items():
        links = detail.get(name) or [(f"bench/results/{name}.json", f"bench/results/{name}.json")]
        link_text = ", ".join(f"[{text}]({target if '/' in target else '#' + target})" for text, target in links)
        measured = str(body.get("measured_at", ""))[:10] or MISSING
        cells = [f"`{name}`", headline_text(name, body), goal_text(name, body), machine_text(body, machine_id),
                 measured, link_text]
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return [*lines, "", END_MARKER]
