"""Late fusion trained through `train.py fit` (`--model.late_fusion`): stages freeze the right weights, stage 2
starts from stage 1's connector, checkpoints hold each weight once, and bad options fail naming what to change."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data_shards.token_shards import write_manifest, write_token_shard
from fusion_model.cli.fit import fit_from_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_worker as fw  # noqa: E402

# The vocabulary layout of the shards below (the tiny decoder's 256 ids): special ids, text, then the image block.
PAD, BOS, EOS, BOI, EOI, IMAGE = 0, 1, 2, 3, 4, 5
TEXT = range(6, 128)
IMAGE_OFFSET, IMAGE_CODES = 128, 64
PATCHES = 4  # a 2x2 grid of codes per image
FEATURE_DIM = 8


def image_document(rng: np.random.Generator, caption_first: bool) -> list[int]:
    """<bos> caption <boi> codes <eoi> <eos>, or the image first (the two orders pretokenize writes)."""
    caption = rng.integers(TEXT.start, TEXT.stop, int(rng.integers(3, 9))).tolist()
    image = [BOI, *rng.integers(IMAGE_OFFSET, IMAGE_OFFSET + IMAGE_CODES, PATCHES).tolist(), EOI]
    return [BOS, *(caption + image if caption_first else image + caption), EOS]


def write_feature_shards(path: Path, *, features: bool = True, documents: int = 24, seed: int = 0) -> Path:
    """Token shards of caption/image documents with one feature row per image-code position (as
    `shards tokenize --features` writes them), or, with features=False, the same shards without any."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    info = {"vocab_size": 256, "vocab_fingerprint": "vocab-test", "image_tokenizer_fingerprint": "image-test"}
    metas = []
    for shard in range(2):
        docs = [image_document(rng, caption_first=bool(i % 2)) for i in range(documents // 2)]
        codes = sum(IMAGE_OFFSET <= token < IMAGE_OFFSET + IMAGE_CODES for doc in docs for token in doc)
        rows = rng.standard_normal((codes, FEATURE_DIM)).astype(np.float16) if features else None
        keys = [f"s{shard}-d{i}" for i in range(len(docs))]
        metas.append(write_token_shard(path, f"shard-{shard:03d}", keys, docs, {**info, "images": len(docs)},
                                       features=rows))
    header = {**info, "pad_id": PAD, "bos_id": BOS, "eos_id": EOS, "image_offset": IMAGE_OFFSET,
              "image_codes": IMAGE_CODES, "boi_id": BOI, "eoi_id": EOI, "image_placeholder_id": IMAGE,
              "feature_dim": FEATURE_DIM if features else None}
    write_manifest(path, header, metas)
    return path


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: one torch thread, restored after


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_feature_shards(tmp_path_factory.mktemp("late") / "tokens")


def late_args(token_dir: Path, root: Path, steps: int, late_fusion: dict, extra: list[str] | None = None) -> list[str]:
    """A seconds-long CPU fit of the tiny decoder with a late-fusion connector; every step checkpointed."""
    args = fw.tiny_args(token_dir, root, steps, batch_size=2, extra=["--trainer.logger=false"])
    return [*args, f"--model.late_fusion={json.dumps(late_fusion)}", *(extra or [])]


def fit(token_dir: Path, root: Path, steps: int, late_fusion: dict, extra: list[str] | None = None):
    """Train; returns the CLI object (its .model is the trained FusionLightningModule)."""
    return fit_from_config(None, late_args(token_dir, root, steps, late_fusion, extra))


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the module's state."""
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit."""
    return [name for name, value in before.items() if not torch.equal(value, after[name])]


def test_llava_stage_one_trains_only_the_projector_and_stage_two_starts_from_it(shards, tmp_path):
    stage_one_root = tmp_path / "one"
    built = fit_from_config(None, late_args(shards, stage_one_root, 3, {"kind": "llava", "stage": 1}), run=False)
    decoder_before, connector_before = weights(built.model.model), weights(built.model.connector)

    trained = fit(shards, stage_one_root, 3, {"kind": "llava", "stage": 1}).model
    assert trained.family.options.image_token_id == IMAGE and trained.family.options.feature_dim == FEATURE_DIM
    assert not changed(decoder_before, weights(trained.model)), "stage 1 must leave the decoder bit-identical"
    assert changed(connector_before, weights(trained.connector)) == list(connector_before)
    assert trained.decoder_positions > 0

    last = stage_one_root / "ckpt" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=True)
    state = checkpoint["state_dict"]
    connector_keys = [name for name in state if name.startswith("connector.")]
    assert sorted(connector_keys) == sorted(f"connector.{name}" for name in connector_before)
    assert all(name.startswith(("model.", "connector.")) for name in state), "a weight saved under another name"
    assert len(state) == len(decoder_before) + len(connector_before), "a weight saved twice"
    for name, value in weights(trained.connector).items():
        assert torch.equal(state[f"connector.{name}"], value), name

    # a resumed stage-1 run restores the connector (and its optimizer state) from its own checkpoint
    resumed_root = tmp_path / "resumed"
    step_two = stage_one_root / "ckpt" / "epoch=0-step=2.ckpt"
    resumed = fit(shards, resumed_root, 3, {"kind": "llava", "stage": 1}, extra=[f"--ckpt_path={step_two}"]).model
    assert not changed(weights(trained.connector), weights(resumed.connector)), "the resumed run went elsewhere"

    stage_two = {"kind": "llava", "stage": 2, "init_connector": str(last)}
    stage_two_root = tmp_path / "two"
    built = fit_from_config(None, late_args(shards, stage_two_root, 2, stage_two), run=False)
    fresh = weights(built.model.connector)
    assert changed(fresh, weights(trained.connector)), "a fresh connector equals the trained one: nothing to test"
    built.model.trainer = built.trainer  # setup reads the trainer's ckpt_path (None: a new run)
    built.model.setup("fit")
    assert not changed(weights(trained.connector), weights(built.model.connector)), "stage 2 starts elsewhere"

    second = fit(shards, stage_two_root, 2, stage_two).model
    assert changed(decoder_before, weights(second.model)), "stage 2 trains the decoder too"
    assert changed(weights(trained.connector), weights(second.connector))
    assert all(p.requires_grad for p in second.model.parameters())


@pytest.mark.parametrize(("kind", "stage", "options"), [
    ("qformer", 2, {"num_queries": 6, "depth": 1}),  # 6 queries for a 4-patch image: the rows grow
    ("flamingo", 1, {"num_latents": 3, "depth": 1}),
])
def test_frozen_decoder_stages_train_the_connector_only(shards, tmp_path, kind, stage, options):
    late_fusion = {"kind": kind, "stage": stage, **options}
    built = fit_from_config(None, late_args(shards, tmp_path, 2, late_fusion), run=False)
    decoder_before, connector_before = weights(built.model.model), weights(built.model.connector)
    trained = fit(shards, tmp_path, 2, late_fusion).model
    assert not changed(decoder_before, weights(trained.model))
    moved = changed(connector_before, weights(trained.connector))
    assert moved, f"{kind}: the connector did not train"
    if kind == "flamingo":  # the gates open: the decoder's input now depends on the images
        assert any(name.endswith(("alpha_attn", "alpha_ff")) for name in moved)
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    assert len(state) == len(decoder_before) + len(connector_before)


def test_shards_without_features_are_refused_naming_the_tokenize_option(tmp_path):
    plain = write_feature_shards(tmp_path / "plain", features=False)
    with pytest.raises(ValueError, match="--features"):
        fit_from_config(None, late_args(plain, tmp_path, 2, {"kind": "llava", "stage": 1}), run=False)
    assert not (tmp_path / "ckpt").exists()


def test_an_unknown_late_fusion_option_is_refused_by_name(shards, tmp_path):
    with pytest.raises(ValueError, match="num_querys"):
        fit_from_config(None, late_args(shards, tmp_path, 2, {"kind": "qformer", "stage": 2, "num_querys": 4}),
                        run=False)


def test_init_connector_from_a_checkpoint_without_a_connector_is_refused(shards, tmp_path):
    from fusion_model.checkpoint import save_model
    from fusion_model.config import FusionConfig
    from fusion_model.model import FusionModel

    plain = save_model(FusionModel(FusionConfig.from_preset("tiny")), tmp_path / "decoder.ckpt")
    late_fusion = {"kind": "llava", "stage": 2, "init_connector": str(plain)}
    built = fit_from_config(None, late_args(shards, tmp_path, 2, late_fusion), run=False)
    built.model.trainer = built.trainer
    with pytest.raises(ValueError, match=r"no connector\.\* weights"):
        built.model.setup("fit")


def test_rows_the_connector_grows_beyond_max_seq_len_stop_naming_both_settings(shards, tmp_path):
    # 40 queries per 4-patch image: a 32-token row holding any image needs at least 32 - 4 + 40 = 68 positions
    with pytest.raises(ValueError, match="more than model.config.max_seq_len 64"):
        fit(shards, tmp_path, 1, {"kind": "qformer", "stage": 2, "num_queries": 40, "depth": 1})


def test_fsdp2_is_refused_with_a_message_instead_of_failing_on_mixed_dtensors(shards, tmp_path):
    built = fit_from_config(None, late_args(shards, tmp_path, 2, {"kind": "llava", "stage": 1}), run=False)
    built.model._device_mesh = object()  # what ModelParallelStrategy sets before configure_model
    with pytest.raises(ValueError, match="strategy=ddp"):
        built.model.configure_model()


def test_qformer_stage_one_trains_against_the_encoder_alone_and_hands_its_queries_to_stage_two(shards, tmp_path):
    stage_one = {"kind": "qformer", "stage": 1, "num_queries": 3, "depth": 1}
    built = fit_from_config(None, late_args(shards, tmp_path / "one", 3, stage_one), run=False)
    decoder_before, connector_before = weights(built.model.model), weights(built.model.connector)
    assert built.model.family.options.special_ids == (PAD, BOS, EOS, BOI, EOI)  # taken from the manifest

    trained = fit(shards, tmp_path / "one", 3, stage_one)
    module = trained.model
    assert not changed(decoder_before, weights(module.model)), "stage 1 does not use the decoder"
    moved = changed(connector_before, weights(module.connector))
    # everything but the projection to the decoder's width, which only stage 2 uses
    assert sorted(moved) == sorted(n for n in connector_before if not n.startswith("to_language_model."))
    metrics = trained.trainer.callback_metrics
    assert {"train/itc", "train/itm", "train/itg", "train/itc_accuracy"} <= set(metrics)
    assert all(torch.isfinite(metrics[f"train/{name}"]) for name in ("itc", "itm", "itg"))
    state = torch.load(tmp_path / "one" / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    assert not any(name.startswith("stage1_heads.qformer.") for name in state), "the Q-Former saved twice"

    stage_two = {"kind": "qformer", "stage": 2, "num_queries": 3, "depth": 1,
                 "init_connector": str(tmp_path / "one" / "ckpt" / "last.ckpt")}
    built = fit_from_config(None, late_args(shards, tmp_path / "two", 2, stage_two), run=False)
    built.model.trainer = built.trainer
    built.model.setup("fit")
    assert not changed(weights(module.connector), weights(built.model.connector))
