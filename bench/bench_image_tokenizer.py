"""Image tokenizer speed: encode images/s of ours vs transformers' ChameleonVQVAE at the same config and weights,
side by side (plus our decode images/s and the fraction of identical codes)."""

from __future__ import annotations

import torch

from bench.harness import compare, write_result


def _reference(smoke: bool):
    """A randomly initialised ChameleonVQVAE: small (smoke) or medium (256 px, Chameleon's widths halved)."""
    from transformers import ChameleonVQVAEConfig
    from transformers.models.chameleon.modeling_chameleon import ChameleonVQVAE

    if smoke:
        config = ChameleonVQVAEConfig(resolution=64, base_channels=32, channel_multiplier=[1, 1, 2, 2, 4],
                                      num_res_blocks=1, latent_channels=64, embed_dim=64, num_embeddings=512)
    else:
        config = ChameleonVQVAEConfig(resolution=256, base_channels=64, channel_multiplier=[1, 1, 2, 2, 4],
                                      num_res_blocks=2, latent_channels=256, embed_dim=256, num_embeddings=8192)
    torch.manual_seed(0)
    return ChameleonVQVAE(config).eval()


def run(smoke: bool = False) -> dict:
    """Measure and write bench/results/image_tokenizer.json."""
    from tokenizer.image import ImageTokenizer

    torch.set_num_threads(1 if not torch.cuda.is_available() else torch.get_num_threads())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference = _reference(smoke).to(device)
    ours = ImageTokenizer.from_transformers(reference).to(device).eval()
    size = reference.config.resolution
    batch = 2 if smoke else 4
    pixels = torch.rand(batch, 3, size, size, device=device) * 2 - 1
    sync = torch.cuda.synchronize if device == "cuda" else None

    @torch.no_grad()
    def encode_ours():
        return ours.encode(pixels)

    @torch.no_grad()
    def encode_reference():
        return reference.encode(pixels).image_tokens

    same_codes = float((encode_ours().flatten() == encode_reference()).float().mean())
    result = compare(encode_ours, encode_reference, min_pairs=3, max_pairs=5 if smoke else 10,
                     max_seconds=5 if smoke else 60, sync=sync)
    codes = encode_ours()
    decode = compare(lambda: ours.decode(codes), lambda: ours.decode(codes), min_pairs=1, max_pairs=2,
                     max_seconds=5, sync=sync)
    figures = {
        # speedup > 1: our encoder is faster than transformers' at equal weights
        "encode_vs_transformers": result.as_dict(),
        "encode_images_per_s": {"value": batch / result.ours_median_s, "unit": "images/s"},
        "reference_encode_images_per_s": {"value": batch / result.reference_median_s, "unit": "images/s"},
        "decode_images_per_s": {"value": batch / decode.ours_median_s, "unit": "images/s"},
        "identical_code_fraction": same_codes,
    }
    payload = {
        "figures": figures,
        "config": {
            "image_size": size, "batch_size": batch, "device": device, "smoke": smoke,
            "base_channels": reference.config.base_channels,
            "channel_multiplier": list(reference.config.channel_multiplier),
            "num_res_blocks": reference.config.num_res_blocks, "codebook": reference.config.num_embeddings,
            "weights": "random ChameleonVQVAE, copied into ours with ImageTokenizer.from_transformers",
            "threads": torch.get_num_threads(), "dtype": "float32",
        },
    }
    write_result("image_tokenizer", payload)
    return payload


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
