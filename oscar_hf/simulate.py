"""Decode-equivalent simulation: one forward over a whole sequence whose attention sees exactly what an
`OscarCache` would show each query if the sequence were fed as a prefill followed by token-by-token decoding.

Why it is exact. A history token is quantized per row (one token of one KV head), so its dequantized key/value
`K̂_p, V̂_p` do not depend on when or by whom it is read. What changes from query to query is only *which* cached
tokens are quantized, and that follows from the demotion schedule of `layer.py`, which runs after every forward
(so a forward always attends to its own tokens in BF16): with S sink tokens, R = `recent_tokens` and
b = `demote_block`, a multi-token forward (prefill or chunk) leaves at most R tokens in the recent window, and a
single-token (decode) forward demotes only once the window exceeds R + b - 1, then down to R.

So with forwards `[0, P)` (the prefill), then `[P, P + c)`, `[P + c, P + 2c)`, ... (c = 1: decoding), the query at
position t, computed in the forward that starts at `s`, sees positions `S <= p < S + N_s` quantized and every other
`p <= t` in BF16, where `N_s` is the history length left by the forwards before `s` (`history_lengths`). For a
prefill of P > 1 tokens followed by decoding this has the closed form

    N_P = max(0, P - S - R)
    N_t = N_P + b * floor(max(0, t - S - N_P - R) / b)      for t >= P;   N_t = 0 for t < P.

The simulation computes two score matrices per layer (`q·K` and `q·K̂`, the latter in the rotated basis, as
the cache does), picks per (t, p) which one applies, applies the causal/padding mask, takes one softmax, and mixes
`V` and `V̂` with the same selection. It is O(L²) like ordinary attention; `tests/test_simulate.py` checks it
against real token-by-token decoding through `OscarCache`.

```python
from oscar_hf import OscarCache
from oscar_hf.simulate import simulate_logits
template = OscarCache(model.config, rotations="hadamard")   # only its settings and rotations are used
logits = simulate_logits(model, input_ids, template, prefill=512)  # [B, L, vocab], decode-equivalent
```

Batches: every row is simulated as if decoded alone (batch 1, no padding). Right padding (lm-eval's) is harmless
because attention is causal; `prefill` may differ per row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .config import OscarConfig
from .layer import OscarLayer
from .quantize import dequantize_rows, quantize_rows
from .rotation import expand_heads, rotate

SIMULATION_ATTENTION = "oscar_simulate"
QUERY_BLOCK = 256  # queries per score block (bounds memory at [B, Hq, QUERY_BLOCK, L] floats)


def history_lengths(length: int, prefill: int, sink: int, recent: int, block: int, chunk: int = 1) -> torch.Tensor:
    """History length N seen by each query position `[length]` (long), for a prefill of `prefill` tokens followed
    by forwards of `chunk` tokens (1: decoding), under `OscarLayer`'s demotion schedule.

    Query t sees positions `[sink, sink + N[t])` quantized. Mirrors `OscarLayer.settle` step by step: after a
    forward of n tokens the recent window may hold R tokens (n > 1) or R + b - 1 tokens (n = 1); beyond that it is
    demoted down to R.
    """
    if length < 0 or chunk < 1 or block < 1:
        raise ValueError(f"length={length}, chunk={chunk}, block={block}: expected length >= 0, chunk >= 1, block >= 1")
    prefill = min(max(int(prefill), 1), max(length, 1))
    out = torch.zeros(length, dtype=torch.long)
    history = 0
    bounds = [0, *range(prefill, length, chunk), length]
    for start, end in zip(bounds[:-1], bounds[1:]):
        out[start:end] = history
        recent_count = max(0, end - sink) - history
        if recent_count > recent + (block - 1 if end - start == 1 else 0):
            history += recent_count - recent
    return out


@dataclass
class SimulationPlan:
    """What the simulated attention needs: the cache settings, rotations per layer, and the forward schedule.

    `prefill` is one int for the batch or one per row; `chunk` is the size of the forwards after the prefill.
    `recorder`, when set, is called once per OSCAR layer with a `LayerProbe` (see `oscar_hf.diagnostics`).
    `propagate=False` returns the BF16 attention output (the model stays on the BF16 trajectory) while the
    recorder still sees the quantized one.
    """

    config: OscarConfig
    rotations: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]
    prefill: int | Sequence[int] = 1
    chunk: int = 1
    recorder: Callable | None = None
    propagate: bool = True
    clip_ratios: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)
    _history: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_cache(cls, cache, prefill: int | Sequence[int] = 1, chunk: int = 1, **kwargs) -> "SimulationPlan":
        """Settings and rotations of an (unused) `OscarCache`: `OscarCache(model.config, rotations, method, ...)`."""
        layers = [layer for layer in cache.layers if isinstance(layer, OscarLayer)]
        rotations = {layer.layer_idx: (layer.key_rotation, layer.value_rotation) for layer in layers}
        clips = {layer.layer_idx: (layer.config.key_clip_ratio, layer.config.value_clip_ratio) for layer in layers}
        return cls(cache.oscar_config, rotations, prefill=prefill, chunk=chunk, clip_ratios=clips, **kwargs)

    def history(self, batch: int, length: int, device) -> torch.Tensor:
        """`[batch, length]` history length seen by each query (cached per shape)."""
        prefills = [self.prefill] * batch if isinstance(self.prefill, int) else list(self.prefill)
        if len(prefills) != batch:
            raise ValueError(f"{len(prefills)} prefill lengths for a batch of {batch} rows")
        key = (tuple(prefills), length, str(device))
        if key not in self._history:
            cfg = self.config
            rows = [history_lengths(length, p, cfg.sink_tokens, cfg.recent_tokens, cfg.demote_block, self.chunk)
                    for p in prefills]
            self._history = {key: torch.stack(rows).to(device)}
        return self._history[key]


@dataclass
class LayerProbe:
    """One layer's simulated attention, handed to `SimulationPlan.recorder` (all float32, model basis).

    `query` `[B, Hq, L, D]`; `keys`/`values` and their dequantized `keys_hat`/`values_hat` `[B, Hkv, L, D]`;
    `history` `[B, L]` (query t sees `[sink, sink + history[t])` quantized); `mask` bool `[B or 1, 1, L, L]`
    (True = attend); `output_bf16` / `output_quantized` `[B, L, Hq, D]` before the output projection.
    """

    layer_idx: int
    module: torch.nn.Module
    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    keys_hat: torch.Tensor
    values_hat: torch.Tensor
    history: torch.Tensor
    sink: int
    mask: torch.Tensor
    scaling: float
    softcap: float | None
    output_bf16: torch.Tensor
    output_quantized: torch.Tensor


def reconstruct(x: torch.Tensor, rotation: torch.Tensor | None, config: OscarConfig, clip_ratio: float | None):
    """Rows `x` `[B, H, L, d]` as the history stores them, dequantized: float32, in the *rotated* basis."""
    rotated = rotate(x, None if rotation is None else rotation.to(x.device))
    if not config.quantize:
        return rotated.to(x.dtype).float()
    codes, scale_zero = quantize_rows(rotated, config.bits, clip_ratio, config.scale_dtype, config.encoder)
    return dequantize_rows(codes, scale_zero)


def band_mask(history: torch.Tensor, sink: int, q_start: int, q_end: int, length: int) -> torch.Tensor:
    """bool `[B, 1, q_end - q_start, length]`: True where query t reads key p from the quantized history."""
    p = torch.arange(length, device=history.device)
    n = history[:, q_start:q_end, None]
    return ((p >= sink) & (p < sink + n))[:, None]


def _scores(q: torch.Tensor, k: torch.Tensor, scaling: float, softcap: float | None) -> torch.Tensor:
    """`[B, Hq, Lq, Lk]` scores of `q` `[B, Hq, Lq, D]` against `k` `[B, Hkv, Lk, D]` (GQA by head groups)."""
    b, hq, lq, d = q.shape
    hkv = k.shape[1]
    s = (q.reshape(b, hkv, (hq // hkv) * lq, d) @ k.transpose(-1, -2)).mul_(scaling).view(b, hq, lq, -1)
    return torch.tanh(s / softcap) * softcap if softcap is not None else s


def _mix(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`probs` `[B, Hq, Lq, Lk]` @ `v` `[B, Hkv, Lk, D]` -> `[B, Hq, Lq, D]`."""
    b, hq, lq, lk = probs.shape
    hkv = v.shape[1]
    return (probs.reshape(b, hkv, (hq // hkv) * lq, lk) @ v).view(b, hq, lq, -1)


def simulate_attention(module, query, key, value, attention_mask, plan: SimulationPlan, scaling: float,
                       softcap: float | None = None) -> torch.Tensor:
    """Decode-equivalent attention of one OSCAR layer; returns `[B, L, Hq, D]` in the query dtype."""
    layer_idx = module.layer_idx
    batch, q_heads, length, _ = query.shape
    if key.shape[2] != length:
        raise ValueError(f"the simulation runs without a cache: got {length} queries but {key.shape[2]} keys")
    cfg = plan.config
    key_rotation, value_rotation = plan.rotations[layer_idx]
    groups = q_heads // key.shape[1]
    key_clip, value_clip = plan.clip_ratios.get(layer_idx, (cfg.key_clip_ratio, cfg.value_clip_ratio))
    k_hat = reconstruct(key, key_rotation, cfg, key_clip)
    v_hat = reconstruct(value, value_rotation, cfg, value_clip)
    key_r = None if key_rotation is None else key_rotation.to(query.device, torch.float32)
    value_r = None if value_rotation is None else value_rotation.to(query.device, torch.float32)
    q = query.float()
    q_rot = rotate(q, expand_heads(key_r, groups))
    k, v = key.float(), value.float()
    history = plan.history(batch, length, query.device)
    if attention_mask is None:
        rows = torch.arange(length, device=query.device)
        mask = (rows[None, :] <= rows[:, None])[None, None]
    else:
        mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    outputs, bf16_outputs = [], []
    for start in range(0, length, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, length)
        m = mask[:, :, start:end]
        band = band_mask(history, cfg.sink_tokens, start, end, length)
        exact = _scores(q[:, :, start:end], k, scaling, softcap)
        scores = torch.where(band, _scores(q_rot[:, :, start:end], k_hat, scaling, softcap), exact)
        probs = torch.softmax(scores.masked_fill(~m, float("-inf")), dim=-1).nan_to_num_(0.0)
        hist_out = _mix(probs * band, v_hat)
        out = _mix(probs * ~band, v) + rotate(hist_out, expand_heads(value_r, groups), transpose=True)
        outputs.append(out)
        if plan.recorder is not None or not plan.propagate:
            bf16 = torch.softmax(exact.masked_fill(~m, float("-inf")), dim=-1).nan_to_num_(0.0)
            bf16_outputs.append(_mix(bf16, v))
    out = torch.cat(outputs, dim=2).transpose(1, 2)
    out_bf16 = torch.cat(bf16_outputs, dim=2).transpose(1, 2) if bf16_outputs else None
    if plan.recorder is not None:
        plan.recorder(LayerProbe(
            layer_idx, module, q, k, v,
            rotate(k_hat, key_r, transpose=True), rotate(v_hat, value_r, transpose=True),
            history, cfg.sink_tokens, mask, scaling, softcap, out_bf16, out,
        ))
    chosen = out if plan.propagate else out_bf16
    return chosen.to(query.dtype).contiguous()


@torch.compiler.disable
def simulation_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface entry for "oscar_simulate": needs `oscar_simulation=SimulationPlan` in the forward kwargs."""
    plan = kwargs.pop("oscar_simulation", None)
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    if plan is None or module.layer_idx not in plan.rotations:
        # not simulated (no plan, or a sliding-window layer the cache keeps in BF16): the exact SDPA path
        if kwargs.get("softcap") is not None:
            raise NotImplementedError("softcapped sliding layers are not supported by the simulation")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return simulate_attention(module, query, key, value, attention_mask, plan, scaling, kwargs.get("softcap")), None


def register_simulation() -> None:
    """Register "oscar_simulate" with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(SIMULATION_ATTENTION, simulation_attention_forward)
    AttentionMaskInterface.register(SIMULATION_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Temporarily switch `model` to the attention implementation `name`."""
    from .models import text_config_of

    previous = text_config_of(model.config)._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@torch.no_grad()
def simulate_logits(model, input_ids: torch.Tensor, cache_or_plan, prefill: int | Sequence[int] = 1,
                    chunk: int = 1, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Decode-equivalent logits `[B, L, vocab]` for `input_ids` `[B, L]`.

    `cache_or_plan` is an `OscarCache` (its settings and rotations are used; it is not filled) or a
    `SimulationPlan`. Positions `t < prefill` are computed as a prefill (all BF16); later positions as the
    forwards of `chunk` tokens that follow it (chunk=1: decoding).
    """
    register_simulation()
    plan = cache_or_plan if isinstance(cache_or_plan, SimulationPlan) else SimulationPlan.from_cache(
        cache_or_plan, prefill=prefill, chunk=chunk)
    with attention_implementation(model, SIMULATION_ATTENTION):
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                     oscar_simulation=plan).logits
