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


# ---------------------------------------------------------------------------------------------- left padding
# A left-padded row b (its first p_b columns are padding) keeps its own first S real tokens as its sink: the pads
# go into the history, in front of the row's real history tokens. With N history tokens stored (the same N for
# every row) the layout of row b is a function of p_b and N alone:
# - sink slots [0, S) hold time columns [s_b, s_b + S) with s_b = min(p_b, N), their first a_b = clamp(p_b - N, 0, S)
#   pads;
# - history rows [0, N) hold time columns [0, s_b) (all pads: h_b = s_b of them) then [s_b + S, S + N);
# - the recent window holds time columns [S + N, length), its first clamp(p_b - N - S, 0, .) pads. When it has pads
#   the sink is all pads, so a row's BF16 pads always lead: a_b plus those = clamp(p_b - N, 0, .).
# A batch thus stores the same number of tokens in each tier for every row, and each row's real tokens sit in the
# tiers its solo cache would put them in.

def padded_starts(row_start: torch.Tensor, history_length) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense start, history start), int32 `[B]`: the leading pads of each row's BF16 rows (sink slots followed by
    the recent window) and of its history rows, for rows whose first `row_start[b]` columns are padding and
    `history_length` (an int, or an integer tensor `[1]` on the device) history tokens."""
    dense = (row_start - history_length).clamp_min(0).to(torch.int32)
    history = torch.minimum(row_start, row_start.new_zeros(()) + history_length).to(torch.int32)
    return dense, history


def demotion_index(row_start: torch.Tensor, history_length, sink: int, tokens: int,
                   active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a demotion of `tokens` BF16 rows (the rows after the `sink` sink slots) takes each row's tokens from,
    as indices into the first `sink + tokens` BF16 rows, long `[B, tokens]` and `[B, sink]`: (the rows appended to
    the history, the rows that become the sink). A row whose sink still holds k pads hands min(k, tokens) of them
    to the history and takes as many real tokens into the sink (see the layout above). `active` (an integer
    tensor `[1]` holding 0 or 1, decided on the device): where 0, the sink keeps its tokens."""
    moved = (row_start - history_length).clamp(0, tokens).long()[:, None]
    if active is not None:
        moved = moved * active.long()
    block = torch.arange(tokens, device=row_start.device)[None]
    slots = torch.arange(sink, device=row_start.device)[None]
    return block + sink * (block >= moved), slots + moved


def time_order_index(row_start: torch.Tensor, history_length: int, sink: int) -> torch.Tensor:
    """long `[B, sink + history_length]`: for each time column of the sink and history, its index in the
    concatenation (sink slots, history rows), so that gathering gives each row's tokens in time order."""
    start = torch.minimum(row_start.long(), torch.tensor(history_length, device=row_start.device))[:, None]
    time = torch.arange(sink + history_length, device=row_start.device)[None]
    return torch.where(time < start, sink + time, torch.where(time < start + sink, time - start, time))
