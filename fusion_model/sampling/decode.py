"""The decode loop, the one every family samples through: `generate_ids` (ids in, new ids out) over plain and
speculative steps, handing whole images to a family that makes them in one piece (`spans.WholeImages`);
`compiled_step`."""

from __future__ import annotations

from typing import Any

import torch

from common.compat import check_compatible
from fusion_model.sampling.config import SamplingConfig
from fusion_model.sampling.feeder import CacheFeeder, round_up
from fusion_model.sampling.logits import new_noise_buffer, redraw_noise
from fusion_model.sampling.modality import ModalityRules, SeenTextTokens
from fusion_model.sampling.protocol import DecodableModel, check_decodable
from fusion_model.sampling.spans import Chunk, WholeImages
from fusion_model.sampling.speculative import SpeculativeStep
from fusion_model.sampling.step import PlainStep
from fusion_model.sampling.streams import Streams, build_streams

# on an accelerator, the steps between two reads of `done` (the only host synchronisation of the loop)
CHECK_DONE_EVERY = 32
# a compiled step is specialised to its shapes; rounding the cache up lets prompts of other lengths reuse it
COMPILED_CACHE_MULTIPLE = 128


@torch.inference_mode()
def generate_ids(
    model: DecodableModel,
    vocab: Any,
    prompts: list[list[int]],
    config: SamplingConfig,
    *,
    uncond_prompts: list[list[int]] | None = None,
    image_cond_prompts: list[list[int]] | None = None,
    stats: dict | None = None,
    whole_images: WholeImages | None = None,
) -> list[list[int]]:
    """Continue each prompt (ids, usually starting `<s>`); returns the new ids of each.

    All streams (conditional, unconditional, image-conditional) of all prompts are rows of one batch,
    so a step is one forward pass over a preallocated KV cache; every stream of a prompt receives the
    token chosen for that prompt. Default streams: u = `<s>`; img = `<s>` + the prompt's images.
    stats, when given, receives `forwards` (forward passes, the prefill included) and `image_tokens` (image
    codes generated, all prompts together).

    The model must satisfy protocol.DecodableModel (TypeError naming what it lacks otherwise). A model whose
    `supports_kv_cache` is False is sampled only with `use_kv_cache=False`: `use_kv_cache=True`, the default
    included, raises ValueError rather than silently taking the slow path.

    whole_images: a family whose images are made in one piece (Transfusion's denoised latents) rather than code by
    code: the loop samples through its feeder, and each image a prompt opens is the family's (spans.WholeImages);
    such a family guides its images itself, so the loop runs the conditional rows alone.
    """
    check_decodable(model)
    check_compatible(model=model.config, vocab=vocab)
    if config.use_kv_cache and not model.supports_kv_cache:
        raise ValueError(
            f"{type(model).__name__} has supports_kv_cache=False: sample it with use_kv_cache=False "
            "(--no-kv-cache), which recomputes the whole sequence every step"
        )
    if not prompts:
        return []
    if whole_images is not None and (config.compile or config.speculative_window):
        raise ValueError("--compile and --speculative-window run a one-token decode step over image codes; images "
                         "made whole by the model's family have neither: leave them out")
    if config.speculative_window and model.config.image_bidirectional:
        raise ValueError(
            "speculative_window needs causal attention inside images, but the model has image_bidirectional=True: "
            "drafts fed in one forward would see each other; use speculative_window=0"
        )
    device = next(model.parameters()).device
    context = int(model.config.max_seq_len)
    streams = build_streams(vocab, prompts, config, context, uncond_prompts, image_cond_prompts,
                            conditional_only=whole_images is not None)
    rules = ModalityRules(vocab, config, streams.prompts, streams.room(context, device), context)
    seen_text = SeenTextTokens(streams.prompts, rules.text_ok) if config.repetition_penalty != 1.0 else None
    generator = None
    if config.seed is not None:
        generator = torch.Generator(device=device).manual_seed(int(config.seed))
    # one spare column: the steps write a token for every prompt, those that take none into the spare one
    columns = max(rules.steps, 1) + 1
    if config.compile:  # the compiled step's shapes then repeat across prompt lengths (as its cache's)
        columns = round_up(columns, COMPILED_CACHE_MULTIPLE)
    out = torch.full((streams.n_prompts, columns), vocab.pad_id, dtype=torch.long, device=device)

    was_training = model.training
    model.eval()
    try:
        forwards = _decode(model, vocab, streams, rules, seen_text, config, generator, out, whole_images)
    finally:
        model.train(was_training)
    if stats is not None:
        generated = torch.arange(out.shape[1], device=device)[None, :] < rules.n_new[:, None]
        stats["forwards"] = forwards
        stats["image_tokens"] = int((rules.is_image[out] & generated).sum())
    return [row[:count] for row, count in zip(out.tolist(), rules.n_new.tolist())]


