"""Which tokens are in the quantized history: the demotion rule of the cache, in one place.

Per layer the cache keeps S = `sink_tokens` | history | R = `recent_tokens`, and demotes after every forward (so a
forward always attends to its own tokens in BF16): a forward of n > 1 tokens (a prefill or a chunk) leaves at most R
tokens in the recent window; a single-token (decode) forward lets it grow to R + b - 1 (b = `demote_block`) and then
demotes b tokens at once, back to R. `tokens_to_demote` is that rule; `OscarLayer` applies it to its tiers, and
`history_lengths` replays it over a whole schedule of forwards for code that computes what the cache would show
each query without running it (the decode-equivalent evaluation, the calibration statistics).

For a prefill of P > 1 tokens followed by decoding, the history seen by the query at position t has the closed form

    N_P = max(0, P - S - R)
    N_t = N_P + b * floor(max(0, t - S - N_P - R) / b)      for t >= P;   N_t = 0 for t < P,

and the query at t reads positions S <= p < S + N_t from the history, every other p <= t in BF16 (`in_history`).
"""

from __future__ import annotations

import functools

import torch


def tokens_to_demote(recent_count: int, forward_tokens: int, recent_tokens: int, demote_block: int) -> int:
    """Tokens to move from the recent window into the history after a forward of `forward_tokens` tokens that left
    `recent_count` tokens in the window (0: none yet)."""
    limit = recent_tokens + (demote_block - 1 if forward_tokens == 1 else 0)
    return recent_count - recent_tokens if recent_count > limit else 0


def history_lengths(length: int, prefill: int, sink: int, recent: int, block: int, chunk: int = 1) -> torch.Tensor:
    """History length seen by each query position `[length]` (long, CPU) for a prefill of `prefill` tokens followed
    by forwards of `chunk` tokens (1: decoding), under `tokens_to_demote`.

    Query t sees positions `[sink, sink + N[t])` quantized (`in_history`). Every query of a forward sees the history
    left by the forwards before it.
    """
    if length < 0 or chunk < 1 or block < 1:
        raise ValueError(f"length={length}, chunk={chunk}, block={block}: expected length >= 0, chunk >= 1, block >= 1")
    return _history_lengths(length, min(max(int(prefill), 1), max(length, 1)), sink, recent, block, chunk).clone()


@functools.lru_cache(maxsize=64)
def _history_lengths(length: int, prefill: int, sink: int, recent: int, block: int, chunk: int) -> torch.Tensor:
    out = torch.zeros(length, dtype=torch.long)
    history = 0
    bounds = [0, *range(prefill, length, chunk), length]
    for start, end in zip(bounds[:-1], bounds[1:]):
        out[start:end] = history
        history += tokens_to_demote(max(0, end - sink) - history, end - start, recent, block)
    return out


def in_history(key_positions: torch.Tensor, history_length: torch.Tensor, sink: int) -> torch.Tensor:
    """bool: whether the key at `key_positions` is read from the history by a query that sees `history_length`
    history tokens (broadcasting: e.g. keys `[1, Lk]` against lengths `[Lq, 1]` give `[Lq, Lk]`)."""
    return (key_positions >= sink) & (key_positions < sink + history_length)
