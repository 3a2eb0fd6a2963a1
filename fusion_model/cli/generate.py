"""`python train.py generate`: sample mixed text-and-image sequences (and clips, with a video tokenizer) from a
checkpoint and write them as PNG files, animated GIF / MP4 clips with frame strips, a JSON of ids and a
self-contained HTML page."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from fusion_model.cli import DefaultsHelpFormatter
from fusion_model.families import BUILTIN_FAMILIES, family_class
from fusion_model.families.loading import checkpoint_family, load_family
from fusion_model.sampling import MODES, SamplingConfig
from fusion_model.sampling.output import write_samples

# The help line of each SamplingConfig field. The options themselves are generated from the dataclass's fields
# (`add_sampling_options`), so a new field gets its option without a new argparse line (help: this table, or the
# field's metadata["help"] for a family's own settings, which the checkpoint's family adds).
SAMPLING_HELP: dict[str, str] = {
    "mode": "text: text only; image: one image right after the prompt; video: one clip right after the prompt "
            "(needs a video tokenizer bundle as --image-tokenizer; written as GIF, MP4 and a frame strip); "
            "interleaved: the model chooses",
    "max_new_tokens": "new tokens per sample (default: until </s> or the context is full; image mode: one image)",
    "text_temperature": "temperature for text tokens; 0 = greedy",
    "text_top_k": "top-k for text tokens; 0 = off",
    "text_top_p": "top-p for text tokens; 1 = off",
    "image_temperature": "temperature for image tokens; 0 = greedy",
    "image_top_k": "top-k for image tokens; 0 = off",
    "image_top_p": "top-p for image tokens; 1 = off",
    "repetition_penalty": "penalty on repeated text tokens; 1 = off",
    "cfg_scale": "two-stream guidance for image tokens, u + s(c - u), u = the prompt '<s>'; 1 = off",
    "cfg_image_scale": "three-stream guidance (with --cfg-text-scale): u + s_img(img - u) + s_txt(full - img), "
                       "img = only the prompt's images",
    "cfg_text_scale": "text scale of three-stream guidance",
    "seed": "random seed (batch k uses seed + k)",
    "stop_at_eos": "keep sampling after </s>",
    "use_kv_cache": "recompute the whole sequence each step (slow; for checks)",
    "speculative_window": "speculative Jacobi decoding inside images: N >= 2 drafted codes checked per forward pass, "
                          "the same distribution in fewer passes (greedy: the same tokens); combines with "
                          "--compile; 0 = off (window 8 made 1.56x fewer passes per image on the demo's model, "
                          "but no CPU time was saved)",
    "compile": "torch.compile the decode step (on CUDA as a CUDA graph): the same tokens, faster steps after a "
               "one-off compile (9-26 s on 2 CPU cores); pays off after several thousand tokens per prompt shape",
}
# Where a field's option differs from the generated `--field-name` / `--no-field-name` (kept for compatibility).
FLAG_NAMES = {"stop_at_eos": "--no-eos-stop", "use_kv_cache": "--no-kv-cache"}
CHOICES: dict[str, tuple[str, ...]] = {"mode": MODES}
COMMAND_DEFAULTS: dict[str, Any] = {"seed": 0}  # a fixed seed: the same command writes the same samples
NOT_OPTIONS = {"image_grid", "video_grid"}  # taken from --image-tokenizer


def _option_type(hint: Any) -> Any:
    """`float | None` -> float; other annotations unchanged."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return hint


