"""oscar-calibrate: fit attention-aware OSCAR rotations for a transformers causal LM (issue 3)."""

from .capture import CALIBRATION_ATTENTION, NoAttentionError, capturing, feed
from .data import CalibrationDataError, load_documents, token_sequences
from .pipeline import CalibrationSettings, calibrate, calibration_layers, collect_moments, rotations_from_moments
from .statistics import Tiers

__all__ = [
    "CALIBRATION_ATTENTION",
    "CalibrationDataError",
    "CalibrationSettings",
    "NoAttentionError",
    "Tiers",
    "calibrate",
    "calibration_layers",
    "capturing",
    "collect_moments",
    "feed",
    "load_documents",
    "rotations_from_moments",
    "token_sequences",
]
