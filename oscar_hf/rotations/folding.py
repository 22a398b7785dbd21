"""Folding the value rotation into the model's weights, so V needs no rotation at runtime.

For KV head h with value rotation R_h (`[d, d]`, or shared by all heads):
    v_proj rows of head h:      W_v[h] <- R_hᵀ · W_v[h],   b_v[h] <- b_v[h] · R_h      (v' = v · R_h)
    o_proj columns of query head j (KV head h = j // groups):  W_o[:, j] <- W_o[:, j] · R_h
so the model's own V is already rotated (every tier holds `v · R`) and o_proj undoes it; the model's output is
unchanged up to rounding the rotated weights to the model dtype. The cache then applies no value rotation.
"""

from __future__ import annotations

import torch

from oscar_hf.rotations.rotations import Rotations

FOLDED_ATTRIBUTE = "_oscar_folded_value_rotation"


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """Attention modules by layer index (those with `layer_idx`, `v_proj` and `o_proj`)."""
    found = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "v_proj") and hasattr(module, "o_proj"):
            found[module.layer_idx] = module
    return found


@torch.no_grad()
def fold_value_rotations(model, rotations: Rotations, layer_ids: list[int], num_kv_heads: int, head_dim: int) -> None:
    """Fold `rotations.value[i]` into layer i's v_proj/o_proj, in place (once per model)."""
    modules = attention_modules(model)
    missing = [i for i in layer_ids if i not in modules]
    if missing:
        raise ValueError(f"cannot fold value rotations: no attention module with v_proj/o_proj for layers {missing}")
    for i in layer_ids:
        module = modules[i]
        rotation = rotations.value[i]
        previous = getattr(module, FOLDED_ATTRIBUTE, None)
        if previous is not None:
            if previous.shape == rotation.shape and torch.equal(previous, rotation.to(previous.device)):
                continue
            raise ValueError(
                f"layer {i} already has a different value rotation folded into its weights; reload the model"
            )
        per_head = rotation.expand(num_kv_heads, head_dim, head_dim) if rotation.dim() == 2 else rotation
        _fold_v_proj(module.v_proj, per_head)
        groups = module.o_proj.weight.shape[1] // (num_kv_heads * head_dim)
        _fold_o_proj(module.o_proj, per_head.repeat_interleave(groups, dim=0))
        setattr(module, FOLDED_ATTRIBUTE, rotation.detach().clone())


def folded_value_rotation(model, layer_idx: int) -> torch.Tensor | None:
    """The value rotation folded into a layer's weights, if any."""
    module = attention_modules(model).get(layer_idx)
    return getattr(module, FOLDED_ATTRIBUTE, None) if module is not None else None


def _fold_v_proj(linear: torch.nn.Linear, per_head: torch.Tensor) -> None:
    heads, d, _ = per_head.shape
    r = per_head.to(linear.weight.device, torch.float32)
    weight = linear.weight.float().view(heads, d, -1)
    linear.weight.copy_(torch.einsum("hde,hdi->hei", r, weight).reshape(heads * d, -1))
    if linear.bias is not None:
        bias = linear.bias.float().view(heads, 1, d)
        linear.bias.copy_((bias @ r).reshape(-1))


def _fold_o_proj(linear: torch.nn.Linear, per_query_head: torch.Tensor) -> None:
    heads, d, _ = per_query_head.shape
    r = per_query_head.to(linear.weight.device, torch.float32)
    weight = linear.weight.float().view(linear.weight.shape[0], heads, d)
    linear.weight.copy_(torch.einsum("ohd,hde->ohe", weight, r).reshape(linear.weight.shape[0], -1))
