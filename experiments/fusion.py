"""`python train.py experiment fusion`: early fusion against LLaVA, BLIP-2 and Flamingo connectors on the demo's data.

Every model has the demo's decoder (same size, same fit recipe) and trains on the same packed documents for the same
number of optimizer steps; the late-fusion models read the image tokenizer's pre-quantisation features (early fusion
reads the codes those features round to). The frozen-LM recipes start from a "blind" language model trained first on
the same documents with every image hidden behind placeholders. Needs a finished demo (`python train.py demo`): its tokenizer, vocabulary, raw
shards and classifier. Writes `<out>/results.json` and `<out>/results.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.files import atomic_write_json, atomic_write_text
from experiments.demo.datasets import caption, parse_digit, to_model_images
from experiments.demo.settings import FIT_CONFIG, DemoConfig, load_config
from experiments.demo.stages import digits_for, load_image_tokenizer, load_vocab, require_outputs
from fusion_model.families.late.family import BoundImages
from fusion_model.families.late.model import LateFusionConfig, LateFusionModel, late_layout
from fusion_model.sampling import SamplingConfig, generate_ids
from tokenizer.layout import image_code_mask

# the models compared: early fusion from scratch (as the demo), with its loss on text only (LLaVA's objective: the
# images are read, never predicted), and from the blind language model the late-fusion recipes start from (the same
# decoder training as theirs); "llava_stage1" is LLaVA after its projector-only stage
EARLY = ("early", "early_text_loss", "early_from_lm")
MODELS = (*EARLY, "llava_stage1", "llava", "qformer", "flamingo")
ALBUM_SIZES = (2, 6)  # captioned digits per album document, at least / at most: 4 shots + the query fit in one
SAMPLES_SHOWN = 12  # held-out digits whose captions the report shows


@dataclass
class ExperimentConfig:
    """The comparison's settings; defaults are the full run (about 18 minutes on 2 CPU cores)."""

    demo: str = "full"  # the demo preset whose finished outputs are reused
    demo_dir: str | None = None  # default: that preset's out_dir
    out_dir: str = "runs/fusion"
    steps: int = 1000  # optimizer steps of every multimodal model (the demo's batches: 8 rows x 256 tokens)
    blind_lm_steps: int = 1000  # the blind language model the late-fusion recipes start from
    llava_stage1_steps: int = 200  # LLaVA's projector-only stage, out of `steps`
    qformer_stage1_steps: int = 300  # BLIP-2's stage 1 (contrastive, matching, generation) on the caption documents
    num_queries: int = 8  # Q-Former positions per image (BLIP-2: 32 for 257 patches; here 16 patches)
    num_latents: int = 16  # Flamingo's resampled vectors per image (Flamingo: 64)
    albums: int = 2000  # interleaved documents of 4 captioned digits added to the demo's (in-context learning data)
    examples: int = 500  # held-out digits captioned (at most the demo's held-out count)
    few_shot_examples: int = 200  # of those, queried with 0 / 1 / 4 captioned examples in context
    shots: tuple[int, ...] = (0, 1, 4)
    seed: int = 0


# ---------------------------------------------------------------- greedy captioning, one rule for every model


# A decoder view for the sampler (fusion_model.sampling.protocol.DecodableModel) and the prompt rows it reads, from
# a batch of early-layout prompts (N, L) and their per-position features (N, L, C).
Decodable = Callable[[torch.Tensor, torch.Tensor], tuple[Any, list[list[int]]]]


def greedy_captions(decodable: Decodable, prompts: torch.Tensor, prompt_features: torch.Tensor, vocab, *,
                    max_new_tokens: int = 16, batch_size: int = 100) -> list[str]:
    """Greedy text after each prompt (N, L) (early layout, features (N, L, C)), through the sampler users run
    (`generate_ids` in text mode at temperature 0: the ids text mode may emit, until </s>)."""
    config = SamplingConfig(mode="text", text_temperature=0.0, max_new_tokens=max_new_tokens)
    texts: list[str] = []
    for begin in range(0, len(prompts), batch_size):
        model, rows = decodable(prompts[begin : begin + batch_size], prompt_features[begin : begin + batch_size])
        # Flamingo's text cross-attends to the images in every block: no KV cache (the sampler refuses one)
        batch_config = config if model.supports_kv_cache else replace(config, use_kv_cache=False)
        for row in generate_ids(model, vocab, rows, batch_config):
            texts.append(vocab.decode_text([t for t in row if t != vocab.eos_id]).strip())
    return texts


