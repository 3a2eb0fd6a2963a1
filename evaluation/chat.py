"""The `chat` suite: held-out conversations about the demo's digits (`evaluation.chat_data`: visual chat, image
generation, interleaved "draw the next digit", text only), each answered once as the assistant through the family's
own `generate` (the chat template's prompt, `tokenizer.chat.prompt_segments`: what `train.py generate --chat`
sends), and scored exactly:
- text answers (visual_chat, text_only): right when the answer is the digit's name and nothing else (case, outer
  spaces and a final full stop aside) and opens no image; `names_answer` is the lenient reading (the last digit word);
- image answers (image_generation, interleaved): right when the answer's first complete image is read by the demo's
  classifier as the asked digit; interleaved also scores the sentence after the image (`sentence_accuracy`);
- the wrong-modality rates: answers that open an image where none was asked, and text-only answers where one was.

The conversations are the held-out JSONL a run wrote (`--conversations`, e.g. the SFT experiment's
`<out>/chat/held_out.jsonl`, its `.labels.json` beside it), or, by default, `prompts_per_skill` conversations per
category made from the demo split's held-out digits with the settings' seed. The model answers in interleaved mode:
greedy text, images with the settings' temperature, top-k and guidance."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from evaluation import chat_data
from evaluation import digits_data as data
from evaluation.base import EvalContext, PageSample, Suite, SuiteResult, first_image, help_metadata, text_of
from evaluation.digits import DemoDigitsOptions, load_classifier, read_digits

TEXT_ANSWERS = tuple(c for c in chat_data.CATEGORIES if not chat_data.ASKS_FOR_IMAGE[c])
IMAGE_ANSWERS = tuple(c for c in chat_data.CATEGORIES if chat_data.ASKS_FOR_IMAGE[c])
MAX_TEXT_TOKENS = 24  # room for an answer's text (the longest right one, "That is a seven.", is 6 tokens in the demo)
SHOWN = 8  # page rows per category
CONVERSATION_STREAM = 11  # the default conversations' own random stream (beside the settings' seed)


@dataclass(frozen=True)
class ChatOptions(DemoDigitsOptions):
    """The chat suite's options: the demo's classifier and split, or a conversations file."""

    conversations: str = field(default="", metadata=help_metadata(
        "held-out conversations to answer: a JSONL written by evaluation.chat_data (its .labels.json beside it, "
        "e.g. an SFT run's chat/held_out.jsonl); default: --prompts-per-skill per category from the demo split's "
        "held-out digits"))

    def labels_path(self) -> Path:
        """The `.labels.json` beside --conversations (what each conversation asks and its right answer)."""
        path = Path(self.conversations)
        return path.with_name(path.name.removesuffix(".jsonl") + ".labels.json")


def normalise(text: str) -> str:
    """An answer as exact match compares it: lower case, outer spaces and a final full stop dropped."""
    return text.strip().lower().rstrip(".").strip()


def read_answer(segments: list[Any], new_ids: list[int], boi_id: int) -> dict[str, Any]:
    """What one answer holds: its text (all text segments), its first complete image, whether it opened any image
    (`<boi>`, complete or not), and the text after its first image."""
    first = next((i for i, s in enumerate(segments) if not isinstance(s, str)), len(segments))
    return {"text": text_of(segments), "after_image": text_of(segments[first + 1:]),
            "image": first_image(segments), "opened_image": int(boi_id) in new_ids}


def text_answer_is_right(text: str, opened_image: bool, digit: int) -> bool:
    """A text answer is right when it is the digit's name alone and opened no image (a complete one opens too)."""
    return not opened_image and normalise(text) == data.DIGIT_WORDS[digit]


def score(conversations: list[chat_data.Conversation], answers: list[dict[str, Any]],
          predicted: list[int | None]) -> dict[str, Any]:
    """Per category: accuracy (text: exact match of the digit's name, no image; image: the classifier reads the
    asked digit in the answer's first image), the wrong-modality rate, and lenient / sentence scores; overall: the
    rate of images where none was asked and of text-only answers where an image was."""
    per: dict[str, dict[str, Any]] = {}
    for category in chat_data.CATEGORIES:
        rows = [(c, a, p) for c, a, p in zip(conversations, answers, predicted) if c.category == category]
        if not rows:
            continue
        n = len(rows)
        if category in TEXT_ANSWERS:
            per[category] = {
                "count": n, "accuracy": float(np.mean([text_answer_is_right(a["text"], a["opened_image"], c.answer)
                                                for c, a, _ in rows])),
                "names_answer": float(np.mean([data.parse_digit(a["text"]) == c.answer for c, a, _ in rows])),
                "image_when_none_asked": float(np.mean([a["opened_image"] for _, a, _ in rows])),
            }
        else:
            correct = [p is not None and p == c.answer for c, _, p in rows]
            per[category] = {
                "count": n, "accuracy": float(np.mean(correct)),
                "text_only_when_image_asked": float(np.mean([a["image"] is None for _, a, _ in rows])),
            }
            if category == "interleaved":
                sentence = [data.parse_digit(a["after_image"]) == c.answer for c, a, _ in rows]
                per[category]["sentence_accuracy"] = float(np.mean(sentence))
                per[category]["image_and_sentence"] = float(np.mean([ok and s for ok, s in zip(correct, sentence)]))
    text_rows = [per[c] for c in TEXT_ANSWERS if c in per]
    image_rows = [per[c] for c in IMAGE_ANSWERS if c in per]

    def weighted(rows: list[dict[str, Any]], key: str) -> float:
        return sum(r[key] * r["count"] for r in rows) / max(sum(r["count"] for r in rows), 1)

    return {"categories": per, "mean_accuracy": float(np.mean([r["accuracy"] for r in per.values()])),
            "image_when_none_asked": weighted(text_rows, "image_when_none_asked"),
            "text_only_when_image_asked": weighted(image_rows, "text_only_when_image_asked")}


