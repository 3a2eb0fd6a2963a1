"""A family defined outside the project (as a user would): a bag-of-embeddings model and a two-term objective.

It is named by dotted path (`--model.family toy_family:ToyFamily`) with this folder on PYTHONPATH: no project
file lists it. Term `next_token` is counted in targets, term `noise` in documents, so gradient accumulation is
exact only if each term is divided by its own count over the whole step; the noise is keyed by the step and each
document's first token key (its identity in the dataset), so it does not depend on which rank or micro-batch the document lands in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fusion_model.families.base import Family, LossTerm, Objective


@dataclass(frozen=True)
class ToyOptions:
    """The toy's options: the weight of its second term."""

    noise_weight: float = 0.5

    @classmethod
    def from_dict(cls, values: dict) -> ToyOptions:
        """From --model.family_options."""
        return cls(**values)


class ToyModel(nn.Module):
    """Embedding -> linear head; each position sees only its own token."""

    def __init__(self, vocab_size: int, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, vocab_size)


class ToyFamily(Family):
    """Next-token CE per target, plus a per-document regression of the mean embedding onto keyed noise."""

    name = "toy"
    Options = ToyOptions
    batch_keys = ("token_keys",)

    def build(self) -> dict[str, nn.Module]:
        return {"model": ToyModel(self.config.vocab_size)}

    def _documents(self, batch) -> torch.Tensor:
        documents = batch["document_ids"]
        starts = (documents >= 0) & torch.cat([torch.ones_like(documents[:, :1], dtype=torch.bool),
                                               documents[:, 1:] != documents[:, :-1]], dim=1)
        return starts

    def denominators(self, batch):
        documents = batch["document_ids"]
        valid = (documents[:, :-1] == documents[:, 1:]) & (documents[:, :-1] >= 0)
        return {"next_token": valid.sum().float(), "noise": self._documents(batch).sum().float()}

    def objective(self, parts, batch, context) -> Objective:
        model, ids, documents = parts["model"], batch["input_ids"], batch["document_ids"]
        hidden = model.embed(ids)
        valid = (documents[:, :-1] == documents[:, 1:]) & (documents[:, :-1] >= 0)
        ce = F.cross_entropy(model.head(hidden[:, :-1][valid]), ids[:, 1:][valid], reduction="sum")
        starts = self._documents(batch)
        # one noise vector per document (piece), keyed by its first token's identity in the dataset: the same
        # document gets the same noise wherever it is batched
        keys = batch["token_keys"][starts]
        noise = context.normal(keys, "toy_noise", draws=hidden.shape[-1])
        mse = F.mse_loss(hidden[starts], noise, reduction="sum") / hidden.shape[-1]
        return Objective(terms={"next_token": LossTerm(ce, valid.sum()),
                                "noise": LossTerm(mse, starts.sum(), weight=self.options.noise_weight)},
                         metrics={"documents": (starts.sum().float(), 1)}, positions=(documents >= 0).sum())