def add_sampling_options(group: Any, config_class: type = SamplingConfig) -> list[str]:
    """Add to `group` (a parser or argument group) one option per field of `config_class`, typed from its
    annotation, dest = the field name; returns those names.

    An unset option keeps the value of the starting config (SamplingConfig() or, with --chameleon-defaults,
    SamplingConfig.chameleon()); the help line shows both defaults when they differ.
    """
    hints = typing.get_type_hints(config_class)
    defaults, chameleon = config_class(), config_class.chameleon()
    dests = []
    for field in dataclasses.fields(config_class):
        name = field.name
        if name in NOT_OPTIONS or not field.init:
            continue
        kind, default = _option_type(hints[name]), getattr(defaults, name)
        help_ = field.metadata.get("help") or SAMPLING_HELP.get(name, f"SamplingConfig.{name}")
        if kind is bool:
            flag = FLAG_NAMES.get(name) or f"--{'no-' if default else ''}{name.replace('_', '-')}"
            group.add_argument(flag, dest=name, action="store_const", const=not default, default=None, help=help_)
            dests.append(name)
            continue
        notes = [f"default: {default}"] if default is not None and name not in COMMAND_DEFAULTS else []
        if getattr(chameleon, name) != default:
            notes.append(f"--chameleon-defaults: {getattr(chameleon, name)}")
        if notes:
            help_ += f" ({'; '.join(notes)})"
        options: dict[str, Any] = {"type": kind}
        if typing.get_origin(kind) is tuple:  # e.g. (h, w): one value per element
            options = {"type": typing.get_args(kind)[0], "nargs": len(typing.get_args(kind))}
        elif kind not in (int, float, str):
            raise TypeError(f"SamplingConfig.{name}: no command-line option for type {kind}; add it to NOT_OPTIONS")
        group.add_argument(FLAG_NAMES.get(name, f"--{name.replace('_', '-')}"), dest=name,
                           default=COMMAND_DEFAULTS.get(name), choices=CHOICES.get(name), help=help_, **options)
        dests.append(name)
    return dests


class _Segment(argparse.Action):
    """--prompt and --image append, in command-line order, to one list of prompt segments."""

    def __call__(self, parser, namespace, values, option_string=None):
        segments = list(getattr(namespace, "segments", None) or [])
        segments.append(values if self.dest == "prompt" else Path(values))
        namespace.segments = segments


def family_options_note() -> str:
    """Which options each built-in family adds to the sampling settings (shown with --checkpoint CKPT --help)."""
    base = {f.name for f in dataclasses.fields(SamplingConfig)}
    added = []
    for name in BUILTIN_FAMILIES:
        extra = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(family_class(name).sampling_config)
                 if f.name not in base]
        if extra:
            added.append(f"{name}: {', '.join(extra)}")
    return ("A checkpoint's family may add sampling options (--checkpoint CKPT --help shows them): "
            + "; ".join(added) + ".") if added else ""


