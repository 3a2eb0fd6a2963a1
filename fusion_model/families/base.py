"""The family protocol: what a model family tells the trainer, the sampler and the checkpoint loader.

A family is a class with a registered name (`fusion_model.families.register_family`). The trainer
(`fusion_model.training.lightning_module`) knows nothing else about it: it builds the family's parts, asks its
objective for loss terms and metrics, sums the terms over their own denominators, and logs what comes back.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from fusion_model.config import FusionConfig
from fusion_model.layers.keyed_random import keyed_generator, keyed_normal, keyed_uniform
from fusion_model.sampling.config import SamplingConfig

# What every packed batch carries (data_shards.stream); a family names any further entries in `batch_keys`.
BASE_BATCH_KEYS = ("input_ids", "document_ids", "position_ids")
# Further entries the data module can add when a family asks for them.
# image_latents (B, T, C*k*k) float: each continuous-image placeholder position's clean latent patch (Transfusion)
# target_mask (B, T) bool: true where the token is a training target (answers of conversation shards; every
# real token of pretraining shards), false at prompt tokens and padding (Chameleon's answer-only SFT)
OPTIONAL_BATCH_KEYS = ("image_features", "token_keys", "image_latents", "target_mask")


@dataclass(frozen=True)
class NoOptions:
    """The options of a family that has none."""

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> NoOptions:
        """Refuse any option: this family takes none."""
        if values:
            raise ValueError(f"this family takes no model.family_options; got {sorted(values)}")
        return cls()


@dataclass(frozen=True)
class LossSettings:
    """The recipe's loss settings every family receives (`--model.text_weight`, ...); a family uses what it needs."""

    text_weight: float = 1.0
    image_weight: float = 1.0
    chunk_size: int = 4096

    def __post_init__(self) -> None:
        for name, flag in (("text_weight", "text_weight"), ("image_weight", "image_weight")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"--model.{flag}={value!r} must be a finite number >= 0")
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size <= 0:
            raise ValueError(f"--model.loss_chunk_size={self.chunk_size!r} must be a positive integer")

    def weighted_count(self, n_text: torch.Tensor, n_image: torch.Tensor) -> torch.Tensor:
        """The modality-weighted number of next-token targets: the denominator of the next-token loss."""
        return (n_text * self.text_weight + n_image * self.image_weight).float()


@dataclass
class LossTerm:
    """One summand of an objective: `total` is summed over its units (targets, images, pairs) in this micro-batch,
    `count` is how many units that is; the trainer divides by the count over every rank and micro-batch of the
    optimizer step, so gradient accumulation and data parallelism stay exact for each term on its own."""

    total: torch.Tensor
    count: torch.Tensor
    weight: float = 1.0


@dataclass
class Objective:
    """What a family's objective returns for one micro-batch.

    terms: the loss = sum over terms of weight * total / (global count); metrics: name -> (value, weight), logged
    as `train/<name>` each step and averaged with that weight over validation; positions: decoder positions run.
    """

    terms: dict[str, LossTerm]
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor | int]] = field(default_factory=dict)
    positions: torch.Tensor | int = 0

    def counts(self) -> torch.Tensor:
        """Each term's count on this rank, in `terms` order (float)."""
        return torch.stack([torch.as_tensor(t.count, dtype=torch.float32).reshape(()).to(t.total.device)
                            for t in self.terms.values()])

    def loss(self, denominators: torch.Tensor) -> torch.Tensor:
        """sum_k weight_k * total_k / denominator_k (denominators in `terms` order, clamped away from 0)."""
        parts = [term.weight * term.total / denominator.clamp_min(1e-12)
                 for term, denominator in zip(self.terms.values(), denominators)]
        return torch.stack(parts).sum()

    def mean(self, name: str) -> torch.Tensor:
        """A term's mean over this micro-batch (its total over its local count), detached: what is logged."""
        term = self.terms[name]
        count = torch.as_tensor(term.count, dtype=torch.float32, device=term.total.device)
        return torch.where(count > 0, term.total.detach() / count.clamp_min(1e-12), 0.0)