def _decode(
    model: DecodableModel,
    vocab: Any,
    streams: Streams,
    rules: ModalityRules,
    seen_text: SeenTextTokens | None,
    config: SamplingConfig,
    generator: torch.Generator | None,
    out: torch.Tensor,
    whole_images: WholeImages | None = None,
) -> int:
    """The decode loop until every prompt is done; fills `out`, returns the forwards made (the prefill included).

    The prefill and the first token run eagerly. Every later forward is a `PlainStep` (one token per prompt) or,
    with speculative_window and while a prompt is inside an image or a clip, a `SpeculativeStep`; compiled when
    config.compile. Text decoding with speculative_window on gives the plain sampler's tokens for a seed: its
    forwards are plain steps that draw the same noise. With whole_images, a step after prompts took `<boi>` hands
    their images to the family and feeds the spans it makes (`_write_whole_images`); image mode then takes `<boi>`
    after the prefill instead of feeding it with the prompt, since the family makes the image from the prompt alone.
    """
    window = int(config.speculative_window)
    rows, boi_first = streams.rows, None
    one_span = config.mode in ("image", "video")  # one image (clip), its opener forced, the row stops at its end
    opener = vocab.bov_id if config.mode == "video" else vocab.boi_id
    if one_span and whole_images is None:
        # image (video) mode forces <boi> (<bov>): it joins the prompt, so the prefill gives the first code's
        # distribution
        boi_first = ~rules.in_image & ~rules.done
        needs = boi_first.tolist()
        rows = [row + [opener] if needs[i % streams.n_prompts] else row for i, row in enumerate(rows)]
    if whole_images is not None:
        feeder = whole_images.feeder(rows, rules.steps, out.device)
    else:
        feeder = CacheFeeder(model, rows, vocab.pad_id, rules.steps, config.use_kv_cache, out.device,
                             chunk=window + 1, cache_multiple=COMPILED_CACHE_MULTIPLE if config.compile else 1)
    noise = new_noise_buffer(config, streams.n_prompts, int(vocab.vocab_size), out.device)
    step = PlainStep(feeder, streams, rules, seen_text, config, noise, vocab.pad_id, out)
    if boi_first is not None:
        step.take(torch.full_like(step.token, opener), boi_first)
    was_in_image = rules.in_image.clone()
    logits = feeder.prefill()
    if one_span and whole_images is not None:
        step.force(opener)
    else:
        step.choose(logits, redraw_noise(noise, generator))
    speculative = SpeculativeStep(step, window) if window else None
    if speculative is not None and bool(was_in_image.any()):  # (no noise drawn otherwise: text keeps its tokens)
        speculative.draw_noise(generator)
        speculative.start(logits, was_in_image)
    run = compiled_step(step, out.device) if config.compile else step
    run_speculative = speculative
    if speculative is not None and config.compile:
        run_speculative = compiled_step(speculative, out.device)
    forwards = 1

    def close_images() -> None:
        """Image (video) mode: `<eoi>` (`<eov>`) is forced after the last code, so it is taken without a forward."""
        closer = vocab.eov_id if config.mode == "video" else vocab.eoi_id
        step.take(torch.full_like(step.token, closer), rules.in_image)

    if one_span and speculative is None and whole_images is None:
        # the length is known (one read back here, none in the loop): a forward per code still to draw, then
        # <eoi>, which is forced, so it needs no forward
        left = int(torch.where(rules.done, 0, rules.n_codes - rules.codes_done).max())
        for _ in range(left):
            run(redraw_noise(noise, generator))
        close_images()
        return forwards + left
    # look for the end every step on CPU (free there) and every CHECK_DONE_EVERY steps elsewhere, where reading
    # `done` back waits for the device. Speculative decoding reads back once per forward whether it is done, whether
    # any prompt is inside an image and (image mode) whether only the forced <eoi> is left.
    check_every = 1 if out.device.type == "cpu" else CHECK_DONE_EVERY
    # every forward commits at least one token for every unfinished prompt, so rules.steps bounds the forwards
    for index in range(1, rules.steps):
        if whole_images is not None:  # eager (no compile): `done` and the opened images are read every step
            if rules.all_done:
                break
            opened = (~rules.done & (step.token == vocab.boi_id)).nonzero().flatten().tolist()
            if opened:
                logits = _write_whole_images(step, whole_images, opened, generator)
                if logits is None:  # every prompt ended with its image (image mode): nothing to feed
                    break
                step.choose(logits, redraw_noise(noise, generator))
                forwards += 1
                continue
        elif speculative is not None:
            live = ~rules.done
            # live prompts with more to sample than an image's forced <eoi>
            needs_forward = live & ~(rules.in_image & (rules.codes_done >= rules.n_codes))
            any_live, any_inside_image, any_needs_forward = torch.stack(
                [live.any(), (rules.in_image & live).any(), needs_forward.any()]).tolist()
            if not any_live:
                break
            if one_span and not any_needs_forward:
                close_images()
                break
            if any_inside_image:
                speculative.draw_noise(generator)
                run_speculative(redraw_noise(noise, generator))
                forwards += 1
                continue
        elif index % check_every == 0 and rules.all_done:
            break
        run(redraw_noise(noise, generator))
        forwards += 1
    return forwards


