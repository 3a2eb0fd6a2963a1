"""`ImageTokenizer`: images <-> grids of codes (H/16 x W/16 integers below the codebook size), with
save/load as config json + safetensors and import of transformers' ChameleonVQVAE weights; `ImageAutoencoder`, what
it shares with the continuous tokenizer (pixel input, fingerprint, the bundle on disk)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import nn

from common.files import atomic_path, atomic_write_text
from tokenizer.image.config import ImageTokenizerConfig
from tokenizer.image.model import Decoder, Encoder
from tokenizer.image.preprocess import ImageSource, load_batch, to_pil
from tokenizer.image.quantizer import Quantizer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
KIND_OF_BOTTLENECK = {"vq": "vq", "kl": "continuous"}  # a config's bottleneck -> its bundle's `kind`
_WHAT_KIND_HOLDS = {"vq": "discrete codes", "continuous": "continuous latents"}
_EXAMPLE_PRESET = {"vq": "demo-64", "continuous": "kl-demo-64"}
_Bundle = TypeVar("_Bundle", bound="ImageAutoencoder")


class TokenizerOutput(NamedTuple):
    """What `ImageTokenizer.forward` returns."""

    reconstruction: torch.Tensor  # (B, 3, H, W), unbounded: clamp only for display
    codes: torch.LongTensor  # (B, h, w)
    vq_loss: torch.Tensor  # commitment loss
    latents: torch.Tensor  # (B, embed_dim, h, w) before quantisation


def read_bundle_config(directory: str | os.PathLike) -> ImageTokenizerConfig:
    """The config of the bundle in `directory`; raises naming a missing file."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: an image tokenizer bundle needs {CONFIG_NAME} and "
                f"{WEIGHTS_NAME} (write one with save_pretrained or `train.py tokenizer export`)"
            )
    return ImageTokenizerConfig.from_dict(json.loads(config_path.read_text()))