def next_token_objective(out: Mapping[str, torch.Tensor], losses: LossSettings,
                         positions: torch.Tensor | int) -> Objective:
    """The Objective of `fusion_loss`'s output: one term `loss` (mean x weighted count = its sum), and the
    CE, z-loss and per-modality losses as metrics (logged as train/ce, train/text_loss, ...)."""
    n_text, n_image = out["n_text_targets"], out["n_image_targets"]
    weighted_count = losses.weighted_count(n_text, n_image)
    weight = weighted_count.clamp_min(1)
    return Objective(
        terms={"loss": LossTerm(out["loss"] * weighted_count, weighted_count)},
        metrics={"ce": (out["ce"].detach(), weight), "text_loss": (out["text_loss"], n_text),
                 "image_loss": (out["image_loss"], n_image), "z_loss": (out["z_loss"].detach(), weight)},
        positions=positions,
    )


@dataclass(frozen=True)
class ObjectiveContext:
    """Where in training an objective runs: its randomness is keyed by (seed, step) and the sample, never drawn from
    a rank's generator."""

    step: int
    seed: int = 0
    training: bool = True

    def uniform(self, keys: torch.Tensor, stream: str, draws: int = 1) -> torch.Tensor:
        """`keyed_uniform` at this step."""
        return keyed_uniform(keys, seed=self.seed, step=self.step, stream=stream, draws=draws)

    def normal(self, keys: torch.Tensor, stream: str, draws: int = 1) -> torch.Tensor:
        """`keyed_normal` at this step."""
        return keyed_normal(keys, seed=self.seed, step=self.step, stream=stream, draws=draws)

    def generator(self, keys: torch.Tensor, stream: str, device: torch.device | str = "cpu") -> torch.Generator:
        """`keyed_generator` at this step."""
        return keyed_generator(keys, seed=self.seed, step=self.step, stream=stream, device=device)


def data_parallel_mesh(mesh: Any) -> Any:
    """A 1-D mesh over all of `mesh`'s ranks: pure data parallelism, since these decoders have no tensor-parallel
    layers, even when the strategy's "auto" sizes split the ranks into data x tensor (it does so within a node)."""
    from torch.distributed.device_mesh import init_device_mesh

    dp_mesh = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
    if dp_mesh.size() != mesh.size():
        dp_mesh = init_device_mesh(mesh.device_type, (mesh.size(),), mesh_dim_names=("data_parallel",))
    return dp_mesh


