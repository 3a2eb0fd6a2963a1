"""The video tokenizer on tiny random weights: causality of the temporal layers (eval mode), an image = its frame
repeated, shapes of clips and images, numpy clips, clear errors, the bundle (safetensors) and its loader."""

import numpy as np
import pytest
import torch
from PIL import Image

from tokenizer.bundle import load_media_tokenizer
from tokenizer.image import ImageTokenizer, ImageTokenizerConfig, load_image_tokenizer
from tokenizer.video import VIDEO_PRESETS, VideoTokenizer, VideoTokenizerConfig
from tokenizer.video.video_tokenizer import read_video_bundle_config

torch.set_num_threads(1)


def tiny_config(**overrides) -> VideoTokenizerConfig:
    data = dict(image_size=16, clip_frames=12, codebook_size=32, embed_dim=4, latent_channels=4, base_channels=8,
                channel_multiplier=(1, 2), num_res_blocks=1, attn_resolutions=(), norm_groups=4)
    return VideoTokenizerConfig(**{**data, **overrides})


@pytest.fixture(scope="module")
def tokenizer() -> VideoTokenizer:
    torch.manual_seed(0)
    model = VideoTokenizer(tiny_config())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # BatchNorm statistics and a codebook that are not the initial constants
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm3d):
                module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=generator) * 0.1)
                module.running_var.copy_(torch.rand(module.running_var.shape, generator=generator) + 0.5)
        model.quantize.vq.codebook = torch.randn(32, 4, generator=generator) * 0.3
    return model.eval()


