"""lm-eval task files of this package (`oscar-lm-eval` puts this folder on the include path)."""
