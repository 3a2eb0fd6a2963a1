"""The `clips` suite: text-to-video on the clip world (`evaluation.clip_world`: coloured shapes moving in 4
directions, captions such as "a red square moving left"), scored by its rule-based checker.

- generation: one clip per held-out caption, sampled in video mode through the family's own `generate`
  (`EvalContext.sample`: `<bov>` forced, the video tokenizer's t x h x w codes, `<eov>`; the settings' image
  temperature, top-k and guidance), decoded by the checkpoint's video tokenizer and read by the checker: accuracy of
  colour, shape, direction and all three, for new clips of trained caption triples (`held_out`) and, with
  `unseen`, for clips of triples no training clip shows (`novel`). A row that made no whole clip is scored wrong
  (`incomplete`);
- ceiling: the same ground-truth clips through the checkpoint's own video tokenizer, read by the checker (what a
  perfect model of the tokens would reach); `checker_ground_truth`: the checker on the clips themselves (100%);
  `chance`: one over the colours, shapes, directions and triples;
- loss per video token: the decoder's mean cross-entropy (nats) on the clip codes of each held-out document
  `<s> caption <bov> codes <eov> </s>`, and the same for an add-one unigram of the training clips' codes
  (`unigram_loss`; the training clips are redrawn from the split's seed; None with `train_clips` 0).

Prompts of one caption are batched together (captions in sorted order), and each batch of `batch_size` samples
with seed `seed + its first row` (the video experiment's seeds before it scored through this suite). The options
are the split the checkpoint was trained on (the video experiment's `--seed`, `--train-clips`, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from evaluation import clip_world as world
from evaluation.base import EvalContext, PageSample, Suite, SuiteResult, help_metadata

SPLITS = {"held_out": "held-out clips, trained triples", "novel": "held-out triples"}
TOKENIZER_BATCH = 64  # clips per encode / decode call (the video experiment's batching: the same codes, bit for bit)
LOSS_BATCH = 32  # documents per forward of the loss
SHOWN = 12  # page rows per split (generated clips)
SHOWN_CEILING = 4  # page rows of ground truth through the tokenizer


@dataclass(frozen=True)
class ClipOptions:
    """The clip world's split the checkpoint was trained on, and what to score."""

    split_seed: int = field(default=0, metadata=help_metadata("the seed of the clip world's split (the video "
                                                              "experiment's --seed)"))
    train_clips: int = field(default=2000, metadata=help_metadata("training clips of the split: their codes make the "
                                                                  "unigram reference of the loss (0: no unigram)"))
    held_out_clips: int = field(default=84, metadata=help_metadata("held-out clips of the trained triples, one "
                                                                   "sample each"))
    novel_clips: int = field(default=48, metadata=help_metadata("clips of the held-out triples, one sample each"))
    novel_triples: int = field(default=6, metadata=help_metadata("caption triples held out of training"))
    unseen: bool = field(default=True, metadata=help_metadata("also score the clips of the held-out triples"))

    def make_split(self) -> world.VideoSplit:
        """The seeded split (the training clips only when the unigram needs them)."""
        return world.make_split(self.train_clips, self.held_out_clips, self.novel_clips if self.scores_novel else 0,
                                self.novel_triples, self.split_seed)

    @property
    def scores_novel(self) -> bool:
        """Whether the held-out triples' clips are scored (asked for, and some drawn)."""
        return self.unseen and self.novel_clips > 0


def document_ids(vocab: Any, caption: str, codes: torch.Tensor) -> list[int]:
    """`<s> caption <bov> codes <eov> </s>`: a training document."""
    return list(vocab.encode_document([caption, codes.cpu()], bos=True, eos=True))


@torch.no_grad()
def video_token_loss(model: Any, vocab: Any, captions: list[str], codes: torch.Tensor, batch: int = LOSS_BATCH,
                     device: str = "cpu") -> float:
    """Mean cross-entropy (nats) of the model's predictions of every clip code of the given documents (the
    `<eov>` and text targets left out)."""
    from tokenizer.layout import image_code_mask

    rows = [torch.tensor(document_ids(vocab, c, g)) for c, g in zip(captions, codes)]
    total, count = 0.0, 0
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        length = max(len(r) for r in chunk)
        ids = torch.full((len(chunk), length), vocab.pad_id, dtype=torch.long)
        documents = torch.full((len(chunk), length), -1, dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, :len(r)], documents[i, :len(r)] = r, 0
        ids, documents = ids.to(device), documents.to(device)
        logits = model(ids, document_ids=documents)[:, :-1]
        targets = ids[:, 1:]
        is_code = image_code_mask(targets, vocab.image_offset, vocab.image_codes) & (documents[:, 1:] >= 0)
        loss = torch.nn.functional.cross_entropy(logits[is_code], targets[is_code], reduction="sum")
        total, count = total + float(loss), count + int(is_code.sum())
    return total / max(count, 1)


