"""Calibration experiments on SmolLM2-135M: moments, rotation sets, clip ratios and their tables."""
