"""What a model's own weights say about its attention, measured on random tokens: the data-free recipe.

One forward over a random token sequence repeated twice (no text, no tokenizer; seeded, so every run of a model
gives the same answer) yields the two things the calibrated recipe takes from text:

- **key smoothing** scales per (layer, KV head, channel): `sqrt(rms(k) / rms(q))` of the post-RoPE keys and
  queries, each root mean square taken over a RoPE channel pair, normalized to a geometric mean of 1 per head
  (`ChannelPower`, the rule `oscar_hf.calibrate.smoothing` applies to calibration text). Outlier key channels
  come from the projection weights, not from the text, so random tokens find them too;
- a **ranking of layers and KV heads by induction**: over the second copy, the attention a query pays to the
  token that followed its earlier occurrence (`InductionScores`). Copying a fact out of the context is what these
  heads do (retrieval heads are induction heads), and it is what a 2-bit history loses first.

`data_free_rotations(model)` records the rankings and the smoothing on Hadamard `Rotations`, where the ranked
presets (`oscar-mixed`, `oscar-next`) find them. The result is kept on the model, so caches built on it after the
first reuse it.
"""

from __future__ import annotations

import json

import torch

from oscar_hf.attention import AttentionCall, oscar_attention
from oscar_hf.model_support import UnsupportedModelError, attention_shape, rotary_dim
from oscar_hf.rotations.rotations import RETRIEVAL_HEADS_KEY, RETRIEVAL_LAYERS_KEY, RETRIEVAL_RANKING_KEY, Rotations

# The random sequence's length (it is fed twice). The slow RoPE channels' scales need thousands of positions: scales
# from 256 tokens (512 positions) broke SmolLM2's retrieval at 4k tokens (0 of 18 needles, degenerate text), from
# 2,048 (4,096 positions) they keep it (4 of 18, as BF16) and lower perplexity (docs/retrieval.md).
PROFILE_TOKENS = 2048
PROFILE_SEED = 0
FLOOR = 1e-6  # a channel that is always zero (in keys or queries) keeps a finite scale
SMOOTHING_RULE = "sqrt(rms(k) / rms(q)) per KV head and RoPE channel pair (per channel where RoPE turns none)"


class UnobservedLayersError(UnsupportedModelError):
    """The profile's forward never called the attention of some quantized layers under their own index (their
    attention module is shared, or offsets its cache index: Zamba, HRM)."""


