"""Run every requested method over one long held-out text and collect the quality numbers.

Same model, same tokens, same schedule for every method:
- perplexity, next-token KL and top-1 agreement vs BF16 through the real cache (`chunked_logits`: a
  `prefill`-token forward, then `chunk`-token forwards; every scored token attends to the cache's history).
  With `chunk` = 8 and a prefill that is a multiple of 8 this equals token-by-token decoding for every cache here:
  OSCAR demotes in blocks of `demote_block` = 8 and the quanto/HQQ/TurboQuant caches re-quantize every 128
  tokens, both on boundaries a chunk of 8 never straddles (tests/test_layer_errors.py checks the OSCAR case);
- for OSCAR methods also the decode-equivalent numbers (`oscar_hf.simulate`: prefill, then token-by-token);
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

from oscar_hf.compat import cache_argument_name
from oscar_hf.eval.decode_equivalent import simulate_logits
from oscar_hf.eval.diagnostics.generation import Prefill, greedy_through_cache
from oscar_hf.eval.diagnostics.layers import LayerErrors, capture_attention_inputs, replay_layer_errors
from oscar_hf.eval.diagnostics.methods import Method, bits_per_element
from oscar_hf.eval.diagnostics.metrics import (
    greedy_agreement_length,
    negative_log_likelihood,
    next_token_kl,
    top1_agreement,
)


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
    tokens: int = 2048
    prefill: int = 512
    chunk: int = 8
    replay_chunk: int = 8
    generate: int = 32
    progress: bool = True


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


@torch.no_grad()
def chunked_logits(model, ids: torch.Tensor, cache, prefill: int, chunk: int, progress: bool = False,
                   desc: str = "scoring") -> torch.Tensor:
    """float32 logits `[L - prefill, vocab]` of positions `prefill..L-1`, computed through `cache` by a
    `prefill`-token forward followed by `chunk`-token forwards."""
    name = cache_argument_name(model)
    model(input_ids=ids[:, :prefill], use_cache=True, **{name: cache})
    pieces = []
    for start in tqdm(range(prefill, ids.shape[1], chunk), desc=desc, disable=not progress, leave=False):
        logits = model(input_ids=ids[:, start:start + chunk], use_cache=True, **{name: cache}).logits[0]
        pieces.append(logits.float())
    return torch.cat(pieces)


@torch.no_grad()
def run_methods(model, input_ids: torch.Tensor, methods: list[Method], settings: RunSettings,
                on_result=None) -> list[MethodResult]:
    """Evaluate `methods` on `input_ids` `[1, tokens]`; the first method must be the BF16 reference.

    `on_result(results_so_far)` is called after each method (e.g. to save partial results of a long run).
    """
    if not methods or methods[0].name != "bf16":
        raise ValueError("the first method must be 'bf16', the reference of every KL and agreement number")
    ids = input_ids[:, : settings.tokens]
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    results = {m.name: MethodResult(m.name, m.label) for m in methods}

    start = time.time()
    captured, reference_logits = capture_attention_inputs(model, ids)
    capture_seconds = time.time() - start
    prefill = Prefill(ids, [c.key for c in captured], [c.value for c in captured],
                      int(reference_logits[0, -1].argmax()))
    scored = slice(settings.prefill, ids.shape[1] - 1)
    targets = ids[0, settings.prefill + 1:]

    reference = None
    reference_tokens = None
    done: set[str] = set()
    for method in tqdm(methods, desc="methods", disable=not settings.progress):
        r = results[method.name]
        try:
            _evaluate_method(model, ids, method, settings, r, captured, reference_logits, prefill, scored, targets,
                             reference, reference_tokens, kv_heads, head_dim)
        except Exception as e:  # noqa: BLE001 - a failing baseline is reported in the table, the run goes on
            r.error = f"{type(e).__name__}: {e}"
            if method.name == "bf16":
                raise
        r.seconds["capture"] = capture_seconds
        if method.name == "bf16":
            reference, reference_tokens = r._chunked_logits, r.greedy_tokens
        r._chunked_logits = None
        if on_result is not None:
            on_result([results[m.name] for m in methods if m.name in done or m is method])
        done.add(method.name)
    return [results[m.name] for m in methods]


def _evaluate_method(model, ids, method, settings, r, captured, reference_logits, prefill, scored, targets,
                     reference, reference_tokens, kv_heads, head_dim) -> None:
    start = time.time()
    logits = chunked_logits(model, ids, method.build(model), settings.prefill, settings.chunk,
                            progress=settings.progress, desc=f"scoring {method.name}")[:-1]
    r.perplexity = math.exp(negative_log_likelihood(logits, targets))
    r._chunked_logits = logits
    ref = logits if reference is None else reference
    r.next_token_kl = next_token_kl(ref, logits)
    r.top1_agreement = top1_agreement(ref, logits)
    r.seconds["chunked_scoring"] = time.time() - start
    if method.oscar or method.name == "bf16":
        start = time.time()
        logits = reference_logits if method.name == "bf16" else simulate_logits(
            model, ids, method.oscar_template(model), prefill=settings.prefill)
        r.decode_perplexity = math.exp(negative_log_likelihood(logits[0, scored], targets))
        r.decode_next_token_kl = next_token_kl(reference_logits[0, scored], logits[0, scored])
        r.decode_top1_agreement = top1_agreement(reference_logits[0, scored], logits[0, scored])
        r.seconds["decode_simulation"] = time.time() - start
    start = time.time()
    cache = method.build(model)
    r.layers = replay_layer_errors(captured, cache, settings.prefill, settings.replay_chunk,
                                   progress=settings.progress, desc=f"layers {method.name}")
    r.bits_per_element = bits_per_element(cache, ids.shape[1], 1, kv_heads, head_dim)
    r.bits_per_element_bf16 = bits_per_element(cache, ids.shape[1], 1, kv_heads, head_dim, bf16_model=True)
    r.mean_attention_kl = _mean(e.attention_kl for e in r.layers)
    r.mean_output_relative_mse = _mean(e.output_relative_mse for e in r.layers)
    r.mean_key_mse = _mean(e.key_mse for e in r.layers)
    r.mean_value_mse = _mean(e.value_mse for e in r.layers)
    r.seconds["layer_replay"] = time.time() - start
    del cache
    if settings.generate:
        start = time.time()
        r.greedy_tokens = greedy_through_cache(model, method.build(model), settings.generate, prefill=prefill)
        if reference_tokens is None:
            reference_tokens = r.greedy_tokens
        r.greedy_agreement = greedy_agreement_length(reference_tokens, r.greedy_tokens)
        r.seconds["greedy"] = time.time() - start