def parser(config_class: type[SamplingConfig] = SamplingConfig) -> argparse.ArgumentParser:
    """The command-line options (every one has a help line), with one sampling option per field of `config_class`
    (the checkpoint's family's `sampling_config`)."""
    p = argparse.ArgumentParser(
        prog="train.py generate",
        description=__doc__,
        formatter_class=DefaultsHelpFormatter,
        epilog="Example: python train.py generate --checkpoint runs/fit/last.ckpt --vocab runs/vocab/tokenizer.json "
        "--image-tokenizer runs/tokenizer/export --prompt 'a photo of a seven' --mode image --cfg-scale 1.5. "
        + (family_options_note() if config_class is SamplingConfig else ""),
    )
    io = p.add_argument_group("model and tokenizers")
    io.add_argument("--checkpoint", required=True,
                    help="a Lightning checkpoint (.ckpt from `train.py fit` or `train.py convert import`) "
                         "or a transformers Chameleon directory (from `train.py convert export`)")
    io.add_argument("--base", help="a LoRA checkpoint's base weights, when they moved from the path it recorded "
                                   "(refused unless they are the weights it was trained on)")
    io.add_argument("--vocab", help="the unified tokenizer.json the model was trained with "
                                    "(default: tokenizer.json inside a transformers checkpoint directory)")
    io.add_argument("--media-tokenizer", "--image-tokenizer", dest="image_tokenizer", metavar="BUNDLE", help="image or video tokenizer bundle (save_pretrained / `train.py tokenizer "
                                              "export`); needed for image prompts and image output; a video "
                                              "tokenizer's bundle also sizes and decodes clips (--mode video)")
    io.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    io.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="decoder weight dtype (use float32 on CPU)")

    pr = p.add_argument_group("prompts")
    pr.add_argument("--prompt", action=_Segment, metavar="TEXT",
                    help="a text segment of the prompt; repeat and mix with --image, order is kept")
    pr.add_argument("--image", action=_Segment, metavar="PATH",
                    help="an image segment of the prompt (PNG/JPEG path); repeat and mix with --prompt")
    pr.add_argument("--prompts-file", metavar="JSONL",
                    help='one prompt per line: {"segments": [{"text": "..."}, {"image": "path"}]} or {"text": "..."}; '
                         "image paths are relative to the file")
    pr.add_argument("--chat", action="store_true",
                    help="answer as the assistant of a chat (tokenizer/chat.py's template): --prompt / --image make "
                         "one user turn, or give --conversation; stops at the answer's </s>; default --mode: "
                         "interleaved with an image tokenizer, else text")
    pr.add_argument("--conversation", metavar="FILE",
                    help='a chat (implies --chat): .json {"messages": [{"role": "user", "content": ...}]} or a '
                         ".jsonl whose first line is one; image paths relative to the file; every user turn with "
                         "no assistant turn after it is answered, in order, each answer kept for the next")
    pr.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    pr.add_argument("--batch-size", type=int, default=8, help="prompts sampled together in one batch")

    s = p.add_argument_group("sampling (SamplingConfig)")
    s.add_argument("--chameleon-defaults", action="store_true",
                   help="start from Chameleon's release settings (temperature 0.7, top-p 0.9, text repetition "
                        "penalty 1.2, three-stream CFG 1.2 / 3.0); explicit options below override them")
    add_sampling_options(s, config_class)

    p.add_argument("--out", default="runs/samples", help="output directory (PNGs, samples.json, index.html)")
    return p


def read_prompts(args: argparse.Namespace) -> list[list[Any]]:
    """Prompts from --prompt/--image and --prompts-file, each a list of str / Path segments."""
    prompts: list[list[Any]] = []
    if getattr(args, "segments", None):
        prompts.append(list(args.segments))
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise FileNotFoundError(f"--prompts-file {path} does not exist")
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                items = entry["segments"] if "segments" in entry else [{"text": entry["text"]}]
                prompt = [s["text"] if "text" in s else path.parent / s["image"] for s in items]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(
                    f'{path}:{number}: not a prompt ({error}); write {{"segments": [{{"text": "..."}}, {{"image": "a.png"}}]}}'
                ) from error
            prompts.append(prompt)
    if not prompts:
        prompts.append([])  # no prompt: sample from <s> alone
    return prompts


def check_prompt_images(prompts: list[list[Any]]) -> None:
    """Open every prompt image (--image, --prompts-file) as the tokenizers' preprocessing does, before the model
    loads: a missing, unreadable, too small or too large one is one line naming its file."""
    from tokenizer.image.preprocess import open_image

    for prompt in prompts:
        for segment in prompt:
            if isinstance(segment, Path):
                open_image(segment, name=f"prompt image {segment}")


def sampling_config(args: argparse.Namespace, config_class: type[SamplingConfig] = SamplingConfig) -> SamplingConfig:
    """`config_class` (the checkpoint's family's sampling settings) from the options: its defaults, or Chameleon's
    with --chameleon-defaults, with every option given on top."""
    base = config_class.chameleon() if args.chameleon_defaults else config_class()
    fields = [f.name for f in dataclasses.fields(config_class)]
    values = {name: getattr(args, name) for name in fields if getattr(args, name, None) is not None}
    values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}
    if args.cfg_scale is not None and args.cfg_image_scale is None:
        values["cfg_image_scale"] = values["cfg_text_scale"] = None  # an explicit two-stream request wins
    return replace(base, **values)