class Family(ABC):
    """A model family: its parts, its objective, how it is parallelised, sampled and saved.

    Subclass, set `name` (and `Options`, a frozen dataclass with `from_dict`, when the family has options), and
    implement `build` and `objective`; register the class with `fusion_model.families.register_family`, or name it
    by dotted path (`--model.family my_package.module:MyFamily`). Everything else has a default.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    # batch entries beyond BASE_BATCH_KEYS (from OPTIONAL_BATCH_KEYS) the objective reads
    batch_keys: ClassVar[tuple[str, ...]] = ()
    # whether the objective puts a next-token loss on image positions (then attention inside an image must stay
    # causal: image_bidirectional would let a position see its own target)
    scores_image_positions: ClassVar[bool] = False
    # whether `train.py convert export` can write the checkpoint in transformers' Chameleon layout
    exportable: ClassVar[bool] = False
    # the settings `generate` reads: SamplingConfig or a subclass with the family's own fields (`train.py generate`
    # makes one option per field, from the checkpoint's family)
    sampling_config: ClassVar[type[SamplingConfig]] = SamplingConfig
    # whether `generate` can write images (what `train.py eval` asks before scoring generation)
    writes_images: ClassVar[bool] = True

    def __init__(self, config: FusionConfig, options: Any = None, losses: LossSettings | None = None) -> None:
        if options is None:
            options = {}
        if isinstance(options, Mapping):
            options = self.Options.from_dict(dict(options))
        self.config = config
        self.options = options
        self.losses = losses or LossSettings()
        self.check()

    # ---- configuration --------------------------------------------------------------------------------------
    def check(self) -> None:
        """Refuse a decoder config this family's objective cannot train correctly (raise ValueError)."""
        if self.scores_image_positions and self.config.image_bidirectional:
            raise ValueError(
                f"model.config.image_bidirectional is true, but the {self.name} family puts a next-token loss on "
                "image positions: with attention across the whole image, each image position would see the code "
                "it is asked to predict and learn to copy it; set --model.config.image_bidirectional false (it "
                "belongs to objectives without a next-token loss on images, such as Transfusion's)"
            )

    @classmethod
    def derive_options(cls, options: dict, manifest: Mapping[str, Any], vocab: Any | None) -> None:
        """Fill options the token shards' manifest (or the vocabulary) already fix; called by `train.py fit`.
        The default fills nothing."""
        return None

    def options_dict(self) -> dict:
        """The options as plain values (stored in checkpoints)."""
        return dataclasses.asdict(self.options) if dataclasses.is_dataclass(self.options) else dict(self.options)

    # ---- training ---------------------------------------------------------------------------------------------
    @abstractmethod
    def build(self) -> dict[str, nn.Module]:
        """The trainable parts, by the name each is registered (and checkpointed) under."""

    @abstractmethod
    def objective(self, parts: Mapping[str, nn.Module], batch: Mapping[str, torch.Tensor],
                  context: ObjectiveContext) -> Objective:
        """Loss terms (each with its own count), metrics and decoder positions of one micro-batch."""

    def denominators(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Each term's count computed from the batch alone, without a forward (the same numbers `objective`
        returns), or None when that needs the model. With gradient accumulation the loader reads an optimizer
        step's micro-batches ahead and sums these, so each term is divided by its count over the whole step."""
        return None

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per input position, what MFU counts: the decoder's
        (`FusionConfig.flops_per_token`) unless the family runs more around it."""
        return self.config.flops_per_token(seq_len)

    def set_mode(self, parts: Mapping[str, nn.Module], training: bool) -> None:
        """Train/eval mode of the parts before a forward (a frozen part stays in eval mode); the default sets every
        part to `training`."""
        for part in parts.values():
            part.train(training)

    def start_new_run(self, parts: Mapping[str, nn.Module]) -> None:
        """Load what a new run starts from (e.g. an earlier stage's weights); not called on resume. The default
        loads nothing."""
        return None

    def compile(self, parts: Mapping[str, nn.Module]) -> None:
        """torch.compile in place (parameter names unchanged): every block of a decoder part."""
        for part in parts.values():
            for block in getattr(part, "layers", ()):
                block.compile()

    def parallelize(self, parts: Mapping[str, nn.Module], mesh: Any) -> None:
        """FSDP2 over the strategy's DeviceMesh: each block of the decoder, then each part's root, sharded over
        every rank. Raise ValueError with a sentence when the family cannot be sharded."""
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        mesh = data_parallel_mesh(mesh)
        for part in parts.values():
            for block in getattr(part, "layers", ()):
                fully_shard(block, mesh=mesh)
            fully_shard(part, mesh=mesh)
            if hasattr(part, "loss"):
                register_fsdp_forward_method(part, "loss")  # root params are gathered around part.loss too

    # ---- sampling and export ----------------------------------------------------------------------------------
    def generate(self, parts: Mapping[str, nn.Module], vocab: Any, image_tokenizer: Any, prompts: list[list[Any]],
                 config: Any) -> tuple[list[list[Any]], list[list[int]]]:
        """Sample a continuation of each prompt (segments: str and image paths / PIL images); returns the output
        segments and the new ids of each. Families that cannot sample keep this refusal."""
        raise ValueError(f"the {self.name} family cannot generate: its checkpoint holds no model that samples text "
                         "or images (train the next stage, or sample another checkpoint)")