def early_decodable(model) -> Decodable:
    """An early-fusion decoder: the codes are its input."""

    def rows(ids: torch.Tensor, features: torch.Tensor) -> tuple[Any, list[list[int]]]:
        return model, ids.tolist()

    return rows


def late_decodable(late: LateFusionModel, config: LateFusionConfig, vocab) -> Decodable:
    """A late-fusion model with the batch's images bound to it (as its family's `generate` binds them): the
    early-layout prompts re-laid out as its connector reads them."""

    def rows(ids: torch.Tensor, features: torch.Tensor) -> tuple[Any, list[list[int]]]:
        layout = late_layout(ids, torch.zeros_like(ids), features, config=config, image_offset=vocab.image_offset,
                             image_codes=vocab.image_codes, pad_id=vocab.pad_id)
        real = layout["document_ids"] >= 0
        prompts = [row[keep].tolist() for row, keep in zip(layout["input_ids"], real)]
        return BoundImages(late, layout["features"], layout["feature_mask"]), prompts

    return rows


def prompts_with_features(vocab, segments: list[list], features: list[list[torch.Tensor]],
                          feature_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Early-layout prompts (N, L) `<s> segments...` (no </s>) and their per-position features (N, L, C).

    Each prompt's segments are text or (h, w) code grids; `features[i]` holds one (h*w, C) tensor per grid."""
    rows = [vocab.encode_document(doc, bos=True, eos=False) for doc in segments]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("greedy_captions batches equal-length prompts; these differ")
    ids = torch.tensor(rows)
    per_position = torch.zeros(*ids.shape, feature_dim)
    is_code = image_code_mask(ids, vocab.image_offset, vocab.image_codes)
    for i, grids in enumerate(features):
        if grids:
            per_position[i, is_code[i]] = torch.cat(grids).float()
    return ids, per_position


def few_shot_prompts(vocab, test_codes, test_features, train_codes, train_features, train_labels, shots: int,
                     rng: np.random.Generator, feature_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`shots` captioned training digits, then the query digit: `<s> <img> caption ... <img>`, one per test digit.

    Every example uses the first caption phrasing so that all prompts have the same length."""
    segments, features = [], []
    for codes, feats in zip(test_codes, test_features):
        picks = rng.choice(len(train_labels), size=shots, replace=False)
        doc, grids = [], []
        for p in picks:
            doc += [train_codes[p], " " + caption(int(train_labels[p]), 0)]
            grids.append(train_features[p])
        segments.append(doc + [codes])
        features.append(grids + [feats])
    return prompts_with_features(vocab, segments, features, feature_dim)


# ---------------------------------------------------------------- data


def experiment_raw_shards(config: ExperimentConfig, demo: DemoConfig, demo_dir: Path, out_dir: Path) -> Path:
    """The demo's documents plus `albums` interleaved documents of captioned digits (`<img> caption` x 2-6): the
    interleaved data in-context examples need (Flamingo's M3W), the same for every model."""
    from PIL import Image

    from data_shards.raw import RawShardWriter, iter_raw_shard, read_raw_manifest
    from experiments.demo.report import to_uint8

    folder, source = out_dir / "raw", demo_dir / "shards" / "raw"
    if folder.exists():
        shutil.rmtree(folder)  # cheap and deterministic: always rewritten
    digits = digits_for(demo)
    pictures = [Image.fromarray(a) for a in to_uint8(to_model_images(digits.train_images, demo.data.image_size))]
    rng = np.random.default_rng(config.seed)
    with RawShardWriter(folder, shard_max_docs=demo.shards.samples_per_shard, prefix="fusion") as writer:
        for shard in read_raw_manifest(source)["shards"]:
            for key, segments in iter_raw_shard(source / shard["name"]):
                writer.add(key, [s if isinstance(s, str) else Image.open(io.BytesIO(s[1])) for s in segments])
        for album in range(config.albums):
            segments: list = []
            size = int(rng.integers(ALBUM_SIZES[0], ALBUM_SIZES[1] + 1))
            for pick in rng.choice(len(pictures), size=size, replace=False):
                segments += [pictures[pick], " " + caption(int(digits.train_labels[pick]), int(rng.integers(0, 4)))]
            writer.add(f"album_{album:05d}", segments)
    return folder


def feature_shards(demo: DemoConfig, demo_dir: Path, raw_dir: Path, out_dir: Path) -> Path:
    """The experiment's documents tokenized with their images' pre-quantisation features."""
    from data_shards.pretokenize import pretokenize

    folder = out_dir / "tokens"
    if folder.exists():
        shutil.rmtree(folder)  # the raw shards were rewritten
    pretokenize(raw_dir, folder, load_vocab(demo_dir), load_image_tokenizer(demo_dir),
                flip_probability=demo.shards.flip_probability, seed=demo.seed, progress=False, features=True)
    return folder


def blind_shards(config: ExperimentConfig, token_dir: Path, out_dir: Path, vocab, patches: int) -> Path:
    """The same documents with every image hidden behind one of the late-fusion layouts, chosen at random per image:
    `<boi> <image> x h*w <eoi>` (LLaVA), `<boi> <image> x M <eoi>` (Q-Former) or `<image>` (Flamingo). The frozen
    language model of the late-fusion recipes trains on these: it learns the text around images and where images
    go, without ever seeing one."""
    from data_shards.token_shards import TokenShard, read_manifest, write_manifest, write_token_shard

    folder = out_dir / "blind_tokens"
    if folder.exists():
        shutil.rmtree(folder)
    manifest = read_manifest(token_dir)
    marker = vocab.image_placeholder_id
    layouts = ([vocab.boi_id] + [marker] * patches + [vocab.eoi_id],
               [vocab.boi_id] + [marker] * config.num_queries + [vocab.eoi_id], [marker])
    rng = np.random.default_rng(config.seed)
    metas = []
    for entry in manifest["shards"]:
        shard = TokenShard(token_dir, entry["name"], manifest["vocab_size"])
        documents = []
        for start, stop in zip(shard.offsets[:-1].tolist(), shard.offsets[1:].tolist()):
            ids, out, i = shard.ids[start:stop].tolist(), [], 0
            while i < len(ids):
                if ids[i] == vocab.boi_id:  # <boi> h*w codes <eoi>
                    out += layouts[int(rng.integers(0, len(layouts)))]
                    i += patches + 2
                else:
                    out.append(ids[i])
                    i += 1
            documents.append(out)
        info = {k: shard.meta[k] for k in ("vocab_fingerprint", "image_tokenizer_fingerprint", "vocab_size")}
        metas.append(write_token_shard(folder, entry["name"], shard.keys, documents, {**info, "images": 0}))
    header = {k: manifest[k] for k in manifest if k not in ("documents", "tokens", "images", "shards", "format",
                                                           "dtype")}
    write_manifest(folder, {**header, "feature_dim": None}, metas)
    return folder


# ---------------------------------------------------------------- scoring (train.py eval --suite digits)


def score_digits(checkpoint: str | Path, demo: DemoConfig, demo_dir: Path, out: Path | None, *, seed: int,
                 parts: str, media_tokenizer: str | Path | None = None, images_per_caption: int | None = None,
                 understanding_examples: int | None = None, denoising_steps: int = 50,
                 batch_size: int = 100) -> dict:
    """`evaluation.run.evaluate(checkpoint, "digits")`, as `train.py eval --suite digits` scores any family's
    checkpoint through its own `generate`: the demo's image sampling (temperature, top-k, guidance), its held-out
    split and classifier, `images_per_caption` / `understanding_examples` (None: the demo's), `parts` of the suite;
    the image tokenizer is the demo's VQ bundle unless given. Returns results.json's content (written to `out`
    with the sample page when given)."""
    from evaluation.base import EvalSettings
    from evaluation.digits import DigitOptions
    from evaluation.run import evaluate

    g = demo.generate
    settings = EvalSettings(seed=seed, temperature=g.temperature, top_k=g.top_k, cfg_scale=g.cfg_scale,
                            denoising_steps=denoising_steps,
                            samples_per_prompt=images_per_caption or g.images_per_caption,
                            understanding_items=min(understanding_examples or g.understanding_examples,
                                                    demo.data.held_out),
                            batch_size=batch_size)
    options = DigitOptions(demo_dir=str(demo_dir), held_out=demo.data.held_out, split_seed=demo.seed, parts=parts)
    return evaluate(checkpoint, "digits", vocab=demo_dir / "vocab" / "tokenizer.json",
                    media_tokenizer=media_tokenizer or demo_dir / "tokenizer" / "model", out=out, settings=settings,
                    options=options, progress=lambda line: None)


# ---------------------------------------------------------------- training runs (all through train.py fit)


def fit(name: str, out_dir: Path, demo_dir: Path, train_dir: Path, steps: int, seed: int,
        extra: list[str], log: Callable[[str], None]) -> tuple[object, dict]:
    """One `train.py fit --config configs/fusion/demo.yaml` run of `steps` steps; the module and its record."""
    from fusion_model.cli.fit import fit_from_config

    folder = out_dir / name
    if folder.exists():
        shutil.rmtree(folder)  # every run starts fresh: the comparison is of fixed step counts
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(folder / "checkpoints"), "save_last": True, "every_n_train_steps": steps}},
        {"class_path": "experiments.demo.recorder.LossRecorder", "init_args": {"path": str(folder / "losses.json")}},
    ]
    options = [
        f"--seed_everything={seed}", f"--trainer.max_steps={steps}", "--trainer.max_time=null",
        f"--trainer.default_root_dir={folder}",  # progress: a bar on a terminal, a line every 30 s in a log file
        f"--trainer.logger.init_args.save_dir={folder}", f"--data.train_dir={train_dir}", f"--data.seed={seed}",
        f"--data.vocab={demo_dir / 'vocab' / 'tokenizer.json'}",
        # the blind shards hold no image codes: the image tokenizer's fingerprint check is for the feature shards
        f"--data.image_tokenizer={demo_dir / 'tokenizer' / 'model' if train_dir.name == 'tokens' else 'null'}",
        *[f"--trainer.callbacks+={json.dumps(c)}" for c in callbacks], *extra,
    ]
    log(f"  {name}: {steps} steps ...")
    cli = fit_from_config(FIT_CONFIG, options)
    module = cli.model.eval()
    final = json.loads((folder / "losses.json").read_text())["final"]
    record = {"steps": int(final["steps"]), "document_tokens": int(final["tokens"]),
              "decoder_positions": int(module.decoder_positions), "seconds": float(final["seconds"]),
              "last_checkpoint": str(folder / "checkpoints" / "last.ckpt"), "options": options}
    rate = (f"{record['decoder_positions'] / record['seconds']:,.0f} decoder positions/s" if record["decoder_positions"]
            else f"{record['steps'] / record['seconds']:.1f} steps/s; the decoder is not used")
    log(f"  {name}: done in {record['seconds']:.0f} s ({rate})")
    return module, record


