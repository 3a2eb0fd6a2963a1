"""The suite protocol of `train.py eval`: the sampling settings every suite reads (`EvalSettings`), what a suite is
given (`EvalContext`: the checkpoint's family, its tokenizers, batched sampling through the family's own `generate`,
a text loss) and what it returns (`SuiteResult`: figures for results.json, samples for the page)."""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch
from PIL import Image

from fusion_model.families.loading import LoadedFamily

PROGRESS_SECONDS = 30.0  # at most this long between progress lines while sampling


def help_metadata(text: str) -> dict[str, str]:
    """A dataclass field's metadata carrying its `train.py eval` option's help (suites' Options use it too)."""
    return {"help": text}


@dataclass(frozen=True)
class EvalSettings:
    """How a suite samples and how much it scores; every field is a `train.py eval` option (its help below)."""

    seed: int = field(default=0, metadata=help_metadata("seed of every sampled image and of the suite's prompts; the same "
                                                "seed and settings give the same results.json"))
    temperature: float = field(default=1.0, metadata=help_metadata("image temperature (text answers are greedy)"))
    top_k: int = field(default=0, metadata=help_metadata("image top-k (0: off)"))
    cfg_scale: float = field(default=3.0, metadata=help_metadata("classifier-free guidance scale of images (1: none)"))
    denoising_steps: int = field(default=50, metadata=help_metadata("DDIM steps per image, for families that denoise "
                                                            "(transfusion); ignored by families that sample codes"))
    samples_per_prompt: int = field(default=4, metadata=help_metadata("images generated for each prompt"))
    prompts_per_skill: int = field(default=25, metadata=help_metadata("prompts per skill (scenes: held-out captions, cycled "
                                                              "when a skill has fewer; digits: arithmetic problems; "
                                                              "chat: conversations per category)"))
    understanding_items: int = field(default=200, metadata=help_metadata("held-out images the model answers questions "
                                                                 "about"))
    text_documents: int = field(default=200, metadata=help_metadata("held-out text documents of the text loss"))
    batch_size: int = field(default=32, metadata=help_metadata("prompts per sampling batch"))
    device: str = field(default="cpu", metadata=help_metadata("cpu or cuda"))

    def __post_init__(self) -> None:
        for name in ("samples_per_prompt", "prompts_per_skill", "batch_size", "denoising_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})")
        for name in ("understanding_items", "text_documents", "top_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (got {getattr(self, name)})")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be a finite number >= 0 (got {self.temperature})")
        if not (math.isfinite(self.cfg_scale) and self.cfg_scale > 0):
            raise ValueError(f"--cfg-scale must be a finite number > 0 (got {self.cfg_scale})")


@dataclass
class PageSample:
    """One row of the sample page: a prompt, what the model made (an image and/or text) and the verdict."""

    group: str  # e.g. the skill
    prompt: str
    image: Image.Image | None = None
    text: str = ""
    correct: bool | None = None
    note: str = ""  # what the checker read


@dataclass
class SuiteResult:
    """What a suite returns: JSON-able figures (results.json's `figures`) and the page's samples."""

    figures: dict[str, Any]
    samples: list[PageSample] = field(default_factory=list)