def _write_whole_images(step: PlainStep, images: WholeImages, opened: list[int],
                        generator: torch.Generator | None) -> torch.Tensor | None:
    """The images the `opened` prompts just opened, made by the family: their spans' ids after `<boi>` are taken as
    those prompts' tokens, and every prompt still going is fed its chunk in one forward (an opened one its span, the
    others their last token); the logits after each, or None when no prompt is left to feed."""
    rules, feeder = step.rules, step.feeder
    tokens, live = step.token.tolist(), (~rules.done).tolist()
    chunks: list[Chunk | None] = [([tokens[b]], None) if live[b] else None for b in range(len(live))]
    made = images.make(feeder, opened, generator)
    taking = torch.zeros_like(rules.done)
    taking[opened] = True
    for b, chunk in zip(opened, made):
        chunks[b] = chunk
    for k in range(1, len(made[0][0])):  # the rules count a span's positions one by one
        token = torch.full_like(step.token, step.pad_id)
        token[opened] = torch.tensor([chunk[0][k] for chunk in made], device=token.device)
        step.take(token, taking)
    still = (~rules.done).tolist()
    if not any(still):
        return None
    return feeder.feed([chunk if still[b] else None for b, chunk in enumerate(chunks)])


RECOMPILE_LIMIT = 64  # compiled decode steps one process may hold (models x shapes x settings)


def compiled_step(step: PlainStep | SpeculativeStep, device: torch.device):
    """`step` under torch.compile (one graph, static shapes); on CUDA mode="reduce-overhead", a CUDA graph.

    The compiled code is cached on the step's code, so later calls with the same shapes and settings reuse it.
    """
    # The state is mutated in place between replays, so a CUDA graph must take it at fixed addresses. guard=False:
    # a later generate call (new tensors) re-records the graph instead of recompiling. Marked on every device, so
    # the CPU tests run this too (only CUDA graphs read the mark).
    for tensor in step.state():
        torch._dynamo.mark_static_address(tensor, guard=False)
    mode = "reduce-overhead" if device.type == "cuda" else None
    # Every model, shape and setting sampled in one process adds a compiled entry to the same code object; past
    # dynamo's default limit of 8 a fullgraph compile is an error, not a fallback (a process that samples several
    # checkpoints, or the test suite, reaches it), so allow more.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(step.__call__, fullgraph=True, dynamic=False, mode=mode)