def run(args: argparse.Namespace, config_class: type[SamplingConfig] = SamplingConfig) -> dict[str, Path]:
    """Load, sample in batches, write; returns the written JSON and HTML paths. `config_class`: the sampling
    settings of the checkpoint's family (what `parse_arguments` parsed the options for)."""
    from tokenizer.vocab import UnifiedVocab

    if args.num_samples < 1 or args.batch_size < 1:
        raise ValueError("--num-samples and --batch-size must be at least 1")
    config = sampling_config(args, config_class)  # checked before the model loads
    turns = read_conversation(args) if getattr(args, "chat", False) or getattr(args, "conversation", None) else None
    prompts = read_prompts(args) if turns is None else [list(turn.parts) for turn in turns]
    check_prompt_images(prompts)
    prompts = [p for p in prompts for _ in range(args.num_samples)]
    dtype = getattr(torch, args.dtype)
    # any family's checkpoint (the family says how it samples); a LoRA adapter comes merged into its base
    loaded = load_family(args.checkpoint, base=getattr(args, "base", None))
    for part in loaded.parts.values():
        part.to(device=args.device, dtype=dtype).eval()
    bundled_vocab = Path(args.checkpoint) / "tokenizer.json"  # a transformers directory carries its vocabulary
    vocab_path = args.vocab or (bundled_vocab if bundled_vocab.is_file() else None)
    if vocab_path is None:
        raise ValueError("--vocab is required: pass the tokenizer.json the checkpoint was trained with")
    vocab = UnifiedVocab.load(vocab_path)
    image_tokenizer = None
    if args.image_tokenizer:
        from tokenizer.bundle import load_media_tokenizer

        # either kind of bundle: codes (VQ) or continuous latents, as the checkpoint's family reads them
        image_tokenizer = load_media_tokenizer(args.image_tokenizer, map_location=args.device)
    loaded.check_tokenizers(vocab, image_tokenizer, where=f"--checkpoint {args.checkpoint}")
    if config.compile:  # otherwise the first batch is silent for the length of the compile
        print("generate: compiling the decode step (once per batch shape and settings; 9-26 s on 2 CPU cores)",
              flush=True)
    if turns is not None:
        if args.mode is None:  # a chat answers in what it can write back
            config = replace(config, mode="interleaved" if image_tokenizer is not None else "text")
        return run_chat(args, config, loaded, vocab, image_tokenizer, turns)
    samples, ids = [], []
    for k, start in enumerate(range(0, len(prompts), args.batch_size)):
        batch_config = replace(config, seed=config.seed + k)
        out, new_ids = loaded.family.generate(loaded.parts, vocab, image_tokenizer,
                                              prompts[start : start + args.batch_size], batch_config)
        samples += out
        ids += new_ids
    settings = asdict(config) | {"checkpoint": str(args.checkpoint)}
    if getattr(image_tokenizer, "video_grid", None) is not None:  # the clips' (t, h, w), as the sampler used it
        settings["video_grid"] = [int(n) for n in image_tokenizer.video_grid]
    return write_samples(args.out, samples, prompts=prompts, ids=ids, settings=settings, title="train.py generate")


def read_conversation(args: argparse.Namespace) -> list[Any]:
    """The turns `--chat` answers (`tokenizer.chat.Turn`s): --conversation FILE, or one user turn of --prompt /
    --image; refuses a chat with nothing left to answer."""
    from tokenizer.chat import Turn, load_conversation, pending_turns

    segments = list(getattr(args, "segments", None) or [])
    if args.prompts_file:
        raise ValueError("--chat takes --prompt / --image (one user turn) or --conversation FILE, not --prompts-file")
    if args.conversation:
        if segments:
            raise ValueError("--conversation FILE holds the whole chat: leave out --prompt and --image")
        turns, where = load_conversation(args.conversation), f"--conversation {args.conversation}"
    elif segments:
        turns, where = [Turn("user", tuple(segments))], "--prompt"
    else:
        raise ValueError("--chat needs a user turn: --prompt TEXT (and --image PATH) or --conversation FILE")
    if not pending_turns(turns):
        raise ValueError(f"{where}: no user turn is left to answer (each has an assistant turn after it); end the "
                         "chat with a user turn")
    return turns


