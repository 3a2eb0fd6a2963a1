"""BLIP-2's stage 1 for the Q-Former: image-text contrastive (ITC), matching (ITM) and image-grounded generation (ITG)
against the frozen image encoder alone, the text running through the Q-Former's own layers (Li et al. 2023, §3.2)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fusion_model.families.late.connectors import QFormer
from fusion_model.families.late.model import IGNORE_INDEX
from tokenizer.layout import image_code_mask

CLS, DEC = 0, 1  # rows of QFormerPretrainer.start_tokens: the text's first position for ITC/ITM, and for ITG
TEMPERATURE_RANGE = (0.001, 0.5)  # BLIP-2 clamps its learnable temperature to this range


# ---- the three attention masks -----------------------------------------------------------------------------------
def _key_is_real(num_queries: int, text_len: int, text_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, 1, M+L) bool: queries are always real keys, text keys only where the padding mask says so."""
    if text_mask is None:
        text_mask = torch.ones(1, text_len, dtype=torch.bool)
    if text_mask.shape[1] != text_len:
        raise ValueError(f"mask: text_mask has {text_mask.shape[1]} positions, not text_len {text_len}")
    queries = text_mask.new_ones(text_mask.shape[0], num_queries)
    return torch.cat([queries, text_mask.bool()], dim=1)[:, None, :]


def _is_query(num_queries: int, text_len: int, device: torch.device) -> torch.Tensor:
    return torch.arange(num_queries + text_len, device=device) < num_queries


