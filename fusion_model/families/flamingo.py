"""The Flamingo family: a Perceiver resampler and gated cross-attention layers in front of a frozen decoder."""

from fusion_model.families.late import LateFusionFamily


class FlamingoFamily(LateFusionFamily):
    """Flamingo: one `<image>` marker per image in the text; the text after it attends to that image's resampled
    latents before every decoder block, through gates that start closed."""

    name = "flamingo"
    kind = "flamingo"