def bundle_fingerprint(tokenizer: nn.Module) -> str:
    """SHA-256 (first 16 hex digits) over a tokenizer's `config.to_json()` and every weight and buffer: the identity
    every bundle kind (VQ, continuous, video) records, so shards and checkpoints can say which tokenizer made them."""
    digest = hashlib.sha256(tokenizer.config.to_json().encode())
    for name, tensor in sorted(tokenizer.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def save_bundle(tokenizer: nn.Module, directory: str | os.PathLike) -> Path:
    """Write a tokenizer's config.json + model.safetensors (its fingerprint in the metadata) into `directory`,
    each atomically: the bundle layout of every kind."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in tokenizer.state_dict().items()}
    with atomic_path(directory / WEIGHTS_NAME) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt", "fingerprint": tokenizer.fingerprint()})
    atomic_write_text(directory / CONFIG_NAME, tokenizer.config.to_json() + "\n")
    return directory


class ImageAutoencoder(nn.Module):
    """What the VQ and the continuous tokenizer share: pixel input, fingerprint, and the bundle on disk.

    Subclasses build `encoder`, `quant_conv`, the bottleneck, `post_quant_conv` and `decoder` themselves: the order
    modules are registered in is the order of the optimizer's parameters, which checkpoints rely on.
    """

    kind: ClassVar[str]  # "vq" (codes) or "continuous" (latents): what a consumer checks before using a bundle
    bottleneck: ClassVar[str]  # the config's `bottleneck` this class is built from
    config: ImageTokenizerConfig
    quant_conv: nn.Conv2d

    def _check_bottleneck(self, config: ImageTokenizerConfig) -> None:
        if config.bottleneck != self.bottleneck:
            raise ValueError(
                f"{type(self).__name__} needs a config with bottleneck {self.bottleneck!r}, got "
                f"{config.bottleneck!r}; tokenizer.image.bundle.build_image_tokenizer(config) picks the class"
            )

    @property
    def grid_shape(self) -> tuple[int, int]:
        """(rows, columns) of codes or latents for one image at `config.image_size`."""
        return self.config.grid_shape

    @property
    def downsample_factor(self) -> int:
        """Pixels per code or latent position along each side."""
        return self.config.downsample_factor

    def latent_grid(self, image_size: int | tuple[int, int] | None = None) -> tuple[int, int]:
        """(rows, columns) of the grid for a square side or (height, width); default `config.image_size`."""
        size = self.config.image_size if image_size is None else image_size
        height, width = (size, size) if isinstance(size, int) else size
        f = self.downsample_factor
        if height <= 0 or width <= 0 or height % f or width % f:
            raise ValueError(f"image size {height}x{width} must be a positive multiple of the downsampling factor {f}")
        return height // f, width // f

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.quant_conv.weight.device

    def _to_pixels(self, images: Any) -> torch.Tensor:
        if isinstance(images, torch.Tensor):
            pixels = images.unsqueeze(0) if images.dim() == 3 else images
            if pixels.dim() != 4 or pixels.shape[1] != self.config.in_channels:
                raise ValueError(
                    f"expected a (B, 3, H, W) or (3, H, W) tensor, got shape {tuple(images.shape)}"
                )
            if not pixels.dtype.is_floating_point:
                raise ValueError(
                    f"pixel tensors must be float in [-1, 1], got dtype {pixels.dtype}; "
                    "pass PIL images or paths for uint8 data"
                )
            if pixels.numel() and (pixels.min() < -1.001 or pixels.max() > 1.001):
                raise ValueError(
                    f"pixel tensors must lie in [-1, 1], got [{float(pixels.min()):.3f}, "
                    f"{float(pixels.max()):.3f}]; use tokenizer.image.preprocess"
                )
            f = self.config.downsample_factor
            if pixels.shape[-1] % f or pixels.shape[-2] % f:
                raise ValueError(f"height and width must be multiples of {f}, got {tuple(pixels.shape[-2:])}")
            return pixels
        single = isinstance(images, str | os.PathLike | bytes | Image.Image)
        sources: Sequence[ImageSource] = [images] if single else list(images)
        return load_batch(sources, self.config.image_size).pixels

    to_pil = staticmethod(to_pil)

    def fingerprint(self) -> str:
        """SHA-256 (first 16 hex digits) over the config and every weight and buffer (codebook, latent scale)."""
        return bundle_fingerprint(self)

    # ----- persistence -----

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write config.json + model.safetensors into `directory` (each atomically)."""
        return save_bundle(self, directory)

    @classmethod
    def from_pretrained(
        cls: type[_Bundle], directory: str | os.PathLike, map_location: str | torch.device = "cpu"
    ) -> _Bundle:
        """Load a bundle written by `save_pretrained` (in eval mode); refuses a bundle of the other kind in one
        sentence (`tokenizer.image.load_image_tokenizer` loads either)."""
        config = read_bundle_config(directory)
        kind = KIND_OF_BOTTLENECK[config.bottleneck]
        if kind != cls.kind:
            raise ValueError(
                f"{directory} is a {kind} image tokenizer bundle ({_WHAT_KIND_HOLDS[kind]}, bottleneck "
                f"{config.bottleneck!r}) but a {cls.kind} one ({_WHAT_KIND_HOLDS[cls.kind]}) is needed here; pass a "
                f"bundle trained with a {cls.kind} preset such as {_EXAMPLE_PRESET[cls.kind]}"
            )
        model = cls(config)
        state = load_file(str(Path(directory) / WEIGHTS_NAME), device=str(map_location))
        model.load_state_dict(state, strict=True)
        return model.to(map_location).eval()


class ImageTokenizer(ImageAutoencoder):
    """Chameleon-layout VQGAN: encoder -> quant_conv -> quantize -> post_quant_conv -> decoder."""

    kind: ClassVar[str] = "vq"
    bottleneck: ClassVar[str] = "vq"

    def __init__(self, config: ImageTokenizerConfig):
        super().__init__()
        self._check_bottleneck(config)
        self.config = config
        self.encoder = Encoder(config)
        self.quant_conv = nn.Conv2d(config.latent_channels, config.embed_dim, kernel_size=1)
        self.quantize = Quantizer(config)
        self.post_quant_conv = nn.Conv2d(config.embed_dim, config.latent_channels, kernel_size=1)
        self.decoder = Decoder(config)

    # ----- differentiable pieces (used in training) -----

    def encode_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pre-quantisation latents (B, embed_dim, h, w) of pixels in [-1, 1]."""
        return self.quant_conv(self.encoder(pixels))

    def decode_latents(self, quantized: torch.Tensor) -> torch.Tensor:
        """Pixels (unbounded) from quantized latents (B, embed_dim, h, w)."""
        return self.decoder(self.post_quant_conv(quantized))

    def forward(self, pixels: torch.Tensor) -> TokenizerOutput:
        """Reconstruct pixels through the quantizer (straight-through gradients reach the encoder)."""
        latents = self.encode_latents(pixels)
        quantized, codes, vq_loss = self.quantize(latents)
        return TokenizerOutput(self.decode_latents(quantized), codes, vq_loss, latents)

    # ----- inference API -----

    @torch.no_grad()
    def encode(self, images: Any, batch_size: int = 32) -> torch.LongTensor:
        """Codes (B, h, w) for PIL images, paths, bytes, or a float tensor (B, 3, H, W) in [-1, 1]."""
        return self.encode_with_features(images, batch_size, features=False)[0]

    @staticmethod
    def patch_features(latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, C, h, w) -> one feature per code position (B, h*w, C), in the codes' raster order."""
        return latents.flatten(2).transpose(1, 2)

    @torch.no_grad()
    def encode_with_features(self, images: Any, batch_size: int = 32,
                             features: bool = True) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Codes (B, h, w) and, with `features`, the pre-quantisation features (B, h*w, C) they were rounded from:
        what late-fusion connectors read instead of the codes (one encoder pass gives both)."""
        pixels = self._to_pixels(images)
        dtype = self.quant_conv.weight.dtype
        codes, feats = [], []
        for start in range(0, pixels.shape[0], batch_size):
            latents = self.encode_latents(pixels[start : start + batch_size].to(self.device, dtype))
            codes.append(self.quantize_codes(latents))
            if features:
                feats.append(self.patch_features(latents))
        if not codes:
            h, w = self.grid_shape
            empty = torch.empty(0, h * w, self.config.embed_dim, device=self.device) if features else None
            return torch.empty(0, h, w, dtype=torch.long, device=self.device), empty
        return torch.cat(codes), torch.cat(feats) if features else None

    def quantize_codes(self, latents: torch.Tensor) -> torch.LongTensor:
        """Nearest codes for latents, without touching the EMA codebook (eval-mode quantizer)."""
        was_training = self.quantize.training
        self.quantize.eval()
        try:
            return self.quantize(latents).codes
        finally:
            self.quantize.train(was_training)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, batch_size: int = 32) -> torch.Tensor:
        """Pixels (B, 3, H, W) clamped to [-1, 1] for codes (B, h, w) or (h, w); raises on out-of-range codes."""
        codes = torch.as_tensor(codes)
        if codes.dim() == 2:
            codes = codes.unsqueeze(0)
        if codes.dim() != 3:
            raise ValueError(f"codes must have shape (B, h, w) or (h, w), got {tuple(codes.shape)}")
        latents = self.quantize.codes_to_latents(codes.to(self.device))
        chunks = [
            self.decode_latents(latents[i : i + batch_size]).clamp(-1, 1)
            for i in range(0, latents.shape[0], batch_size)
        ]
        return (
            torch.cat(chunks)
            if chunks
            else latents.new_empty(0, 3, *[s * self.config.downsample_factor for s in codes.shape[1:]])
        )

    @classmethod
    def from_transformers(cls, vqvae: nn.Module, **overrides: Any) -> ImageTokenizer:
        """Import a transformers `ChameleonVQVAE` (encoder, quant_conv, codebook, post_quant_conv).

        transformers has no decoder, so ours keeps its random initialisation: codes are Chameleon's, but
        `decode` needs a decoder trained (or loaded) separately.
        """
        hf = vqvae.config
        attn = tuple(hf.attn_resolutions or ())
        if getattr(hf, "double_latent", False):
            raise ValueError("ChameleonVQVAE with double_latent=True is not supported (Chameleon uses False)")
        config = ImageTokenizerConfig(
            image_size=hf.resolution,
            in_channels=hf.in_channels,
            base_channels=hf.base_channels,
            channel_multiplier=tuple(hf.channel_multiplier),
            num_res_blocks=hf.num_res_blocks,
            attn_resolutions=attn,
            latent_channels=hf.latent_channels,
            dropout=float(hf.dropout),
            codebook_size=hf.num_embeddings,
            embed_dim=hf.embed_dim,
            quantizer="chameleon",
            commitment_weight=float(getattr(vqvae.quantize, "beta", 0.25)),
            name="chameleon-import",
            **overrides,
        )
        model = cls(config)
        source = vqvae.state_dict()
        ours = model.state_dict()
        loaded = {}
        for key, value in source.items():
            if key == "quantize.embedding.weight":
                continue
            if key not in ours:  # same module names by construction
                raise ValueError(
                    f"unexpected ChameleonVQVAE weight {key!r}; cannot map it onto ImageTokenizer"
                )
            loaded[key] = value
        model.load_state_dict(loaded, strict=False)
        missing = {k for k in ours if k.startswith(("encoder.", "quant_conv.", "post_quant_conv."))} - set(
            loaded
        )
        if missing:
            raise ValueError(f"ChameleonVQVAE lacks weights for {sorted(missing)[:5]}...; configs disagree")
        with torch.no_grad():
            model.quantize.vq.codebook = source["quantize.embedding.weight"].to(model.quantize.codebook)
            book = model.quantize.vq._codebook
            book.embed_avg.copy_(book.embed)  # consistent EMA state with cluster_size = 1
            book.cluster_size.fill_(1.0)
            book.initted.fill_(True)
        return model.eval()
