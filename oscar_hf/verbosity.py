"""oscar-hf's log records follow transformers' verbosity (`transformers.logging.set_verbosity_*`).

The modules log through `transformers.utils.logging.get_logger(__name__)`, so their loggers are `oscar_hf.*`, outside
the `transformers` logger whose level `set_verbosity_*` sets: on their own they would follow the root logger's
level. (Diffusers and optimum copy transformers' logging module and keep a verbosity of their own; a cache plugged
into transformers' `generate` should instead go quiet or verbose with transformers.) So the `oscar_hf` logger's
parent is a logger without handlers whose level is transformers' verbosity, and whose own parent is the root logger:
records still reach the root logger's handlers (an application's, pytest's `caplog`), and a level set on `oscar_hf`
itself (`logging.getLogger("oscar_hf").setLevel`, the command lines' `--verbosity`) still wins.
"""

from __future__ import annotations

import logging

from transformers.utils import logging as transformers_logging

PACKAGE = "oscar_hf"


class _TransformersVerbosity(logging.Logger):
    """The `oscar_hf` logger's parent: no handlers, its level is the `transformers` logger's effective level, read at
    every lookup. Loggers cache their lookups, and `set_verbosity_*` (a `setLevel`) clears every logger's cache."""

    def __init__(self, transformers_logger: logging.Logger):
        self._transformers = transformers_logger
        super().__init__(f"{PACKAGE} (transformers verbosity)")
        self.parent = logging.root

    @property
    def level(self) -> int:
        return self._transformers.getEffectiveLevel()

    @level.setter
    def level(self, value: int) -> None:
        pass  # `Logger.__init__` assigns one; the level is transformers' and set through transformers


def follow_transformers_verbosity() -> None:
    """Put the `oscar_hf` logger under transformers' verbosity (idempotent)."""
    package = logging.getLogger(PACKAGE)
    if not isinstance(package.parent, _TransformersVerbosity):
        # get_logger() also applies TRANSFORMERS_VERBOSITY, on first use
        package.parent = _TransformersVerbosity(transformers_logging.get_logger())