def _message(turn: Any, entries: list[dict] | None = None) -> dict[str, Any]:
    """A turn in the chat-messages convention; a generated answer from its samples.json entries (files by name)."""
    content: list[dict[str, Any]] = []
    if entries is None:
        for part in turn.parts:
            content.append({"type": "text", "text": part} if isinstance(part, str)
                           else {"type": "image", "path": str(part)})
        return {"role": turn.role, "content": content}
    for entry in entries:
        if "text" in entry:
            content.append({"type": "text", "text": entry["text"]})
        else:
            content.append({"type": "video" if "clip" in entry else "image", "path": entry.get("clip") or entry["image"]})
    return {"role": "assistant", "content": content}


def run_chat(args: argparse.Namespace, config: SamplingConfig, loaded: Any, vocab: Any, image_tokenizer: Any,
             turns: list[Any]) -> dict[str, Path]:
    """`--chat`: each sample's model answers the pending user turns in order (tokenizer.chat.prompt_segments, so
    any family reads the chat as a prompt), its answers kept in its context; writes one sample per answer and the
    conversations in samples.json."""
    from common.files import atomic_write_json
    from tokenizer.chat import answer_turn, pending_turns, prompt_segments

    contexts: list[list[Any]] = [[] for _ in range(args.num_samples)]
    answers: list[list[tuple[int, list[Any], list[int]]]] = [[] for _ in contexts]  # (turn index, out, ids)
    given = 0
    for index in pending_turns(turns):
        for context in contexts:
            context += turns[given : index + 1]
        given = index + 1
        for k, start in enumerate(range(0, len(contexts), args.batch_size)):
            batch = contexts[start : start + args.batch_size]
            out, new_ids = loaded.family.generate(loaded.parts, vocab, image_tokenizer,
                                                  [prompt_segments(vocab, c) for c in batch],
                                                  replace(config, seed=config.seed + k))
            for b, context in enumerate(batch):
                answers[start + b].append((len(context), out[b], new_ids[b]))
                context.append(answer_turn(vocab, new_ids[b], out[b]))
    for context in contexts:
        context += turns[given:]
    order = [(s, a) for s in range(len(contexts)) for a in range(len(answers[s]))]
    settings = asdict(config) | {"checkpoint": str(args.checkpoint), "chat": True,
                                 "conversation": args.conversation}
    paths = write_samples(args.out, [answers[s][a][1] for s, a in order],
                          prompts=[list(contexts[s][answers[s][a][0] - 1].parts) for s, a in order],
                          ids=[answers[s][a][2] for s, a in order], settings=settings,
                          title="train.py generate --chat")
    body = json.loads(paths["json"].read_text())
    written = {pair: record for pair, record in zip(order, body["samples"])}
    conversations = []
    for s, context in enumerate(contexts):
        made = {position: written[(s, a)]["output"] for a, (position, _, _) in enumerate(answers[s])}
        conversations.append({"sample": s, "messages": [_message(turn, made.get(i)) for i, turn in enumerate(context)]})
        for a, (position, _, _) in enumerate(answers[s]):
            written[(s, a)] |= {"conversation": s, "message": position}
    atomic_write_json(paths["json"], body | {"conversations": conversations})
    return paths


def _printable(text: str) -> str:
    """Control characters (an untrained model's bytes: carriage returns, escapes) written as `\\x0d`, so they
    cannot garble a terminal or a log; newlines and tabs stay."""
    return "".join(ch if ch.isprintable() or ch in "\n\t" else ascii(ch)[1:-1] for ch in text)


