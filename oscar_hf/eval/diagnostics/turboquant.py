"""TurboQuant-MSE, the OSCAR paper's headline peer, as a simulated (fake-quantized) KV cache: `turboquant3`.

Each key and each value vector x `[d]` (per token, per KV head) is stored as its norm in BF16 and the b-bit codes of
its direction: u = x / ||x|| is rotated by a random orthogonal matrix Π (one per layer, shared by K and V), which
makes every coordinate of √d·Πu close to a standard normal whatever x was, so one scalar codebook fits them all:
the Lloyd-Max centroids of N(0, 1) for 2**b levels. Dequantized, x̂ = ||x||_bf16 · Πᵀ(c / √d). That is
b + 16/d bits per element (3.25 at b = 3, d = 64), with no outlier handling and no layer kept in full precision.

The cache stores the dequantized vectors in the model dtype (`TurboQuantMSELayer.keys` / `.values`) instead of
packed codes: what attention reads is exact, and `TurboQuantMSELayer.nbytes` counts what packed storage would hold.
Like every cache of the side-by-side tables, a forward attends to its own tokens in full precision and to the
history as the forwards before it left it; the most recent `residual_length` tokens stay in full precision, and
tokens leaving that window are quantized once, after the forward (`oscar_hf.demotion.tokens_to_demote`, the OSCAR
caches' window rule, so a forward of 8 tokens sees what 8 decode steps would).
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from oscar_hf.demotion import tokens_to_demote

NORM_BITS = 16  # one BF16 norm per vector


@functools.cache
def _lloyd_max(bits: int) -> tuple[float, ...]:
    levels = 2 ** bits

    def pdf(t: float) -> float:
        return math.exp(-t * t / 2) / math.sqrt(2 * math.pi) if math.isfinite(t) else 0.0

    def cdf(t: float) -> float:
        return 0.5 * (1 + math.erf(t / math.sqrt(2)))

    # start from the quantiles at the middle of `levels` equal-probability cells; Lloyd iterations then alternate
    # nearest-centroid cells (midpoint thresholds) and cell means (closed form for a Gaussian) until they settle
    centroids = [math.sqrt(2) * _erfinv(2 * (i + 0.5) / levels - 1) for i in range(levels)]
    for _ in range(100_000):
        edges = [-math.inf, *((a + b) / 2 for a, b in itertools.pairwise(centroids)), math.inf]
        updated = [(pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) for a, b in itertools.pairwise(edges)]
        change = max(abs(u - c) for u, c in zip(updated, centroids))
        centroids = updated
        if change < 1e-13:
            break
    return tuple(centroids)


def _erfinv(y: float) -> float:
    return torch.special.erfinv(torch.tensor(y, dtype=torch.float64)).item()


def gaussian_lloyd_max(bits: int) -> torch.Tensor:
    """The 2**bits Lloyd-Max centroids of a standard normal, ascending, float32 `[2**bits]` (a fresh tensor)."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r}: expected an int from 1 to 8")
    return torch.tensor(_lloyd_max(bits), dtype=torch.float32)


def bits_per_element(bits: int, head_dim: int) -> float:
    """Stored bits per K/V element of a quantized token: the codes plus the BF16 norm spread over `head_dim`."""
    return bits + NORM_BITS / head_dim


def random_rotation(dim: int, seed: int, layer_idx: int) -> torch.Tensor:
    """A random orthogonal matrix Π `[dim, dim]` (float32), the same for the same (seed, layer_idx): the Q of a
    Gaussian matrix's QR, its columns' signs fixed by diag(R) so that Π is uniform (Haar), not biased by QR."""
    # distinct streams for every layer of a model with fewer than 1_000_003 layers
    generator = torch.Generator().manual_seed(seed * 1_000_003 + layer_idx)
    gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    return (q * torch.sign(torch.diagonal(r))).float()


def fake_quantize(x: torch.Tensor, rotation: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """TurboQuant-MSE quantize-dequantize of vectors `x` `[..., d]`: the result has the shape and dtype of `x`.

    `rotation` `[d, d]` and `centroids` `[levels]` (ascending, for N(0, 1)) are float32 on the device of `x`. The
    norm is rounded to BF16 as it would be stored; a zero vector comes back as zeros.
    """
    d = x.shape[-1]
    x32 = x.float()
    norm = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)
    unit = x32 / norm.clamp_min(torch.finfo(torch.float32).tiny)
    rotated = (unit @ rotation.T) * math.sqrt(d)
    codes = torch.bucketize(rotated, (centroids[1:] + centroids[:-1]) / 2)
    direction = (centroids[codes] / math.sqrt(d)) @ rotation
    return (norm.to(torch.bfloat16).float() * direction).to(x.dtype)