def unimodal_mask(num_queries: int, text_len: int, text_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ITC's mask (B, M+L, M+L), True = row may attend to column: queries see queries, text sees real text only."""
    keys = _key_is_real(num_queries, text_len, text_mask)
    is_query = _is_query(num_queries, text_len, keys.device)
    same_modality = is_query[:, None] == is_query[None, :]
    return same_modality[None] & keys


def multimodal_causal_mask(num_queries: int, text_len: int, text_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ITG's mask (B, M+L, M+L): queries see all queries and no text; text token t sees every query and real text
    tokens <= t."""
    keys = _key_is_real(num_queries, text_len, text_mask)
    is_query = _is_query(num_queries, text_len, keys.device)
    position = torch.arange(num_queries + text_len, device=keys.device)
    # queries come first, so "column <= row" lets text see all queries and earlier text, and queries see no text
    causal_text = ~is_query[:, None] & (position[None, :] <= position[:, None])
    query_to_query = is_query[:, None] & is_query[None, :]
    return (causal_text | query_to_query)[None] & keys


def bidirectional_mask(num_queries: int, text_len: int, text_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ITM's mask (B, M+L, M+L): every position sees every query and every real text token."""
    keys = _key_is_real(num_queries, text_len, text_mask)
    return keys.expand(-1, num_queries + text_len, -1)


MaskFunction = Callable[[int, int, torch.Tensor | None], torch.Tensor]


# ---- hard negatives ----------------------------------------------------------------------------------------------
def sample_hard_negatives(similarity: torch.Tensor, positive: torch.Tensor,
                          generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One column per row of `similarity` (B, B'), drawn with softmax(similarity) weights over the columns that are
    not `positive` (B, B') bool, as BLIP-2 picks ITM negatives. Returns (indices (B,), has_negative (B,) bool);
    a row whose columns are all positive has no negative, and its index is meaningless."""
    has_negative = (~positive).any(dim=1)
    logits = similarity.detach().float().masked_fill(positive, -math.inf)
    # a row with no negative would softmax over nothing (NaN): give it uniform weights and flag it instead
    logits = torch.where(has_negative[:, None], logits, torch.zeros((), device=logits.device))
    indices = torch.multinomial(logits.softmax(dim=1), 1, generator=generator).squeeze(1)
    return indices, has_negative


# ---- the pretrainer ----------------------------------------------------------------------------------------------
class QFormerPretrainer(nn.Module):
    """Stage-1 heads around an existing QFormer (`self.qformer` is that module, so stage 2 reuses its weights).

    Text runs through the Q-Former's own layers next to the queries: self-attention over [queries; text] under the
    objective's mask, cross-attention to the image for the query positions only, and one FFN for both. BLIP-2 gives
    text its own FFN weights; this module shares `layer.ff` (fewer parameters, and the Q-Former class stays as it
    is). The text is the caption with a learned start token prepended: [CLS] for ITC/ITM, a separate [DEC] for ITG
    (BLIP-2 swaps [CLS] for [DEC] the same way), so ITG also predicts the caption's first token from the image.
    """

    def __init__(self, qformer: QFormer, vocab_size: int, max_text_len: int, embed_dim: int = 256) -> None:
        super().__init__()
        self.qformer = qformer
        dim = qformer.queries.shape[1]
        self.max_text_len = max_text_len
        # BERT's text embeddings: token + learned position (one more for the start token), then a LayerNorm
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.positions = nn.Parameter(torch.randn(max_text_len + 1, dim) * 0.02)
        self.start_tokens = nn.Parameter(torch.randn(2, dim) * 0.02)  # rows CLS and DEC
        self.text_norm = nn.LayerNorm(dim)
        nn.init.normal_(self.token_embedding.weight, std=0.02)  # small, as BERT: the LM head is tied to it
        self.vision_proj = nn.Linear(dim, embed_dim)
        self.text_proj = nn.Linear(dim, embed_dim)
        self.temperature = nn.Parameter(torch.tensor(0.07))
        self.itm_head = nn.Linear(dim, 2)
        # BERT's LM head: a transform, then the decoder tied to the token embedding, plus its own bias
        self.lm_transform = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim))
        self.lm_bias = nn.Parameter(torch.zeros(vocab_size))

    @property
    def num_queries(self) -> int:
        """M, the Q-Former's number of learned queries."""
        return self.qformer.queries.shape[0]

    # ---- shared encoder ------------------------------------------------------------------------------------------
    def _embed_text(self, text_ids: torch.Tensor, start: int) -> torch.Tensor:
        batch, length = text_ids.shape
        if length > self.max_text_len:
            raise ValueError(f"QFormerPretrainer: text of {length} tokens, max_text_len is {self.max_text_len}")
        start_token = self.start_tokens[start].expand(batch, 1, -1)
        text = torch.cat([start_token, self.token_embedding(text_ids)], dim=1)
        return self.text_norm(text + self.positions[: length + 1])

    def encode(self, features: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor,
               mask_function: MaskFunction, start: int = CLS,
               feature_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the Q-Former's layers over [queries; start token + text] under one objective's mask.

        Returns the query states (B, M, dim) and the text states (B, 1+L, dim), position 0 the start token.
        """
        qformer = self.qformer
        features = qformer.feature_norm(features)
        batch, num_queries = features.shape[0], self.num_queries
        queries = qformer.query_norm(qformer.queries).expand(batch, -1, -1)
        text = self._embed_text(text_ids, start)
        text_mask = torch.cat([text_mask.new_ones(batch, 1), text_mask], dim=1).bool()  # the start token is real
        mask = mask_function(num_queries, text.shape[1], text_mask).to(features.device)
        cross_mask = None if feature_mask is None else feature_mask[:, None, :].expand(-1, num_queries, -1)
        x = torch.cat([queries, text], dim=1)
        for layer in qformer.layers:
            # QFormerLayer's post-norm order, with the text joining self-attention and the FFN only
            x = layer.self_norm(x + layer.self_attn(x, x, mask))
            queries, text = x[:, :num_queries], x[:, num_queries:]
            queries = layer.cross_norm(queries + layer.cross_attn(queries, features, cross_mask))
            x = torch.cat([queries, text], dim=1)
            x = layer.ff_norm(x + layer.ff(x))
        return x[:, :num_queries], x[:, num_queries:]

    # ---- the three objectives' outputs ---------------------------------------------------------------------------
    def itc_embeddings(self, features: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor,
                       feature_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit-norm image embeddings (B, M, E), one per query, and text embeddings (B, E) from the [CLS] output."""
        queries, text = self.encode(features, text_ids, text_mask, unimodal_mask, CLS, feature_mask)
        return F.normalize(self.vision_proj(queries), dim=-1), F.normalize(self.text_proj(text[:, 0]), dim=-1)

    def similarity(self, image_embeds: torch.Tensor, text_embeds: torch.Tensor) -> torch.Tensor:
        """(B_image, B_text) image-to-text logits: the best query's cosine similarity over the temperature."""
        cosine = torch.einsum("ime,te->itm", image_embeds, text_embeds).amax(dim=-1)
        return cosine / self.temperature.clamp(*TEMPERATURE_RANGE)

    def itm_logits(self, features: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor,
                   feature_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, 2) no-match/match logits: the 2-way head on each query output, averaged over the queries."""
        queries, _ = self.encode(features, text_ids, text_mask, bidirectional_mask, CLS, feature_mask)
        return self.itm_head(queries).mean(dim=1)

    def itg_logits(self, features: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor,
                   feature_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, vocab): logits[:, t] predicts text_ids[:, t] from the image and the tokens before t."""
        _, text = self.encode(features, text_ids, text_mask, multimodal_causal_mask, DEC, feature_mask)
        hidden = self.lm_transform(text[:, :-1])  # the last token predicts nothing inside the caption
        return F.linear(hidden, self.token_embedding.weight, self.lm_bias)

    # ---- losses --------------------------------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor,
                feature_mask: torch.Tensor | None = None, *, pair_ids: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Stage-1 losses of B image-text pairs: `itc`, `itm`, `itg`, `loss` (their sum), `itc_accuracy`.

        features (B, N, C) from the frozen encoder, text_ids (B, L) long, text_mask (B, L) bool True = real.
        pair_ids (B,) optional: items with equal ids count as the same pair (BLIP-2's image_ids), so ITC spreads its
        target over them, ITM never draws them as negatives, and accuracy counts a hit on any of them.
        """
        batch = features.shape[0]
        if batch < 2:
            raise ValueError("QFormerPretrainer: stage 1 needs at least 2 pairs per batch: ITC contrasts within the "
                             "batch and ITM draws its negatives from it")
        if text_ids.shape != text_mask.shape or text_ids.shape[0] != batch:
            raise ValueError(f"QFormerPretrainer: text_ids {tuple(text_ids.shape)} and text_mask "
                             f"{tuple(text_mask.shape)} must both be (B={batch}, L)")
        text_mask = text_mask.bool()
        if pair_ids is None:
            positive = torch.eye(batch, dtype=torch.bool, device=features.device)
        else:
            positive = pair_ids[:, None] == pair_ids[None, :]

        # ITC: symmetric InfoNCE, the target spread evenly over each row's positives
        image_embeds, text_embeds = self.itc_embeddings(features, text_ids, text_mask, feature_mask)
        image_to_text = self.similarity(image_embeds, text_embeds)
        targets = positive.float() / positive.sum(dim=1, keepdim=True)
        itc = -0.5 * ((targets * image_to_text.log_softmax(dim=1)).sum(dim=1).mean()
                      + (targets.T * image_to_text.T.log_softmax(dim=1)).sum(dim=1).mean())
        best_text = image_to_text.argmax(dim=1)
        itc_accuracy = positive[torch.arange(batch, device=positive.device), best_text].float().mean()

        itm = self._itm_loss(features, text_ids, text_mask, feature_mask, image_to_text, positive, generator)

        # ITG: next-token cross-entropy over the real caption tokens
        logits = self.itg_logits(features, text_ids, text_mask, feature_mask)
        labels = text_ids.masked_fill(~text_mask, IGNORE_INDEX)
        itg = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
        return {"itc": itc, "itm": itm, "itg": itg, "loss": itc + itm + itg, "itc_accuracy": itc_accuracy}

    def _itm_loss(self, features: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor,
                  feature_mask: torch.Tensor | None, image_to_text: torch.Tensor, positive: torch.Tensor,
                  generator: torch.Generator | None) -> torch.Tensor:
        # BLIP-2: every pair is a positive; each image gets one hard negative text and each text one hard negative
        # image, drawn in proportion to their ITC similarity
        negative_text, image_has = sample_hard_negatives(image_to_text, positive, generator)
        negative_image, text_has = sample_hard_negatives(image_to_text.T, positive.T, generator)
        image_rows = image_has.nonzero().squeeze(1)
        text_rows = text_has.nonzero().squeeze(1)
        if image_rows.numel() + text_rows.numel() == 0:
            # every item in the batch is the same pair: nothing to mismatch, so ITM adds nothing this batch
            return image_to_text.new_zeros(())
        batch = features.shape[0]
        every = torch.arange(batch, device=features.device)
        image_index = torch.cat([every, image_rows, negative_image[text_rows]])
        text_index = torch.cat([every, negative_text[image_rows], text_rows])
        labels = torch.cat([torch.ones(batch), torch.zeros(image_rows.numel() + text_rows.numel())]).long()
        logits = self.itm_logits(features[image_index], text_ids[text_index], text_mask[text_index],
                                 None if feature_mask is None else feature_mask[image_index])
        return F.cross_entropy(logits, labels.to(logits.device))


# ---- pairs from packed documents ---------------------------------------------------------------------------------
def caption_pairs(input_ids: torch.Tensor, document_ids: torch.Tensor, image_features: torch.Tensor, *,
                  image_offset: int, image_codes: int, special_ids: list[int], pad_id: int,
                  max_text_len: int) -> dict[str, torch.Tensor] | None:
    """A packed early-layout batch's one-image documents as stage-1 pairs: the image's features and the document's
    text (special ids dropped, at most max_text_len tokens); None when the batch holds fewer than two.

    Returns features (N, P, C), feature_mask (N, P), text_ids (N, L), text_mask (N, L) and pair_ids (N,): identical
    texts share an id, so the same caption on two images is never treated as a mismatch.
    """
    specials = torch.tensor(special_ids, device=input_ids.device)
    images, texts = [], []
    for row in range(input_ids.shape[0]):
        for document in document_ids[row].unique().tolist():
            if document < 0:
                continue
            where = document_ids[row] == document
            ids = input_ids[row, where]
            is_code = image_code_mask(ids, image_offset, image_codes)
            at = is_code.nonzero().squeeze(1)
            if at.numel() == 0 or int(at[-1] - at[0]) + 1 != at.numel():
                continue  # no image, or several: not a pair
            text = ids[~is_code & ~torch.isin(ids, specials)][:max_text_len]
            if text.numel():
                images.append(image_features[row, where][is_code])
                texts.append(text)
    if len(images) < 2:
        return None
    patches, length = max(len(f) for f in images), max(len(t) for t in texts)
    features = image_features.new_zeros(len(images), patches, image_features.shape[-1])
    feature_mask = torch.zeros(len(images), patches, dtype=torch.bool, device=input_ids.device)
    text_ids = input_ids.new_full((len(texts), length), pad_id)
    text_mask = torch.zeros(len(texts), length, dtype=torch.bool, device=input_ids.device)
    for i, (feats, text) in enumerate(zip(images, texts)):
        features[i, : len(feats)], feature_mask[i, : len(feats)] = feats, True
        text_ids[i, : len(text)], text_mask[i, : len(text)] = text, True
    ids: dict[tuple[int, ...], int] = {}
    pair_ids = torch.tensor([ids.setdefault(tuple(t.tolist()), len(ids)) for t in texts], device=input_ids.device)
    return {"features": features, "feature_mask": feature_mask, "text_ids": text_ids, "text_mask": text_mask,
            "pair_ids": pair_ids}


# ---- training ----------------------------------------------------------------------------------------------------
def _evaluate(pretrainer: QFormerPretrainer, batches: list[torch.Tensor], features: torch.Tensor,
              text_ids: torch.Tensor, text_mask: torch.Tensor, feature_mask: torch.Tensor | None,
              pair_ids: torch.Tensor | None, seed: int) -> dict[str, float]:
    """Mean of each metric over fixed batches, with fixed negative draws, so start and end compare like for like."""
    generator = torch.Generator(device=features.device).manual_seed(seed)
    totals: dict[str, float] = {}
    was_training = pretrainer.training
    pretrainer.eval()
    with torch.no_grad():
        for index in batches:
            out = pretrainer(features[index], text_ids[index], text_mask[index],
                             None if feature_mask is None else feature_mask[index],
                             pair_ids=None if pair_ids is None else pair_ids[index], generator=generator)
            for name, value in out.items():
                totals[name] = totals.get(name, 0.0) + float(value) / len(batches)
    pretrainer.train(was_training)
    return totals


def train_stage1(qformer: QFormer, features: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor, *,
                 steps: int, batch_size: int, lr: float, seed: int, vocab_size: int,
                 log: Callable[[int, dict[str, float]], None] | None = None,
                 feature_mask: torch.Tensor | None = None, pair_ids: torch.Tensor | None = None,
                 max_text_len: int | None = None, embed_dim: int = 256,
                 weight_decay: float = 0.05) -> dict[str, object]:
    """Train `qformer` in place with BLIP-2's stage-1 losses: a plain AdamW loop over random batches of the pairs.

    Returns `start` and `end` (each metric averaged over the whole set in fixed batches), `steps`, `seconds`
    (training only) and `pretrainer` (holding the trained stage-1 heads). The same seed gives the same run.
    """
    count = features.shape[0]
    if count < 2:
        raise ValueError("train_stage1: needs at least 2 image-text pairs")
    batch_size = min(batch_size, count)
    with torch.random.fork_rng(devices=[]):
        # the new heads' initialisation follows the seed without disturbing the caller's global RNG
        torch.manual_seed(seed)
        pretrainer = QFormerPretrainer(qformer, vocab_size, max_text_len or text_ids.shape[1], embed_dim)
    pretrainer.to(features.device).train()
    # no weight decay on gains, biases, the temperature: only on matrices, as BERT-style training does
    decayed = [p for p in pretrainer.parameters() if p.requires_grad and p.ndim >= 2]
    not_decayed = [p for p in pretrainer.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": weight_decay},
                                   {"params": not_decayed, "weight_decay": 0.0}], lr=lr)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    order = torch.randperm(count, generator=generator).to(features.device)
    evaluation_batches = list(order.split(batch_size))
    if len(evaluation_batches) > 1 and len(evaluation_batches[-1]) < 2:
        evaluation_batches.pop()  # a lone leftover pair has nothing to contrast with
    start = _evaluate(pretrainer, evaluation_batches, features, text_ids, text_mask, feature_mask, pair_ids, seed)

    negatives = torch.Generator(device=features.device).manual_seed(seed + 1)
    began = time.perf_counter()
    for step in range(steps):
        index = torch.randperm(count, generator=generator)[:batch_size].to(features.device)
        out = pretrainer(features[index], text_ids[index], text_mask[index],
                         None if feature_mask is None else feature_mask[index],
                         pair_ids=None if pair_ids is None else pair_ids[index], generator=negatives)
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        optimizer.step()
        if log is not None:
            log(step, {name: float(value.detach()) for name, value in out.items()})
    seconds = time.perf_counter() - began

    end = _evaluate(pretrainer, evaluation_batches, features, text_ids, text_mask, feature_mask, pair_ids, seed)
    return {"start": start, "end": end, "steps": steps, "seconds": seconds, "pretrainer": pretrainer}
