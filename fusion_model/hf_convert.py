"""Import from / export to transformers' ChameleonForConditionalGeneration (config.json + safetensors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel
from tokenizer.files import atomic_path, atomic_write_text
from tokenizer.vocab import image_code_of_name, image_token_name

# A placeholder VQ encoder for exports without an image tokenizer: transformers always builds one, and
# the default (70M parameters, random) would only cost time; text and image-token ids work without it.
PLACEHOLDER_VQ_CONFIG = dict(
    embed_dim=32, num_embeddings=8192, latent_channels=32, resolution=32, base_channels=32,
    channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=None,
)


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


def to_transformers_config(config: FusionConfig, vocabulary_map: dict, vq_config: dict | None = None):
    """The transformers ChameleonConfig equivalent to a FusionConfig."""
    from transformers import ChameleonConfig

    if not config.qk_norm:
        raise ValueError("to_transformers: transformers' Chameleon always applies QK-norm; export needs qk_norm=True")
    hf_config = ChameleonConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads, max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        swin_norm=config.norm_placement == "swin", vocabulary_map=vocabulary_map,
        vq_config=vq_config or PLACEHOLDER_VQ_CONFIG, tie_word_embeddings=False,
    )
    hf_config.architectures = ["ChameleonForConditionalGeneration"]
    return hf_config


def _vocabulary(config: FusionConfig, vocab, directory: Path) -> tuple[dict, Path | None]:
    """The vocabulary map (name -> id) and tokenizer.json to copy, from a vocab or the image block alone.

    vocab: None, a path to a tokenizer.json, or an object with `.save(path)` (UnifiedVocab).
    """
    if vocab is None:
        if config.image_offset is None:
            return {}, None
        return {image_token_name(k): config.image_offset + k for k in range(config.image_codes)}, None
    from tokenizers import Tokenizer

    if hasattr(vocab, "save"):
        path = directory / "tokenizer.json"
        vocab.save(path)
    else:
        path = Path(vocab)
    tokenizer = Tokenizer.from_file(str(path))
    mapping = tokenizer.get_vocab(with_added_tokens=True)
    if len(mapping) != config.vocab_size:
        raise ValueError(f"to_transformers: {path} has {len(mapping)} tokens but the model has {config.vocab_size}")
    return mapping, path


def _vq_weights(image_tokenizer) -> tuple[dict | None, dict]:
    """(vq_config dict, state dict in ChameleonVQVAE names) from an image tokenizer, or (None, {})."""
    if image_tokenizer is None:
        return None, {}
    if type(image_tokenizer).__name__ == "ChameleonVQVAE":
        return image_tokenizer.config.to_dict(), image_tokenizer.state_dict()
    config = getattr(image_tokenizer, "config", None)
    if getattr(config, "quantizer", None) != "chameleon" or getattr(config, "norm_groups", 32) != 32:
        raise TypeError(
            f"to_transformers: cannot export the VQ weights of {type(image_tokenizer).__name__}: transformers' "
            "ChameleonVQVAE needs a Chameleon-layout tokenizer (quantizer='chameleon', GroupNorm 32) "
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


def to_transformers(model: FusionModel, directory, image_tokenizer=None, vocab=None) -> Path:
    """Write `directory` loadable by ChameleonForConditionalGeneration.from_pretrained (offline).

    vocab: path of the unified tokenizer.json (its names become config.vocabulary_map and it is copied);
    without it the map names only the image block, which is what transformers needs to mask image logits.
    image_tokenizer: when given (Chameleon layout), its VQ encoder is exported as model.vqmodel.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocabulary_map, tokenizer_path = _vocabulary(model.config, vocab, directory)
    vq_config, vq_state = _vq_weights(image_tokenizer)
    hf_config = to_transformers_config(model.config, vocabulary_map, vq_config)
    ours = model.state_dict()
    tensors = {}
    for name, targets in name_map(model.config).items():
        pieces = ours[name].split([ours_size(model.config, t) for t in targets], dim=0) if len(targets) > 1 else [ours[name]]
        for target, piece in zip(targets, pieces):
            tensors[target] = piece.detach().to("cpu").contiguous().clone()
    for name, tensor in vq_state.items():
        tensors["model.vqmodel." + name] = tensor.detach().to("cpu").contiguous().clone()
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_text(directory / "config.json", hf_config.to_json_string())
    if tokenizer_path is not None and tokenizer_path.resolve() != (directory / "tokenizer.json").resolve():
        with atomic_path(directory / "tokenizer.json") as tmp:
            shutil.copyfile(tokenizer_path, tmp)
    return directory


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
