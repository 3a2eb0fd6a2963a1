"""Import from / export to transformers' ChameleonForConditionalGeneration: weights, config, generation rules,
tokenizer and processor, so one `from_pretrained` loads an export that generates what our sampler does."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from common.files import atomic_path, atomic_write_text, load_checkpoint_file, replace_directory
from fusion_model.blocks import block_class
from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel
from tokenizer.vocab import BOS, EOS, PAD, UnifiedVocab, image_code_of_name, image_token_name, text_mode_mask

# A placeholder VQ encoder for exports without an image tokenizer: transformers always builds one, and
# the default (70M parameters, random) would only cost time; text and image-token ids work without it.
PLACEHOLDER_VQ_CONFIG = dict(
    embed_dim=32, num_embeddings=8192, latent_channels=32, resolution=32, base_channels=32,
    channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=None,
)
# Where an export keeps an image tokenizer transformers has no layout for (ImageTokenizer.from_pretrained loads it).
IMAGE_TOKENIZER_FOLDER = "image_tokenizer"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def image_block(vocabulary_map: dict | None) -> tuple[int | None, int | None]:
    """(image_offset, image_codes) from a vocabulary map when its image ids form one block id = offset + code."""
    if not vocabulary_map:
        return None, None
    pairs = sorted((token_id, code) for name, token_id in vocabulary_map.items()
                   if (code := image_code_of_name(name)) is not None)
    if not pairs:
        return None, None
    offset = pairs[0][0] - pairs[0][1]
    if any(token_id - code != offset for token_id, code in pairs) or [c for _, c in pairs] != list(range(len(pairs))):
        return None, None  # not one contiguous block: the loss then treats every target as text
    return offset, len(pairs)


def released_layout(tokenizer_json) -> str | None:
    """Why a tokenizer.json in a released Chameleon's layout cannot become this project's vocabulary (one
    sentence), or None for any other tokenizer (one of ours, or none)."""
    from tokenizers import Tokenizer

    from tokenizer.specials import BOI, EOI, SEP

    try:
        names = Tokenizer.from_file(str(tokenizer_json)).get_vocab(with_added_tokens=True)
    except Exception:  # unreadable: UnifiedVocab.load says why
        return None
    images = [i for name, i in names.items() if image_code_of_name(name) is not None]
    if SEP in names or not images or BOI not in names or names[BOI] < min(images):
        return None
    return (f"{tokenizer_json} has the released Chameleon layout ({BOI} and {EOI} after the image block, "
            f"<reserved08706> where this project has {SEP}), but this project's vocabulary keeps its specials before "
            "the image block, and convert import does not yet move those ids (with the decoder's embedding and "
            "head rows) into that order: until it does, fine-tune this model in transformers (model.ckpt holds its decoder)")


def config_from_transformers(hf_config, **overrides) -> FusionConfig:
    """FusionConfig equivalent to a transformers ChameleonConfig."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"from_transformers: rope_type {rope.get('rope_type')!r} is not supported (only 'default')")
    offset, codes = image_block(getattr(hf_config, "vocabulary_map", None))
    fields = dict(
        vocab_size=hf_config.vocab_size, dim=hf_config.hidden_size, n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads, n_kv_heads=hf_config.num_key_value_heads,
        ffn_dim=hf_config.intermediate_size, rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_seq_len=hf_config.max_position_embeddings, norm_eps=hf_config.rms_norm_eps, qk_norm=True,
        norm_placement="swin" if hf_config.swin_norm else "pre", image_offset=offset, image_codes=codes,
    )
    fields.update(overrides)
    return FusionConfig(**fields)


