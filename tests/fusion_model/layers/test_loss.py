"""fusion_loss: targets stay inside documents, z-loss value, modality split and weights, chunked path."""

import pytest
import torch
import torch.nn.functional as F

from fusion_model.layers.loss import fusion_loss, fusion_loss_from_hidden

IMAGE = dict(image_offset=100, image_codes=50)


def test_single_document_equals_cross_entropy_plus_z_loss_by_hand():
    logits = torch.randn(1, 6, 200)
    ids = torch.randint(0, 100, (1, 6))  # text only
    out = fusion_loss(logits, ids, torch.zeros_like(ids), z_loss_coef=1e-2, **IMAGE)
    ce = F.cross_entropy(logits[0, :-1], ids[0, 1:])
    log_z = torch.logsumexp(logits[0, :-1], dim=-1)
    torch.testing.assert_close(out["ce"], ce)
    torch.testing.assert_close(out["z_loss"], 1e-2 * (log_z**2).mean())
    torch.testing.assert_close(out["loss"], ce + 1e-2 * (log_z**2).mean())
    assert int(out["n_text_targets"]) == 5 and int(out["n_image_targets"]) == 0


def test_no_target_crosses_a_document_boundary_or_padding():
    ids = torch.randint(0, 100, (1, 8))
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, -1, -1]])
    logits = torch.randn(1, 8, 200, requires_grad=True)
    out = fusion_loss(logits, ids, docs, z_loss_coef=1e-5, **IMAGE)
    assert int(out["n_text_targets"]) == 4  # 0->1, 1->2, 3->4, 4->5
    out["loss"].backward()
    # last token of each document and the padding predict nothing
    assert logits.grad[0, [2, 5, 6, 7]].abs().sum() == 0
    assert (logits.grad[0, [0, 1, 3, 4]].abs().sum(-1) > 0).all()


def test_text_and_image_are_split_by_target_id():
    ids = torch.tensor([[1, 100, 120, 149, 2, 150]])  # targets: img, img, img, text(2), text(150 is past the block)
    logits = torch.randn(1, 6, 200)
    out = fusion_loss(logits, ids, None, z_loss_coef=0.0, **IMAGE)
    ce = F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
    assert (int(out["n_image_targets"]), int(out["n_text_targets"])) == (3, 2)
    torch.testing.assert_close(out["image_loss"], ce[:3].mean())
    torch.testing.assert_close(out["text_loss"], ce[3:].mean())
    torch.testing.assert_close(out["ce"], ce.mean())


def test_image_weight_zero_removes_image_targets():
    ids = torch.tensor([[1, 100, 120, 149, 2, 5]])
    logits = torch.randn(1, 6, 200, requires_grad=True)
    out = fusion_loss(logits, ids, None, z_loss_coef=1e-5, image_weight=0.0, **IMAGE)
    torch.testing.assert_close(out["ce"], out["text_loss"])
    out["loss"].backward()
    assert logits.grad[0, :3].abs().sum() == 0  # positions whose targets are image codes
    assert logits.grad[0, 3:5].abs().sum() > 0


@pytest.mark.parametrize("chunk_size", [4, 4096])  # 4: logits recomputed in backward; 4096: logits kept
def test_chunked_loss_from_hidden_equals_full_logits_path(chunk_size):
    """The hand-written backward of the fused head + CE + z-loss equals autograd through full logits."""
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    head = torch.randn(200, 16, requires_grad=True)
    ids = torch.randint(0, 200, (2, 9))
    docs = torch.tensor([[0] * 4 + [1] * 5, [-1] * 2 + [0] * 7])
    kwargs = dict(z_loss_coef=1e-3, text_weight=1.0, image_weight=0.5, **IMAGE)
    full = fusion_loss(hidden @ head.t(), ids, docs, **kwargs)
    chunked = fusion_loss_from_hidden(hidden, head, ids, docs, chunk_size=chunk_size, **kwargs)
    for key in full:
        torch.testing.assert_close(chunked[key].float(), full[key].float())
    grads_full = torch.autograd.grad(full["loss"], (hidden, head))
    grads_chunked = torch.autograd.grad(chunked["loss"], (hidden, head))
    for a, b in zip(grads_full, grads_chunked):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chunked", [False, True])
def test_all_padding_batch_gives_zero_loss_and_backward_works(chunked):
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    head = torch.randn(200, 8)
    ids, docs = torch.zeros(1, 4, dtype=torch.long), torch.full((1, 4), -1)
    if chunked:
        out = fusion_loss_from_hidden(hidden, head, ids, docs, z_loss_coef=1e-5, **IMAGE)
    else:
        out = fusion_loss(hidden @ head.t(), ids, docs, z_loss_coef=1e-5, **IMAGE)
    out["loss"].backward()
    assert float(out["loss"].detach()) == 0.0 and int(out["n_text_targets"]) == 0