def _segments_text(entries: list[dict], out_dir: Path, max_chars: int) -> str:
    """Segments as one string: text as is, images as `<image: path>`, clips as `<clip: gif, mp4, strip>`; text past
    `max_chars` is cut (with a note) but every image and clip marker is kept, so each written file's path is
    shown."""
    parts, left, cut = [], max_chars, 0
    for entry in entries:
        if "text" in entry:
            text = _printable(entry["text"])
            parts.append(text[:left] + ("…" if 0 < left < len(text) else ""))
            cut += max(len(text) - left, 0)
            left = max(left - len(text), 0)
        elif "clip" in entry:
            files = [entry["clip"], *([entry["mp4"]] if "mp4" in entry else []), entry["strip"]]
            parts.append(f"<clip: {', '.join(str(out_dir / name) for name in files)}>")
        else:
            parts.append(f"<image: {entry.get('source') or out_dir / entry['image']}>")
    joined = "".join(parts) or "(nothing)"
    return joined + (f" [{cut:,} more characters in samples.json]" if cut else "")


def describe_samples(json_path: str | Path, max_chars: int = 500) -> str:
    """What `samples.json` holds, for the terminal or a log: per sample its prompt and generated text (images as
    `<image: path>`, each text cut to `max_chars`), then the number of image files written."""
    json_path = Path(json_path)
    out_dir = json_path.parent
    samples = json.loads(json_path.read_text())["samples"]
    lines, images, clips = [], 0, 0
    for number, sample in enumerate(samples, start=1):
        label = f"[{number}/{len(samples)}]"
        indent = " " * (len(label) + 1)
        if "prompt" in sample:
            prompt = _segments_text(sample["prompt"], out_dir, max_chars)
            lines.append(f"{label} prompt: {prompt}".replace("\n", "\n" + indent))
            label = indent[:-1]
        output = _segments_text(sample["output"], out_dir, max_chars)
        lines.append(f"{label} output: {output}".replace("\n", "\n" + indent))
        images += sum("image" in entry for entry in sample["output"])
        clips += sum("clip" in entry for entry in sample["output"])
    shown = f"{images} generated image files" + (f" and {clips} generated clips (GIF" + (
        ", MP4" if any("mp4" in e for s in samples for e in s["output"]) else "") + " and a frame strip each)"
        if clips else "")
    lines.append(f"generate: {len(samples)} samples, {shown} in {out_dir}")
    return "\n".join(lines)


def given_checkpoint(argv: list[str]) -> str | None:
    """The --checkpoint of a command line, read before the rest (its family decides the sampling options)."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--checkpoint")
    return early.parse_known_args(argv)[0].checkpoint


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, type[SamplingConfig]]:
    """The options, parsed for the sampling settings of the checkpoint's family (read from its hparams, not its
    weights); an option of another family's settings is refused in one sentence naming both."""
    checkpoint = given_checkpoint(argv)
    helping = any(arg in ("-h", "--help") for arg in argv)
    if checkpoint is None or (helping and not Path(checkpoint).exists()):
        return parser().parse_args(argv), SamplingConfig  # --help, or argparse's own error for a missing flag
    family = checkpoint_family(checkpoint)
    config_class = family.sampling_config
    args, unknown = parser(config_class).parse_known_args(argv)
    flags = {arg.partition("=")[0] for arg in unknown if arg.startswith("--")}
    for name in BUILTIN_FAMILIES:
        other = family_class(name).sampling_config
        theirs = {f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(other)} - {
            f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(config_class)}
        for flag in sorted(flags & theirs):
            raise ValueError(f"{flag} applies to {getattr(other, 'applies_to', f'a {name} checkpoint')}; "
                             f"{checkpoint} is a {family.name} one")
    if unknown:
        parser(config_class).parse_args(argv)  # argparse's message for what no family knows (exit 2)
    return args, config_class


def main(argv: list[str] | None = None) -> int:
    """Entry point for `python train.py generate ...`; bad input raises ValueError (exit code 2 in `train.py`)."""
    args, config_class = parse_arguments(list(sys.argv[1:] if argv is None else argv))
    paths = run(args, config_class)
    print(describe_samples(paths["json"]))
    print(f"generate: wrote {paths['html']} and {paths['json']}")
    return 0