def _layer_map(i: int) -> dict[str, list[str]]:
    """Our parameter name -> the transformers names concatenated (along dim 0) to form it, for layer i."""
    ours, theirs = f"layers.{i}.", f"model.layers.{i}."
    attn = theirs + "self_attn."
    return {
        ours + "attn.qkv.weight": [attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"],
        ours + "attn.out.weight": [attn + "o_proj.weight"],
        ours + "attn.q_norm.weight": [attn + "q_norm.weight"],
        ours + "attn.q_norm.bias": [attn + "q_norm.bias"],
        ours + "attn.k_norm.weight": [attn + "k_norm.weight"],
        ours + "attn.k_norm.bias": [attn + "k_norm.bias"],
        ours + "mlp.gate_up.weight": [theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"],
        ours + "mlp.down.weight": [theirs + "mlp.down_proj.weight"],
        ours + "attn_norm.weight": [theirs + "input_layernorm.weight"],
        ours + "mlp_norm.weight": [theirs + "post_attention_layernorm.weight"],
    }


def name_map(config: FusionConfig) -> dict[str, list[str]]:
    """Every parameter of FusionModel -> the transformers ChameleonForConditionalGeneration names."""
    names = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"],
             "head.weight": ["lm_head.weight"]}
    for i in range(config.n_layers):
        names.update(_layer_map(i))
    return names


def from_transformers(hf_model, **config_overrides) -> FusionModel:
    """A FusionModel with the weights of a transformers ChameleonForConditionalGeneration or ChameleonModel.

    A bare ChameleonModel has no lm_head: the head keeps its fresh initialisation.
    """
    state = {k: v for k, v in hf_model.state_dict().items() if ".vqmodel." not in k and not k.startswith("vqmodel.")}
    if "lm_head.weight" not in state:  # ChameleonModel: its keys lack the "model." prefix
        state = {"model." + k: v for k, v in state.items()}
    config = config_from_transformers(hf_model.config, **config_overrides)
    with torch.device("meta"):
        model = FusionModel(config)
    ours = {}
    for name, sources in name_map(config).items():
        if all(s in state for s in sources):
            ours[name] = torch.cat([state[s].detach() for s in sources], dim=0).clone()
    missing = set(name_map(config)) - set(ours)
    if missing - {"head.weight"}:
        raise ValueError(f"from_transformers: the transformers model lacks weights for {sorted(missing)[:5]} ...")
    if missing:
        model.head.to_empty(device="cpu")
        torch.nn.init.normal_(model.head.weight, std=config.init_std)
        ours["head.weight"] = model.head.weight.detach()
    model.load_state_dict(ours, assign=True)
    return model.to(next(iter(ours.values())).dtype)


def check_exportable(config: FusionConfig, where: str = "") -> None:
    """Refuse, in one sentence, a decoder whose layers transformers' Chameleon cannot hold: any block but the dense
    one (a Mixture-of-Transformers block keeps weights per modality, which Chameleon's layout has no place for)."""
    if block_class(config.block) is not block_class("dense"):
        raise ValueError(f"{where}transformers' Chameleon holds only dense layers (one set of weights for every "
                         f"token), not this decoder's {config.block!r} block, so it cannot be exported (sample it with "
                         "`train.py generate`)")


def to_transformers_config(
    config: FusionConfig, vocabulary_map: dict, vq_config: dict | None = None, dtype: torch.dtype | None = None
):
    """The transformers ChameleonConfig equivalent to a FusionConfig (pad/bos/eos ids from the map's names)."""
    from transformers import ChameleonConfig

    check_exportable(config, "to_transformers: ")
    if not config.qk_norm:
        raise ValueError("to_transformers: transformers' Chameleon always applies QK-norm; export needs qk_norm=True")
    hf_config = ChameleonConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads, max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        swin_norm=config.norm_placement == "swin", vocabulary_map=vocabulary_map,
        vq_config=vq_config or PLACEHOLDER_VQ_CONFIG, tie_word_embeddings=False,
        pad_token_id=vocabulary_map.get(PAD), bos_token_id=vocabulary_map.get(BOS),
        eos_token_id=vocabulary_map.get(EOS),
    )
    hf_config.architectures = ["ChameleonForConditionalGeneration"]
    if dtype is not None:
        hf_config.dtype = dtype
    return hf_config


