"""Streaming float64 second moments of post-RoPE queries, keys and values, plain and attention-weighted.

Nothing is dumped: every attention call adds its contribution to running sums and the activations are dropped.

Notation, per layer and KV head h (query heads of group h pooled as extra samples, the reference's convention):

- query moment   `Σ_q q qᵀ / n_q`
- key moment     `Σ_t k_t k_tᵀ / n_k`
- value moment   `Σ_t v_t v_tᵀ / n_v`
- weighted value moments `Σ_t w_t v_t v_tᵀ / Σ_t w_t` with
  - `sst` (the OSCAR reference: logit² weights): `w_t = k_tᵀ Σ_Q k_t = E_q[(q·k_t)²]`, Σ_Q the final query moment of the
    head, all queries pooled, no causality. Needs Σ_Q first, so it is a second pass over the data.
  - `softmax_diag`: `w_t = Σ_q S_qt²`, S the causal softmax of the layer (the query heads of the group summed). This is
    the diagonal of `SᵀS`: the expected output error `E‖S ΔV‖²` of independent per-token value errors ΔV is
    `Σ_t (SᵀS)_tt E‖Δv_t‖²`.
- `softmax_sv`: `(S V)ᵀ (S V) / n_q` = `Vᵀ SᵀS V / n_q`, the paper's `C_S` written literally (second moment of the
  attention output). It keeps the cross-token terms of `SᵀS`, which cancel for independent quantization errors.

`Tiers` restricts what is counted to what the cache quantizes, by the cache's demotion rule (`oscar_hf.demotion`)
for text decoded token by token: keys at positions `>= sink` (sink tokens stay BF16) and the query-key pairs the
query reads from the history (with the default `demote_block=1`, `t < p - recent`: the recent window stays BF16);
queries count once they can see one quantized key. Softmax probabilities are always those of the full causal
attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_hf.demotion import history_lengths, in_history
from oscar_hf.kernels.reference.attention import gqa_scores

MOMENTS = ("query", "key", "value", "sst", "softmax_diag", "softmax_sv")


@dataclass(frozen=True)
class Tiers:
    """Which tokens and query-key pairs the statistics count.

    `sink` / `recent` None count every causal pair (the reference); integers mirror `OscarConfig.sink_tokens` /
    `recent_tokens`, and `demote_block` its demotion granularity (1: the recent window always holds exactly `recent`
    tokens). `skip_tokens` drops the first positions of every sequence from every statistic (degenerate warm-up
    tokens; the reference drops its 6-token warm-up batch).
    """

    sink: int | None = None
    recent: int | None = None
    skip_tokens: int = 0
    demote_block: int = 1

    def __post_init__(self):
        if (self.sink is None) != (self.recent is None):
            raise ValueError(f"sink={self.sink!r}, recent={self.recent!r}: give both or neither")
        for name in ("sink", "recent", "skip_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}={value!r}: expected an integer >= 0")
        if not isinstance(self.demote_block, int) or self.demote_block < 1:
            raise ValueError(f"demote_block={self.demote_block!r}: expected an integer >= 1")

    @property
    def tier_aware(self) -> bool:
        return self.sink is not None

    @property
    def first_key(self) -> int:
        """First position whose key/value is counted."""
        return max(self.skip_tokens, self.sink or 0)

    @property
    def first_query(self) -> int:
        """First position whose query is counted (it must see at least one counted key)."""
        if not self.tier_aware:
            return self.skip_tokens
        # the history reaches past first_key once it holds first_key - sink + 1 tokens: N(p) grows by
        # demote_block at a time, from p = sink + recent + demote_block on
        needed = self.first_key - self.sink + 1
        return self.sink + self.recent + self.demote_block * -(-needed // self.demote_block)

    def pair_mask(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """bool `[Lq, Lk]`: the counted (query, key) pairs."""
        p, t = query_positions[:, None], key_positions[None, :]
        allowed = (t <= p) & (t >= self.first_key) & (p >= self.first_query)
        if self.tier_aware and p.numel():
            # one table per sequence length (cached): the history each position sees when decoded
            length = int(max(query_positions.max(), key_positions.max())) + 1
            seen = history_lengths(length, 1, self.sink, self.recent, self.demote_block).to(p.device)
            allowed &= in_history(t, seen[p], self.sink)
        return allowed


class SecondMoment:
    """Running `Σ w_i x_i x_iᵀ` and `Σ w_i` per group, in float64. Allocated on the device of the first update."""

    def __init__(self, groups: int, dim: int):
        self.groups, self.dim = groups, dim
        self.total: torch.Tensor | None = None  # [G, d, d] float64
        self.weight: torch.Tensor | None = None  # [G] float64
        self.samples = 0  # rows seen (per group)

    def update(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add rows `x` `[G, N, d]` with optional non-negative weights `[G, N]` (1 when None)."""
        if x.dim() != 3 or x.shape[0] != self.groups or x.shape[2] != self.dim:
            raise ValueError(f"expected rows of shape [{self.groups}, N, {self.dim}], got {tuple(x.shape)}")
        if x.shape[1] == 0:
            return
        x = x.to(torch.float64)
        if self.total is None:
            self.total = torch.zeros(self.groups, self.dim, self.dim, dtype=torch.float64, device=x.device)
            self.weight = torch.zeros(self.groups, dtype=torch.float64, device=x.device)
        if weights is None:
            self.total += x.transpose(1, 2) @ x
            self.weight += x.shape[1]
        else:
            w = weights.to(device=x.device, dtype=torch.float64)
            self.total += (x * w[..., None]).transpose(1, 2) @ x
            self.weight += w.sum(dim=1)
        self.samples += x.shape[1]

    @property
    def empty(self) -> bool:
        return self.total is None or bool((self.weight <= 0).any())

    def mean(self) -> torch.Tensor:
        """`Σ w x xᵀ / Σ w` per group: float64 `[G, d, d]` on the CPU, symmetrized."""
        if self.empty:
            raise ValueError("no samples were accumulated (empty data, or every token was skipped)")
        m = (self.total / self.weight[:, None, None]).cpu()
        return (m + m.transpose(1, 2)) / 2


