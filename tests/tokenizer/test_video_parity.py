"""Parity with transformers' `Emu3VQVAE` on a small random config: the same codes and the same reconstruction for an
image (transformers' 4-D path) and for a non-square clip (its 5-D path), after `VideoTokenizer.from_transformers`;
and our weights (after a training step) load into `Emu3VQVAE` with `strict=True` and decode the same.

transformers' `encode` crops each sample's codes with `[:H/f, :W/f]`; on video codes (t, h, w) that indexes time and
height (an 8-frame 32x16 clip has 2x8x4 latent codes but `encode` returns 2x4x4). The clip test therefore takes
transformers' codes from its own lower-level pieces, exactly what `encode` runs before that crop: `encoder`,
`quant_conv` and `quantize`. Images are not affected (their codes are (h, w)), so the image test calls `encode`.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Emu3VQVAE, Emu3VQVAEConfig  # noqa: E402

from tokenizer.video import VideoTokenizer  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def emu3() -> Emu3VQVAE:
    """A seeded random Emu3VQVAE, 2 levels (f=2), attention at level 1, BatchNorm statistics made non-trivial."""
    torch.manual_seed(0)
    config = Emu3VQVAEConfig(codebook_size=64, embed_dim=4, latent_channels=4, base_channels=32,
                             channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=[1], hidden_size=64,
                             num_attention_heads=2, temporal_downsample_factor=4)
    model = Emu3VQVAE(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm3d):
                module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=generator) * 0.1)
                module.running_var.copy_(torch.rand(module.running_var.shape, generator=generator) + 0.5)
                module.weight.copy_(torch.rand(module.weight.shape, generator=generator) + 0.5)
    return model


def hf_clip_codes(model: Emu3VQVAE, clips: torch.Tensor) -> torch.Tensor:
    """What Emu3VQVAE.encode computes for (B, T, 3, H, W) clips before its per-sample crop: (B, t, h, w) codes."""
    hidden = model.encoder(clips)  # (B, t, C, h, w)
    latents = model.quant_conv(hidden.permute(0, 2, 1, 3, 4)).permute(0, 2, 1, 3, 4)
    return model.quantize(latents)


def test_state_dict_keys_are_transformers_but_the_codebook(emu3):
    ours = VideoTokenizer(VideoTokenizer.from_transformers(emu3).config)
    theirs = set(emu3.state_dict())
    mine = set(ours.state_dict())
    assert theirs - mine == {"quantize.embedding.weight"}
    assert all(k.startswith("quantize.vq.") for k in mine - theirs)
    for key in theirs & mine:
        assert ours.state_dict()[key].shape == emu3.state_dict()[key].shape, key


@torch.no_grad()
def test_image_parity_through_transformers_4d_path(emu3):
    ours = VideoTokenizer.from_transformers(emu3, image_size=32)
    pixels = torch.rand(3, 3, 32, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1  # taller than wide
    sizes = torch.tensor([[32, 16]] * 3)
    theirs = torch.stack(emu3.encode(pixels, image_sizes=sizes).image_tokens)
    codes = ours.encode(pixels)
    assert codes.shape == theirs.shape == (3, 16, 8)
    assert torch.equal(codes, theirs)
    assert codes.unique().numel() > 8  # the comparison is not between two constant grids
    torch.testing.assert_close(ours.decode(codes), emu3.decode(theirs).clamp(-1, 1), atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_clip_parity_through_transformers_5d_path_on_a_non_square_clip(emu3):
    ours = VideoTokenizer.from_transformers(emu3, image_size=32, clip_frames=8)
    clips = torch.rand(2, 8, 3, 32, 16, generator=torch.Generator().manual_seed(3)) * 2 - 1
    theirs = hf_clip_codes(emu3, clips)
    codes = ours.encode_clips(clips)
    assert codes.shape == theirs.shape == (2, 2, 16, 8)  # the latent's shape: 2 latent frames of 16x8
    assert torch.equal(codes, theirs)
    assert codes.unique().numel() > 8
    video = emu3.decode(theirs)  # transformers' 5-D decode does not crop
    assert video.shape == (2, 8, 3, 32, 16)
    torch.testing.assert_close(ours.decode_clips(codes), video.clamp(-1, 1), atol=1e-4, rtol=1e-4)


def test_our_weights_load_into_transformers_strictly_after_training(emu3):
    ours = VideoTokenizer.from_transformers(emu3, image_size=32, clip_frames=8)
    clips = torch.rand(2, 8, 3, 32, 16, generator=torch.Generator().manual_seed(4)) * 2 - 1
    ours.train()
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.01)
    out = ours(clips)
    ((out.reconstruction - clips).pow(2).mean() + out.vq_loss).backward()
    optimizer.step()  # weights, BatchNorm statistics and the EMA codebook all move
    ours.eval()
    target = Emu3VQVAE(emu3.config).eval()
    target.load_state_dict(ours.transformers_state_dict(), strict=True)
    with torch.no_grad():
        codes = ours.encode_clips(clips)
        assert torch.equal(codes, hf_clip_codes(target, clips))
        torch.testing.assert_close(ours.decode_clips(codes), target.decode(codes).clamp(-1, 1), atol=1e-4, rtol=1e-4)