def late_option(kind: str, stage: int, config: ExperimentConfig, init_connector: str | None = None) -> str:
    """The `--model.late_fusion` value of one run."""
    value: dict = {"kind": kind, "stage": stage}
    if kind == "qformer":
        value["num_queries"] = config.num_queries
    if kind == "flamingo":
        value["num_latents"] = config.num_latents
    if init_connector:
        value["init_connector"] = init_connector
    return f"--model.late_fusion={json.dumps(value)}"


# ---------------------------------------------------------------- the experiment


def run(config: ExperimentConfig, log: Callable[[str], None] = print) -> dict:
    """Train the blind language model and the four models, evaluate each; returns (and writes) the results."""
    from fusion_model.checkpoint import save_model

    demo = load_config(config.demo)
    demo_dir = Path(config.demo_dir or demo.out_dir).resolve()
    out_dir = Path(config.out_dir).resolve()
    require_outputs(demo_dir, config.demo, ("tokenizer/model", "vocab/tokenizer.json", "shards/raw",
                                            "generate/classifier.pt"),
                    "tokenizer, vocabulary, raw shards and classifier")
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    vocab, tokenizer = load_vocab(demo_dir), load_image_tokenizer(demo_dir)
    feature_dim = tokenizer.config.embed_dim

    log(f"[1/4] data: the demo's documents and {config.albums:,} albums, with image features, and blind")
    tokens = feature_shards(demo, demo_dir, experiment_raw_shards(config, demo, demo_dir, out_dir), out_dir)
    texts = blind_shards(config, tokens, out_dir, vocab, tokenizer.grid_shape[0] * tokenizer.grid_shape[1])

    log("[2/4] training (train.py fit, configs/fusion/demo.yaml)")
    runs: dict[str, dict] = {}
    modules: dict[str, object] = {}
    fit_args = (out_dir, demo_dir)
    modules["early"], runs["early"] = fit("early", *fit_args, tokens, config.steps, config.seed, [], log)
    modules["early_text_loss"], runs["early_text_loss"] = fit("early_text_loss", *fit_args, tokens, config.steps,
                                                              config.seed, ["--model.image_weight=0"], log)
    blind_lm, runs["blind_lm"] = fit("blind_lm", *fit_args, texts, config.blind_lm_steps, config.seed, [], log)
    blind_lm_path = save_model(blind_lm.model, out_dir / "blind_lm" / "model.ckpt")
    from_blind_lm = [f"--model.init_weights={blind_lm_path}"]
    modules["early_from_lm"], runs["early_from_lm"] = fit("early_from_lm", *fit_args, tokens, config.steps,
                                                          config.seed, from_blind_lm, log)
    modules["llava_stage1"], runs["llava_stage1"] = fit("llava_stage1", *fit_args, tokens, config.llava_stage1_steps,
                                                        config.seed, from_blind_lm + [late_option("llava", 1, config)],
                                                        log)
    modules["llava"], runs["llava"] = fit(
        "llava", *fit_args, tokens, config.steps - config.llava_stage1_steps, config.seed,
        from_blind_lm + [late_option("llava", 2, config, runs["llava_stage1"]["last_checkpoint"])], log)
    stage1, runs["qformer_stage1"] = fit("qformer_stage1", *fit_args, tokens, config.qformer_stage1_steps, config.seed,
                                         [late_option("qformer", 1, config)], log)
    runs["qformer_stage1"]["end"] = {name: float(stage1.trainer.callback_metrics[f"train/{name}"])
                                     for name in ("itc", "itm", "itg", "itc_accuracy")}
    modules["qformer"], runs["qformer"] = fit(
        "qformer", *fit_args, tokens, config.steps, config.seed,
        from_blind_lm + [late_option("qformer", 2, config, runs["qformer_stage1"]["last_checkpoint"])], log)
    modules["flamingo"], runs["flamingo"] = fit("flamingo", *fit_args, tokens, config.steps, config.seed,
                                                from_blind_lm + [late_option("flamingo", 1, config)], log)

    log("[3/4] evaluation on held-out digits")
    digits = digits_for(demo)
    count = min(config.examples, len(digits.test_labels))
    with torch.no_grad():
        test_codes, test_features = tokenizer.encode_with_features(
            to_model_images(digits.test_images[:count], demo.data.image_size))
        train_codes, train_features = tokenizer.encode_with_features(
            to_model_images(digits.train_images[:1000], demo.data.image_size))
    train_labels = digits.train_labels[:1000]
    results: dict[str, dict] = {}
    decoder_parameters = blind_lm.model.num_parameters()
    for kind in MODELS:
        module = modules[kind]
        if kind in EARLY:
            decodable, added, per_image = early_decodable(module.model), 0, test_codes[0].numel()
        else:
            wrapped = module.family.late
            decodable = late_decodable(wrapped, module.family.options, vocab)
            added, per_image = wrapped.parameters_added(), wrapped_cost(wrapped, test_codes[0].numel())
        with torch.no_grad():
            ids, feats = prompts_with_features(vocab, [[c] for c in test_codes], [[f] for f in test_features],
                                               feature_dim)
            captions = greedy_captions(decodable, ids, feats, vocab)
            predicted = [parse_digit(t) for t in captions]
            accuracy = float(np.mean([p == int(y) for p, y in zip(predicted, digits.test_labels[:count])]))
            few_shot = {}
            n_few = min(config.few_shot_examples, count)
            for shots in config.shots:
                rng = np.random.default_rng(config.seed + shots)
                ids, feats = few_shot_prompts(vocab, test_codes[:n_few], test_features[:n_few], train_codes,
                                              train_features, train_labels, shots, rng, feature_dim)
                guesses = [parse_digit(t) for t in greedy_captions(decodable, ids, feats, vocab, batch_size=50)]
                few_shot[str(shots)] = float(np.mean([g == int(y) for g, y in zip(guesses, digits.test_labels[:n_few])]))
        train = runs[kind]
        stages = [runs["llava_stage1"], train] if kind == "llava" else [train]
        seconds = sum(r["seconds"] for r in stages)
        positions = sum(r["decoder_positions"] for r in stages)
        results[kind] = {
            "understanding_accuracy": accuracy, "understanding_count": count, "few_shot_accuracy": few_shot,
            "image_positions_per_image": per_image, "parameters_added": added,
            "decoder_parameters": decoder_parameters,
            "trainable_parameters": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "steps": sum(r["steps"] for r in stages), "document_tokens": sum(r["document_tokens"] for r in stages),
            "decoder_positions": positions, "train_seconds": seconds, "decoder_positions_per_second": positions / seconds,
            "blind_lm_steps": 0 if kind in ("early", "early_text_loss") else runs["blind_lm"]["steps"],
            "sample_captions": captions[:SAMPLES_SHOWN],
        }
        log(f"  {kind}: understanding {accuracy:.1%}, few-shot "
            + " / ".join(f"{k}: {v:.1%}" for k, v in few_shot.items()))
    for kind in EARLY:  # the late-fusion families write no images (the digits suite would report None)
        scored = score_digits(runs[kind]["last_checkpoint"], demo, demo_dir, out_dir / kind / "eval",
                              seed=config.seed, parts="generation")
        accuracy = scored["figures"]["generation"]["accuracy"]
        results[kind]["generation_accuracy"] = accuracy
        log(f"  {kind}: generation {accuracy:.1%} (the late-fusion models cannot draw)")

    log("[4/4] results")
    record = {"config": dataclasses.asdict(config), "demo_dir": str(demo_dir), "results": results,
              "runs": runs, "minutes": (time.perf_counter() - start) / 60, "threads": torch.get_num_threads(),
              "finished_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    atomic_write_json(out_dir / "results.json", record)
    atomic_write_text(out_dir / "results.md", results_table(record))
    write_report(record, out_dir, to_model_images(digits.test_images[:SAMPLES_SHOWN], demo.data.image_size),
                 digits.test_labels[:SAMPLES_SHOWN])
    log(results_table(record))
    log(f"results: {out_dir / 'results.md'} and {out_dir / 'report.html'} ({record['minutes']:.1f} minutes)")
    return record


def write_report(record: dict, out_dir: Path, images: torch.Tensor, labels: np.ndarray) -> Path:
    """`<out>/report.html`: the table, each model's caption loss, and the captions each wrote for the same digits."""
    import html

    from experiments.demo import report

    results, runs = record["results"], record["runs"]
    curves = {}
    for kind in results:
        names = ["llava_stage1", "llava"] if kind == "llava" else [kind]
        points, offset = [], 0
        for name in names:
            losses = json.loads((out_dir / name / "losses.json").read_text())
            points += [(offset + step, loss) for step, loss in zip(losses["step"], losses["text"])]
            offset += runs[name]["steps"]
        curves[kind] = points
    shots = [str(s) for s in record["config"]["shots"]]
    rows = [[kind, r["understanding_accuracy"], *[r["few_shot_accuracy"][s] for s in shots],
             r.get("generation_accuracy", "-"), r["image_positions_per_image"], r["parameters_added"],
             r["trainable_parameters"], r["decoder_positions"], r["decoder_positions_per_second"]]
            for kind, r in results.items()]
    header = ["model", "understanding", *[f"{s}-shot" for s in shots], "generation", "image positions per image",
              "parameters added", "trainable", "decoder positions trained", "positions/s"]
    pixels = report.to_uint8(images)
    samples = "".join(
        "<tr><td>" + report.image_tag(pixels[i], 56) + "</td>"
        + "".join(f"<td>{report.mark(parse_digit(results[k]['sample_captions'][i]) == int(labels[i]))} "
                  f"{html.escape(results[k]['sample_captions'][i])}</td>" for k in results) + "</tr>"
        for i in range(min(len(labels), *(len(r["sample_captions"]) for r in results.values()))))
    sections = [
        report.section("Results", report.table(header, rows), results_table(record).split("\n\n")[-1].strip()),
        report.section("Caption loss while training", report.plot_tag(curves, "text loss (image positions excluded)")),
        report.section("Captions of held-out digits", "<table><tr><th>digit</th>"
                       + "".join(f"<th>{k}</th>" for k in results) + "</tr>" + samples + "</table>"),
        report.section("Configuration", report.config_block(record["config"])),
    ]
    return report.write_html(out_dir / "report.html", "Early vs late fusion on the demo's digits", sections)


def wrapped_cost(wrapped: LateFusionModel, patches: int) -> int:
    """Decoder positions one image costs the late-fusion model."""
    return patches if wrapped.kind == "llava" else wrapped.image_tokens_in_context


def results_table(record: dict) -> str:
    """The results as a Markdown table."""
    results, config = record["results"], record["config"]
    shots = [str(s) for s in config["shots"]]
    lines = [
        "| model | understanding | " + " | ".join(f"{s}-shot" for s in shots) + " | generation | image positions "
        "per image | parameters added | trainable | decoder positions trained | positions/s |",
        "|---" * (8 + len(shots)) + "|",
    ]
    for kind, r in results.items():
        generation = f"{r['generation_accuracy']:.1%}" if "generation_accuracy" in r else "-"
        lines.append(
            f"| {kind} | {r['understanding_accuracy']:.1%} | "
            + " | ".join(f"{r['few_shot_accuracy'][s]:.1%}" for s in shots)
            + f" | {generation} | {r['image_positions_per_image']} | {r['parameters_added']:,} | "
            f"{r['trainable_parameters']:,} | {r['decoder_positions']:,} | {r['decoder_positions_per_second']:,.0f} |")
    blind_lm = record["runs"]["blind_lm"]
    lines += ["", f"{config['steps']} multimodal steps per model (LLaVA: {config['llava_stage1_steps']} projector-only "
              f"+ the rest with the decoder; llava_stage1 is LLaVA after the first, its decoder frozen; "
              f"early_text_loss is early fusion with no loss on image codes; early_from_lm is early fusion started from the "
              f"late-fusion models' language model); the late-fusion models start from a language model trained {blind_lm['steps']} "
              f"steps on the same documents with the images hidden; Q-Former also had {config['qformer_stage1_steps']} "
              f"BLIP-2 stage-1 steps. Understanding over {results['early']['understanding_count']} held-out digits, "
              f"few-shot over {config['few_shot_examples']}. {record['minutes']:.1f} minutes on "
              f"{record['threads']} threads."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    """The `train.py experiment fusion` options."""
    parser = argparse.ArgumentParser(prog="train.py experiment fusion", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ExperimentConfig()
    parser.add_argument("--demo", default=defaults.demo, help="the demo preset whose outputs are reused (full, smoke)")
    parser.add_argument("--demo-dir", default=None, help="the finished demo's folder (default: the preset's out_dir)")
    parser.add_argument("--out", default=defaults.out_dir, help="output folder (default: %(default)s)")
    for name in ("steps", "blind_lm_steps", "llava_stage1_steps", "qformer_stage1_steps", "num_queries", "num_latents",
                 "albums", "examples", "few_shot_examples", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name),
                            help=f"default: {getattr(defaults, name)}")
    parser.add_argument("--threads", default="auto", help="torch threads: auto = the cores other processes leave idle")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python train.py experiment fusion`."""
    from common.threads import free_cores

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "fusion":
        print("usage: python train.py experiment fusion [options]  (the one experiment so far: early vs late fusion)",
              file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv[1:])
    config = ExperimentConfig(demo=args.demo, demo_dir=args.demo_dir, out_dir=args.out, steps=args.steps,
                              blind_lm_steps=args.blind_lm_steps, llava_stage1_steps=args.llava_stage1_steps,
                              qformer_stage1_steps=args.qformer_stage1_steps, num_queries=args.num_queries,
                              num_latents=args.num_latents, albums=args.albums, examples=args.examples,
                              few_shot_examples=args.few_shot_examples, seed=args.seed)
    if not 0 < config.llava_stage1_steps < config.steps:
        raise ValueError(f"--llava-stage1-steps {config.llava_stage1_steps} must lie between 0 and --steps "
                         f"{config.steps} (stage 2 trains the rest)")
    threads = free_cores() if args.threads == "auto" else int(args.threads)
    torch.set_num_threads(threads)
    print(f"experiment fusion: {threads} thread{'s' if threads > 1 else ''}, output in {config.out_dir}", flush=True)
    run(config)
    return 0
