"""The LLaVA family: each image patch's feature becomes one decoder input through a two-layer projector."""

from fusion_model.families.late import LateFusionFamily


class LlavaFamily(LateFusionFamily):
    """LLaVA-1.5: stage 1 trains the projector alone on captions, stage 2 the projector and the decoder."""

    name = "llava"
    kind = "llava"
