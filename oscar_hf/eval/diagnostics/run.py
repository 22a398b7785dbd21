"""Run every requested method over one long held-out text and collect the quality numbers.

The BF16 reference is computed once (one full-precision forward over the text, plus its greedy continuation) and
is not replayed as a method. Same model, same tokens, same schedule for every method:
- perplexity, next-token KL and top-1 agreement vs BF16 through the real cache (`chunked_logits`: the reference's
  K/V of the first `prefill` tokens through the cache's own `update`, as a prefill forward would give them, then
  `chunk`-token forwards; every scored token attends to the cache's history).
  With `chunk` = 8 and a prefill that is a multiple of 8 this equals token-by-token decoding for every cache here:
  OSCAR demotes in blocks of `demote_block` = 8 and the quanto/HQQ/TurboQuant caches re-quantize every 128
  tokens, both on boundaries a chunk of 8 never straddles (tests/test_layer_errors.py checks the OSCAR case);
- for OSCAR methods, with `simulate`, also the decode-equivalent numbers (`oscar_hf.eval.decode_equivalent`:
  prefill, then token by token);
- per-layer attention KL, attention-block output relative MSE and K/V reconstruction MSE with decode-style
  queries over the cache's real tier layout (`layers.replay_layer_errors`);
- greedy-agreement length: leading tokens of a greedy continuation of the whole text that match BF16's;
- stored bits per K/V element of the cache after the text.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.utils import logging

from oscar_hf.compat import cache_argument_name
from oscar_hf.eval.decode_equivalent import simulate_logits
from oscar_hf.eval.diagnostics.generation import Prefill, greedy_through_cache
from oscar_hf.eval.diagnostics.layers import (
    LayerErrors,
    capture_attention_inputs,
    prefill_by_replay,
    replay_layer_errors,
)
from oscar_hf.eval.diagnostics.methods import Method, bits_per_element
from oscar_hf.eval.diagnostics.metrics import (
    greedy_agreement_length,
    negative_log_likelihood,
    next_token_kl,
    top1_agreement,
)

logger = logging.get_logger(__name__)


@dataclass
class MethodResult:
    name: str
    label: str
    bits_per_element: float | None = None  # as stored in this run (model dtype tiers/scales)
    bits_per_element_bf16: float | None = None  # the same cache under a BF16 model
    perplexity: float | None = None  # through the cache, chunked forwards
    next_token_kl: float | None = None
    top1_agreement: float | None = None
    decode_perplexity: float | None = None  # decode-equivalent simulation (OSCAR methods)
    decode_next_token_kl: float | None = None
    decode_top1_agreement: float | None = None
    mean_attention_kl: float | None = None
    mean_output_relative_mse: float | None = None
    mean_key_mse: float | None = None
    mean_value_mse: float | None = None
    greedy_agreement: int | None = None
    greedy_tokens: list[int] = field(default_factory=list)
    layers: list[LayerErrors] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["layers"] = [asdict(e) for e in self.layers]
        return d


@dataclass
class RunSettings:
    """What a run measures. `chunk` / `replay_chunk`: forward sizes after the prefill (8 is decode-exact for every
    cache here, see the module docstring); `generate`: greedy tokens for the agreement length (0: none);
    `simulate`: also the decode-equivalent simulation of the OSCAR rows (one more full forward each)."""

    tokens: int = 2048
    prefill: int = 512
    chunk: int = 8
    replay_chunk: int = 8
    generate: int = 32
    progress: bool = True
    simulate: bool = True


REFERENCE = "bf16"
REFERENCE_LABEL = "BF16 reference (DynamicCache; computed once)"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


@torch.no_grad()
def chunked_logits(model, ids: torch.Tensor, cache, prefill: int, chunk: int, progress: bool = False,
                   desc: str = "scoring", prefill_kv: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
                   ) -> torch.Tensor:
    """float32 logits `[L - prefill, vocab]` of positions `prefill..L-1`, computed through `cache` by a
    `prefill`-token forward followed by `chunk`-token forwards.

    `prefill_kv`: the full-precision K/V per layer `[1, Hkv, >= prefill, D]` of the text (`capture_attention_inputs`);
    the cache is then filled with their first `prefill` tokens through its own `update` (`prefill_by_replay`)
    instead of running the prefill forward. Every cache here attends to its prefill in full precision and scores
    none of its tokens, so this is the same cache at a fraction of the cost (tests/test_diagnostics_quick.py)."""
    name = cache_argument_name(model)
    if prefill_kv is None:
        model(input_ids=ids[:, :prefill], use_cache=True, **{name: cache})
    else:
        keys, values = prefill_kv
        prefill_by_replay(cache, [k[:, :, :prefill] for k in keys], [v[:, :, :prefill] for v in values])
    pieces = []
    for start in tqdm(range(prefill, ids.shape[1], chunk), desc=desc, disable=not progress, leave=False):
        logits = model(input_ids=ids[:, start:start + chunk], use_cache=True, **{name: cache}).logits[0]
        pieces.append(logits.float())
    return torch.cat(pieces)


@dataclass
class _Reference:
    """What every method is compared with, computed once: the full-precision forward over the text and BF16's
    greedy continuation."""

    captured: list
    logits: torch.Tensor  # [1, tokens, vocab], the model's own forward (no quantized cache)
    prefill: Prefill  # the whole text as a prompt, for the greedy continuations
    scored: slice  # positions whose logits predict `targets`
    targets: torch.Tensor
    greedy_tokens: list[int]


@torch.no_grad()
def run_methods(model, input_ids: torch.Tensor, methods: list[Method], settings: RunSettings,
                on_result=None) -> list[MethodResult]:
    """Evaluate `methods` on `input_ids` `[1, tokens]` against the BF16 reference; returns the reference row (name
    `bf16`) and then one row per method.

    The reference is computed once and not replayed as a method: one full-precision forward over the text gives
    its logits (ppl; the KL and top-1 of every row are against them) and the per-layer Q/K/V every replay reads;
    its per-layer errors are zero by definition, its bits are the model dtype's. A `bf16` entry in `methods` only
    asks for that row, which is always there. `on_result(results_so_far)` is called after the reference and after
    each method (e.g. to save partial results of a long run).
    """
    ids = input_ids[:, : settings.tokens]
    if not 0 < settings.prefill < ids.shape[1] - 1:
        raise ValueError(f"prefill={settings.prefill} must leave tokens to score in a text of {ids.shape[1]} tokens")
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    methods = [m for m in methods if m.name != REFERENCE]
    reference_row = MethodResult(REFERENCE, REFERENCE_LABEL)
    start = time.perf_counter()
    captured, logits = capture_attention_inputs(model, ids)
    reference_row.seconds["capture"] = time.perf_counter() - start
    prefill = Prefill(ids, [c.key for c in captured], [c.value for c in captured], int(logits[0, -1].argmax()))
    scored = slice(settings.prefill, ids.shape[1] - 1)
    reference = _Reference(captured, logits, prefill, scored, ids[0, settings.prefill + 1:], [])
    _fill_reference(model, reference_row, reference, settings)
    results = [reference_row]
    if on_result is not None:
        on_result(list(results))
    for method in tqdm(methods, desc="methods", disable=not settings.progress):
        r = MethodResult(method.name, method.label)
        try:
            _evaluate_method(model, ids, method, settings, r, reference, kv_heads, head_dim)
        except Exception as e:  # noqa: BLE001 - a failing baseline is reported in the table, the run goes on
            r.error = f"{type(e).__name__}: {e}"
            logger.warning("%s failed: %s", method.name, r.error)
        results.append(r)
        if on_result is not None:
            on_result(list(results))
    return results


def _fill_reference(model, r: MethodResult, reference: _Reference, settings: RunSettings) -> None:
    logits = reference.logits[0, reference.scored]
    r.perplexity = math.exp(negative_log_likelihood(logits, reference.targets))
    r.next_token_kl, r.top1_agreement = 0.0, 1.0
    if settings.simulate:  # the BF16 row of the decode-equivalent columns is the same cache-free forward
        r.decode_perplexity, r.decode_next_token_kl, r.decode_top1_agreement = r.perplexity, 0.0, 1.0
    r.mean_attention_kl = r.mean_output_relative_mse = r.mean_key_mse = r.mean_value_mse = 0.0
    element_size = reference.captured[0].key.element_size()
    r.bits_per_element = 8.0 * element_size
    r.bits_per_element_bf16 = 16.0 if element_size == 4 else 8.0 * element_size
    if settings.generate:
        start = time.perf_counter()
        cache = DynamicCache(config=model.config)
        reference.greedy_tokens = greedy_through_cache(model, cache, settings.generate, prefill=reference.prefill)
        r.greedy_tokens, r.greedy_agreement = reference.greedy_tokens, len(reference.greedy_tokens)
        r.seconds["greedy"] = time.perf_counter() - start


def _evaluate_method(model, ids, method: Method, settings: RunSettings, r: MethodResult, reference: _Reference,
                     kv_heads: int, head_dim: int) -> None:
    scored, targets = reference.scored, reference.targets
    reference_logits = reference.logits[0, scored]
    start = time.perf_counter()
    prefill_kv = ([c.key for c in reference.captured], [c.value for c in reference.captured])
    logits = chunked_logits(model, ids, method.build(model), settings.prefill, settings.chunk,
                            progress=settings.progress, desc=f"scoring {method.name}", prefill_kv=prefill_kv)[:-1]
    r.perplexity = math.exp(negative_log_likelihood(logits, targets))
    r.next_token_kl = next_token_kl(reference_logits, logits)
    r.top1_agreement = top1_agreement(reference_logits, logits)
    r.seconds["chunked_scoring"] = time.perf_counter() - start
    if method.oscar and settings.simulate:
        start = time.perf_counter()
        logits = simulate_logits(model, ids, method.oscar_template(model), prefill=settings.prefill)[0, scored]
        r.decode_perplexity = math.exp(negative_log_likelihood(logits, targets))
        r.decode_next_token_kl = next_token_kl(reference_logits, logits)
        r.decode_top1_agreement = top1_agreement(reference_logits, logits)
        r.seconds["decode_simulation"] = time.perf_counter() - start
    start = time.perf_counter()
    cache = method.build(model)
    r.layers = replay_layer_errors(reference.captured, cache, settings.prefill, settings.replay_chunk,
                                   progress=settings.progress, desc=f"layers {method.name}")
    r.bits_per_element = bits_per_element(cache, ids.shape[1], 1, kv_heads, head_dim)
    r.bits_per_element_bf16 = bits_per_element(cache, ids.shape[1], 1, kv_heads, head_dim, bf16_model=True)
    r.mean_attention_kl = _mean(e.attention_kl for e in r.layers)
    r.mean_output_relative_mse = _mean(e.output_relative_mse for e in r.layers)
    r.mean_key_mse = _mean(e.key_mse for e in r.layers)
    r.mean_value_mse = _mean(e.value_mse for e in r.layers)
    r.seconds["layer_replay"] = time.perf_counter() - start
    del cache
    if settings.generate:
        start = time.perf_counter()
        r.greedy_tokens = greedy_through_cache(model, method.build(model), settings.generate, prefill=reference.prefill)
        r.greedy_agreement = greedy_agreement_length(reference.greedy_tokens, r.greedy_tokens)
        r.seconds["greedy"] = time.perf_counter() - start
