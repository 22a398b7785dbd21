"""Streaming calibration statistics equal their batch formulas (computed here from dumped tensors)."""

import pytest
import torch

from oscar_hf.calibrate.capture import feed
from oscar_hf.calibrate.pipeline import collect_moments
from oscar_hf.calibrate.statistics import SecondMoment, Tiers, attention_blocks

from conftest import tiny_model


@pytest.mark.quick
def test_second_moment_streaming_equals_batch_formula():
    torch.manual_seed(0)
    x = torch.randn(3, 1000, 8, dtype=torch.float64) * torch.linspace(0.1, 5, 8)
    w = torch.rand(3, 1000, dtype=torch.float64)
    plain, weighted = SecondMoment(3, 8), SecondMoment(3, 8)
    for chunk, wchunk in zip(x.split(137, dim=1), w.split(137, dim=1)):
        plain.update(chunk.float())
        weighted.update(chunk, wchunk)
    expected_plain = x.float().double().transpose(1, 2) @ x.float().double() / 1000
    expected_weighted = (x * w[..., None]).transpose(1, 2) @ x / w.sum(1)[:, None, None]
    torch.testing.assert_close(plain.mean(), expected_plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weighted.mean(), expected_weighted, rtol=1e-12, atol=1e-12)


@pytest.mark.quick
def test_empty_moment_fails_clearly():
    with pytest.raises(ValueError, match="no samples"):
        SecondMoment(2, 4).mean()
    with pytest.raises(ValueError, match=r"expected rows of shape \[2, N, 4\]"):
        SecondMoment(2, 4).update(torch.zeros(3, 5, 4))


class Dump:
    """Observer that keeps the full-sequence q/k/v of every layer (the reference's activation dump)."""

    def __init__(self):
        self.calls = {}

    def __call__(self, module, query, key, value, scaling, softcap=None):
        self.calls.setdefault(module.layer_idx, []).append((query.double(), key.double(), value.double(), scaling))

    def full(self, layer):
        """q `[Hq, L, d]` (all positions), k, v `[Hkv, L, d]`, scaling — from the last call (keys cover everything)."""
        queries = torch.cat([q for q, _, _, _ in self.calls[layer]], dim=2)[0]
        _, k, v, s = self.calls[layer][-1]
        return queries, k[0], v[0], s


def batch_moments(q, k, v, scaling, tiers: Tiers, groups: int):
    """Every moment straight from its definition, one KV head at a time (float64)."""
    kv_heads, length, _ = k.shape
    pos = torch.arange(length)
    qmask, kmask = pos >= tiers.first_query, pos >= tiers.first_key
    pairs = tiers.pair_mask(pos, pos).double()
    out = {name: [] for name in ("query", "key", "value", "sst", "softmax_diag", "softmax_sv")}
    for h in range(kv_heads):
        qg = q[h * groups : (h + 1) * groups][:, qmask].reshape(-1, q.shape[-1])  # GQA heads pooled
        kh, vh = k[h][kmask], v[h][kmask]
        qtq = qg.T @ qg / qg.shape[0]
        out["query"].append(qtq)
        out["key"].append(kh.T @ kh / kh.shape[0])
        out["value"].append(vh.T @ vh / vh.shape[0])
        # The OSCAR reference's compute_sst: w_t = k_t^T (QᵀQ) k_t, normalised to mean 1, V^T diag(w) V / T.
        weights = (kh @ qtq * kh).sum(1)
        weights = weights / weights.sum().clamp(min=1e-12) * kh.shape[0]
        vw = vh * weights.unsqueeze(1).sqrt()
        out["sst"].append(vw.T @ vw / kh.shape[0])
        # True causal softmax S per query head, restricted to counted pairs.
        scores = q[h * groups : (h + 1) * groups] @ k[h].T * scaling
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        s = torch.softmax(scores, dim=-1) * pairs  # [g, L, L]
        mass = s.square().sum(dim=(0, 1))  # Σ_q S_qt²
        out["softmax_diag"].append((v[h] * mass[:, None]).T @ v[h] / mass.sum())
        sv = (s @ v[h])[:, qmask].reshape(-1, v.shape[-1])
        out["softmax_sv"].append(sv.T @ sv / sv.shape[0])
    return {name: torch.stack(mats) for name, mats in out.items()}


@pytest.mark.parametrize("tiers", [Tiers(), Tiers(sink=4, recent=8, skip_tokens=1)], ids=["all", "tiered"])
@pytest.mark.parametrize("chunk_tokens", [64, 1000], ids=["chunked", "whole"])
def test_streamed_moments_equal_batch_formulas(tiers, chunk_tokens):
    model = tiny_model("llama")
    sequences = [torch.randint(1, 96, (1, 150)), torch.randint(1, 96, (1, 97))]
    needs = {"query", "key", "value", "sst", "softmax_diag", "softmax_sv"}
    streamed = collect_moments(model, sequences, needs, tiers, chunk_tokens=chunk_tokens, max_elements=500)

    per_sequence = []
    for ids in sequences:
        dump = Dump()
        feed(model, [ids], chunk_tokens=1000, observer=dump)
        per_sequence.append(dump)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer in (0, 1):
        expected = _pooled([dump.full(layer) for dump in per_sequence], tiers, groups)
        for name in needs:
            torch.testing.assert_close(streamed[name][layer], expected[name], rtol=1e-6, atol=1e-9,
                                       msg=f"{name} of layer {layer}")