def _vocabulary(config: FusionConfig, vocab) -> tuple[dict, UnifiedVocab | None]:
    """The vocabulary map (name -> id) and the UnifiedVocab, from a vocab or (without one) the image block alone.

    vocab: None, a UnifiedVocab, or the path of its tokenizer.json.
    """
    if vocab is None:
        if config.image_offset is None:
            return {}, None
        return {image_token_name(k): config.image_offset + k for k in range(config.image_codes)}, None
    if not isinstance(vocab, UnifiedVocab):
        vocab = UnifiedVocab.load(vocab)
    mapping = vocab.tokenizer.get_vocab(with_added_tokens=True)
    if len(mapping) != config.vocab_size:
        raise ValueError(
            f"to_transformers: {vocab.source} has {len(mapping)} tokens but the model has {config.vocab_size}"
        )
    return mapping, vocab


def _vq_weights(image_tokenizer) -> tuple[dict | None, dict]:
    """(vq_config dict, state dict in ChameleonVQVAE names) from an image tokenizer, or (None, {})."""
    if image_tokenizer is None:
        return None, {}
    if type(image_tokenizer).__name__ == "ChameleonVQVAE":
        return image_tokenizer.config.to_dict(), image_tokenizer.state_dict()
    config = getattr(image_tokenizer, "config", None)
    if not getattr(config, "chameleon_layout", False):
        raise TypeError(
            f"to_transformers: cannot export the VQ weights of {type(image_tokenizer).__name__}: transformers' "
            "ChameleonVQVAE needs a Chameleon-layout tokenizer (quantizer='chameleon', GroupNorm 32, one res-block "
            "count for every encoder level) "
            "or a ChameleonVQVAE itself"
        )
    # our ImageTokenizer keeps transformers' module names for the encoder, quant_conv and post_quant_conv
    state = {k: v for k, v in image_tokenizer.state_dict().items()
             if k.startswith(("encoder.", "quant_conv.", "post_quant_conv."))}
    state["quantize.embedding.weight"] = image_tokenizer.quantize.codebook.detach()
    vq_config = dict(
        embed_dim=config.embed_dim, num_embeddings=config.codebook_size, double_latent=False,
        latent_channels=config.latent_channels, resolution=config.image_size, in_channels=config.in_channels,
        base_channels=config.base_channels, channel_multiplier=list(config.channel_multiplier),
        num_res_blocks=config.num_res_blocks, attn_resolutions=list(config.attn_resolutions) or None,
        dropout=float(config.dropout),
    )
    return vq_config, state


def _is_side_bundle(image_tokenizer) -> bool:
    """Whether an image tokenizer is ours but of a layout transformers' ChameleonVQVAE cannot hold."""
    config = getattr(image_tokenizer, "config", None)
    return (hasattr(image_tokenizer, "save_pretrained") and hasattr(config, "grid_shape")
            and not getattr(config, "chameleon_layout", False))


def _image_geometry(image_tokenizer) -> tuple[int, int] | None:
    """(image side in pixels, codes per image) of an image tokenizer or ChameleonVQVAE; None without one."""
    if image_tokenizer is None:
        return None
    config = image_tokenizer.config
    if hasattr(config, "grid_shape"):  # ours
        h, w = config.grid_shape
        return config.image_size, h * w
    side = config.resolution // 2 ** (len(config.channel_multiplier) - 1)  # a ChameleonVQVAE
    return config.resolution, side * side


def _placeholder_vq_state(vq_config: dict) -> dict:
    """Deterministic initial weights of the placeholder VQ encoder (it never tokenises real images)."""
    from transformers import ChameleonVQVAE, ChameleonVQVAEConfig

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return ChameleonVQVAE(ChameleonVQVAEConfig(**vq_config)).state_dict()


def _save_pretrained_atomically(obj, directory: Path) -> list[str]:
    """`obj.save_pretrained` into a scratch folder, then each file into `directory` atomically; the names."""
    with tempfile.TemporaryDirectory(dir=directory, prefix=".save-") as scratch:
        obj.save_pretrained(scratch)
        names = sorted(f.name for f in Path(scratch).iterdir() if f.is_file())
        for name in names:
            with atomic_path(directory / name) as tmp:
                shutil.copyfile(Path(scratch) / name, tmp)
    return names


