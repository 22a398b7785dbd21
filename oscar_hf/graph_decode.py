"""`graphed_generate`, kept for code written against earlier releases: greedy `model.generate` through an OscarCache.

Earlier releases replayed the decode step from CUDA graphs of their own here, because `generate` could not. Now an
`OscarCache` is compileable (`counted_decode`): on a GPU, `model.generate(ids, past_key_values=OscarCache(model))`
compiles the decode step and replays it from CUDA graphs by itself (once compiling pays, `compile_policy`), for
every decoding strategy, at the speed this module used to reach (`docs/performance.md`). So there is one decode
path, `generate`'s, and this function only calls it.

`generate_with_graphs` (a `custom_generate` for greedy search) is gone: drop the `custom_generate=` argument.
"""

from __future__ import annotations

import warnings

import torch

from oscar_hf.compat import cache_argument_name


class GraphDecodeError(ValueError):
    """Asked for CUDA graphs where there are none to capture."""


def graphed_generate(model, input_ids: torch.LongTensor, cache, max_new_tokens: int,
                     eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                     attention_mask: torch.Tensor | None = None, use_graphs: bool | None = None) -> torch.LongTensor:
    """Deprecated: `model.generate(input_ids, past_key_values=cache, do_sample=False, num_beams=1,
    max_new_tokens=max_new_tokens, ...)`, which it returns (`[B, L + n]`).

    `eos_token_id` and `pad_token_id` default to the model's generation config, as in `generate`. `use_graphs`:
    None lets `generate` decide (it compiles the decode step on CUDA devices), False runs every step eagerly
    (`disable_compile=True`), True requires a CUDA device."""
    warnings.warn("graphed_generate is plain model.generate now, as fast (it compiles OscarCache's decode step "
                  "by itself): call model.generate(ids, past_key_values=cache, do_sample=False) instead",
                  FutureWarning, stacklevel=2)
    if use_graphs and input_ids.device.type != "cuda":
        raise GraphDecodeError("CUDA graphs need the model and input_ids on a CUDA device; pass use_graphs=False")
    options = {}
    if eos_token_id is not None:
        options["eos_token_id"] = eos_token_id
    if pad_token_id is not None:
        options["pad_token_id"] = pad_token_id
    if use_graphs is False:
        options["disable_compile"] = True
    elif use_graphs and hasattr(cache, "compile_decode"):
        cache.compile_decode = True  # graphs were asked for: from this call, not once eager steps would pay for them
    return model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False,
                          num_beams=1, **options, **{cache_argument_name(model): cache})