class TurboQuantMSELayer(DynamicLayer):
    """One layer of `TurboQuantMSECache`: `keys` / `values` `[batch, kv_heads, seq, head_dim]` (model dtype) hold
    the first `quantized_tokens` tokens quantize-dequantized and the rest, the recent window, as given."""

    def __init__(self, layer_idx: int, bits: int = 3, residual_length: int = 128, demote_block: int = 8,
                 seed: int = 0):
        super().__init__()
        self.layer_idx, self.bits, self.seed = layer_idx, bits, seed
        self.residual_length, self.demote_block = residual_length, demote_block
        self.quantized_tokens = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        # the same Π for K and V (one per layer); a value width unlike the keys' gets its own
        self.key_rotation = random_rotation(key_states.shape[-1], self.seed, self.layer_idx).to(self.device)
        value_dim = value_states.shape[-1]
        self.value_rotation = (self.key_rotation if value_dim == key_states.shape[-1]
                               else random_rotation(value_dim, self.seed, self.layer_idx).to(self.device))
        self.centroids = gaussian_lloyd_max(self.bits).to(self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `[batch, kv_heads, n, head_dim]` and return the K/V this forward attends to: the stored history
        and its own n tokens in full precision. Tokens then leaving the recent window are stored quantized."""
        keys, values = super().update(key_states, value_states)
        demote = tokens_to_demote(keys.shape[-2] - self.quantized_tokens, key_states.shape[-2],
                                  self.residual_length, self.demote_block)
        if demote:
            start, stop = self.quantized_tokens, self.quantized_tokens + demote
            self.keys = self._demoted(keys, start, stop, self.key_rotation)
            self.values = self._demoted(values, start, stop, self.value_rotation)
            self.quantized_tokens = stop
        return keys, values

    def _demoted(self, states: torch.Tensor, start: int, stop: int, rotation: torch.Tensor) -> torch.Tensor:
        # a new tensor: `states` is what this forward attends to, with these tokens still in full precision
        quantized = fake_quantize(states[..., start:stop, :], rotation, self.centroids)
        return torch.cat([states[..., :start, :], quantized, states[..., stop:, :]], dim=-2)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.quantized_tokens = min(self.quantized_tokens, self.get_seq_length())

    def reset(self) -> None:
        super().reset()
        self.quantized_tokens = 0

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes this layer would hold packed: `bits` per element and a BF16 norm per vector for the quantized
        tokens, the recent window at `dtype` (default: the stored dtype)."""
        length = self.get_seq_length()
        if not length:
            return 0
        batch, heads, _, key_dim = self.keys.shape
        vectors = batch * heads
        value_dim = self.values.shape[-1]
        code_bits = vectors * self.quantized_tokens * (self.bits * (key_dim + value_dim) + 2 * NORM_BITS)
        element_size = torch.empty((), dtype=dtype or self.keys.dtype).element_size()
        recent = vectors * (length - self.quantized_tokens) * (key_dim + value_dim) * element_size
        return math.ceil(code_bits / 8) + recent


class TurboQuantMSECache(DynamicCache):
    """TurboQuant-MSE at `bits` bits for every layer's K and V (module docstring), full precision for the
    `residual_length` most recent tokens, each layer with its own random rotation drawn from `seed`.

    Args:
        model: a transformers causal LM or its config; every attention layer must be full attention.
        bits: code bits per element (1 to 8).
        residual_length: most recent tokens kept in full precision.
        demote_block: after a single-token forward, tokens leave the recent window in blocks of this many
            (`oscar_hf.demotion.tokens_to_demote`); a multi-token forward leaves exactly `residual_length`.
        seed: seed of the per-layer rotations.
    """

    def __init__(self, model, bits: int = 3, residual_length: int = 128, demote_block: int = 8, seed: int = 0):
        gaussian_lloyd_max(bits)  # validates `bits`
        for name, value, low in (("residual_length", residual_length, 0), ("demote_block", demote_block, 1),
                                 ("seed", seed, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r}: expected an int >= {low}")
        super().__init__(config=getattr(model, "config", model))
        # DynamicCache reads the layer types from the config; only plain full-attention layers are quantized here
        others = {i: type(layer).__name__ for i, layer in enumerate(self.layers) if type(layer) is not DynamicLayer}
        if not self.layers or others:
            raise ValueError(f"TurboQuantMSECache quantizes full-attention layers only; this model's config gives "
                             f"{others or 'no layers'}")
        self.layers = [TurboQuantMSELayer(i, bits, residual_length, demote_block, seed)
                       for i in range(len(self.layers))]
