"""The late-fusion families: LLaVA, BLIP-2 (its stage 1 and stage 2) and Flamingo connectors in front of the decoder
(see README.md)."""

from fusion_model.families.late.blip2_stage1 import Blip2Stage1Family
from fusion_model.families.late.family import FlamingoFamily, LateFusionFamily, LlavaFamily, QFormerFamily

__all__ = ["Blip2Stage1Family", "FlamingoFamily", "LateFusionFamily", "LlavaFamily", "QFormerFamily"]
