"""Next-token cross-entropy + z-loss over packed rows, with text and image losses reported separately."""

from __future__ import annotations

import torch

from tokenizer.layout import image_code_mask


def next_token_targets(input_ids: torch.Tensor, document_ids: torch.Tensor, ignore_id: int | None = None,
                       target_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets (B, T-1) = input_ids shifted by one, and where they are valid (same document >= 0, not
    `ignore_id`: late fusion's image placeholders, which carry label -100; and `target_mask` (B, T) bool true
    at the target: SFT's answer tokens, false at prompt tokens; None = every token)."""
    valid = (document_ids[:, :-1] == document_ids[:, 1:]) & (document_ids[:, :-1] >= 0)
    if ignore_id is not None:
        valid &= input_ids[:, 1:] != ignore_id
    if target_mask is not None:
        if target_mask.dtype != torch.bool or target_mask.shape != input_ids.shape:
            raise ValueError(f"target_mask must be a torch.bool tensor shaped like input_ids "
                             f"{tuple(input_ids.shape)}, got {target_mask.dtype} {tuple(target_mask.shape)}")
        # the term predicting token t counts iff token t is a target (the mask is indexed by the predicted
        # token, so a mask of per-token roles needs no shifting by whoever writes it)
        valid &= target_mask[:, 1:]
    return input_ids[:, 1:], valid


def target_weights(targets: torch.Tensor, image_offset: int | None, image_codes: int | None,
                   text_weight: float, image_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Which targets are image tokens, and each target's modality weight."""
    if image_offset is None:
        is_image = torch.zeros_like(targets, dtype=torch.bool)
    else:
        is_image = image_code_mask(targets, image_offset, image_codes)
    weights = torch.where(is_image, image_weight, text_weight).float()
    return is_image, weights


def target_counts(input_ids: torch.Tensor, document_ids: torch.Tensor, image_offset: int | None,
                  image_codes: int | None, ignore_id: int | None = None,
                  target_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(text targets, image targets) of a packed batch: what the loss counts, found without a forward."""
    targets, valid = next_token_targets(input_ids, document_ids, ignore_id, target_mask)
    is_image, _ = target_weights(targets[valid], image_offset, image_codes, 1.0, 1.0)
    n_image = is_image.sum()
    return is_image.numel() - n_image, n_image


def _summarise(ce: torch.Tensor, lse: torch.Tensor, is_image: torch.Tensor, weights: torch.Tensor,
               z_loss_coef: float) -> dict:
    """Reduce per-target CE and log Z (all valid targets, flat) to the loss dictionary."""
    total_weight = weights.sum()
    denominator = total_weight.clamp_min(1e-12)
    ce_mean = (weights * ce).sum() / denominator
    z_loss = z_loss_coef * (weights * lse.pow(2)).sum() / denominator
    n_image = is_image.sum()
    n_text = is_image.numel() - n_image
    text_loss = torch.where(~is_image, ce, 0.0).sum() / n_text.clamp_min(1)
    image_loss = torch.where(is_image, ce, 0.0).sum() / n_image.clamp_min(1)
    return {
        "loss": ce_mean + z_loss,
        "ce": ce_mean,
        "z_loss": z_loss,
        "text_loss": text_loss.detach(),
        "image_loss": image_loss.detach(),
        "n_text_targets": n_text,
        "n_image_targets": n_image,
    }


def fusion_loss(logits: torch.Tensor, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None, *,
                image_offset: int | None, image_codes: int | None, z_loss_coef: float,
                text_weight: float = 1.0, image_weight: float = 1.0,
                target_mask: torch.Tensor | None = None) -> dict:
    """CE + z_loss_coef * mean(logsumexp(logits)^2) over valid next-token targets.

    The target of token t is token t+1 only when both are in the same document (>= 0) and, with
    `target_mask`, token t+1 is marked a target (answer-only SFT). Text vs image
    is decided by the target id; `ce` and `z_loss` weight each target by its modality's weight, so
    image_weight=0 trains on text targets only. `text_loss`/`image_loss` are unweighted, detached
    means for logging (0 when a modality has no target).
    """
    if document_ids is None:
        document_ids = torch.zeros_like(input_ids)
    targets, valid = next_token_targets(input_ids, document_ids, target_mask=target_mask)
    logits = logits[:, :-1][valid].float()
    targets = targets[valid]
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(1, targets[:, None]).squeeze(1)
    is_image, weights = target_weights(targets, image_offset, image_codes, text_weight, image_weight)
    return _summarise(ce, lse, is_image, weights, z_loss_coef)


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-target CE and log Z of `hidden @ weight.T`, with a hand-written backward.

    Autograd's version of lse - gather(logits) allocates and sweeps the (N, vocab) logits about six times in
    backward; this one turns the logits into softmax x upstream grad in place (three sweeps), which makes
    the CE + z-loss as fast as transformers' plain CE. With `keep_logits=False` only log Z is saved and the
    logits are recomputed in backward (the memory of one chunk at a time, like activation checkpointing).
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, keep_logits: bool):
        logits = (hidden @ weight.t()).float()
        lse = torch.logsumexp(logits, dim=-1)
        ce = lse - logits.gather(1, targets[:, None]).squeeze(1)
        ctx.save_for_backward(hidden, weight, targets, lse, logits if keep_logits else None)
        return ce, lse

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_ce: torch.Tensor, grad_lse: torch.Tensor):
        hidden, weight, targets, lse, logits = ctx.saved_tensors
        if logits is None:
            logits = (hidden @ weight.t()).float()
        # d(ce)/d(logits) = softmax - onehot(target); d(lse)/d(logits) = softmax
        grad = logits.sub_(lse[:, None]).exp_().mul_((grad_ce + grad_lse)[:, None])
        grad[torch.arange(len(targets), device=grad.device), targets] -= grad_ce
        grad = grad.to(weight.dtype)
        grad_hidden = (grad @ weight).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad.t() @ hidden.to(weight.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def fusion_loss_from_hidden(hidden: torch.Tensor, head_weight: torch.Tensor, input_ids: torch.Tensor,
                            document_ids: torch.Tensor, *, image_offset: int | None, image_codes: int | None,
                            z_loss_coef: float, text_weight: float = 1.0, image_weight: float = 1.0,
                            chunk_size: int = 4096, ignore_id: int | None = None,
                            target_mask: torch.Tensor | None = None) -> dict:
    """fusion_loss from final hidden states and the head weight, computed in chunks of valid targets.

    With more than one chunk, each chunk's fp32 logits are recomputed in backward, so memory holds one chunk
    of (chunk_size, vocab) logits instead of (B, T, vocab): at T 4,096 x vocab 65,536 that is 1 GiB per row.
    Prompt positions (`target_mask` false at the next token) never reach the head, so they cost no logits.
    """
    targets, valid = next_token_targets(input_ids, document_ids, ignore_id, target_mask)
    flat_hidden = hidden[:, :-1][valid]
    targets = targets[valid]
    pieces = []
    # one chunk gains nothing from recomputation (its logits live until backward either way)
    keep_logits = targets.numel() <= chunk_size or not torch.is_grad_enabled()
    for begin in range(0, targets.numel(), chunk_size):
        h, t = flat_hidden[begin : begin + chunk_size], targets[begin : begin + chunk_size]
        pieces.append(torch.stack(_LinearCrossEntropy.apply(h, head_weight, t, keep_logits)))
    # with no valid target the result still hangs off the graph, so backward() works on an all-padding batch
    stacked = torch.cat(pieces, dim=1) if pieces else hidden.new_zeros(2, 0, dtype=torch.float32) + 0 * hidden.sum()
    is_image, weights = target_weights(targets, image_offset, image_codes, text_weight, image_weight)
    return _summarise(stacked[0], stacked[1], is_image, weights, z_loss_coef)
