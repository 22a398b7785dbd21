"""oscar-calibrate: fit attention-aware OSCAR rotations for a transformers causal LM ."""

from oscar_hf.calibrate.capture import NoAttentionError, feed
from oscar_hf.calibrate.data import CalibrationDataError, load_documents, token_sequences
from oscar_hf.calibrate.pipeline import (
    CalibrationSettings,
    calibrate,
    calibration_layers,
    collect_moments,
    rotations_from_moments,
)
from oscar_hf.calibrate.statistics import Tiers

__all__ = [
    "CalibrationDataError",
    "CalibrationSettings",
    "NoAttentionError",
    "Tiers",
    "calibrate",
    "calibration_layers",
    "collect_moments",
    "feed",
    "load_documents",
    "rotations_from_moments",
    "token_sequences",
]
