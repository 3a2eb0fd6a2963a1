"""The GPU paths (flex attention, bf16-mixed Lightning, sampling, image tokenizer) on CUDA; skipped without a GPU."""

import dataclasses

import pytest
import torch

from fusion_model.config import FusionConfig
from fusion_model.model import FusionModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a lent device)")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    # TF32 would make fp32 comparisons loose; these tests compare fp32 paths against each other.
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def packed_batch(config: FusionConfig, batch: int = 2, seq_len: int = 128):
    """Rows of three documents each, with positions restarting per document and a padded tail."""
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), device=CUDA)
    docs = torch.full((batch, seq_len), -1, device=CUDA)
    pos = torch.zeros((batch, seq_len), dtype=torch.long, device=CUDA)
    bounds = [0, 40, 90, seq_len - 8]
    for d, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        docs[:, start:end] = d
        pos[:, start:end] = torch.arange(end - start, device=CUDA)
    return ids, pos, docs


def small_config(**overrides) -> FusionConfig:
    return FusionConfig.from_preset("tiny", vocab_size=512, dim=128, n_heads=4, n_kv_heads=2, max_seq_len=256, **overrides)


def test_flex_attention_matches_sdpa_forward_and_backward():
    config = small_config(attention_backend="sdpa")
    reference = FusionModel(config).to(CUDA)
    flex = FusionModel(dataclasses.replace(config, attention_backend="flex")).to(CUDA)
    flex.load_state_dict(reference.state_dict())
    ids, pos, docs = packed_batch(config)
    real = docs >= 0
    out_ref = reference(ids, position_ids=pos, document_ids=docs)
    out_flex = flex(ids, position_ids=pos, document_ids=docs)
    torch.testing.assert_close(out_flex[real], out_ref[real], atol=2e-4, rtol=2e-4)
    out_ref[real].square().mean().backward()
    out_flex[real].square().mean().backward()
    for (name, p_ref), p_flex in zip(reference.named_parameters(), flex.parameters()):
        torch.testing.assert_close(p_flex.grad, p_ref.grad, atol=2e-4, rtol=2e-3, msg=name)


def test_bf16_autocast_stays_close_to_fp32():
    config = small_config()
    model = FusionModel(config).to(CUDA).eval()
    ids, pos, docs = packed_batch(config)
    real = docs >= 0
    with torch.no_grad():
        fp32 = model(ids, position_ids=pos, document_ids=docs)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = model(ids, position_ids=pos, document_ids=docs)
    assert bf16.dtype == torch.float32  # logits are promoted for the loss
    assert torch.isfinite(bf16[real]).all()
    assert (bf16[real] - fp32[real]).abs().max() < 0.1 * fp32[real].abs().max()


def test_lightning_bf16_mixed_fit_lowers_the_loss():
    import lightning as L

    from fusion_model.training.lightning_module import FusionLightningModule

    config = small_config(attention_backend="flex")
    ids, pos, docs = packed_batch(config, batch=4)
    batch = {"input_ids": ids.cpu(), "position_ids": pos.cpu(), "document_ids": docs.cpu()}
    # one fixed batch, 30 times: the loss must fall as it is learned
    loader = torch.utils.data.DataLoader([batch] * 30, batch_size=None)
    module = FusionLightningModule(config=config, lr=3e-3, warmup_steps=2)
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    trainer = L.Trainer(
        accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=30, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, callbacks=[Record()],
    )
    trainer.fit(module, train_dataloaders=loader)
    assert len(losses) == 30 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0]


def test_sampler_on_cuda_cache_equals_recompute_and_keeps_image_rules():
    from fusion_model.sampling import SamplingConfig, generate_ids
    from tokenizer.vocab import train_unified_vocab

    vocab = train_unified_vocab(["a small corpus of words for a tiny vocabulary"] * 20, vocab_size=400, image_codes=64)
    config = FusionConfig.from_preset(
        "tiny", vocab_size=vocab.vocab_size, max_seq_len=128, image_offset=vocab.image_offset, image_codes=vocab.image_codes
    )
    model = FusionModel(config).to(CUDA).eval()
    prompts = [[vocab.bos_id, *vocab.encode_text("a small")], [vocab.bos_id, *vocab.encode_text("words")]]
    greedy = dict(mode="image", text_temperature=0.0, image_temperature=0.0, image_grid=(4, 4), cfg_scale=2.0, seed=0)
    cached = generate_ids(model, vocab, prompts, SamplingConfig(**greedy))
    recomputed = generate_ids(model, vocab, prompts, SamplingConfig(**greedy, use_kv_cache=False))
    assert cached == recomputed
    for row in cached:
        boi = row.index(vocab.boi_id)
        codes = row[boi + 1 : boi + 17]
        assert all(vocab.image_offset <= t < vocab.image_offset + vocab.image_codes for t in codes)
        assert row[boi + 17] == vocab.eoi_id


def test_image_tokenizer_gives_the_same_codes_on_cuda_as_on_cpu():
    from tokenizer.image.config import ImageTokenizerConfig
    from tokenizer.image.image_tokenizer import ImageTokenizer

    tokenizer = ImageTokenizer(ImageTokenizerConfig.from_preset("demo-64")).eval()
    images = torch.rand(4, 3, 64, 64) * 2 - 1
    codes_cpu = tokenizer.encode(images)
    codes_cuda = tokenizer.to(CUDA).encode(images.to(CUDA)).cpu()
    assert codes_cuda.shape == (4, *tokenizer.grid_shape)
    assert (codes_cuda == codes_cpu).float().mean() > 0.98  # argmin ties may differ in the last bit
    decoded = tokenizer.decode(codes_cuda.to(CUDA))
    assert decoded.shape == (4, 3, 64, 64) and decoded.device.type == CUDA.type
