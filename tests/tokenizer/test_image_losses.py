"""Training losses: reconstruction and PSNR, the perceptual loss from a local weights file, PatchGAN + adaptive weight."""

import pytest
import torch
from safetensors.torch import save_file

from tokenizer.image.losses import (
    _VGG16_CONVS,
    PatchDiscriminator,
    PerceptualLoss,
    adaptive_weight,
    hinge_d_loss,
    psnr,
    reconstruction_loss,
)


def test_reconstruction_losses_and_psnr():
    a, b = torch.zeros(1, 3, 4, 4), torch.full((1, 3, 4, 4), 0.2)
    assert reconstruction_loss(a, b, "l1") == pytest.approx(0.2)
    assert reconstruction_loss(a, b, "l2") == pytest.approx(0.04)
    with pytest.raises(ValueError, match="l1"):
        reconstruction_loss(a, b, "l3")
    # an error of 0.2 in [-1, 1] is 0.1 in [0, 1]: MSE 0.01 -> 20 dB
    assert psnr(a, b).item() == pytest.approx(20.0, abs=1e-4)
    assert psnr(torch.full_like(a, 5.0), torch.ones_like(a)).item() == pytest.approx(100.0)  # clamped before PSNR
    low = psnr(a.bfloat16(), b.bfloat16())  # bf16 images (autocast, the demo) are measured in fp32
    assert low.dtype == torch.float32 and low.item() == pytest.approx(psnr(a, b.bfloat16().float()).item())


def _vgg_file(path, heads: bool):
    generator = torch.Generator().manual_seed(0)
    state = {}
    for index, cin, cout in _VGG16_CONVS:
        state[f"features.{index}.weight"] = torch.randn(cout, cin, 3, 3, generator=generator) * (2 / (9 * cin)) ** 0.5
        state[f"features.{index}.bias"] = torch.zeros(cout)
    if heads:
        for k, width in enumerate((64, 128, 256, 512, 512)):
            state[f"lin{k}.model.1.weight"] = torch.rand(1, width, 1, 1, generator=generator)
    if path.suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)
    return path


@pytest.mark.parametrize("name, heads", [("vgg.safetensors", True), ("vgg.pt", False)])
def test_perceptual_loss_from_a_local_file_is_zero_on_identical_images_and_differentiable(tmp_path, name, heads):
    loss = PerceptualLoss(_vgg_file(tmp_path / name, heads))
    target = torch.rand(1, 3, 32, 32) * 2 - 1
    assert loss(target, target).item() == pytest.approx(0.0, abs=1e-6)
    reconstruction = (target + 0.3 * torch.randn_like(target)).requires_grad_(True)
    value = loss(reconstruction, target)
    value.backward()
    assert value > 0 and reconstruction.grad.abs().sum() > 0
    assert all(not p.requires_grad for p in loss.parameters())


def test_perceptual_loss_refuses_missing_or_wrong_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        PerceptualLoss(tmp_path / "absent.safetensors")
    save_file({"other.weight": torch.zeros(1)}, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ValueError, match="missing VGG16 weights"):
        PerceptualLoss(tmp_path / "wrong.safetensors")


def test_patch_discriminator_hinge_loss_and_adaptive_weight():
    discriminator = PatchDiscriminator(3, width=8, layers=2)
    logits = discriminator(torch.randn(2, 3, 32, 32))
    assert logits.shape == (2, 1, 6, 6)  # one logit per overlapping patch
    assert hinge_d_loss(torch.full((2,), 2.0), torch.full((2,), -2.0)).item() == 0.0  # confident and right
    assert hinge_d_loss(torch.zeros(2), torch.zeros(2)).item() == pytest.approx(1.0)

    last = torch.nn.Parameter(torch.randn(3, 3))
    x = torch.randn(5, 3)
    nll = (x @ last).abs().mean()
    g_loss = -(x @ last).mean() * 10
    weight = adaptive_weight(nll, g_loss, last)
    expected = torch.autograd.grad(nll, last, retain_graph=True)[0].norm() / (
        torch.autograd.grad(g_loss, last, retain_graph=True)[0].norm() + 1e-4)
    torch.testing.assert_close(weight, expected)
    assert not weight.requires_grad
