"""The Transfusion family: one decoder, next-token loss on text and a diffusion loss on continuous image latents
(see README.md)."""

from fusion_model.families.transfusion.family import TransfusionFamily
from fusion_model.families.transfusion.layout import ImageLayout, image_layout, visible_from
from fusion_model.families.transfusion.options import TransfusionOptions
from fusion_model.families.transfusion.patches import LatentPatches, TimestepEmbedding

__all__ = ["ImageLayout", "LatentPatches", "TimestepEmbedding", "TransfusionFamily", "TransfusionOptions",
           "image_layout", "visible_from"]