def generation_config(vocab: UnifiedVocab):
    """transformers' GenerationConfig with the sampler's text-mode rule: every id that is neither text, `</s>`
    nor `<sep>` is suppressed (transformers masks image ids itself), so greedy `generate()` matches ours."""
    from transformers import GenerationConfig

    ids = torch.arange(vocab.vocab_size)
    suppress = ~text_mode_mask(vocab) & ~vocab.is_image(ids)
    return GenerationConfig(bos_token_id=vocab.bos_id, eos_token_id=vocab.eos_id, pad_token_id=vocab.pad_id,
                            suppress_tokens=torch.nonzero(suppress).flatten().tolist())


def processor(vocab: UnifiedVocab, image_size: int, image_seq_length: int):
    """transformers' ChameleonProcessor for our vocabulary and an image tokenizer of `image_size` pixels.

    Pixels are scaled to [-1, 1] as Chameleon's own preprocessing and ours do (x / 127.5 − 1, LANCZOS resize of
    the shortest side, center crop); each `<image>` becomes `<boi>`, image_seq_length placeholders, `<eoi>`.
    """
    from transformers import ChameleonImageProcessorPil, ChameleonProcessor

    images = ChameleonImageProcessorPil(size={"shortest_edge": image_size},
                                     crop_size={"height": image_size, "width": image_size},
                                     rescale_factor=1 / 127.5, image_mean=[1.0] * 3, image_std=[1.0] * 3)
    return ChameleonProcessor(images, vocab.to_transformers(), image_seq_length=image_seq_length)


def to_transformers(
    model: FusionModel, directory, image_tokenizer=None, vocab=None, dtype: torch.dtype | None = None
) -> Path:
    """Write `directory` loadable by ChameleonForConditionalGeneration.from_pretrained (offline).

    vocab: the UnifiedVocab or its tokenizer.json; its names become config.vocabulary_map, and it brings the
    tokenizer files, generation_config.json (the text-mode rule, special ids) and, with an image tokenizer,
    the processor files (AutoProcessor). Without it the map names only the image block.
    image_tokenizer: a Chameleon-layout one (or a ChameleonVQVAE) is exported as model.vqmodel; one of our
    other layouts (the "improved" quantizer) goes to `directory/image_tokenizer/` as our own bundle, and
    model.vqmodel is then a placeholder that cannot tokenise images.
    dtype: of the floating-point weights (default: the model's).
    """
    from safetensors.torch import save_file

    check_exportable(model.config, "to_transformers: ")  # before the folder is made
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocabulary_map, unified = _vocabulary(model.config, vocab)
    side_bundle = _is_side_bundle(image_tokenizer)
    vq_config, vq_state = _vq_weights(None if side_bundle else image_tokenizer)
    if side_bundle:
        vq_state = _placeholder_vq_state(PLACEHOLDER_VQ_CONFIG)
    dtype = dtype or next(model.parameters()).dtype
    hf_config = to_transformers_config(model.config, vocabulary_map, vq_config, dtype)
    ours = model.state_dict()
    tensors = {}
    for name, targets in name_map(model.config).items():
        pieces = ours[name].split([ours_size(model.config, t) for t in targets], dim=0) if len(targets) > 1 else [ours[name]]
        for target, piece in zip(targets, pieces):
            tensors[target] = piece.detach()
    for name, tensor in vq_state.items():
        tensors["model.vqmodel." + name] = tensor.detach()
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).to("cpu").contiguous().clone() for k, v in tensors.items()}
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(directory / "config.json", hf_config.to_json_string())
    if unified is not None:
        _save_pretrained_atomically(generation_config(unified), directory)
        geometry = _image_geometry(image_tokenizer)
        if geometry is None:
            _save_pretrained_atomically(unified.to_transformers(), directory)
        else:
            files = processor(unified, *geometry)
            _save_pretrained_atomically(files, directory)  # processor_config.json and the tokenizer files
            _save_pretrained_atomically(files.image_processor, directory)  # preprocessor_config.json
    side = directory / IMAGE_TOKENIZER_FOLDER
    if side_bundle:
        with tempfile.TemporaryDirectory(dir=directory, prefix=".image_tokenizer-") as scratch:
            replace_directory(image_tokenizer.save_pretrained(Path(scratch) / "bundle"), side)
    elif side.is_dir():  # a stale bundle from an earlier export into the same folder would mislead
        shutil.rmtree(side)
    return directory