def unigram_loss(train_codes: torch.Tensor, held_out_codes: torch.Tensor, codebook_size: int) -> float:
    """Cross-entropy (nats) of the held-out codes under the training codes' add-one unigram."""
    counts = torch.bincount(train_codes.flatten(), minlength=codebook_size).double() + 1.0
    log_p = torch.log(counts / counts.sum())
    return float(-log_p[held_out_codes.flatten()].mean())


@torch.no_grad()
def encode_clips(tokenizer: Any, clips: np.ndarray, device: str = "cpu", batch: int = TOKENIZER_BATCH) -> torch.Tensor:
    """(N, t, h, w) codes of uint8 clips, on the CPU."""
    x = world.to_model_clips(clips)
    if not len(x):
        return torch.zeros((0, *tokenizer.video_grid), dtype=torch.long)
    return torch.cat([tokenizer.encode_clips(x[s:s + batch].to(device)).cpu() for s in range(0, len(x), batch)])


@torch.no_grad()
def round_trip_clips(tokenizer: Any, clips: np.ndarray, device: str = "cpu", batch: int = TOKENIZER_BATCH) -> np.ndarray:
    """uint8 clips through the video tokenizer's codes and back, as uint8."""
    x = world.to_model_clips(clips)
    out = [tokenizer.decode_clips(tokenizer.encode_clips(x[s:s + batch].to(device))).float().cpu()
           for s in range(0, len(x), batch)]
    return world.to_uint8_clips(torch.cat(out)) if out else np.zeros_like(clips)


def frame_grid(frames: np.ndarray, gap: int = 2) -> Image.Image:
    """A clip's frames in reading order on a near-square grid (the sample page shows square cells, where a strip
    of 8 frames would be squashed), white between frames and in unused cells."""
    from tokenizer.video.clips import frame_strip

    count, height, width, _ = frames.shape
    columns = int(np.ceil(np.sqrt(count)))
    rows = [frames[i:i + columns] for i in range(0, count, columns)]
    blank = np.full((height, width, 3), 255, dtype=np.uint8)
    rows[-1] = np.concatenate([rows[-1], np.repeat(blank[None], columns - len(rows[-1]), axis=0)])
    strips = [np.asarray(frame_strip(row, gap)) for row in rows]
    spacer = np.full((gap, strips[0].shape[1], 3), 255, dtype=np.uint8)
    stacked = [part for strip in strips for part in (strip, spacer)][:-1]
    return Image.fromarray(np.concatenate(stacked))


def _describe(reading: world.Reading) -> str:
    """What the checker read, for the page: `read: red square left` (`?` where it read nothing)."""
    return "read: " + " ".join(value or "?" for value in (reading.colour, reading.shape, reading.direction))


