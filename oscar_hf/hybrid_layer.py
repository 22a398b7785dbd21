"""`OscarHybridLayer`: a decoder layer's cache that holds a linear-attention (or SSM / convolution) state beside
its full attention, and `oscar_layer_for`, the OSCAR layer that takes the place of one of transformers' own."""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from oscar_hf.kernels.interface import Backend
from oscar_hf.layer import OscarLayer


class OscarHybridLayer(LinearAttentionLayer, OscarLayer):
    """A decoder layer that holds a linear-attention (or SSM / convolution) state beside its full attention
    (transformers' "hybrid" layer type, e.g. Falcon-H1, Zamba2): transformers' state as it keeps it, the full
    attention's K/V as `OscarLayer` does."""

    def __init__(self, *args, number_of_states: int = 1, **kwargs):
        OscarLayer.__init__(self, *args, **kwargs)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # the K/V path calls it with the two states, the recurrent path with keywords only (as transformers' own
        # hybrid layer tells them apart)
        if args:
            OscarLayer.lazy_initialization(self, *args, **kwargs)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        OscarLayer.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        OscarLayer.reorder_cache(self, beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        LinearAttentionLayer.batch_select_indices(self, indices)
        OscarLayer.batch_select_indices(self, indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        LinearAttentionLayer.batch_repeat_interleave(self, repeats)
        OscarLayer.batch_repeat_interleave(self, repeats)

    def crop_problem(self, tokens_to_remove: int) -> str | None:
        return OscarLayer.crop_problem(self, tokens_to_remove)

    def crop(self, tokens_to_remove: int) -> None:
        LinearAttentionLayer.crop(self, tokens_to_remove)
        OscarLayer.crop(self, tokens_to_remove)

    def get_seq_length(self) -> int:
        return OscarLayer.get_seq_length(self)

    def get_max_length(self) -> int:
        return OscarLayer.get_max_length(self)

    def offload(self) -> None:
        OscarLayer.offload(self)

    def prefetch(self) -> None:
        OscarLayer.prefetch(self)

    def __repr__(self) -> str:
        return OscarLayer.__repr__(self)


def oscar_layer_for(replaced, layer_idx: int, plan, backend: Backend | None, max_cache_len: int | None) -> OscarLayer:
    """The OSCAR layer that takes the place of transformers' cache layer `replaced` (a full-attention layer, alone
    or beside a linear-attention state) for layer `layer_idx` of a `plan.LayerPlan`."""
    options = dict(max_cache_len=max_cache_len, query_rotation=plan.query_rotation, readers=plan.readers)
    args = (layer_idx, plan.config, plan.key_rotation, plan.value_rotation, backend)
    if isinstance(replaced, LinearAttentionCacheLayerMixin):
        return OscarHybridLayer(*args, number_of_states=replaced.number_of_states, **options)
    return OscarLayer(*args, **options)
