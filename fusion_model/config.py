"""FusionConfig: the decoder's hyper-parameters (Chameleon architecture) and named presets."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, get_type_hints

from fusion_model.blocks import block_class

NORM_PLACEMENTS = ("pre", "swin")
ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "xformers")


def chameleon_ffn_dim(dim: int) -> int:
    """Chameleon's (LLaMA-2's) FFN width rule: 256 * ceil(int(8 d / 3) / 256)."""
    return 256 * math.ceil(int(8 * dim / 3) / 256)


@dataclass
class FusionConfig:
    """Decoder shape and training-relevant switches; defaults are Chameleon-7B."""

    vocab_size: int = 65536
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: same as n_heads (no GQA)
    ffn_dim: int | None = None  # None: chameleon_ffn_dim(dim)
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    qk_norm: bool = True
    norm_placement: str = "pre"  # "pre" (LLaMA) or "swin" (Chameleon-34B norm reordering)
    dropout: float = 0.0  # residual dropout after each sub-layer
    z_loss_coef: float = 1e-5
    attention_backend: str = "auto"  # auto: flex on CUDA, SDPA elsewhere
    image_bidirectional: bool = False  # Transfusion-style full attention inside each image run
    image_offset: int | None = None  # image id = image_offset + code (None: no image block known)
    image_codes: int | None = None
    # the `<image>` id standing for one continuous latent patch (Transfusion): its positions are image positions
    # (image_bidirectional runs, block modality); None: images are codes only
    image_placeholder_id: int | None = None
    init_std: float = 0.02
    gradient_checkpointing: bool = False  # recompute each block in backward (memory for speed)
    block: str = "dense"  # the layer class by name (fusion_model.blocks): "dense", "mot", or "package.module:Class"
    block_options: dict[str, Any] = field(default_factory=dict)  # the block's own settings (e.g. mot's parts)

    def __post_init__(self) -> None:
        self._check_field_values()
        if self.dim % self.n_heads:
            raise ValueError(f"FusionConfig: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"FusionConfig: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"FusionConfig: head_dim {self.head_dim} must be even for RoPE")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"FusionConfig: norm_placement {self.norm_placement!r}; choose one of {NORM_PLACEMENTS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"FusionConfig: attention_backend {self.attention_backend!r}; choose one of {ATTENTION_BACKENDS}"
            )
        if (self.image_offset is None) != (self.image_codes is None):
            raise ValueError("FusionConfig: set both image_offset and image_codes, or neither")
        if self.image_bidirectional and self.image_offset is None and self.image_placeholder_id is None:
            raise ValueError("FusionConfig: image_bidirectional=True needs image_offset and image_codes (or "
                             "image_placeholder_id)")
        if self.image_placeholder_id is not None and self.image_placeholder_id >= self.vocab_size:
            raise ValueError(f"FusionConfig: image_placeholder_id {self.image_placeholder_id} is not below "
                             f"vocab_size {self.vocab_size}")
        if self.image_placeholder_id is not None and self.image_offset is not None and \
                self.image_offset <= self.image_placeholder_id < self.image_offset + self.image_codes:
            raise ValueError(f"FusionConfig: image_placeholder_id {self.image_placeholder_id} is an image code "
                             f"(block [{self.image_offset}, {self.image_offset + self.image_codes}))")
        if self.image_offset is not None and self.image_offset + self.image_codes > self.vocab_size:
            raise ValueError(
                f"FusionConfig: image block [{self.image_offset}, {self.image_offset + self.image_codes}) "
                f"does not fit in vocab_size {self.vocab_size}"
            )
        block_class(self.block).check_config(self)

    def _check_field_values(self) -> None:
        """Check each field on its own: sizes positive ints, rates in range, switches bools."""
        # a dim of 0 would otherwise train an empty model with exit 0, a vocab_size of -5 fail deep inside torch

        def fail(name: str, rule: str) -> None:
            raise ValueError(f"FusionConfig: {name}={getattr(self, name)!r} is invalid: {rule} (--model.config.{name})")

        def is_int(value: Any) -> bool:
            return isinstance(value, numbers.Integral) and not isinstance(value, bool)

        def is_real(value: Any) -> bool:
            return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            if not is_int(getattr(self, name)) or getattr(self, name) <= 0:
                fail(name, "it must be a positive integer")
        for name in ("n_kv_heads", "ffn_dim", "image_codes"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value <= 0):
                fail(name, "it must be a positive integer or null")
        for name in ("image_offset", "image_placeholder_id"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                fail(name, "it must be an integer >= 0 or null")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not is_real(getattr(self, name)) or getattr(self, name) <= 0:
                fail(name, "it must be a finite number > 0")
        if not is_real(self.dropout) or not 0 <= self.dropout < 1:
            fail("dropout", "it must be a number with 0 <= dropout < 1")
        if not is_real(self.z_loss_coef) or self.z_loss_coef < 0:
            fail("z_loss_coef", "it must be a finite number >= 0")
        for name in ("qk_norm", "image_bidirectional", "gradient_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "it must be true or false")
        if not isinstance(self.block, str) or not self.block:
            fail("block", "it must be a block name")
        if not isinstance(self.block_options, Mapping) or not all(isinstance(k, str) for k in self.block_options):
            fail("block_options", "it must be a mapping from option names to values")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (n_kv_heads, or n_heads without GQA)."""
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        """FFN width (explicit ffn_dim, or Chameleon's rule)."""
        return self.ffn_dim or chameleon_ffn_dim(self.dim)

    def layer_part_parameters(self) -> dict[str, int]:
        """Parameters of one dense layer by part, closed form: attention (Q, K, V, O), ffn, norms (the layer's two
        RMSNorms) and qk_norm (a weight and a bias per head and channel, 0 without QK-norm)."""
        d, hd = self.dim, self.head_dim
        return {
            "attention": d * (self.n_heads * hd) + 2 * d * (self.kv_heads * hd) + (self.n_heads * hd) * d,
            "ffn": 3 * d * self.hidden_dim,
            "norms": 2 * d,
            "qk_norm": 2 * (self.n_heads + self.kv_heads) * hd if self.qk_norm else 0,
        }

    def layer_parameters(self) -> int:
        """Parameters of one decoder block as the configured block builds it, closed form."""
        return block_class(self.block).layer_parameters(self)

    def active_layer_parameters(self) -> int:
        """Parameters of one decoder block that one token runs through (all of them for the dense block)."""
        return block_class(self.block).active_layer_parameters(self)

    def num_parameters(self, embeddings: bool = True) -> int:
        """Total parameters, closed form (untied input embedding and output head, final norm)."""
        tables = 2 * self.vocab_size * self.dim if embeddings else 0
        return tables + self.n_layers * self.layer_parameters() + self.dim

    def active_parameters(self, embeddings: bool = True) -> int:
        """Parameters one token runs through, closed form (equals num_parameters for the dense block)."""
        tables = 2 * self.vocab_size * self.dim if embeddings else 0
        return tables + self.n_layers * self.active_layer_parameters() + self.dim

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 N (matmul weights, head included) + 12 L d T (attention scores/values).

        N counts the active parameters: a block with weights per modality (mot) runs each token through its own
        modality's copy only. The attention term counts the full T x T square (PaLM's convention), since the
        masked SDPA kernels used here compute it; the input embedding lookup is no matmul and is left out.
        """
        matmul_params = self.active_parameters(embeddings=False) + self.vocab_size * self.dim
        return 6.0 * matmul_params + 12.0 * self.n_layers * self.dim * seq_len

    # ---- presets -------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides) -> FusionConfig:
        """Build a named preset (see PRESETS), with any field overridden by keyword."""
        if name not in PRESETS:
            raise ValueError(f"FusionConfig: unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        fields = {**PRESETS[name], **overrides}
        return cls(**fields)

    def to_dict(self) -> dict:
        """Plain-JSON form (for checkpoints and hparams)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> FusionConfig:
        """Inverse of to_dict; a `preset` key starts from that preset, the other keys override its fields.

        Unknown keys are an error naming them. Without `preset`, missing fields take the class defaults.
        """
        values = dict(values)
        preset = values.pop("preset", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"FusionConfig.from_dict: unknown fields {unknown}")
        return cls.from_preset(preset, **values) if preset is not None else cls(**values)


