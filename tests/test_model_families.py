"""Every causal-LM family of the installed transformers, tiny and random (`model_zoo`), with OscarCache: unquantized
(`method="none"`) it generates what `DynamicCache` generates, and the default gives finite logits; a family OscarCache
cannot hold is refused with `UnsupportedModelError` before any forward. A family transformers itself cannot run
through `DynamicCache` here is skipped with the reason. `python -m experiments.models.support_sweep` tabulates the
same checks."""

from __future__ import annotations

import pytest
import torch
from model_zoo import causal_lm_families, config_value, greedy, padded_batch, tiny_config, tiny_model
from transformers import DynamicCache

from oscar_hf import OscarCache, UnsupportedModelError

LOGIT_TOLERANCE = 1e-4  # method="none" keeps K/V unquantized: float32 rounding only
OSCAR_OPTIONS = dict(sink_tokens=4, recent_tokens=16)
MLA_REASON = "multi-head latent attention (kv_lora_rank) caches a compressed latent, not per-head K/V"


def _error_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _has_mla(model_type: str) -> bool:
    try:
        return bool(config_value(tiny_config(model_type).get_text_config(decoder=True), "kv_lora_rank"))
    except Exception:  # no tiny config: the test skips it
        return False


# model_type -> why OscarCache refuses the family (with UnsupportedModelError, before any forward)
REFUSED: dict[str, str] = {model_type: MLA_REASON for model_type in causal_lm_families() if _has_mla(model_type)}

# model_type -> why the family does not pass yet (docs/models.md): strict, so a fix shows as a failure to update
KNOWN_GAPS: dict[str, str] = {}


# the families the quick subset runs: a classic decoder, a hybrid, a model that keeps its own attention
QUICK = ("llama", "qwen3_next", "gpt_neo")


def _cases():
    for model_type in causal_lm_families():
        marks = [pytest.mark.quick] if model_type in QUICK else []
        if model_type in KNOWN_GAPS:
            marks.append(pytest.mark.xfail(reason=KNOWN_GAPS[model_type], strict=True))
        yield pytest.param(model_type, marks=marks)


def dynamic_cache_run(model_type: str):
    """`(config, ids, mask, tokens, logits)` of transformers' own greedy run through `DynamicCache`, or the reason it
    fails (a string)."""
    try:
        config = tiny_config(model_type)
        ids, mask = padded_batch(config)
        model = tiny_model(config)
        tokens, logits = greedy(model, DynamicCache(config=model.config), ids, mask)
    except Exception as error:
        return _error_line(error)
    return config, ids, mask, tokens, logits


@pytest.mark.parametrize("model_type", _cases())
def test_family_runs_with_oscar_cache_as_with_dynamic_cache(model_type):
    reference = dynamic_cache_run(model_type)
    if isinstance(reference, str):
        pytest.skip(f"transformers itself fails with DynamicCache: {reference}")
    config, ids, mask, tokens, logits = reference

    model = tiny_model(config)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    if model_type in REFUSED:
        with pytest.raises(UnsupportedModelError):
            OscarCache(model, **OSCAR_OPTIONS)
        assert not forwards, f"refused only after {len(forwards)} forward(s) of the model"
        return

    none_tokens, none_logits = greedy(model, OscarCache(model, method="none", **OSCAR_OPTIONS), ids, mask)
    assert torch.equal(none_tokens, tokens), f"method='none' generated {none_tokens.tolist()}, DynamicCache " \
                                             f"{tokens.tolist()}"
    torch.testing.assert_close(none_logits, logits, atol=LOGIT_TOLERANCE, rtol=0)

    model = tiny_model(config)
    _, default_logits = greedy(model, OscarCache(model, **OSCAR_OPTIONS), ids, mask)
    assert torch.isfinite(default_logits).all(), "the default OscarCache gave non-finite logits"
