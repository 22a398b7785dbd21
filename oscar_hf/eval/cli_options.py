"""The vocabulary every oscar-hf command line shares: how a model is named and loaded, where it runs, which dtype,
and whether progress bars show.

One statement of each option, so that `oscar-calibrate`, `oscar-diagnostics`, `oscar-needles`, `oscar-passkey`,
`oscar-lm-eval` and the retrieval ranking accept the same spellings with the same defaults:
- `--model`: a local folder, a Hub repo id, or one of `SMOLLM2_ALIASES` (the offline SmolLM2-135M);
- `--dtype`: float32 (default), bfloat16, float16 or auto (the checkpoint's);
- `--device`: default `cuda` when a GPU is visible, else `cpu`;
- `--no-progress`: no progress bars.
- `--verbosity`: the level of oscar-hf's log lines (`configure_logging`); `timed` logs how long a step took.

Every value is checked when the command line is parsed, before anything loads: numbers and lists through argparse
`type=` functions (`positive_int`, `comma_separated`, ...), whose errors name the option, and `--rotations` by
loading them (`check_rotations`).

The method names the tools accept are the `OscarConfig` presets (`oscar_hf.config.PRESETS`) plus the evaluation
rows that are not presets (`bf16`, `oscar4`, the peer caches); `oscar_hf.eval.diagnostics.methods` builds them.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
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


# ------------------------------------------------------------------------------------------------ value types
def positive_int(text: str) -> int:
    """An argparse `type=`: an integer of at least 1."""
    return _ranged_int(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An argparse `type=`: an integer of at least 0."""
    return _ranged_int(text, 0, "a non-negative integer")


def _ranged_int(text: str, lowest: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def fraction(text: str) -> float:
    """An argparse `type=`: a number in [0, 1] (a depth into a prompt)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1]") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1]")
    return value


def one_of(choices: Sequence[str]) -> Callable[[str], str]:
    """An argparse `type=` for an item of a `comma_separated` list: one of `choices`."""
    def check(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return text
    return check


def comma_separated(item: Callable[[str], object], example: str) -> Callable[[str], list]:
    """An argparse `type=`: a comma-separated list, each item checked by `item` (another of these types), so that
    `--lengths 2k` stops the command line at once with `argument --lengths: '2k' is not a positive integer
    (expected a comma-separated list such as 1024,2048)` rather than after the model loads. `example` is such a
    list. Argparse passes a string default through it too."""
    def parse(text: str) -> list:
        try:
            return [item(piece.strip()) for piece in text.split(",")]
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentTypeError(f"{error} (expected a comma-separated list such as {example})") from None
    parse.__name__ = f"comma-separated {getattr(item, '__name__', 'value')}"
    return parse


def check_rotations(rotations: str | None) -> None:
    """Load `--rotations` (a folder, a file or a Hub repo id; "hadamard" and "identity" are names, not files)
    before the model loads, so that a mistyped path or a damaged file stops the run at once instead of failing every
    probe of the methods that read them. Raises ValueError naming `--rotations`."""
    from oscar_hf.plan import NAMED_ROTATIONS
    from oscar_hf.rotations import Rotations

    if rotations is None or rotations in NAMED_ROTATIONS:
        return
    try:
        Rotations.from_pretrained(rotations)
    except (OSError, ValueError) as error:  # FileNotFoundError, a Hub error, RotationFileError
        raise ValueError(f"--rotations: {error}") from None


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
