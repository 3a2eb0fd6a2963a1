"""DecodableModel: what the sampler needs of a model (a typing.Protocol), checked once before sampling."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from fusion_model.layers.kv_cache import KVCache


@runtime_checkable
class DecodableConfig(Protocol):
    """The fields of `model.config` the sampler reads (common.compat.check_compatible reads the image block's)."""

    max_seq_len: int  # the context: prompts and their new tokens must fit in it
    vocab_size: int
    image_offset: int | None  # the image block: ids image_offset .. image_offset + image_codes - 1
    image_codes: int
    image_bidirectional: bool  # full attention inside images: speculative decoding refuses it


@runtime_checkable
class DecodableModel(Protocol):
    """A model `generate_ids` can sample (fusion_model.model.FusionModel is one).

    `forward_hidden` runs a prompt (appending it to `kv_cache` when given) and `head` turns hidden states into
    logits, on the last columns only; with the KV cache, later forwards go through `decode_hidden`, whose shapes
    are fixed (so the step compiles), into a cache from `new_kv_cache` (a fusion_model.layers.kv_cache.KVCache: the sampler's
    compiled step keeps its `keys`, `values`, `document_ids` and `positions` at fixed addresses).

    `supports_kv_cache` (a class attribute) says whether the cached path works: a model that can only recompute
    the whole sequence sets it False, and then `generate_ids` refuses `use_kv_cache=True` (its `decode_hidden` and
    `new_kv_cache` are then never called).

    `check_decodable` checks a model against this protocol member by member; `isinstance(model, DecodableModel)`
    is not that check: from Python 3.12 it looks members up statically and misses a torch module's submodules
    (FusionModel's `head`), and it never looks inside `config`.
    """

    config: DecodableConfig
    head: Callable[[torch.Tensor], torch.Tensor]  # the output projection: hidden (..., dim) -> logits (..., V)
    supports_kv_cache: bool
    training: bool

    def forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                       document_ids: torch.Tensor | None = None, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Final hidden states (B, T, dim) of input_ids (B, T); document -1 is padding."""
        ...

    def decode_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, documents: torch.Tensor,
                      slot: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """Hidden states (B, T, dim) of T new tokens per row, row b's written at cache indices slot[b], ..."""
        ...

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, device: torch.device | str | None = None,
                     dtype: torch.dtype | None = None) -> KVCache:
        """An empty KV cache of `batch_size` rows and `max_len` positions."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """The weights (the first one's device is where sampling runs)."""
        ...

    def train(self, mode: bool = True) -> DecodableModel:
        """Set training mode (the sampler restores the model's own afterwards)."""
        ...

    def eval(self) -> DecodableModel:
        """Set evaluation mode (sampling runs in it)."""
        ...


def _members(protocol: type) -> list[str]:
    """The names a protocol declares: its annotated attributes, then its methods."""
    methods = [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
    return [*protocol.__annotations__, *methods]


MODEL_MEMBERS = tuple(_members(DecodableModel))
CONFIG_MEMBERS = tuple(_members(DecodableConfig))


def check_decodable(model: object) -> None:
    """Raise TypeError naming every member of DecodableModel (and of its config) that `model` lacks."""
    missing = [name for name in MODEL_MEMBERS if not hasattr(model, name)]
    if "config" not in missing:
        missing += [f"config.{name}" for name in CONFIG_MEMBERS if not hasattr(model.config, name)]
    if missing:
        raise TypeError(
            f"{type(model).__name__} cannot be sampled: it lacks {', '.join(missing)} of the DecodableModel protocol "
            "(fusion_model.sampling.protocol; fusion_model.model.FusionModel has them all)"
        )
    if not isinstance(model.supports_kv_cache, bool):
        raise TypeError(
            f"{type(model).__name__}.supports_kv_cache={model.supports_kv_cache!r} must be True or False "
            "(whether the model's cached decode path works)"
        )