def random_clips(b: int, t: int, h: int = 16, w: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, t, 3, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_shapes_and_the_demo_preset():
    config = VideoTokenizerConfig.from_preset("video-demo-32")
    assert config.name == "video-demo-32" and config.temporal_downsample_factor == 4
    assert config.grid_shape == (8, 8) and config.video_grid == (2, 8, 8)
    model = VideoTokenizer(config)
    assert model.kind == "video" and model.temporal_factor == 4
    assert model.grid_shape == (8, 8) and model.video_grid == (2, 8, 8)
    assert model.latent_grid((64, 32)) == (16, 8) and model.clip_grid(12, 64) == (3, 16, 16)
    with pytest.raises(ValueError, match="multiple of the temporal factor 4"):
        model.clip_grid(6)
    assert sum(p.numel() for p in model.parameters()) < 500_000
    assert set(VIDEO_PRESETS) >= {"video-demo-32", "emu3"}
    emu3 = VideoTokenizerConfig.from_preset("emu3")  # transformers' defaults: 4 x 512 x 512 -> 64 x 64 codes
    assert emu3.video_grid == (1, 64, 64) and emu3.codebook_size == 32768 and emu3.hidden_size == 1024


def test_config_refuses_what_emu3_cannot_hold():
    with pytest.raises(ValueError, match="must equal latent_channels"):
        tiny_config(embed_dim=8)
    with pytest.raises(ValueError, match="multiple of temporal_downsample_factor"):
        tiny_config(clip_frames=6)
    with pytest.raises(ValueError, match="power of 2"):
        tiny_config(temporal_downsample_factor=3)
    with pytest.raises(ValueError, match="hidden_size"):
        tiny_config(hidden_size=12)
    with pytest.raises(ValueError, match="unknown video tokenizer config keys"):
        VideoTokenizerConfig.from_dict({"bottleneck": "vq"})


@torch.no_grad()
def test_latent_frame_k_does_not_depend_on_later_frames_in_eval_mode(tokenizer):
    clips = random_clips(2, 12)
    latents = tokenizer.encode_latents(clips)
    codes = tokenizer.encode_clips(clips)
    assert latents.shape == (2, 4, 3, 8, 8) and codes.shape == (2, 3, 8, 8)
    for k in range(2):  # latent frame k covers input frames 4k..4k+3: change every frame after those
        changed = clips.clone()
        changed[:, 4 * (k + 1):] = random_clips(2, 12 - 4 * (k + 1), seed=10 + k)
        after = tokenizer.encode_latents(changed)
        torch.testing.assert_close(after[:, :, : k + 1], latents[:, :, : k + 1], atol=1e-6, rtol=0)
        assert not torch.allclose(after[:, :, k + 1 :], latents[:, :, k + 1 :])  # later frames did change
        assert torch.equal(tokenizer.encode_clips(changed)[:, : k + 1], codes[:, : k + 1])
    changed = clips.clone()
    changed[:, 3] = 0.0  # the last frame latent frame 0 covers does change it
    assert not torch.allclose(tokenizer.encode_latents(changed)[:, :, 0], latents[:, :, 0])


@torch.no_grad()
def test_an_image_is_its_frame_repeated(tokenizer):
    images = random_clips(3, 1, seed=5)[:, 0]
    codes = tokenizer.encode(images)
    assert codes.shape == (3, 8, 8) and codes.dtype == torch.long
    repeated = images.unsqueeze(1).repeat(1, 4, 1, 1, 1)
    assert torch.equal(codes, tokenizer.encode_clips(repeated)[:, 0])
    decoded = tokenizer.decode(codes)
    assert decoded.shape == (3, 3, 16, 16) and decoded.abs().max() <= 1
    torch.testing.assert_close(decoded, tokenizer.decode_clips(codes.unsqueeze(1))[:, 0])
    assert tokenizer.decode(codes[0]).shape == (1, 3, 16, 16)
    pil = Image.fromarray(((images[0].permute(1, 2, 0) + 1) * 127.5).round().byte().numpy())
    assert tokenizer.encode(pil).shape == (1, 8, 8)  # PIL images and paths are preprocessed as image tokenizers do


@torch.no_grad()
def test_clip_round_trip_shapes_numpy_clips_and_batch_independence(tokenizer):
    clips = random_clips(3, 8)
    codes = tokenizer.encode_clips(clips, batch_size=2)
    assert codes.shape == (3, 2, 8, 8)
    assert torch.equal(codes, tokenizer.encode_clips(clips, batch_size=3))
    video = tokenizer.decode_clips(codes)
    assert video.shape == (3, 8, 3, 16, 16) and video.abs().max() <= 1
    assert tokenizer.decode_clips(codes[0]).shape == (1, 8, 3, 16, 16)
    # uint8 numpy clips of another size are resized (shortest side) and center-cropped frame by frame
    frames = np.random.default_rng(0).integers(0, 256, (4, 20, 28, 3), dtype=np.uint8)
    assert tokenizer.encode_clips(frames).shape == (1, 1, 8, 8)
    assert tokenizer.encode_clips([frames, frames]).shape == (2, 1, 8, 8)
    exact = np.random.default_rng(1).integers(0, 256, (4, 16, 16, 3), dtype=np.uint8)
    as_tensor = torch.from_numpy(exact).permute(0, 3, 1, 2).float().unsqueeze(0) / 127.5 - 1
    assert torch.equal(tokenizer.encode_clips([exact]), tokenizer.encode_clips(as_tensor))
    # a module left in training mode still encodes with running statistics, and stays in training mode
    tokenizer.train()
    try:
        assert torch.equal(tokenizer.encode_clips(clips[:1]), codes[:1]) and tokenizer.training
    finally:
        tokenizer.eval()


def test_forward_gives_training_terms_and_gradients_reach_the_encoder():
    torch.manual_seed(0)
    model = VideoTokenizer(tiny_config(clip_frames=8)).train()
    out = model(random_clips(2, 8))
    assert out.reconstruction.shape == (2, 8, 3, 16, 16) and out.codes.shape == (2, 2, 8, 8)
    assert out.latents.shape == (2, 4, 2, 8, 8) and out.vq_loss.dim() == 0
    (out.reconstruction.pow(2).mean() + out.vq_loss).backward()
    assert model.encoder.conv_in.weight.grad.abs().sum() > 0  # straight-through estimator


def test_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="multiple of the temporal factor 4.*got 6 frames"):
        tokenizer.encode_clips(random_clips(1, 6))
    with pytest.raises(ValueError, match="multiple of the temporal factor 4.*got 5 frames"):
        tokenizer.encode_clips(np.zeros((5, 16, 16, 3), np.uint8))
    with pytest.raises(ValueError, match=r"\(B, T, 3, H, W\)"):
        tokenizer.encode_clips(torch.zeros(1, 4, 16, 16, 3))
    with pytest.raises(ValueError, match=r"\(B, T, 3, H, W\)"):
        tokenizer.encode_clips(torch.zeros(4, 3, 16, 16))
    with pytest.raises(ValueError, match="float"):
        tokenizer.encode_clips(torch.zeros(1, 4, 3, 16, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        tokenizer.encode_clips(torch.full((1, 4, 3, 16, 16), 3.0))
    with pytest.raises(ValueError, match="multiples of 2"):
        tokenizer.encode_clips(torch.zeros(1, 4, 3, 15, 16))
    with pytest.raises(ValueError, match=r"uint8 \(T, H, W, 3\)"):
        tokenizer.encode_clips([np.zeros((4, 16, 16, 3), np.float32)])
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 32\)"):
        tokenizer.decode_clips(torch.full((1, 2, 8, 8), 32))
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 32\)"):
        tokenizer.decode(torch.full((8, 8), -1))
    with pytest.raises(ValueError, match=r"\(B, t, h, w\)"):
        tokenizer.decode_clips(torch.zeros(1, 1, 2, 8, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, h, w\)"):
        tokenizer.decode(torch.zeros(1, 2, 8, 8, dtype=torch.long))


def test_bundle_round_trip_and_the_shared_loader(tokenizer, tmp_path):
    out = tokenizer.save_pretrained(tmp_path / "video")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = VideoTokenizer.from_pretrained(out)
    assert loaded.fingerprint() == tokenizer.fingerprint() and not loaded.training
    assert loaded.config == tokenizer.config
    clips = random_clips(1, 8)
    assert torch.equal(loaded.encode_clips(clips), tokenizer.encode_clips(clips))
    shared = load_media_tokenizer(out)  # the one loader of every media bundle dispatches on config.json
    assert isinstance(shared, VideoTokenizer) and shared.kind == "video"
    assert shared.fingerprint() == tokenizer.fingerprint()
    image_bundle = ImageTokenizer(ImageTokenizerConfig(image_size=16, base_channels=8, channel_multiplier=(1, 2),
                                                       num_res_blocks=1, latent_channels=8, norm_groups=4,
                                                       codebook_size=16)).save_pretrained(tmp_path / "image")
    assert load_media_tokenizer(image_bundle).kind == load_image_tokenizer(image_bundle).kind == "vq"
    with pytest.raises(ValueError, match="holds a video tokenizer bundle.*load_media_tokenizer"):
        load_image_tokenizer(out)  # the image-only loader names the one that loads this bundle
    with pytest.raises(ValueError, match="image tokenizer bundle, not a video one"):
        read_video_bundle_config(image_bundle)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        VideoTokenizer.from_pretrained(tmp_path)
    changed = VideoTokenizer(tokenizer.config)
    changed.load_state_dict(tokenizer.state_dict())
    with torch.no_grad():
        changed.decoder.time_res_stack[0].norm1.running_mean.add_(1.0)
    assert changed.fingerprint() != tokenizer.fingerprint()  # BatchNorm statistics are part of the identity
