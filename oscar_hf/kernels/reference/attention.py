"""Reference attention partials and their log-sum-exp merge (PyTorch, float32).

A partial is `(out, lse)`: `out` `[B, Hq, Lq, Dv]` is the softmax-normalized attention over one set of keys,
`lse` `[B, Hq, Lq]` the log-sum-exp of its scores (`-inf` where every key is masked, with `out` = 0 there).
Two partials over disjoint key sets merge exactly into attention over their union.

Masks are `[B or 1, 1, Lq, Lk]`: bool (True = attend) or additive float; None attends everywhere.
Query head h uses KV head `h // (Hq // Hkv)`.

`tiered_reference` composes them into the attention of one layer over its BF16 tiers and quantized history: the
semantics every backend's `tiered_attention` implements.
"""

from __future__ import annotations

import torch

from oscar_hf.kernels.interface import HistoryTensors
from oscar_hf.kernels.reference.quantize import unpack_dequantize
from oscar_hf.rotations.math import expand_heads, rotate


def gqa_scores(query: torch.Tensor, key: torch.Tensor, scaling: float, softcap: float | None = None) -> torch.Tensor:
    """float32 scores `[B, Hq, Lq, Lk]` of `query` `[B, Hq, Lq, D]` against `key` `[B, Hkv, Lk, D]`: `q·k · scaling`,
    then `tanh(s / softcap) · softcap` when a softcap is given. Query head h reads KV head `h // (Hq / Hkv)`, and
    all query heads of a group share one product with their KV head's keys."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    q = query.float().reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, dim)
    scores = (q @ key.float().transpose(-1, -2)).mul_(scaling).view(batch, q_heads, q_len, -1)
    return torch.tanh(scores / softcap) * softcap if softcap is not None else scores


def gqa_mix(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """float32 `probs` `[B, Hq, Lq, Lk]` @ `value` `[B, Hkv, Lk, D]` -> `[B, Hq, Lq, D]` (GQA as in `gqa_scores`)."""
    batch, q_heads, q_len, k_len = probs.shape
    kv_heads = value.shape[1]
    mixed = probs.reshape(batch, kv_heads, (q_heads // kv_heads) * q_len, k_len) @ value.float()
    return mixed.view(batch, q_heads, q_len, -1)


def dense_partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `query` `[B, Hq, Lq, D]` over `key`/`value` `[B, Hkv, Lk, D]`, as a partial."""
    scores = gqa_scores(query, key, scaling, softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return gqa_mix(probs, value), lse


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of partials over disjoint key sets (float32; fully masked rows give out 0, lse -inf)."""
    if len(parts) == 1:
        return parts[0]
    lses = torch.stack([lse.float() for _, lse in parts])
    top = lses.max(dim=0).values
    top = torch.where(torch.isfinite(top), top, 0.0)
    weights = torch.exp(lses - top)
    total = weights.sum(dim=0)
    out = sum(w[..., None] * o.float() for w, (o, _) in zip(weights, parts))
    out = out / total.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out, top + torch.log(total)


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The attention `out` `[B, Hq, Lq, D]` (float32, with log-sum-exp `lse` `[B, Hq, Lq]`) of a softmax whose
    denominator also holds `exp(sinks[h])` for each query head h (learned sink logits, gpt-oss: a key no value goes
    with): `out · sigmoid(lse - sink)`, exact, 0 where nothing was attended."""
    return out * torch.sigmoid(lse - sinks.float().view(1, -1, 1))[..., None]


def history_partial(
    query: torch.Tensor,
    history: HistoryTensors,
    key_rotation: torch.Tensor | None,
    value_rotation: torch.Tensor | None,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    chunk: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `query` (model basis) over a rotated, quantized history, returned in the model basis.

    The query is rotated by the key rotation (`q·k` is invariant), the history is dequantized `chunk` tokens at
    a time (never all at once), and the output is un-rotated by the value rotation's transpose.
    `mask` covers the history columns only: `[B or 1, 1, Lq, N]`.
    """
    groups = query.shape[1] // history.num_heads
    q_rot = rotate(query, expand_heads(key_rotation, groups))
    merged = None
    for start in range(0, history.length, chunk):
        end = min(start + chunk, history.length)
        keys, values = history_rows(history, start, end)
        part_mask = None if mask is None else mask[..., start:end]
        part = dense_partial(q_rot, keys, values, part_mask, scaling, softcap)
        merged = part if merged is None else merge_partials([merged, part])
    out, lse = merged
    return rotate(out, expand_heads(value_rotation, groups), transpose=True), lse


def history_rows(history: HistoryTensors, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rotated keys and values of history tokens [start, end): `[B, Hkv, end - start, d]`."""
    keys, values = history.keys[:, :, start:end], history.values[:, :, start:end]
    if not history.quantized:
        return keys.float(), values.float()
    return (unpack_dequantize(keys, history.key_scale_zero[:, :, start:end], history.bits),
            unpack_dequantize(values, history.value_scale_zero[:, :, start:end], history.bits))


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """bool `[1, 1, q_len, kv_len]`, queries aligned to the last `q_len` key positions."""
    rows = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return (torch.arange(kv_len, device=device)[None, :] <= rows)[None, None]


def _and_masks(mask: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """`mask` (bool or additive float) further restricted to the bool `allowed`."""
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


def split_mask(mask: torch.Tensor | None, sink: int, history: int):
    """(mask of the BF16 columns, mask of the history columns) from a mask over all `kv_len` columns."""
    if mask is None:
        return None, None
    dense = torch.cat([mask[..., :sink], mask[..., sink + history :]], dim=-1)
    return dense, mask[..., sink : sink + history]


def tiered_reference(backend, query, key, value, mask, history, sink_length, key_rotation, value_rotation, scaling,
                     softcap=None, dense_start=None, history_start=None, sinks=None) -> torch.Tensor:
    """Attention over BF16 tiers + quantized history through `backend`'s partial ops; `[B, Lq, Hq, D]`, query dtype.

    `key`/`value` `[B, Hkv, Ld, D]` are the sink followed by the recent and new tokens (model basis); the history
    (`history.length` tokens, possibly 0) sits between mask columns `sink_length` and `sink_length + length`.
    Without a mask and with several queries, a bottom-right causal mask over all columns is used.
    `dense_start` / `history_start` (int `[B]`, optional): row b ignores its first `dense_start[b]` dense keys and
    its first `history_start[b]` history rows (left padding, `demotion.padded_starts`), on top of the mask.
    `sinks` (`[Hq]`, optional): learned sink logits in every row's softmax (`add_sinks`).
    """
    hist_len = history.length if history is not None else 0
    q_len = query.shape[2]
    if mask is None and q_len > 1:
        mask = causal_mask(q_len, hist_len + key.shape[2], query.device)
    dense_mask, history_mask = split_mask(mask, sink_length, hist_len)
    if dense_start is not None:
        real = torch.arange(key.shape[2], device=key.device)[None, :] >= dense_start.to(key.device)[:, None]
        real = real[:, None, None, :]
        dense_mask = real if dense_mask is None else _and_masks(dense_mask, real)
    if history_start is not None and hist_len:
        real = torch.arange(hist_len, device=key.device)[None, :] >= history_start.to(key.device)[:, None]
        real = real[:, None, None, :]
        history_mask = real if history_mask is None else _and_masks(history_mask, real)
    parts = [backend.dense_attention(query, key, value, dense_mask, scaling, softcap)]
    if hist_len:
        parts.append(backend.history_attention(query, history, key_rotation, value_rotation, history_mask, scaling,
                                               softcap))
    out, lse = backend.merge(parts)
    if sinks is not None:
        out = add_sinks(out.float(), lse, sinks)
    return out.to(query.dtype).transpose(1, 2).contiguous()
