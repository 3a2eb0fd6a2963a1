"""The decoder with a late-fusion connector in front (LateFusionModel), its training stages, its options and the
early -> late re-layout of a packed batch; the frozen image encoder the connectors read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fusion_model.families.late.connectors import (
    FlamingoConnector,
    LlavaProjector,
    QFormer,
    media_index,
    media_mask,
)
from fusion_model.layers.kv_cache import KVCache
from fusion_model.model import FusionModel
from tokenizer.image.image_tokenizer import ImageTokenizer
from tokenizer.layout import image_code_mask

KINDS = ("llava", "qformer", "flamingo")
IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: image positions add no loss


# ---- the frozen image encoder ------------------------------------------------------------------------------------
def frozen_image_features(tokenizer: ImageTokenizer, pixels: torch.Tensor) -> torch.Tensor:
    """Pre-quantisation features (B, h*w, C) of pixels in [-1, 1], flattened row-major, without gradients."""
    # the same encoder early fusion tokenizes with: early fusion rounds these vectors to codes, late fusion
    # reads them as they are, so the two compare on equal vision
    with torch.no_grad():
        return tokenizer.patch_features(tokenizer.encode_latents(pixels))


def freeze(module: nn.Module) -> nn.Module:
    """Stop training `module`: no parameter requires grad, and it runs in eval mode (no dropout)."""
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    return module.eval()


def unfreeze(module: nn.Module) -> nn.Module:
    """Train `module` again: every parameter requires grad, and it runs in train mode."""
    for parameter in module.parameters():
        parameter.requires_grad_(True)
    return module.train()


# ---- the wrapped decoder -----------------------------------------------------------------------------------------
class LateFusionModel(nn.Module):
    """A FusionModel decoder fed images by a connector ("llava", "qformer" or "flamingo") over frozen features.

    Images are given in the order their markers appear, row by row. LLaVA and Q-Former: each image is a run of
    `image_tokens_in_context` placeholder ids `image_token_id`, whose embeddings are replaced by the connector's
    outputs. Flamingo: each image is one `image_token_id` marker, an ordinary token; the text after it (up to the
    next marker, inside its document) cross-attends to that image's resampled latents before every decoder block.
    """

    def __init__(self, decoder: FusionModel, kind: str, image_token_id: int, *,
                 tokenizer: ImageTokenizer | None = None, feature_dim: int | None = None,
                 patches_per_image: int | None = None, connector_dim: int | None = None, num_latents: int = 64,
                 num_queries: int = 32, depth: int = 2, heads: int = 4) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"LateFusionModel: kind {kind!r}; choose one of {KINDS}")
        if not 0 <= image_token_id < decoder.config.vocab_size:
            raise ValueError(f"LateFusionModel: image_token_id {image_token_id} is outside the decoder's vocabulary")
        if tokenizer is None and feature_dim is None:
            raise ValueError("LateFusionModel: give the image tokenizer, or feature_dim when passing features")
        self.kind = kind
        self.image_token_id = image_token_id
        self.decoder = decoder
        self.tokenizer = None if tokenizer is None else freeze(tokenizer)  # never trained here
        feature_dim = feature_dim or tokenizer.config.embed_dim
        if patches_per_image is None and tokenizer is not None:
            rows, columns = tokenizer.grid_shape
            patches_per_image = rows * columns
        self.patches_per_image = patches_per_image
        model_dim = decoder.config.dim
        connector_dim = connector_dim or model_dim
        self.num_queries = num_queries
        if kind == "llava":
            self.connector = LlavaProjector(feature_dim, model_dim)
        elif kind == "qformer":
            self.connector = QFormer(feature_dim, connector_dim, num_queries, depth, heads, out_dim=model_dim)
        else:
            self.connector = FlamingoConnector(feature_dim, model_dim, decoder.config.n_layers, connector_dim,
                                               num_latents, depth, heads)

    @property
    def image_tokens_in_context(self) -> int:
        """Decoder positions one image costs: h*w patches (LLaVA), M queries (Q-Former), 0 (Flamingo: its marker
        token is text; the image enters through cross-attention)."""
        if self.kind == "flamingo":
            return 0
        if self.kind == "qformer":
            return self.num_queries
        if self.patches_per_image is None:
            raise ValueError("LateFusionModel: LLaVA's image cost is h*w: give the tokenizer or patches_per_image")
        return self.patches_per_image

    def parameters_added(self) -> int:
        """Parameters the connector adds to the decoder (and the frozen tokenizer)."""
        return sum(p.numel() for p in self.connector.parameters())

    def connector_state_dict(self) -> dict[str, torch.Tensor]:
        """A copy of the connector's weights (what stage 1 hands to stage 2)."""
        return {name: tensor.detach().clone() for name, tensor in self.connector.state_dict().items()}

    def load_connector_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load connector weights saved by `connector_state_dict` (strict: every name must match)."""
        self.connector.load_state_dict(state)

    def train(self, mode: bool = True) -> LateFusionModel:
        """Set train/eval mode, keeping frozen parts (the tokenizer, a frozen decoder) in eval mode."""
        super().train(mode)
        for part in (self.tokenizer, self.decoder):
            if part is not None and not any(p.requires_grad for p in part.parameters()):
                part.eval()  # a frozen decoder must compute the function it was trained to, without dropout
        return self

    # ---- forward -------------------------------------------------------------------------------------------------
    def image_features(self, pixels: torch.Tensor | None, features: torch.Tensor | None) -> torch.Tensor:
        """The images' features (N, P, C): given directly, or from the frozen tokenizer's encoder."""
        if (pixels is None) == (features is None):
            raise ValueError("LateFusionModel: give exactly one of pixels and features")
        if features is not None:
            return features
        if self.tokenizer is None:
            raise ValueError("LateFusionModel: pixels need the image tokenizer; pass features instead")
        return frozen_image_features(self.tokenizer, pixels)

    def hidden(self, input_ids: torch.Tensor, pixels: torch.Tensor | None = None, *,
               features: torch.Tensor | None = None, feature_mask: torch.Tensor | None = None,
               document_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
               kv_cache: KVCache | None = None) -> torch.Tensor:
        """The decoder's final normed hidden states (B, T, dim) with the images fused in; with `kv_cache` (LLaVA
        and Q-Former: the images are input embeddings) the tokens are appended to the cache, as a prefill."""
        image_features = self.image_features(pixels, features)
        if self.kind == "flamingo":
            if kv_cache is not None:
                raise ValueError("LateFusionModel: Flamingo's cross-attention runs in every block, which the KV-cached "
                                 "decode step does not do: sample it without the cache")
            return self._flamingo_hidden(input_ids, image_features, feature_mask, document_ids, position_ids)
        if self.kind == "llava":
            image_embeds = self.connector(image_features)
            if feature_mask is not None:  # an image cut at a row boundary keeps only the patches the row holds
                image_embeds = image_embeds[feature_mask][None]
        else:
            image_embeds = self.connector(image_features, feature_mask)
        is_image = input_ids == self.image_token_id
        if int(is_image.sum()) != image_embeds.shape[0] * image_embeds.shape[1]:
            raise ValueError(
                f"LateFusionModel: {int(is_image.sum())} placeholder positions, but {image_embeds.shape[0]} images "
                f"x {image_embeds.shape[1]} embeddings each ({self.kind} costs {image_embeds.shape[1]} per image)"
            )
        embeds = self.decoder.embed(input_ids)
        # fills the placeholder positions in row-major order: image i's embeddings land in the i-th run
        embeds = embeds.masked_scatter(is_image[..., None], image_embeds.to(embeds.dtype))
        return self.decoder.forward_hidden(input_ids, position_ids, document_ids, kv_cache, inputs_embeds=embeds)

    def _flamingo_hidden(self, input_ids: torch.Tensor, image_features: torch.Tensor,
                         feature_mask: torch.Tensor | None, document_ids: torch.Tensor | None,
                         position_ids: torch.Tensor | None) -> torch.Tensor:
        is_marker = input_ids == self.image_token_id
        per_row = is_marker.sum(dim=1)
        if int(per_row.sum()) != image_features.shape[0]:
            raise ValueError(f"LateFusionModel: {int(per_row.sum())} image markers, but {image_features.shape[0]} "
                             "images")
        latents = self.connector.resampler(image_features, feature_mask)  # (N, K, media_dim)
        # rows hold different numbers of images: place image i at (its row, its rank in the row), zero-padded;
        # the mask keeps every token off the padding slots
        rows = is_marker.nonzero()[:, 0]
        slots = is_marker.long().cumsum(dim=1)[is_marker] - 1
        num_media = max(int(per_row.max()), 1) if per_row.numel() else 1
        media = latents.new_zeros(input_ids.shape[0], num_media, *latents.shape[1:])
        media = media.index_put((rows, slots), latents)
        mask = media_mask(media_index(input_ids, self.image_token_id, document_ids), num_media)

        def before_layer(index: int, x: torch.Tensor) -> torch.Tensor:
            return self.connector.gated[index](x, media, mask)

        return self.decoder.forward_hidden(input_ids, position_ids, document_ids, before_layer=before_layer)

    def labels(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token targets (B, T-1): input_ids shifted by one, -100 where the target is an image position or
        crosses into another document (or padding)."""
        targets = input_ids[:, 1:].masked_fill(input_ids[:, 1:] == self.image_token_id, IGNORE_INDEX)
        if document_ids is not None:
            same_document = (document_ids[:, :-1] == document_ids[:, 1:]) & (document_ids[:, 1:] >= 0)
            targets = targets.masked_fill(~same_document, IGNORE_INDEX)
        return targets

    def forward(self, input_ids: torch.Tensor, pixels: torch.Tensor | None = None, *,
                features: torch.Tensor | None = None, feature_mask: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                return_loss: bool = False) -> torch.Tensor:
        """Logits (B, T, vocab) in fp32; with return_loss, the mean next-token CE over text targets only."""
        hidden = self.hidden(input_ids, pixels, features=features, feature_mask=feature_mask,
                             document_ids=document_ids, position_ids=position_ids)
        if not return_loss:
            return self.decoder.head(hidden).float()
        # the last position predicts nothing: skip its head matmul
        logits = self.decoder.head(hidden[:, :-1]).float()
        targets = self.labels(input_ids, document_ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


# ---- training stages ---------------------------------------------------------------------------------------------
# (kind, stage) -> does the decoder train too? The connector always trains and the tokenizer never does.
STAGES: dict[tuple[str, int], bool] = {
    ("llava", 1): False,  # feature alignment: only the projector learns, on caption data
    ("llava", 2): True,  # visual instruction tuning: projector and language model
    # BLIP-2's representation stage: the Q-Former learns against the frozen encoder alone, with contrastive, matching
    # and generation losses (fusion_model.families.late.qformer_pretraining); the decoder is not used
    ("qformer", 1): False,
    ("qformer", 2): False,  # BLIP-2's generative stage: Q-Former + projection learn, the LM stays frozen
    ("flamingo", 1): False,  # Flamingo's single stage: resampler + gated layers learn, the LM stays frozen
}


def set_stage(model: LateFusionModel, stage: int) -> list[nn.Parameter]:
    """Freeze and unfreeze for one training stage of the model's kind; returns the trainable parameters."""
    if (model.kind, stage) not in STAGES:
        known = sorted(s for kind, s in STAGES if kind == model.kind)
        raise ValueError(f"set_stage: {model.kind} has stages {known}, not {stage}")
    unfreeze(model.connector)
    if STAGES[(model.kind, stage)]:
        unfreeze(model.decoder)
    else:
        freeze(model.decoder)
    if model.tokenizer is not None:
        freeze(model.tokenizer)
    model.train(model.training)  # re-apply the eval mode of what is now frozen
    return [p for p in model.parameters() if p.requires_grad]


# ---- training through `train.py fit`: options and the early -> late layout of a packed batch ---------------------
@dataclass(frozen=True)
class LateFusionConfig:
    """A connector in front of the decoder (`--model.late_fusion`); ids and feature_dim come from the token shards."""

    kind: str
    stage: int = 1
    num_queries: int = 32  # Q-Former: image positions in context per image (BLIP-2: 32)
    num_latents: int = 64  # Flamingo: resampled vectors per image (Flamingo: 64)
    depth: int = 2  # Q-Former / Perceiver layers
    heads: int = 4
    connector_dim: int | None = None  # Q-Former / Perceiver width (default: the decoder's)
    init_connector: str | None = None  # a checkpoint of an earlier stage: its connector weights start this run
    text_len: int = 64  # Q-Former stage 1: caption tokens kept per image-text pair
    feature_dim: int | None = None
    image_token_id: int | None = None  # the vocabulary's <image>: LLaVA/Q-Former placeholders, Flamingo's marker
    boi_id: int | None = None
    eoi_id: int | None = None
    special_ids: tuple[int, ...] = ()  # Q-Former stage 1: ids dropped from captions (pad, <s>, </s>, <boi>, <eoi>)

    def __post_init__(self) -> None:
        object.__setattr__(self, "special_ids", tuple(int(i) for i in self.special_ids))  # YAML gives a list
        if self.kind not in KINDS:
            raise ValueError(f"late_fusion.kind {self.kind!r}: choose one of {KINDS}")
        if (self.kind, self.stage) not in STAGES:
            stages = sorted(s for kind, s in STAGES if kind == self.kind)
            raise ValueError(f"late_fusion.stage {self.stage}: {self.kind} trains in stage(s) {stages} here")

        def whole(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for name in ("num_queries", "num_latents", "depth", "heads", "text_len"):
            if not whole(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"late_fusion.{name}={getattr(self, name)!r} must be a positive integer "
                                 f"(--model.family_options.{name})")
        for name in ("connector_dim", "feature_dim"):
            value = getattr(self, name)
            if value is not None and (not whole(value) or value <= 0):
                raise ValueError(f"late_fusion.{name}={value!r} must be a positive integer or null")
        for name in ("image_token_id", "boi_id", "eoi_id"):
            value = getattr(self, name)
            if value is not None and (not whole(value) or value < 0):
                raise ValueError(f"late_fusion.{name}={value!r} must be a token id (an integer >= 0) or null")

    @classmethod
    def from_dict(cls, values: dict) -> LateFusionConfig:
        """From a dict, naming unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"late_fusion: unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    @property
    def per_image(self) -> int | None:
        """Decoder positions per image in the late layout (None: one per patch, as in the early layout)."""
        return {"llava": None, "qformer": self.num_queries, "flamingo": 1}[self.kind]


def late_layout(input_ids: torch.Tensor, document_ids: torch.Tensor, image_features: torch.Tensor, *,
                config: LateFusionConfig, image_offset: int, image_codes: int, pad_id: int = 0) -> dict:
    """An early-fusion packed batch (codes in the sequence) -> the same documents as `config.kind` sees them.

    Every run of image codes is one image. LLaVA: each code becomes a placeholder (one position per patch).
    Q-Former: the run becomes `num_queries` placeholders. Flamingo: <boi> codes <eoi> becomes one marker.
    Text keeps its order; rows are re-padded at the end and positions restart in each document. Returns
    input_ids, document_ids, position_ids (B, T'), features (N images, P, C) and feature_mask (N, P): an image
    cut by a row boundary keeps only the patches its row holds.
    """
    batch, length = input_ids.shape
    real = document_ids >= 0
    is_code = image_code_mask(input_ids, image_offset, image_codes) & real
    continues = torch.zeros_like(is_code)
    continues[:, 1:] = is_code[:, :-1] & (document_ids[:, 1:] == document_ids[:, :-1])
    run_start = is_code & ~continues
    # image index (row-major over the batch) and patch index within the image, at every code position
    image_of = (run_start.flatten().long().cumsum(0) - 1).view(batch, length)
    positions = torch.arange(length, device=input_ids.device).expand(batch, length)
    start_of = torch.where(run_start, positions, -1).cummax(dim=1).values
    patch_of = positions - start_of
    num_images = int(run_start.sum())
    patches = int(patch_of[is_code].max()) + 1 if num_images else 1
    features = image_features.new_zeros(num_images, patches, image_features.shape[-1])
    feature_mask = torch.zeros(num_images, patches, dtype=torch.bool, device=input_ids.device)
    features[image_of[is_code], patch_of[is_code]] = image_features[is_code]
    feature_mask[image_of[is_code], patch_of[is_code]] = True

    tokens = input_ids.clone()
    counts = real.long()
    if config.kind == "llava":
        tokens[is_code] = config.image_token_id
    else:
        counts = counts.masked_fill(is_code, 0).masked_fill(run_start, config.per_image)
        tokens[run_start] = config.image_token_id
        if config.kind == "flamingo":  # Flamingo's documents read "<image> caption": the marker replaces the span
            counts = counts.masked_fill((input_ids == config.boi_id) | (input_ids == config.eoi_id), 0)
    rows = [(tokens[r].repeat_interleave(counts[r]), document_ids[r].repeat_interleave(counts[r]))
            for r in range(batch)]
    new_length = max([1] + [len(ids) for ids, _ in rows])
    new_ids = input_ids.new_full((batch, new_length), pad_id)
    new_documents = document_ids.new_full((batch, new_length), -1)
    for r, (ids, documents) in enumerate(rows):
        new_ids[r, : len(ids)], new_documents[r, : len(ids)] = ids, documents
    # positions restart where the document changes
    new_positions = torch.arange(new_length, device=input_ids.device).expand(batch, new_length)
    changes = torch.ones_like(new_documents, dtype=torch.bool)
    changes[:, 1:] = new_documents[:, 1:] != new_documents[:, :-1]
    first = torch.where(changes, new_positions, 0).cummax(dim=1).values
    position_ids = torch.where(new_documents >= 0, new_positions - first, 0)
    return {"input_ids": new_ids, "document_ids": new_documents, "position_ids": position_ids,
            "features": features, "feature_mask": feature_mask}