# What a folder that transformers cannot load raises from `from_pretrained`: a missing or unreadable file
# (OSError), a bad config (ValueError, KeyError), a truncated weights file (EOFError, RuntimeError, safetensors'
# error). `*.bin` weights are read first through the project's one safe loader (weights_only), so a file that is
# not a plain tensor pickle is refused there, before transformers reads it.
LOAD_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError, EOFError, RuntimeError)
LOAD_FIX = ("give a folder written by `train.py convert export` or by transformers' save_pretrained, with config.json "
            "(including vocabulary_map) and model.safetensors")


def _one_line(error: BaseException) -> str:
    """The first sentence of an error's first line (torch's and transformers' messages run to paragraphs)."""
    line = next((part.strip() for part in str(error).splitlines() if part.strip()), type(error).__name__)
    return line.split(". ")[0].rstrip(".")


def _check_pickled_weights(path: Path) -> None:
    """Refuse a `*.bin` weights file that is not a plain tensor pickle, through common.files' safe loader (weights
    only, tensors on the meta device: nothing is materialised), with one line naming the file."""
    for weights in sorted(path.glob("*.bin")):
        try:
            load_checkpoint_file(weights, map_location="meta")
        except ValueError as error:
            refused = error.__cause__ or error  # torch's refusal, a paragraph around the reason
            reason = _one_line(refused.__cause__ or refused.__context__ or refused)
            raise ValueError(f"{path}: transformers could not load this Chameleon folder ({weights.name} is not a "
                             f"plain tensor pickle; torch.load(weights_only=True) refused it: {reason}); "
                             f"{LOAD_FIX}") from error


def _load_reason(error: BaseException) -> str:
    """Why transformers could not load a folder, in a few words."""
    return f"{type(error).__name__}: {_one_line(error)}"


def load_transformers_folder(path, output_loading_info: bool = False):
    """ChameleonForConditionalGeneration (float32) from a local folder, plus transformers' loading info when asked;
    a folder it cannot load raises ValueError with one line naming the folder and what to give instead."""
    from safetensors import SafetensorError
    from transformers import ChameleonForConditionalGeneration

    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: transformers could not load this Chameleon folder (config.json: "
                         f"{_one_line(error)}); {LOAD_FIX}") from error
    if not isinstance(raw, dict) or not isinstance(raw.get("vocabulary_map"), dict):
        raise ValueError(
            f"{path}: config.json has no vocabulary_map (the token name -> id map transformers' Chameleon needs); "
            f"{LOAD_FIX}")
    _check_pickled_weights(path)
    try:
        return ChameleonForConditionalGeneration.from_pretrained(
            path, local_files_only=True, dtype=torch.float32, output_loading_info=output_loading_info)
    except (*LOAD_ERRORS, SafetensorError) as error:
        raise ValueError(f"{path}: transformers could not load this Chameleon folder ({_load_reason(error)}); "
                         f"{LOAD_FIX}") from error


def ours_size(config: FusionConfig, hf_name: str) -> int:
    """Rows of a fused weight that belong to one transformers matrix (for splitting qkv and gate_up)."""
    if hf_name.endswith("q_proj.weight"):
        return config.n_heads * config.head_dim
    if hf_name.endswith(("k_proj.weight", "v_proj.weight")):
        return config.kv_heads * config.head_dim
    if hf_name.endswith(("gate_proj.weight", "up_proj.weight")):
        return config.hidden_dim
    raise ValueError(f"ours_size: {hf_name} is not part of a fused weight")


def load_config_json(directory) -> dict:
    """The raw config.json of an exported/transformers directory (for the CLI's summary)."""
    return json.loads((Path(directory) / "config.json").read_text())