class ChannelPower:
    """Observer of attention calls: running sums of squares per (layer, KV head, channel) of the keys and the
    queries (a GQA group's queries pooled), and `scales()`, the key smoothing rule.

    `rotary_dim` (`model_support.rotary_dim`) ties the two channels of each RoPE pair (i, i + rotary_dim / 2) to one
    scale. RoPE turns a pair through an angle that grows with the position, so how a slow pair's energy divides
    between its channels depends on which positions were measured, while the pair's total does not: scales of
    single channels fitted on 2,048-token text broke SmolLM2 at 6k tokens (docs/retrieval.md)."""

    def __init__(self, rotary_dim: int = 0):
        self.rotary_dim = rotary_dim
        self.sums: dict[int, dict[str, torch.Tensor]] = {}
        self.counts: dict[int, dict[str, int]] = {}

    @classmethod
    def for_model(cls, model) -> ChannelPower:
        """The observer for `model`'s attention, its RoPE pairs tied."""
        return cls(rotary_dim(model.config, attention_shape(model.config).head_dim))

    def __call__(self, module, query, key, value, scaling, softcap) -> None:
        layer = module.layer_idx
        batch, q_heads, q_len, dim = query.shape
        kv_heads = key.shape[1]
        new_keys = key[:, :, -q_len:].float()  # a chunked feed's key holds the earlier chunks' tokens too
        grouped = query.float().reshape(batch, kv_heads, q_heads // kv_heads, q_len, dim)
        sums = self.sums.setdefault(layer, {"key": 0.0, "query": 0.0})
        counts = self.counts.setdefault(layer, {"key": 0, "query": 0})
        sums["key"] = sums["key"] + new_keys.pow(2).sum(dim=(0, 2)).cpu()
        sums["query"] = sums["query"] + grouped.pow(2).sum(dim=(0, 2, 3)).cpu()
        counts["key"] += batch * q_len
        counts["query"] += batch * q_len * (q_heads // kv_heads)

    def scales(self) -> dict[int, torch.Tensor]:
        """`{layer: [Hkv, d]}`: `sqrt(rms(k) / rms(q))` per channel, normalized to a geometric mean of 1 per head
        (the overall size changes nothing: keys are divided by it, queries multiplied)."""
        out = {}
        for layer, sums in self.sums.items():
            key_rms = self.paired(sums["key"] / self.counts[layer]["key"]).sqrt().clamp_min(FLOOR)
            query_rms = self.paired(sums["query"] / self.counts[layer]["query"]).sqrt().clamp_min(FLOOR)
            s = (key_rms / query_rms).sqrt()
            out[layer] = s / s.log().mean(dim=-1, keepdim=True).exp()
        return out

    def paired(self, power: torch.Tensor) -> torch.Tensor:
        """`power` `[..., d]` with each RoPE pair's two channels replaced by their mean."""
        half = self.rotary_dim // 2
        if half == 0:
            return power
        mean = (power[..., :half] + power[..., half:2 * half]) / 2
        return torch.cat([mean, mean, power[..., 2 * half:]], dim=-1)


class InductionScores:
    """Observer of one forward over a block of `period` tokens fed twice: per layer, `[Hkv]` the mean attention
    probability a query at position t of the second copy gives position t - period + 1 (the token that followed
    the same token in the first copy), over the queries of each KV head's group at about `queries` evenly spaced
    positions t (every one of a long period would cost more than the forward itself)."""

    def __init__(self, period: int, queries: int = 256):
        self.period = period
        self.queries = queries
        self.scores: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, scaling, softcap) -> None:
        batch, q_heads, q_len, dim = query.shape
        kv_heads, n = key.shape[1], self.period
        if q_len != 2 * n or key.shape[2] != 2 * n:
            raise ValueError(f"induction scores read one forward of 2 x {n} tokens, got {q_len} queries")
        rows = torch.arange(n, 2 * n - 1, max(1, (n - 1) // self.queries), device=query.device)
        future = torch.arange(2 * n, device=query.device)[None, :] > rows[:, None]
        grouped = query[:, :, rows].reshape(batch, kv_heads, -1, dim)  # [B, Hkv, G * rows, d]
        scores = []
        for head in range(kv_heads):  # one KV head's [G * rows, 2n] probabilities at a time: memory
            logits = (grouped[:, head].float() @ key[:, head].float().transpose(-1, -2)) * scaling
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            logits = logits.view(batch, q_heads // kv_heads, len(rows), 2 * n)
            probs = logits.masked_fill(future, float("-inf")).softmax(-1)
            copied = probs.gather(-1, (rows - n + 1)[:, None].expand(probs.shape[:-1] + (1,))).squeeze(-1)
            scores.append(copied.mean())
        self.scores[module.layer_idx] = torch.stack(scores).cpu()


def random_tokens(vocab_size: int, length: int, seed: int) -> torch.Tensor:
    """`[1, length]` token ids drawn uniformly from the vocabulary without its first 100 and its last tenth (where
    vocabularies tend to keep special and control tokens)."""
    generator = torch.Generator().manual_seed(seed)
    low = min(100, vocab_size // 2)
    return torch.randint(low, max(int(vocab_size * 0.9), low + 1), (1, length), generator=generator)


def profile_length(model, tokens: int = PROFILE_TOKENS) -> int:
    """The random sequence's length for `model`: `tokens`, or half the model's position range if that is shorter
    (the sequence is fed twice)."""
    config = model.config.get_text_config()
    # the position table's length under each name families give it (Whisper's decoder: max_target_positions)
    ranges = [getattr(config, name, None) for name in ("max_position_embeddings", "max_target_positions")]
    positions = min((r for r in ranges if r), default=None)
    # RoBERTa-style positions start after the padding index (2): leave them room
    return min(tokens, (positions - 2) // 2) if positions else tokens


@torch.no_grad()
def profile_model(model, tokens: int = PROFILE_TOKENS, seed: int = PROFILE_SEED, smoothing: bool = True
                  ) -> tuple[dict[int, torch.Tensor] | None, dict[int, torch.Tensor]]:
    """(key smoothing scales `{layer: [Hkv, d]}`, or None unless `smoothing`; induction scores `{layer: [Hkv]}`) of
    `model`, from one forward over `tokens` random tokens fed twice (module docstring), fewer where the model's
    position range is shorter."""
    tokens = profile_length(model, tokens)
    block = random_tokens(model.config.get_text_config().vocab_size, tokens, seed)
    ids = block.repeat(1, 2).to(model.get_input_embeddings().weight.device)
    induction = InductionScores(tokens)
    observers = [induction, ChannelPower.for_model(model)] if smoothing else [induction]
    stored = set(attention_shape(model.config).oscar_layer_ids)  # not windows, nor layers reading others' K/V

    def observe(call: AttentionCall) -> None:
        if call.layer_idx not in stored:
            return
        for observer in observers:
            observer(call.module, call.query, call.key, call.value, call.scaling, call.softcap)

    with oscar_attention(model, observe):
        model(input_ids=ids, use_cache=False)
    missing = sorted(stored - set(induction.scores))
    if missing:
        raise UnobservedLayersError(
            f"{type(model).__name__}: the data-free profile saw no attention call of layers {missing} (the model "
            "computes their attention outside transformers' attention interface); pass rotations='hadamard' with "
            "method='hadamard' for uniform rows, which need no profile")
    return (observers[1].scales() if smoothing else None), induction.scores


def data_free_rotations(model, tokens: int = PROFILE_TOKENS, seed: int = PROFILE_SEED,
                        smooth_keys: bool = True) -> Rotations:
    """Hadamard rotations for `model`'s full-attention layers with the induction rankings of `profile_model`
    (module docstring) and, unless `smooth_keys` is False, its key smoothing; kept on the model for the next
    cache."""
    kept = model.__dict__.setdefault("_oscar_data_free_rotations", {})
    if (tokens, seed, smooth_keys) in kept:
        return kept[(tokens, seed, smooth_keys)]
    shape = attention_shape(model.config)
    layers = list(shape.oscar_layer_ids)
    scales, induction = profile_model(model, tokens, seed, smoothing=smooth_keys)
    rotations = Rotations.hadamard(layers, shape.head_dim)
    if smooth_keys:
        recipe = json.dumps({"rule": SMOOTHING_RULE, "text": "random tokens, fed twice",
                             "tokens": profile_length(model, tokens), "seed": seed})
        rotations = rotations.with_key_smoothing({i: scales[i] for i in layers if i in scales}, recipe)
    record_induction_ranking(rotations, induction, layers)
    rotations.metadata["objective"] = "hadamard"
    kept[(tokens, seed, smooth_keys)] = rotations
    return rotations


def induction_ranking(induction: dict[int, torch.Tensor], layers: list[int]) -> tuple[list[int], list[tuple]]:
    """(layers, (layer, KV head) pairs), most induction first: a layer ranks by its strongest KV head."""
    scored = [(float(induction[i][h]), i, h) for i in layers if i in induction for h in range(len(induction[i]))]
    heads = [(i, h) for _, i, h in sorted(scored, key=lambda x: -x[0])]
    by_layer = sorted({i for _, i, _ in scored}, key=lambda i: -float(induction[i].max()))
    return by_layer, heads


def record_induction_ranking(rotations: Rotations, induction: dict[int, torch.Tensor], layers: list[int]) -> None:
    """Record `induction_ranking` in `rotations.metadata`, where the ranked presets read it, and say how it was
    made."""
    by_layer, heads = induction_ranking(induction, layers)
    rotations.metadata.update({RETRIEVAL_LAYERS_KEY: json.dumps([int(i) for i in by_layer]),
                               RETRIEVAL_HEADS_KEY: json.dumps([[int(i), int(h)] for i, h in heads]),
                               RETRIEVAL_RANKING_KEY: "induction on random tokens (oscar_hf.profile)"})
