"""Per-layer attention error of a quantized history, measured on the model's own queries, keys and values.

For every full-attention layer and every candidate quantization (rotations + clip ratios + quantizer), the probe
compares, on the same BF16-model inputs (errors are not propagated between layers):

- `P = softmax(q Kᵀ·s)` with exact keys, and `P̂` with the keys of the history tier fake-quantized;
- `O = P V · W_Oᵀ` and `Ô = (P̂_hist V̂_hist + P̂_bf16 V_bf16) · W_Oᵀ` (after `o_proj` when the attention module has
  one, else per head before it).

The tiers follow the cache's demotion rule (`oscar_hf.demotion`) for text decoded token by token, with
`demote_block` tokens demoted at a time (default 1: the recent window always holds exactly `recent` tokens, so the
query at position `p` reads `sink <= t < p - recent` from the history); the sink and the recent window stay exact.
Only queries that see at least one quantized key are counted. Reported per layer:

- `kl`: mean over query heads and counted queries of `KL(P ‖ P̂)` (nats);
- `rel_mse`: `Σ ‖Ô − O‖² / Σ ‖O‖²` over counted queries.

Quantization is the core reference (`oscar_hf.quantize`): rotate, clip, min-max quantize, dequantize,
un-rotate, so the numbers describe exactly what `OscarCache` stores (up to its block-wise demotion schedule).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from oscar_hf.calibrate.statistics import query_block_size
from oscar_hf.demotion import history_lengths, in_history
from oscar_hf.kernels.reference.attention import gqa_mix, gqa_scores
from oscar_hf.kernels.reference.quantize import fake_quantize
from oscar_hf.rotations import Rotations
from oscar_hf.rotations.math import rotate

ClipRatio = float | None
RowQuantizer = Callable[[torch.Tensor, int, ClipRatio, torch.dtype], torch.Tensor]


@dataclass
class Candidate:
    """One way to make the history: rotations (None = identity), clip ratios (one, or one per layer), quantizer."""

    rotations: Rotations | None
    key_clip: ClipRatio | Mapping[int, ClipRatio] = 0.96
    value_clip: ClipRatio | Mapping[int, ClipRatio] = 0.92
    bits: int = 2
    scale_dtype: torch.dtype = torch.float16
    quantizer: RowQuantizer = field(default=fake_quantize)
    quantize_keys: bool = True  # False keeps exact keys (to measure the value side alone)
    quantize_values: bool = True
    # Experimental (calibrate.transforms): layer -> (A, A⁻ᵀ), keys stored as Q(k A), queries use q A⁻ᵀ.
    key_transforms: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def clips(self, layer_idx: int) -> tuple[ClipRatio, ClipRatio]:
        def pick(value):
            return value.get(layer_idx) if isinstance(value, Mapping) else value

        return pick(self.key_clip), pick(self.value_clip)

    def rotations_of(self, layer_idx: int):
        if self.rotations is None:
            return None, None
        return self.rotations.for_layer(layer_idx)

    def fake_quantize(self, x: torch.Tensor, rotation, clip: ClipRatio, inverse_transpose=None) -> torch.Tensor:
        """`[B, H, L, d]` model basis -> float32 model basis, through the history's rotated, quantized form.

        `inverse_transpose` (`A⁻ᵀ`) maps back for a non-orthogonal `rotation` `A` (default: `Rᵀ = R⁻¹`).
        """
        if rotation is not None:
            rotation = rotation.to(x.device)
        back = rotation if inverse_transpose is None else inverse_transpose.to(x.device)
        rotated = rotate(x, rotation)
        return rotate(self.quantizer(rotated, self.bits, clip, self.scale_dtype), back, transpose=True)

    def quantized_keys(self, keys: torch.Tensor, layer_idx: int, clip: ClipRatio) -> torch.Tensor:
        if self.key_transforms is not None and layer_idx in self.key_transforms:
            forward, query_side = self.key_transforms[layer_idx]
            return self.fake_quantize(keys, forward, clip, query_side)
        return self.fake_quantize(keys, self.rotations_of(layer_idx)[0], clip)


@dataclass
class LayerError:
    kl_sum: float = 0.0
    error_sum: float = 0.0
    reference_sum: float = 0.0
    queries: int = 0  # counted query positions (times batch)
    heads: int = 1

    @property
    def kl(self) -> float:
        return self.kl_sum / max(1, self.queries * self.heads)

    @property
    def rel_mse(self) -> float:
        return self.error_sum / self.reference_sum if self.reference_sum > 0 else 0.0


class AttentionErrorProbe:
    """Observer for `capture.feed` that accumulates `LayerError`s per candidate and layer.

    `query_stride` > 1 measures every n-th query position only (all keys still count).
    """

    def __init__(self, candidates: Mapping[str, Candidate], layer_ids, sink: int = 64, recent: int = 256,
                 use_output_projection: bool = True, max_elements: int = 1 << 22, query_stride: int = 1,
                 demote_block: int = 1):
        self.candidates = dict(candidates)
        self.layer_ids = set(int(i) for i in layer_ids)
        self.sink, self.recent, self.demote_block = sink, recent, demote_block
        self.use_output_projection = use_output_projection
        self.max_elements = max_elements
        if query_stride < 1:
            raise ValueError(f"query_stride={query_stride}: expected >= 1")
        self.query_stride = query_stride  # measure every n-th query position (cheaper, same expectation)
        self.errors: dict[str, dict[int, LayerError]] = {name: {} for name in self.candidates}

    def summary(self) -> dict[str, dict[str, float]]:
        """Candidate -> {"kl", "rel_mse"}: means over layers of the per-layer values."""
        out = {}
        for name, layers in self.errors.items():
            values = list(layers.values())
            n = max(1, len(values))
            out[name] = {"kl": sum(e.kl for e in values) / n, "rel_mse": sum(e.rel_mse for e in values) / n}
        return out

    @torch.no_grad()
    def __call__(self, module, query, key, value, scaling, softcap=None) -> None:
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx not in self.layer_ids:
            return
        batch, q_heads, q_len, dim = query.shape
        k_len = key.shape[2]
        device = query.device
        key_positions = torch.arange(k_len, device=device)
        query_positions = key_positions[k_len - q_len :]
        seen = history_lengths(k_len, 1, self.sink, self.recent, self.demote_block).to(device)  # every token decoded
        first_query = int(torch.count_nonzero(seen == 0))
        counted_rows = (query_positions >= first_query) & ((query_positions - first_query) % self.query_stride == 0)
        if not counted_rows.any():
            return
        projection = getattr(module, "o_proj", None) if self.use_output_projection else None
        weight = projection.weight.float() if projection is not None else None

        k32, v32 = key.float(), value.float()
        quantized = {}
        for name, candidate in self.candidates.items():
            key_rotation, value_rotation = candidate.rotations_of(layer_idx)
            key_clip, value_clip = candidate.clips(layer_idx)
            quantized[name] = (
                candidate.quantized_keys(k32, layer_idx, key_clip) if candidate.quantize_keys else k32,
                candidate.fake_quantize(v32, value_rotation, value_clip) if candidate.quantize_values else v32,
            )
            self.errors[name].setdefault(layer_idx, LayerError(heads=q_heads))

        def project(out):  # [B, Hq, b, d] -> [B, b, hidden or Hq*d]
            flat = out.transpose(1, 2).reshape(batch, out.shape[2], q_heads * dim)
            return flat @ weight.T if weight is not None else flat

        block = query_block_size(batch, q_heads, k_len, self.max_elements)
        rows_all = torch.nonzero(counted_rows).flatten()
        for start in range(0, rows_all.numel(), block):
            rows = rows_all[start : start + block]
            positions = query_positions[rows]
            q = query[:, :, rows].float()
            causal = key_positions[None, :] <= positions[:, None]  # [b, Lk]
            history = in_history(key_positions[None, :], seen[positions, None], self.sink)
            scores = gqa_scores(q, k32, scaling, softcap).masked_fill(~causal, float("-inf"))
            log_p = torch.log_softmax(scores, dim=-1)
            p = log_p.exp()
            reference = project(gqa_mix(p, v32))
            reference_sq = reference.square().sum().item()
            for name, (k_hat, v_hat) in quantized.items():
                scores_hat = torch.where(history, gqa_scores(q, k_hat, scaling, softcap), scores)
                log_p_hat = torch.log_softmax(scores_hat, dim=-1)
                p_hat = log_p_hat.exp()
                out_hat = gqa_mix(p_hat * history, v_hat) + gqa_mix(p_hat * ~history, v32)
                kl = torch.where(causal, p * (log_p - log_p_hat), 0.0).sum().item()
                error = self.errors[name][layer_idx]
                error.kl_sum += kl
                error.error_sum += (project(out_hat) - reference).square().sum().item()
                error.reference_sum += reference_sq
                error.queries += batch * rows.numel()

