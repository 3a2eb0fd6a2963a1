"""The next-token loss's target mask (answer-only SFT): only marked tokens are targets, counted and scored; an
all-true mask is no mask, bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from fusion_model.layers.loss import fusion_loss, fusion_loss_from_hidden, next_token_targets, target_counts

IMAGE = dict(image_offset=100, image_codes=50)

# two documents and padding; the first is a prompt (ids 1..3) then an answer with an image code, the second a
# prompt then an answer
IDS = torch.tensor([[1, 5, 6, 7, 120, 8, 2, 9, 10, 11, 12, 0]])
DOCS = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, -1]])
MASK = torch.tensor([[False, False, False, True, True, True, False, False, True, True, True, False]])
# positions whose next token is a target in the same document: the only ones the loss reads
SCORED = [2, 3, 4, 7, 8, 9]


def test_only_marked_tokens_are_targets_and_the_loss_is_their_ce_by_hand():
    logits = torch.randn(1, 12, 200, requires_grad=True)
    out = fusion_loss(logits, IDS, DOCS, z_loss_coef=1e-2, text_weight=1.0, image_weight=0.5, target_mask=MASK,
                      **IMAGE)
    assert (int(out["n_text_targets"]), int(out["n_image_targets"])) == (5, 1)
    scored = torch.tensor(SCORED)
    ce = F.cross_entropy(logits[0, scored], IDS[0, scored + 1], reduction="none")
    log_z = torch.logsumexp(logits[0, scored], dim=-1)
    weights = torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0, 1.0])  # the target after position 3 is the image code 120
    expected = ((weights * ce).sum() + 1e-2 * (weights * log_z**2).sum()) / weights.sum()
    torch.testing.assert_close(out["loss"], expected)
    out["loss"].backward()
    # a prompt position (its next token unmarked), a document's last token and padding get no gradient
    others = [t for t in range(12) if t not in SCORED]
    assert logits.grad[0, others].abs().sum() == 0
    assert (logits.grad[0, SCORED].abs().sum(-1) > 0).all()


def test_changing_a_prompt_token_changes_no_count():
    before = target_counts(IDS, DOCS, target_mask=MASK, **IMAGE)
    changed = IDS.clone()
    changed[0, 1] = 130  # a prompt token whose next token is also prompt, made an image code
    after = target_counts(changed, DOCS, target_mask=MASK, **IMAGE)
    assert [int(n) for n in after] == [int(n) for n in before] == [5, 1]
    counted = target_counts(changed, DOCS, **IMAGE)  # without the mask it would be a target, of the image kind
    assert int(counted[1]) == 2


@pytest.mark.parametrize("chunk_size", [2, 4096])  # 2: chunks recomputed in backward; 4096: one chunk
def test_an_all_true_mask_is_no_mask_bit_for_bit(chunk_size):
    hidden = torch.randn(2, 12, 16)
    head = torch.randn(200, 16)
    ids, docs = IDS.repeat(2, 1), DOCS.repeat(2, 1)
    results = []
    for mask in (None, torch.ones_like(ids, dtype=torch.bool)):
        h, w = hidden.clone().requires_grad_(), head.clone().requires_grad_()
        out = fusion_loss_from_hidden(h, w, ids, docs, z_loss_coef=1e-4, image_weight=0.3, chunk_size=chunk_size,
                                      target_mask=mask, **IMAGE)
        out["loss"].backward()
        results.append((out, h.grad, w.grad))
    (plain, h0, w0), (masked, h1, w1) = results
    for name in plain:
        assert torch.equal(plain[name], masked[name]), name
    assert torch.equal(h0, h1) and torch.equal(w0, w1)
    logits = torch.randn(2, 12, 200)
    a = fusion_loss(logits, ids, docs, z_loss_coef=1e-4, **IMAGE)
    every = torch.ones_like(ids, dtype=torch.bool)
    b = fusion_loss(logits, ids, docs, z_loss_coef=1e-4, target_mask=every, **IMAGE)
    assert all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("chunk_size", [2, 4096])
def test_the_masked_loss_from_hidden_equals_the_masked_loss_from_logits(chunk_size):
    hidden = torch.randn(1, 12, 16, requires_grad=True)
    head = torch.randn(200, 16, requires_grad=True)
    fused = fusion_loss_from_hidden(hidden, head, IDS, DOCS, z_loss_coef=1e-3, image_weight=0.5,
                                    chunk_size=chunk_size, target_mask=MASK, **IMAGE)
    grads = torch.autograd.grad(fused["loss"], (hidden, head))
    plain = fusion_loss(hidden @ head.t(), IDS, DOCS, z_loss_coef=1e-3, image_weight=0.5, target_mask=MASK,
                        **IMAGE)
    expected = torch.autograd.grad(plain["loss"], (hidden, head))
    torch.testing.assert_close(fused["loss"], plain["loss"])
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_a_mask_of_another_shape_or_type_is_refused_in_one_sentence():
    with pytest.raises(ValueError, match="target_mask must be a torch.bool tensor shaped like input_ids"):
        next_token_targets(IDS, DOCS, target_mask=MASK[:, :-1])
    with pytest.raises(ValueError, match="torch.bool"):
        next_token_targets(IDS, DOCS, target_mask=MASK.long())
