"""Image and text tokenizers and the unified early-fusion vocabulary."""
