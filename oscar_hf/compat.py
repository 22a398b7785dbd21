"""Differences between transformers releases (5.17 through the newest), kept in one place.

- 5.24 renamed the forward/generate argument `past_key_values` to `cache`;
- 5.24 passes the attention's kwargs dict into `Cache.update(..., kwargs=kwargs)`; 5.17-5.23 pass nothing;
- `crop` with a positive value (keep that many tokens) is deprecated in 5.17 and refused in later releases;
- `generate` compiles on CUDA (and a few other accelerators) only, unless a private `CompileConfig` flag says so.
"""

from __future__ import annotations

import functools
import inspect

import torch
import transformers
from packaging.version import Version

TRANSFORMERS_VERSION = Version(transformers.__version__)


def cache_argument_name(model) -> str:
    """Name of the cache argument of `model.forward` / `model.generate`: "cache" (>= 5.24) or "past_key_values"."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def output_cache(outputs):
    """The cache object of a model output, whichever attribute name this release uses."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else getattr(outputs, "past_key_values", None)


def attention_kwargs_of_update(update_kwargs: dict) -> dict | None:
    """The attention kwargs dict that >= 5.24 passes to `Cache.update` (None on older releases)."""
    attention_kwargs = update_kwargs.get("kwargs")
    return attention_kwargs if isinstance(attention_kwargs, dict) else None


@functools.cache
def positive_crop_refused() -> bool:
    """Whether this release's `DynamicLayer.crop` refuses a positive value (asked of a two-token layer once, so that
    the cache follows whichever release is installed)."""
    from transformers.cache_utils import DynamicLayer

    layer = DynamicLayer()
    layer.update(torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1))
    try:
        layer.crop(1)
    except (ValueError, RuntimeError):
        return True
    return False


def compile_config_anywhere(**options):
    """A `CompileConfig(**options)` that `generate` follows on every device, the CPU included: transformers compiles
    on CUDA only unless its private `_compile_all_devices` flag is set (the one place that sets it)."""
    from transformers import CompileConfig

    config = CompileConfig(**options)
    config._compile_all_devices = True
    return config