def _pooled(parts, tiers, groups):
    """Pool per-sequence batch formulas exactly as one stream over all sequences."""
    sums, weights = {}, {}
    q_all = torch.cat([q[:, torch.arange(q.shape[1]) >= tiers.first_query] for q, _, _, _ in parts], dim=1)
    kv_heads = parts[0][1].shape[0]
    qtq = []
    for h in range(kv_heads):
        qg = q_all[h * groups : (h + 1) * groups].reshape(-1, q_all.shape[-1])
        qtq.append(qg.T @ qg / qg.shape[0])
    qtq = torch.stack(qtq)
    for q, k, v, scaling in parts:
        length = k.shape[1]
        pos = torch.arange(length)
        qmask, kmask = pos >= tiers.first_query, pos >= tiers.first_key
        pairs = tiers.pair_mask(pos, pos).double()
        for h in range(kv_heads):
            qh = q[h * groups : (h + 1) * groups]
            kh, vh = k[h][kmask], v[h][kmask]
            scores = (qh @ k[h].T * scaling).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
            s = torch.softmax(scores, dim=-1) * pairs
            mass = s.square().sum(dim=(0, 1))
            sv = (s @ v[h])[:, qmask].reshape(-1, v.shape[-1])
            w_sst = (kh @ qtq[h] * kh).sum(1)  # the reference's logit² weights with the pooled QᵀQ
            qg = qh[:, qmask].reshape(-1, q.shape[-1])
            terms = {
                "query": (qg.T @ qg, qg.shape[0]),
                "key": (kh.T @ kh, kh.shape[0]),
                "value": (vh.T @ vh, vh.shape[0]),
                "sst": ((vh * w_sst[:, None]).T @ vh, w_sst.sum()),
                "softmax_diag": ((v[h] * mass[:, None]).T @ v[h], mass.sum()),
                "softmax_sv": (sv.T @ sv, sv.shape[0]),
            }
            for name, (numerator, denominator) in terms.items():
                sums.setdefault(name, [0] * kv_heads)[h] = sums.get(name, [0] * kv_heads)[h] + numerator
                weights.setdefault(name, [0] * kv_heads)[h] = weights.get(name, [0] * kv_heads)[h] + denominator
    return {name: torch.stack([sums[name][h] / weights[name][h] for h in range(kv_heads)]) for name in sums}


@pytest.mark.quick
def test_single_sequence_matches_reference_formulas_literally():
    """One sequence, all pairs: the streamed `sst` equals the reference's compute_sst written out literally."""
    model = tiny_model("llama", seed=3)
    ids = torch.randint(1, 96, (1, 120))
    streamed = collect_moments(model, [ids], {"query", "sst", "softmax_diag", "softmax_sv"}, Tiers(), chunk_tokens=50)
    dump = Dump()
    feed(model, [ids], chunk_tokens=1000, observer=dump)
    q, k, v, s = dump.full(1)
    expected = batch_moments(q, k, v, s, Tiers(), groups=2)
    for name in ("query", "sst", "softmax_diag", "softmax_sv"):
        torch.testing.assert_close(streamed[name][1], expected[name], rtol=1e-6, atol=1e-9, msg=name)


@pytest.mark.quick
def test_attention_blocks_bound_memory_and_match_softmax():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 40, 8), torch.randn(1, 2, 100, 8)
    pos_k = torch.arange(100)
    pos_q = pos_k[60:]
    blocks = list(attention_blocks(q, k, 0.3, pos_q, pos_k, max_elements=4 * 100 * 7))
    assert all(p.numel() <= 4 * 100 * 7 for _, p in blocks) and len(blocks) == 6
    probs = torch.cat([p for _, p in blocks], dim=3).reshape(1, 4, 40, 100)
    full = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.3
    full = full.masked_fill(pos_k[None, :] > pos_q[:, None], float("-inf"))
    torch.testing.assert_close(probs, torch.softmax(full, dim=-1))


@pytest.mark.quick
def test_tiers_count_only_quantized_pairs():
    tiers = Tiers(sink=2, recent=3)
    pos = torch.arange(10)
    mask = tiers.pair_mask(pos, pos)
    assert tiers.first_key == 2 and tiers.first_query == 6
    assert mask[6].nonzero().flatten().tolist() == [2]  # p=6 sees history keys [2, 3)
    assert mask[9].nonzero().flatten().tolist() == [2, 3, 4, 5]
    assert not mask[:6].any()
    with pytest.raises(ValueError, match="give both or neither"):
        Tiers(sink=4)
