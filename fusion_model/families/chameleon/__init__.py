"""The Chameleon family: early fusion, one decoder over text and image codes (see README.md)."""

from fusion_model.families.chameleon.family import ChameleonFamily

__all__ = ["ChameleonFamily"]
