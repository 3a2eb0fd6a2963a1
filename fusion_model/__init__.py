"""The fused decoder (Chameleon architecture), its loss, training module and sampler."""