# The one definition of each decoder architecture: configs/fusion/<name>.yaml name these (model.config.preset)
# and add only their recipe's overrides. Presets leave image_offset/image_codes unset: they come from the
# vocabulary (UnifiedVocab), passed as overrides, e.g.
# FusionConfig.from_preset("demo", vocab_size=v.vocab_size, image_offset=v.image_offset, ...).
PRESETS: dict[str, dict] = {
    # Chameleon paper (arXiv 2405.09818), Table 1 and section 2.3: 7B trains with pre-norm and dropout 0.1;
    # 34B needed swin norm reordering and no dropout. The paper says 34B uses GQA without the group count:
    # 8 kv heads is inferred (LLaMA-2's GQA sizes use 8).
    "chameleon-7b": dict(dim=4096, n_layers=32, n_heads=32, dropout=0.1),
    "chameleon-34b": dict(dim=8192, n_layers=48, n_heads=64, n_kv_heads=8, norm_placement="swin"),
    # unit tests: everything small, GQA on so the grouped path is always exercised
    "tiny": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128),
    # the CPU demo: d 128, 4 layers, 4 heads, ~0.86M parameters without embeddings, the size a CPU prototype
    # trained to 93.6% held-out caption accuracy in 4 minutes
    "demo": dict(vocab_size=1024, dim=128, n_layers=4, n_heads=4, ffn_dim=384, max_seq_len=256, dropout=0.1),
    # CPU benchmark sizes (small is also configs/fusion/small.yaml's decoder)
    "small": dict(vocab_size=4096, dim=256, n_layers=4, n_heads=4, max_seq_len=512),
    "medium": dict(vocab_size=8192, dim=512, n_layers=8, n_heads=8, max_seq_len=1024),
}

# What a config dict may hold (every FusionConfig field, plus `preset`), all keys optional: the type
# `train.py fit` checks model.config against, so a YAML names a preset and only the fields it changes, while
# each field can still be set on the command line (--model.config.vocab_size 65536) and is type-checked
# there. Built from the dataclass so that the list of fields exists once.
FusionConfigDict = TypedDict(
    "FusionConfigDict", {"preset": Literal[tuple(PRESETS)], **get_type_hints(FusionConfig)}, total=False
)
