"""Calibration objectives: which second moment each rotation is the eigenbasis of.

Keys (the score error `q·Δk` is what matters, so the target is the query statistics):
- `qqt`: pooled query second moment `QᵀQ` (GQA query heads pooled per KV head) — the OSCAR reference.
- `ktk`: key second moment `KᵀK` (tensor-reconstruction ablation).
- `hadamard`: no data; `R = H · P_bitrev`.

Values (the output error `S·ΔV` is what matters):
- `sst`: logit²-weighted `Σ_t (k_tᵀ Σ_Q k_t) v_t v_tᵀ / Σ_t w_t` — the reference code (bit-compatible with the public
  RotationZoo); needs a second pass over the data.
- `softmax_diag`: `Σ_t (Σ_q S_qt²) v_t v_tᵀ / Σ_t w_t`, the true causal softmax, diagonal of `SᵀS`.
- `softmax_sv`: `(SV)ᵀ(SV)`, the paper's `Vᵀ SᵀS V` written literally.
- `vtv`: value second moment `VᵀV` (ablation).
- `hadamard`: no data.
"""

from __future__ import annotations

KEY_OBJECTIVES: dict[str, str | None] = {"qqt": "query", "ktk": "key", "hadamard": None}
VALUE_OBJECTIVES: dict[str, str | None] = {
    "sst": "sst",
    "softmax_diag": "softmax_diag",
    "softmax_sv": "softmax_sv",
    "vtv": "value",
    "hadamard": None,
}


def check_objectives(key_objective: str, value_objective: str) -> None:
    if key_objective not in KEY_OBJECTIVES:
        raise ValueError(f"key objective {key_objective!r}: expected one of {sorted(KEY_OBJECTIVES)}")
    if value_objective not in VALUE_OBJECTIVES:
        raise ValueError(f"value objective {value_objective!r}: expected one of {sorted(VALUE_OBJECTIVES)}")


def passes_needed(key_objectives, value_objectives) -> tuple[frozenset[str], frozenset[str]]:
    """(moments of the first pass, moments of the second pass) for the given objectives.

    Only the reference `sst` value objective needs a second pass (its weights use the final query moment).
    """
    first, second = set(), set()
    for name in key_objectives:
        check_objectives(name, "hadamard")
        if KEY_OBJECTIVES[name]:
            first.add(KEY_OBJECTIVES[name])
    for name in value_objectives:
        check_objectives("hadamard", name)
        moment = VALUE_OBJECTIVES[name]
        if moment == "sst":
            first.add("query")
            second.add("sst")
        elif moment:
            first.add(moment)
    return frozenset(first), frozenset(second)

