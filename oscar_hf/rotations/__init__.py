"""Rotations of the quantized history: their math (`math`), the per-layer container (`rotations.Rotations`), the
file formats (`io`), local folders and the Hub (`hub`), and folding value rotations into a model (`folding`)."""

from oscar_hf.rotations.io import RotationFileError
from oscar_hf.rotations.rotations import Rotations

__all__ = ["RotationFileError", "Rotations"]