class ClipSuite(Suite):
    """Text-to-video on the clip world: checker accuracy against its ceiling and chance, loss per video token."""

    name = "clips"
    description = ("text-to-video on synthetic moving shapes: colour, shape and direction of clips sampled from "
                   "held-out captions (seen and unseen triples) read by a rule-based checker, against the video "
                   "tokenizer's ceiling and chance; held-out loss per video token against a unigram")
    Options = ClipOptions

    def check(self, context: EvalContext) -> None:
        """Refuse impossible options, a checkpoint without a video tokenizer or video markers, or one that writes
        no clips."""
        o = self.options
        if min(o.held_out_clips, o.novel_triples) < 1 or min(o.train_clips, o.novel_clips) < 0:
            raise ValueError("the clips suite needs --held-out-clips and --novel-triples of at least 1, and "
                             "--train-clips and --novel-clips of at least 0")
        tokenizer = context.media_tokenizer
        if tokenizer is None or getattr(tokenizer, "video_grid", None) is None:
            what = "no tokenizer" if tokenizer is None else f"a {getattr(tokenizer, 'kind', 'vq')!r} image tokenizer"
            raise ValueError(f"the clips suite samples video clips but got {what}: pass the video tokenizer bundle "
                             "the checkpoint's shards were made with (--media-tokenizer)")
        config = tokenizer.config
        if (int(config.image_size), int(config.clip_frames)) != (world.SIZE, world.FRAMES):
            raise ValueError(f"the clips suite draws {world.FRAMES} frames of {world.SIZE} px but --media-tokenizer "
                             f"makes {config.clip_frames} of {config.image_size} px: pass a tokenizer trained on the "
                             "clip world (configs/tokenizer/video-demo-32.yaml)")
        if not getattr(context.vocab, "has_video", False):
            raise ValueError("the clips suite samples video clips but --vocab has no <bov>/<eov> markers: pass the "
                             "vocabulary built with `train.py vocab --video` that the checkpoint was trained with")
        if not context.can_make_images() or "model" not in context.loaded.parts:
            raise ValueError(f"the clips suite samples video codes but a {context.family} checkpoint writes none: "
                             "score a decoder of image codes (chameleon family)")

    def run(self, context: EvalContext) -> SuiteResult:
        """Generation per split with its ceiling, the loss per video token and its unigram reference."""
        s, o = context.settings, self.options
        tokenizer, device = context.media_tokenizer, s.device
        split = o.make_split()
        sets = {"held_out": split.held_out, **({"novel": split.novel} if o.scores_novel else {})}
        samples: list[PageSample] = []
        context.progress(f"eval clips: the checker on {sum(len(c) for c in sets.values())} ground-truth clips and "
                         "their round trips through the video tokenizer")
        # one round trip of every held-out clip, in one sequence of batches (the video experiment's)
        recon = round_trip_clips(tokenizer, np.concatenate([c.clips for c in sets.values()]), device)
        bounds = np.cumsum([0] + [len(c) for c in sets.values()])
        ceiling, truth = {}, {}
        for k, (name, clips) in enumerate(sets.items()):
            ceiling[name] = world.score(world.check_clips(recon[bounds[k]:bounds[k + 1]]), clips.specs)
            truth[name] = world.score(world.check_clips(clips.clips), clips.specs)
        for i in range(min(SHOWN_CEILING, len(split.held_out))):
            reading = world.check_clip(recon[i])
            samples.append(PageSample("ceiling: ground truth through the video tokenizer", split.held_out.captions[i],
                                      frame_grid(recon[i]), correct=self._right(reading, split.held_out.specs[i]),
                                      note=_describe(reading)))
        generation, losses = {}, {}
        model = context.loaded.parts["model"]
        codes = {name: encode_clips(tokenizer, clips.clips, device) for name, clips in sets.items()}
        for name, clips in sets.items():
            context.progress(f"eval clips: sampling {len(clips)} clips ({SPLITS[name]})")
            frames, made = self._sample(context, clips.captions)
            readings = world.check_clips(frames)
            generation[name] = {**world.score(readings, clips.specs), "incomplete": int((~made).sum())}
            for i in range(min(SHOWN, len(clips))):
                samples.append(PageSample(SPLITS[name], clips.captions[i], frame_grid(frames[i]) if made[i] else None,
                                          correct=self._right(readings[i], clips.specs[i]),
                                          note=_describe(readings[i]) if made[i] else "no clip"))
            losses[name] = video_token_loss(model, context.vocab, clips.captions, codes[name], device=device)
        unigram = None
        if o.train_clips:
            train_codes = encode_clips(tokenizer, split.train.clips, device)
            codebook = int(tokenizer.config.codebook_size)
            unigram = {name: unigram_loss(train_codes, codes[name], codebook) for name in sets}
        figures: dict[str, Any] = {
            "split": {"split_seed": o.split_seed, "train_clips": o.train_clips,
                      "held_out_clips": len(split.held_out), "novel_clips": len(split.novel),
                      "novel_triples": [" ".join(t) for t in split.novel_triples]},
            "generation": {name: generation.get(name) for name in SPLITS},
            "ceiling": {name: ceiling.get(name) for name in SPLITS},
            "checker_ground_truth": {name: truth.get(name) for name in SPLITS},
            "chance": dict(world.CHANCE),
            "video_loss": {name: losses.get(name) for name in SPLITS},
            "unigram_loss": None if unigram is None else {name: unigram.get(name) for name in SPLITS}}
        figures["summary"] = {
            "all_held_out": generation["held_out"]["all"], "all_novel": (generation.get("novel") or {}).get("all"),
            "direction_held_out": generation["held_out"]["direction"],
            "ceiling_all_held_out": ceiling["held_out"]["all"], "video_loss_held_out": losses["held_out"],
            "unigram_loss_held_out": None if unigram is None else unigram["held_out"]}
        return SuiteResult(figures, samples)

    @staticmethod
    def _right(reading: world.Reading, spec: world.ClipSpec) -> bool:
        return (reading.colour, reading.shape, reading.direction) == spec.triple

    @staticmethod
    def _sample(context: EvalContext, captions: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """One clip per caption: uint8 frames (N, T, H, W, 3), black where none came out, and which rows made one."""
        from fusion_model.sampling.generate import Clip

        config = context.media_tokenizer.config
        out = np.zeros((len(captions), int(config.clip_frames), int(config.image_size), int(config.image_size), 3),
                       dtype=np.uint8)
        made = np.zeros(len(captions), dtype=bool)
        order = sorted(range(len(captions)), key=lambda i: captions[i])
        size = context.settings.batch_size
        for start in range(0, len(order), size):
            rows = order[start:start + size]
            # one call per batch, seeded by its first row: the video experiment's seeds, bit for bit
            sampling = context.sampling("video", seed=start)
            outputs, _ = context.sample([[captions[i]] for i in rows], sampling)
            for i, segments in zip(rows, outputs):
                clip = next((x for x in segments if isinstance(x, Clip)), None)
                if clip is not None:
                    out[i], made[i] = clip.frames, True
        return out, made
