"""Tokenizer training losses: L1/L2 reconstruction, an LPIPS-style perceptual loss from a local VGG16 weights
file (never downloaded), a PatchGAN discriminator with hinge loss, a start step and VQGAN's adaptive weight, and the
KL divergence of the continuous tokenizer's Gaussian from the standard normal."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common.files import load_checkpoint_file


def reconstruction_loss(reconstruction: torch.Tensor, target: torch.Tensor, kind: str = "l1") -> torch.Tensor:
    """Mean absolute ("l1") or squared ("l2") pixel error."""
    if kind == "l1":
        return (reconstruction - target).abs().mean()
    if kind == "l2":
        return F.mse_loss(reconstruction, target)
    raise ValueError(f"reconstruction loss must be 'l1' or 'l2', got {kind!r}")


def psnr(reconstruction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR in dB for images in [-1, 1] (the reconstruction is clamped first), computed in fp32."""
    # bf16 / fp16 inputs (autocast, the demo's decoded images) would round the small errors that PSNR measures
    mse = ((reconstruction.float().clamp(-1, 1) - target.float()) ** 2).flatten(1).mean(1) / 4.0  # range 2 -> 1
    return -10.0 * torch.log10(mse.clamp_min(1e-10))


def gaussian_kl(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mean, exp(logvar)) || N(0, 1)) in nats per image (B,): summed over every latent element, as LDM's VAE."""
    return 0.5 * (mean.float().pow(2) + logvar.float().exp() - 1.0 - logvar.float()).flatten(1).sum(1)


# VGG16 `features` layers in torchvision's numbering; LPIPS reads the ReLU outputs after these convs.
_VGG16_CONVS = [
    (0, 3, 64),
    (2, 64, 64),
    (5, 64, 128),
    (7, 128, 128),
    (10, 128, 256),
    (12, 256, 256),
    (14, 256, 256),
    (17, 256, 512),
    (19, 512, 512),
    (21, 512, 512),
    (24, 512, 512),
    (26, 512, 512),
    (28, 512, 512),
]
_VGG16_TAPS = (2, 7, 14, 21, 28)  # relu1_2, relu2_2, relu3_3, relu4_3, relu5_3
_VGG16_WIDTHS = (64, 128, 256, 512, 512)


class PerceptualLoss(nn.Module):
    """LPIPS-style distance on frozen VGG16 features loaded from a local file.

    The file (safetensors, or a torch file read with weights_only=True) holds torchvision VGG16 keys
    `features.N.weight/bias`, optionally LPIPS linear heads `lin{k}.model.1.weight` (k = 0..4); without the
    heads every channel weighs the same.
    """

    def __init__(self, weights_path: str | os.PathLike):
        super().__init__()
        state = _load_state(Path(weights_path))
        self.features = nn.ModuleDict(
            {str(i): nn.Conv2d(cin, cout, 3, padding=1) for i, cin, cout in _VGG16_CONVS}
        )
        feats = {k.removeprefix("features."): v for k, v in state.items() if k.startswith("features.")}
        missing = self.features.load_state_dict(feats, strict=False).missing_keys
        if missing:
            raise ValueError(
                f"{weights_path}: missing VGG16 weights {missing[:4]}...; expected torchvision "
                "vgg16 `features.N.weight` keys"
            )
        heads = [state.get(f"lin{k}.model.1.weight") for k in range(5)]
        for k, (head, width) in enumerate(zip(heads, _VGG16_WIDTHS)):
            weight = torch.ones(1, width, 1, 1) if head is None else head.reshape(1, width, 1, 1).float()
            self.register_buffer(f"lin{k}", weight, persistent=False)
        # ImageNet statistics in LPIPS' [-1, 1] input convention
        self.register_buffer(
            "shift", torch.tensor([-0.030, -0.088, -0.188]).view(1, 3, 1, 1), persistent=False
        )
        self.register_buffer("scale", torch.tensor([0.458, 0.448, 0.450]).view(1, 3, 1, 1), persistent=False)
        self.requires_grad_(False)
        self.eval()

    def _taps(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = (x - self.shift) / self.scale
        taps = []
        for index in range(_VGG16_TAPS[-1] + 1):
            if str(index) in self.features:
                x = F.relu(self.features[str(index)](x))
                if index in _VGG16_TAPS:
                    taps.append(x)
            elif index in (4, 9, 16, 23):  # max-pool positions in VGG16 features
                x = F.max_pool2d(x, 2)
        return taps

    def forward(self, reconstruction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean perceptual distance (0 for identical images)."""
        total = reconstruction.new_zeros(())
        for k, (a, b) in enumerate(zip(self._taps(reconstruction), self._taps(target))):
            a = a / (a.norm(dim=1, keepdim=True) + 1e-10)
            b = b / (b.norm(dim=1, keepdim=True) + 1e-10)
            total = total + ((a - b) ** 2 * getattr(self, f"lin{k}")).sum(1).mean()
        return total


def _load_state(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(
            f"perceptual weights file {path} not found; pass a local VGG16 weights file "
            "(nothing is downloaded) or set perceptual_weight to 0"
        )
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = load_checkpoint_file(path)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: expected a state dict of tensors, got {type(state).__name__}")
    return state


class PatchDiscriminator(nn.Module):
    """PatchGAN (pix2pix / VQGAN): one real/fake logit per overlapping patch."""

    def __init__(self, in_channels: int = 3, width: int = 64, layers: int = 3):
        super().__init__()
        blocks: list[nn.Module] = [nn.Conv2d(in_channels, width, 4, stride=2, padding=1), nn.LeakyReLU(0.2)]
        mult = 1
        for n in range(1, layers + 1):
            prev, mult = mult, min(2**n, 8)
            stride = 2 if n < layers else 1
            blocks += [
                nn.Conv2d(width * prev, width * mult, 4, stride=stride, padding=1, bias=False),
                nn.GroupNorm(1, width * mult),
                nn.LeakyReLU(0.2),
            ]  # GroupNorm: batch-independent under DDP
        blocks.append(nn.Conv2d(width * mult, 1, 4, stride=1, padding=1))
        self.net = nn.Sequential(*blocks)
        for module in self.modules():  # VQGAN's init
            if isinstance(module, nn.Conv2d):
                nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Patch logits (B, 1, h', w')."""
        return self.net(images)


def hinge_d_loss(logits_real: torch.Tensor, logits_fake: torch.Tensor) -> torch.Tensor:
    """Discriminator hinge loss."""
    return 0.5 * (F.relu(1.0 - logits_real).mean() + F.relu(1.0 + logits_fake).mean())


def adaptive_weight(
    nll: torch.Tensor, g_loss: torch.Tensor, last_layer: torch.Tensor, max_weight: float = 1e4
) -> torch.Tensor:
    """VQGAN's balance: |grad of nll| / |grad of GAN loss| at the decoder's last layer (detached)."""
    nll_grad = torch.autograd.grad(nll, last_layer, retain_graph=True)[0]
    g_grad = torch.autograd.grad(g_loss, last_layer, retain_graph=True)[0]
    return (nll_grad.norm() / (g_grad.norm() + 1e-4)).clamp(0.0, max_weight).detach()