@dataclass
class LayerMoments:
    """The accumulators of one layer, created on demand by name."""

    groups: int
    dim: int

    def __post_init__(self):
        self.moments: dict[str, SecondMoment] = {}

    def __getitem__(self, name: str) -> SecondMoment:
        if name not in self.moments:
            self.moments[name] = SecondMoment(self.groups, self.dim)
        return self.moments[name]


def group_queries(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[B, Hq, L, d]` -> `[Hkv, B * groups * L, d]`: query heads of each KV head pooled (contiguous grouping)."""
    batch, q_heads, length, dim = query.shape
    groups = q_heads // kv_heads
    return query.reshape(batch, kv_heads, groups, length, dim).permute(1, 0, 2, 3, 4).reshape(kv_heads, -1, dim)


def rows_per_head(x: torch.Tensor) -> torch.Tensor:
    """`[B, H, L, d]` -> `[H, B * L, d]`."""
    return x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])


def query_block_size(batch: int, q_heads: int, k_len: int, max_elements: int) -> int:
    """Queries per block so that a `[B, Hq, block, Lk]` score block holds at most `max_elements` (at least 1)."""
    return max(1, max_elements // max(1, batch * q_heads * k_len))


def attention_blocks(query, key, scaling: float, query_positions, key_positions, max_elements: int = 1 << 23,
                     softcap: float | None = None):
    """Causal softmax probabilities of `query` `[B, Hq, Lq, d]` over `key` `[B, Hkv, Lk, d]`, a block of queries at a time.

    Yields `(rows, probs)`: the query slice and float32 probabilities `[B, Hkv, groups, rows, Lk]` (the caller may
    modify them in place). A block holds at most `max_elements` probabilities (32 MiB by default), whatever the
    context length.
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    block = query_block_size(batch, q_heads, k_len, max_elements)
    keys = key.float()
    for start in range(0, q_len, block):
        rows = slice(start, min(start + block, q_len))
        scores = gqa_scores(query[:, :, rows], keys, scaling, softcap).view(batch, kv_heads, groups, -1, k_len)
        future = key_positions[None, :] > query_positions[rows, None]
        yield rows, torch.softmax(scores.masked_fill_(future, float("-inf")), dim=-1)


def observe_layer(
    moments: LayerMoments,
    needs: frozenset[str],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    tiers: Tiers,
    query_moment_for_sst: torch.Tensor | None = None,
    max_elements: int = 1 << 23,
    softcap: float | None = None,
) -> None:
    """Add one attention call's contribution to `moments`.

    `query` `[B, Hq, Lq, d]` are the newest `Lq` positions of the sequence, `key`/`value` `[B, Hkv, Lk, d]` all
    positions `0..Lk-1` (a fresh cache per sequence, no padding). `needs` names the moments to update:
    "query", "key", "value", "softmax_diag", "softmax_sv", "sst" (which needs `query_moment_for_sst` `[Hkv, d, d]`).
    """
    kv_heads = key.shape[1]
    q_len, k_len = query.shape[2], key.shape[2]
    device = query.device
    key_positions = torch.arange(k_len, device=device)
    # Counted queries and this call's counted keys are suffixes of the call's positions.
    first_new = k_len - q_len
    first_query_row = min(q_len, max(0, tiers.first_query - first_new))
    first_key_row = min(q_len, max(0, tiers.first_key - first_new))
    counted_query = query[:, :, first_query_row:]

    if "query" in needs:
        moments["query"].update(group_queries(counted_query, kv_heads))
    new_k = key[:, :, first_new + first_key_row :]
    new_v = value[:, :, first_new + first_key_row :]
    if "key" in needs:
        moments["key"].update(rows_per_head(new_k))
    if "value" in needs:
        moments["value"].update(rows_per_head(new_v))
    if "sst" in needs:
        k_rows = rows_per_head(new_k).to(torch.float64)
        sigma = query_moment_for_sst.to(device=device, dtype=torch.float64)
        weights = ((k_rows @ sigma) * k_rows).sum(-1)  # [Hkv, N] = k_tᵀ Σ_Q k_t
        moments["sst"].update(rows_per_head(new_v), weights)
    if not needs & {"softmax_diag", "softmax_sv"} or counted_query.shape[2] == 0:
        return

    batch = query.shape[0]
    query_positions = key_positions[first_new + first_query_row :]
    mass = torch.zeros(batch, kv_heads, k_len, dtype=torch.float64, device=device)
    v32 = value.float()[:, :, None]  # [B, Hkv, 1, Lk, d]
    for rows, probs in attention_blocks(counted_query, key, scaling, query_positions, key_positions, max_elements,
                                        softcap):
        probs.masked_fill_(~tiers.pair_mask(query_positions[rows], key_positions), 0.0)  # counted pairs only
        if "softmax_sv" in needs:
            out = probs @ v32  # [B, Hkv, g, b, d]
            moments["softmax_sv"].update(out.transpose(0, 1).reshape(kv_heads, -1, out.shape[-1]))
        if "softmax_diag" in needs:
            mass += probs.square_().sum(dim=(2, 3)).to(torch.float64)
    if "softmax_diag" in needs:
        moments["softmax_diag"].update(rows_per_head(value), mass.transpose(0, 1).reshape(kv_heads, -1))


class MomentCollector:
    """Observer for `capture.feed`: accumulates the `needs` moments of every listed layer.

    Layers not listed (sliding-window layers, whose cache stays BF16) are ignored. `query_moments` (layer ->
    `[Hkv, d, d]`) is required for the "sst" moment, the second pass of the reference value objective.
    """

    def __init__(self, layer_ids, kv_heads: int, head_dim: int, needs, tiers: Tiers,
                 query_moments: dict[int, torch.Tensor] | None = None, max_elements: int = 1 << 23):
        unknown = set(needs) - set(MOMENTS)
        if unknown:
            raise ValueError(f"unknown moments {sorted(unknown)}; known: {MOMENTS}")
        if "sst" in needs and query_moments is None:
            raise ValueError("the 'sst' moment needs the query moments of a first pass (query_moments=...)")
        self.needs = frozenset(needs)
        self.tiers = tiers
        self.layers = {int(i): LayerMoments(kv_heads, head_dim) for i in layer_ids}
        self.query_moments = query_moments or {}
        self.max_elements = max_elements
        self.calls = 0
        self.seen_layers: set[int] = set()

    def __call__(self, module, query, key, value, scaling, softcap=None) -> None:
        self.calls += 1
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx not in self.layers:
            return
        self.seen_layers.add(layer_idx)
        observe_layer(self.layers[layer_idx], self.needs, query, key, value, scaling, self.tiers,
                      self.query_moments.get(layer_idx), self.max_elements, softcap)

    def means(self, name: str) -> dict[int, torch.Tensor]:
        """Layer -> float64 `[Hkv, d, d]` mean of moment `name`."""
        return {i: moments[name].mean() for i, moments in self.layers.items()}
