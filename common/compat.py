"""The one compatibility check: a decoder, a vocabulary, an image tokenizer and token shards belong together only
when they agree on the id space; every command (fit, generate, convert, the demo) asks this module."""

from __future__ import annotations

from typing import Any


class CompatibilityError(ValueError):
    """The pieces were made for different id spaces; the message says which and what to change."""


# What to change, by where the check runs: while configuring a training run the model's fields are settable;
# when using a trained checkpoint the files given with it are what can change.
_TRAIN_HINT = "set --model.config.{field} {value}"
_USE_HINT = "pass the tokenizer.json the checkpoint was trained with (--vocab)"


def check_compatible(
    *,
    model: Any = None,
    vocab: Any = None,
    image_tokenizer: Any = None,
    image_tokenizer_fingerprint: str | None = None,
    shards: dict | None = None,
    shards_dir: Any = None,
    val_shards: dict | None = None,
    seq_len: int | None = None,
    training: bool = False,
) -> None:
    """Raise CompatibilityError unless every piece given agrees with the others.

    model: a FusionConfig (or anything with vocab_size, image_offset, image_codes, max_seq_len);
    vocab: a UnifiedVocab; image_tokenizer: an ImageTokenizer (or pass only its fingerprint);
    shards / val_shards: token-shard manifests (data_shards.token_shards.read_manifest) of `shards_dir`;
    training: the hints name `fit`'s options instead of the files to pass.
    """
    if image_tokenizer is not None and image_tokenizer_fingerprint is None and shards is not None:
        image_tokenizer_fingerprint = image_tokenizer.fingerprint()
    if model is not None:
        _model_fits(model, vocab, shards, shards_dir, seq_len, training)
    # a continuous tokenizer (latents at `<image>` placeholders) has no codes to match the vocabulary's image block
    if vocab is not None and image_tokenizer is not None and getattr(image_tokenizer, "kind", "vq") == "vq":
        codebook = getattr(getattr(image_tokenizer, "config", None), "codebook_size", None)
        if codebook is not None and codebook != vocab.image_codes:
            raise CompatibilityError(
                f"the image tokenizer has {codebook} codes but the vocabulary has {vocab.image_codes} image ids: "
                "pass the image tokenizer the vocabulary was built for (--image-tokenizer)"
            )
    if shards is not None:
        _shards_fit(shards, shards_dir, vocab, image_tokenizer_fingerprint)
        if val_shards is not None:
            layout = [f for f in ("image_offset", "image_codes") if f in val_shards and f in shards]
            for field in ("vocab_fingerprint", "image_tokenizer_fingerprint", "vocab_size", *layout):
                if val_shards[field] != shards[field]:
                    raise CompatibilityError(
                        f"validation shards differ from the training shards in {field} ({val_shards[field]} vs "
                        f"{shards[field]}); tokenize both with the same vocabulary and image tokenizer"
                    )


def _model_fits(model: Any, vocab: Any, shards: dict | None, shards_dir: Any, seq_len: int | None, training: bool) -> None:
    if seq_len is not None and seq_len > model.max_seq_len:
        raise CompatibilityError(
            f"data.seq_len={seq_len} exceeds the model's max positions (model.config.max_seq_len="
            f"{model.max_seq_len}); lower --data.seq_len or raise --model.config.max_seq_len"
        )
    if shards is not None and shards["vocab_size"] != model.vocab_size:
        raise CompatibilityError(
            f"the shards in {shards_dir} were tokenized with a {shards['vocab_size']}-entry vocabulary but "
            f"model.config.vocab_size={model.vocab_size}; set --model.config.vocab_size {shards['vocab_size']}"
        )
    if shards is not None:
        _model_fits_shard_layout(model, shards, shards_dir, training)
    if vocab is None:
        return
    if model.vocab_size != vocab.vocab_size:
        hint = _TRAIN_HINT.format(field="vocab_size", value=vocab.vocab_size) if training else _USE_HINT
        raise CompatibilityError(
            f"the model has vocab_size {model.vocab_size} but the vocabulary has {vocab.vocab_size}: {hint}"
        )
    block = f"--model.config.image_offset {vocab.image_offset} --model.config.image_codes {vocab.image_codes}"
    if model.image_offset is None:
        if training:
            raise CompatibilityError(
                f"model.config has no image block, so image targets would count as text; set {block} (the vocabulary's)"
            )
        return  # a checkpoint without an image block samples text; the vocabulary still decodes it
    for name in ("image_offset", "image_codes"):
        if getattr(model, name) != getattr(vocab, name):
            hint = f"set {block}" if training else _USE_HINT
            raise CompatibilityError(
                f"the model's {name} is {getattr(model, name)} but the vocabulary's is {getattr(vocab, name)} "
                f"(image block offset {model.image_offset}, {model.image_codes} codes vs offset {vocab.image_offset}, "
                f"{vocab.image_codes} codes): {hint}"
            )


def _model_fits_shard_layout(model: Any, shards: dict, shards_dir: Any, training: bool) -> None:
    """The model's image block against the one the shards were tokenized with (manifests since it is recorded)."""
    if not isinstance(shards.get("image_offset"), int) or not isinstance(shards.get("image_codes"), int):
        return  # an older manifest without the layout: only the vocabulary (--vocab) can tell
    offset, codes = shards["image_offset"], shards["image_codes"]
    block = f"--model.config.image_offset {offset} --model.config.image_codes {codes}"
    if model.image_offset is None:
        if training and codes > 0:
            raise CompatibilityError(
                f"model.config has no image block but the shards in {shards_dir} were tokenized with image ids "
                f"[{offset}, {offset + codes}), so image targets would count as text; set {block}"
            )
        return
    if (model.image_offset, model.image_codes) != (offset, codes):
        hint = f"set {block}" if training else "use shards tokenized with the checkpoint's vocabulary"
        raise CompatibilityError(
            f"the model's image block (model.config.image_offset={model.image_offset}, model.config.image_codes="
            f"{model.image_codes}) differs from the shards' in {shards_dir} (image_offset {offset}, image_codes "
            f"{codes}): {hint}"
        )


def _shards_fit(shards: dict, shards_dir: Any, vocab: Any, image_tokenizer_fingerprint: str | None) -> None:
    if vocab is not None and shards["vocab_fingerprint"] != vocab.fingerprint():
        raise CompatibilityError(
            f"the shards in {shards_dir} were tokenized with another vocabulary (fingerprint "
            f"{shards['vocab_fingerprint']}, the given tokenizer.json has {vocab.fingerprint()}); re-run "
            "`train.py shards tokenize` with this vocabulary, or pass the one used (--vocab)"
        )
    if image_tokenizer_fingerprint is not None and shards["image_tokenizer_fingerprint"] != image_tokenizer_fingerprint:
        raise CompatibilityError(
            f"the shards in {shards_dir} were tokenized with another image tokenizer (fingerprint "
            f"{shards['image_tokenizer_fingerprint']}, the given one has {image_tokenizer_fingerprint}); re-run "
            "`train.py shards tokenize` with this image tokenizer, or pass the one used (--image-tokenizer)"
        )
