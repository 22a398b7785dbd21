"""The vocabulary every oscar-hf command line shares: how a model is named and loaded, where it runs, which dtype,
and whether progress bars show.

One statement of each option, so that `oscar-calibrate`, `oscar-diagnostics`, `oscar-needles`, `oscar-passkey`,
`oscar-lm-eval` and the retrieval ranking accept the same spellings with the same defaults:
- `--model`: a local folder, a Hub repo id, or one of `SMOLLM2_ALIASES` (the offline SmolLM2-135M);
- `--dtype`: float32 (default), bfloat16, float16 or auto (the checkpoint's);
- `--device`: default `cuda` when a GPU is visible, else `cpu`;
- `--no-progress`: no progress bars.
- `--verbosity`: the level of oscar-hf's log lines (`configure_logging`); `timed` logs how long a step took.

The method names the tools accept are the `OscarConfig` presets (`oscar_hf.config.PRESETS`) plus the evaluation
rows that are not presets (`bf16`, `oscar4`, the peer caches); `oscar_hf.eval.diagnostics.methods` builds them.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from oscar_hf.eval.assets import SMOLLM2_ALIASES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_HELP = (f"local folder or Hub repo id of a causal LM, or {' / '.join(map(repr, SMOLLM2_ALIASES))} "
              "(the offline SmolLM2-135M-Instruct from PyPI)")


def default_device() -> str:
    """`cuda` when a GPU is visible, else `cpu`: the default of every command line."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_model_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, default_model: str | None = None,
                        dtypes: bool = True) -> None:
    """`--model` (required unless `default_model` is given), `--dtype` and `--device`."""
    if default_model is None:
        parser.add_argument("--model", required=True, help=MODEL_HELP)
    else:
        parser.add_argument("--model", default=default_model, help=f"{MODEL_HELP} (default: {default_model})")
    if dtypes:
        parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES) + ["auto"],
                            help="model dtype (default: float32; auto: the checkpoint's)")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda, cuda:1, ... (default: cuda when a GPU is visible, else cpu)")


def add_oscar_options_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--oscar-options`: OscarConfig fields for every OSCAR method, as a JSON object."""
    parser.add_argument("--oscar-options", type=_json_object, default={},
                        help='OscarConfig fields for every OSCAR row, as JSON (e.g. \'{"recent_tokens": 128}\')')


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of OscarConfig fields, got {text!r}")
    return value


def add_progress_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--no-progress`: no progress bars."""
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def resolve_dtype(name: str) -> torch.dtype | str:
    """The torch dtype of a `--dtype` value ("auto" stays "auto")."""
    if name == "auto":
        return "auto"
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r}: expected one of {sorted(DTYPES) + ['auto']}")
    return DTYPES[name]


def resolve_device(name: str | None) -> str:
    """The `--device` value, or the shared default when none was given."""
    return default_device() if name is None else name


# ------------------------------------------------------------------------------------------------ logging
VERBOSITIES = ("debug", "info", "warning", "error")


def add_logging_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--verbosity`: the level of oscar-hf's log lines (as lm-eval's `--verbosity`; default info)."""
    parser.add_argument("--verbosity", default="info", choices=VERBOSITIES,
                        help="level of oscar-hf's log lines on stderr (default: info)")


def configure_logging(verbosity: str = "info") -> None:
    """Show the `oscar_hf` loggers' records at `verbosity` and above on stderr, as `[oscar_hf] message` lines, the
    way transformers shows its own. For command lines, once at start: as a library, oscar-hf leaves the handlers to
    the application (its modules log through `transformers.utils.logging.get_logger(__name__)`)."""
    if verbosity not in VERBOSITIES:
        raise ValueError(f"verbosity={verbosity!r}: expected one of {VERBOSITIES}")
    package = logging.getLogger("oscar_hf")
    if not any(getattr(h, "oscar_hf_cli", False) for h in package.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[oscar_hf] %(message)s"))
        handler.oscar_hf_cli = True
        package.addHandler(handler)
    package.setLevel(verbosity.upper())


@dataclass
class Stopwatch:
    """Wall time of a `timed` block, in seconds (set when the block ends)."""

    seconds: float = 0.0


@contextmanager
def timed(what: str, logger: logging.Logger) -> Iterator[Stopwatch]:
    """Log `what...` at info, run the block, then log `what: 12.3 s`; the yielded `Stopwatch` holds the seconds."""
    watch = Stopwatch()
    logger.info("%s...", what)
    start = time.perf_counter()
    try:
        yield watch
    finally:
        watch.seconds = time.perf_counter() - start
        logger.info("%s: %.1f s", what, watch.seconds)