class ChatSuite(Suite):
    """Held-out digit conversations answered as the assistant, scored per category and by modality."""

    name = "chat"
    description = ("held-out chat conversations about the demo's digits (visual chat, image generation, "
                   "interleaved, text only), answered through the chat template and scored per category")
    Options = ChatOptions

    def check(self, context: EvalContext) -> None:
        """Refuse a checkpoint without an image tokenizer, a missing classifier or conversations file."""
        self.options.check_inputs(context, self.name)
        if self.options.conversations:
            for needed in (Path(self.options.conversations), self.options.labels_path()):
                if not needed.is_file():
                    raise FileNotFoundError(f"{needed} does not exist: --conversations names a held-out JSONL "
                                            "written by evaluation.chat_data.write_split, with its .labels.json")

    def conversations(self, context: EvalContext) -> tuple[list[chat_data.Conversation], list[list[Any]]]:
        """The held-out conversations and each one's user parts (text, PIL images at the tokenizer's size)."""
        if self.options.conversations:
            folder = Path(self.options.conversations).parent
            labels = self.options.labels_path()
            conversations = chat_data.read_labels(folder, labels.name.removesuffix(".labels.json"))
            pictures: dict[Path, Image.Image] = {}

            def picture(path: Path) -> Image.Image:
                if path not in pictures:
                    pictures[path] = Image.open(folder / path).convert("RGB")
                return pictures[path]

            return conversations, [[picture(p) if isinstance(p, Path) else p for p in chat_data.user_parts(c)]
                                   for c in conversations]
        from tokenizer.image import to_pil

        split = data.load_digits(held_out=self.options.held_out, seed=self.options.split_seed)
        rng = np.random.default_rng([context.settings.seed, CONVERSATION_STREAM])
        per = context.settings.prompts_per_skill
        conversations = chat_data.make_conversations(split.test_labels, dict.fromkeys(chat_data.CATEGORIES, per),
                                                     "held_out", rng)
        size = int(getattr(context.media_tokenizer.config, "image_size", 64))
        shown = sorted({c.user_image for c in conversations if c.user_image >= 0})
        images = dict(zip(shown, to_pil(data.to_model_images(split.test_images[shown], size)) if shown else []))
        names = {Path(chat_data.image_name("held_out", i)): image for i, image in images.items()}
        return conversations, [[names[p] if isinstance(p, Path) else p for p in chat_data.user_parts(c)]
                               for c in conversations]

    def run(self, context: EvalContext) -> SuiteResult:
        """Answer every conversation, read the images with the classifier, score."""
        from tokenizer.chat import Turn, prompt_segments

        conversations, user_parts = self.conversations(context)
        classifier = load_classifier(self.options.classifier_path())
        h, w = (int(n) for n in context.media_tokenizer.grid_shape)
        prompts = [prompt_segments(context.vocab, [Turn("user", tuple(parts))]) for parts in user_parts]
        context.progress(f"eval chat: answering {len(prompts)} held-out conversations")
        config = context.sampling("interleaved", max_new_tokens=h * w + 2 + MAX_TEXT_TOKENS)
        outputs, new_ids = context.sample(prompts, config)
        answers = [read_answer(out, ids, context.vocab.boi_id) for out, ids in zip(outputs, new_ids)]
        targets = np.array([c.answer for c in conversations])
        made, read, _ = read_digits(classifier, [a["image"] for a in answers], targets)
        predicted = [int(p) if m else None for p, m in zip(read, made)]
        figures = score(conversations, answers, predicted)
        figures["generated_tokens"] = sum(len(ids) for ids in new_ids)
        # each answer as scored, in the conversations' order (the images are on the page)
        figures["answers"] = [{"category": c.category, "text": a["text"], "image_read": p,
                               "opened_image": a["opened_image"]}
                              for c, a, p in zip(conversations, answers, predicted)]
        figures["summary"] = {"mean_accuracy": figures["mean_accuracy"],
                              **{c: r["accuracy"] for c, r in figures["categories"].items()}}
        return SuiteResult(figures, self._page(conversations, user_parts, answers, predicted))

    @staticmethod
    def _page(conversations: list[chat_data.Conversation], user_parts: list[list[Any]],
              answers: list[dict[str, Any]], predicted: list[int | None]) -> list[PageSample]:
        """The first few conversations of each category: the answer's image and text, and the verdict."""
        samples: list[PageSample] = []
        for category in chat_data.CATEGORIES:
            picks = [i for i, c in enumerate(conversations) if c.category == category][:SHOWN]
            for i in picks:
                c, a, p = conversations[i], answers[i], predicted[i]
                ok = p == c.answer if chat_data.ASKS_FOR_IMAGE[category] else text_answer_is_right(a["text"], a["opened_image"], c.answer)
                prompt = " ".join("<image>" if isinstance(part, Image.Image) else part for part in user_parts[i])
                read = f"; read: {data.DIGIT_WORDS[p]}" if p is not None else ""
                # an image answer shows the image made; a text answer, the image it was asked about (if any)
                asked = next((part for part in user_parts[i] if isinstance(part, Image.Image)), None)
                image = a["image"] if chat_data.ASKS_FOR_IMAGE[category] else asked
                samples.append(PageSample(category, prompt, image, text=a["text"], correct=bool(ok),
                                          note=f"answer: {data.DIGIT_WORDS[c.answer]}{read}"))
        return samples