@dataclass
class EvalContext:
    """A loaded checkpoint, its tokenizers and the settings, with the sampling every suite goes through."""

    loaded: LoadedFamily
    vocab: Any
    media_tokenizer: Any
    settings: EvalSettings
    progress: Callable[[str], None] = print

    @property
    def family(self) -> str:
        """The checkpoint's family name (chameleon, transfusion, ...)."""
        return self.loaded.family.name

    def sampling(self, mode: str, seed: int = 0, **values: Any) -> Any:
        """The family's sampling config (`Family.sampling_config`: e.g. transfusion's adds denoising steps) for
        `mode` with the settings' image temperature, top-k, guidance and steps, greedy text, and `values` over them."""
        config_class = self.loaded.family.sampling_config
        names = {f.name for f in fields(config_class)}
        s = self.settings
        # guidance acts on image tokens only (an interleaved answer's text is unguided either way); a text answer,
        # or any answer of a family that writes no images, samples without it (late fusion refuses it)
        guided = mode != "text" and self.can_make_images()
        chosen: dict[str, Any] = {"mode": mode, "image_temperature": s.temperature, "image_top_k": s.top_k,
                                  "cfg_scale": s.cfg_scale if guided else 1.0, "text_temperature": 0.0,
                                  "seed": s.seed + seed}
        if "denoising_steps" in names:
            chosen["denoising_steps"] = s.denoising_steps
        return config_class(**{k: v for k, v in {**chosen, **values}.items() if k in names})

    def sample(self, prompts: list[list[Any]], config: Any) -> tuple[list[list[Any]], list[list[int]]]:
        """Each prompt's output segments (str, PIL images) and new ids, through the family's `generate` (the one
        `train.py generate` calls), in batches of the settings' size; batch k samples with seed config.seed + k."""
        outputs: list[list[Any]] = []
        ids: list[list[int]] = []
        size = self.settings.batch_size
        last_line = time.monotonic()
        for k, start in enumerate(range(0, len(prompts), size)):
            batch_config = replace(config, seed=(config.seed or 0) + k)
            out, new_ids = self.loaded.family.generate(self.loaded.parts, self.vocab, self.media_tokenizer,
                                                       prompts[start:start + size], batch_config)
            outputs += out
            ids += new_ids
            if time.monotonic() - last_line > PROGRESS_SECONDS and len(outputs) < len(prompts):
                self.progress(f"eval: sampled {len(outputs)}/{len(prompts)}")  # a log file is never silent long
                last_line = time.monotonic()
        return outputs, ids

    def can_make_images(self) -> bool:
        """Whether the family samples images (`Family.writes_images`: a late-fusion decoder only reads them)."""
        return bool(getattr(self.loaded.family, "writes_images", True))

    @torch.no_grad()
    def text_loss(self, documents: list[str]) -> float | None:
        """Mean next-token loss (nats per text token) of the decoder on texts after `<s>`, or None when the family's
        decoder has no `loss` (it reads text through something else). No `</s>` is scored: in documents of captions
        and images a caption is followed by an image, so a closing `</s>` would be a target the data never shows."""
        model = self.loaded.parts.get("model")
        if model is None or not hasattr(model, "loss") or not documents:
            return None
        total, count = 0.0, 0
        for text in documents:
            ids = torch.tensor([self.vocab.encode_document([text], bos=True, eos=False)], device=self.settings.device)
            out = model.loss(ids, torch.zeros_like(ids))
            n = int(out["n_text_targets"])
            total += float(out["text_loss"]) * n
            count += n
        return total / max(count, 1)


@torch.no_grad()
def round_trip_pixels(tokenizer: Any, pixels: torch.Tensor, device: str = "cpu", batch_size: int = 64) -> torch.Tensor:
    """Float images (N, 3, H, W) in [-1, 1] through the image tokenizer and back (codes or latents), clamped, on the
    CPU: what a perfect model of the tokenizer's tokens would show (the suites' reconstruction floors)."""
    out = []
    for start in range(0, len(pixels), batch_size):
        batch = pixels[start:start + batch_size].to(device)
        out.append(tokenizer.decode(tokenizer.encode(batch)).float().clamp(-1, 1).cpu())
    return torch.cat(out)


def first_image(segments: list[Any]) -> Image.Image | None:
    """The first PIL image among a sample's output segments (None when it made none)."""
    return next((s for s in segments if isinstance(s, Image.Image)), None)


def text_of(segments: list[Any]) -> str:
    """The text a sample wrote, its segments joined (images left out)."""
    return "".join(s for s in segments if isinstance(s, str)).strip()


@dataclass(frozen=True)
class NoOptions:
    """A suite that needs nothing besides the checkpoint and its tokenizers."""


class Suite(ABC):
    """A named evaluation: `run(context)` samples through the context and scores what comes back.

    `Options` (a dataclass; its fields become `train.py eval --<name>` options with their `metadata["help"]`)
    holds what the suite needs besides the checkpoint, e.g. the folder of a finished demo."""

    name: ClassVar[str]
    description: ClassVar[str]
    Options: ClassVar[type] = NoOptions

    def __init__(self, options: Any = None) -> None:
        self.options = options if options is not None else self.Options()

    def check(self, context: EvalContext) -> None:
        """Refuse, in one sentence (ValueError), a checkpoint or tokenizer this suite cannot score (by default:
        none is refused)."""
        return None

    @abstractmethod
    def run(self, context: EvalContext) -> SuiteResult:
        """Sample, score and return the figures and the page's samples."""
