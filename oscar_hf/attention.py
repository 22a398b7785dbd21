"""The "oscar" attention implementation registered with transformers, the only one this package registers.

With an `OscarCache` the key/value it receives are the BF16 tiers (sink + recent + this forward's tokens), and a
`HistorySegment` (`handoff.py`) describes the quantized history between them. The segment's backend attends to the
BF16 tiers and to the history separately, each giving (output, log-sum-exp), and merges them exactly in float32;
the whole history is never materialized as a dense tensor (on a GPU a decode step unpacks it inside the kernel;
a chunk of queries, and the PyTorch reference, dequantize a bounded piece at a time). Without a segment (any other
cache, or no history yet) it is transformers' SDPA path (with a softcap, the reference attention).

Hooks: code that needs to see or replace the attention of a forward without a cache of its own (the data-free
profile, the calibration statistics, the diagnostics' capture, the decode-equivalent evaluation) runs the forward
inside `oscar_attention(model, hook)`. Every attention call then gives `hook(AttentionCall)`, an OscarCache's
counted decode steps included; a hook that returns a tensor `[B, Lq, Hq, D]` replaces the call's output, one that
returns None lets the call run as usual. The hook is set on the model's modules for the block, so it reaches the
attention of models whose decoder layers pass their attention no keyword arguments (StableLM, Falcon).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

from oscar_hf.handoff import HistorySegment, UpdateRequest, forget_reader_segments, layer_of, take_segment
from oscar_hf.kernels.reference.attention import add_sinks, causal_mask, dense_partial
from oscar_hf.model_support import UnsupportedModelError, text_config_of

OSCAR_ATTENTION = "oscar"
SINKS_ARGUMENT = "s_aux"  # transformers' name for learned sink logits `[Hq]` (gpt-oss)
HOOK_ATTRIBUTE = "_oscar_hook"  # set on every module of a model inside `oscar_attention(model, hook)`


@dataclass(frozen=True)
class AttentionCall:
    """One attention call, as a hook sees it: `query` `[B, Hq, Lq, D]`, `key`/`value` `[B, Hkv, Lk, D]` (post-RoPE,
    what the cache stores), the mask transformers built (`[B or 1, 1, Lq, Lk]`, or None: bottom-right causal, see
    `oscar_mask`), the softmax scaling and softcap, and the cache's segment (None without an `OscarCache`)."""

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float
    softcap: float | None
    segment: HistorySegment | None

    @property
    def layer_idx(self) -> int | None:
        return getattr(self.module, "layer_idx", None)


AttentionHook = Callable[[AttentionCall], "torch.Tensor | None"]


def oscar_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface entry: `query` `[B, Hq, Lq, D]`, `key`/`value` `[B, Hkv, Lk, D]` ->
    (`[B, Lq, Hq, D]`, None).

    A counted decode step (`counted_decode`) is one custom op (`kernels.ops`), which `torch.compile` keeps whole;
    under `torch.compile`, any other forward's update and attention are one opaque op (`update_and_attend`), so a
    `fullgraph=True` compile of the whole forward holds prefills too; everything else runs eagerly."""
    segment = take_segment(key, kwargs, getattr(module, "layer_idx", None))
    sinks = kwargs.pop(SINKS_ARGUMENT, None)
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    if isinstance(segment, UpdateRequest):
        return _request_update_and_attention(module, query, key, value, attention_mask, dropout, scaling, segment,
                                             sinks, kwargs), None
    if segment is not None and segment.counted and query.shape[2] == 1:
        # a hook sees the whole BF16 buffer as key/value (`HistorySegment`, counted)
        out = _hook_output(module, query, key, value, attention_mask, scaling, segment, kwargs)
        if out is None:
            out = segment.backend.decode_attention(segment.decode_call(query, key, value, scaling,
                                                                       kwargs.get("softcap"), sinks))
        segment.close(output=out)  # the demotion's history write follows this read of the history
        return out, None
    if segment is None and getattr(module, HOOK_ATTRIBUTE, None) is None:  # another cache, or none: traceable
        return _attend(module, query, key, value, attention_mask, dropout, scaling, kwargs.get("softcap"), None,
                       sinks, kwargs), None
    return _eager_attention_forward(module, query, key, value, attention_mask, dropout, scaling, segment, sinks,
                                    kwargs)


# attention kwargs an opaque update-and-attend call may leave out: positions are in the states already, the rest
# does not change what an OSCAR layer computes
_POSITIONAL_KWARGS = frozenset({"position_ids", "cache_position", "output_attentions", "use_cache", "sliding_window",
                                "softcap", "is_causal"})


def _request_update_and_attention(module, query, key, value, attention_mask, dropout, scaling, request, sinks,
                                  kwargs):
    unknown = sorted(name for name, v in kwargs.items() if v is not None and name not in _POSITIONAL_KWARGS)
    if unknown:
        raise ValueError(f"layer {request.layer_idx}: a compiled OSCAR prefill does not take the attention "
                         f"arguments {unknown}; run the prefill eagerly (compile the decode step only)")
    is_causal = kwargs.get("is_causal")
    return torch.ops.oscar_hf.update_and_attend(
        query, key, value, attention_mask, request.handle, float(dropout), float(scaling), kwargs.get("softcap"),
        bool(getattr(module, "is_causal", True) if is_causal is None else is_causal),
        int(getattr(module, "num_key_value_groups", 1)), sinks)


_CUDAGRAPH_UNSAFE = tuple(tag for tag in (getattr(torch.Tag, "cudagraph_unsafe", None),) if tag is not None)


@dataclass(frozen=True)
class _ModuleView:
    """What the eager attention reads of the attention module, for a call made where the module is not at hand."""

    layer_idx: int
    is_causal: bool
    num_key_value_groups: int


@torch.library.custom_op("oscar_hf::update_and_attend", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def update_and_attend(query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                      attention_mask: torch.Tensor | None, handle: torch.Tensor, dropout: float, scaling: float,
                      softcap: float | None, is_causal: bool, kv_groups: int,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's update with `key_states`/`value_states` and its eager attention (and close), as the eager forward
    runs them; `[B, Lq, Hq, D]`. It changes the layer's storage, which no other op of a graph reads: the op's output
    alone orders it. Not capturable in a CUDA graph (host-side lengths, growing buffers)."""
    layer = layer_of(handle)
    keys, values = layer.update(key_states, value_states)
    segment = layer.open_segment()
    module = _ModuleView(layer.layer_idx, is_causal, kv_groups)
    out, _ = _eager_attention_forward(module, query, keys, values, attention_mask, dropout, scaling, segment, sinks,
                                      {} if softcap is None else {"softcap": softcap})
    return out.contiguous()


@update_and_attend.register_fake
def _(query, key_states, value_states, attention_mask, handle, dropout, scaling, softcap, is_causal, kv_groups,
      sinks=None):
    batch, heads, q_len, _ = query.shape
    return query.new_empty((batch, q_len, heads, value_states.shape[-1]))


@torch.compiler.disable
def _eager_attention_forward(module, query, key, value, attention_mask, dropout, scaling, segment, sinks, kwargs):
    out = _hook_output(module, query, key, value, attention_mask, scaling, segment, kwargs)
    if out is None:
        out = _attend(module, query, key, value, attention_mask, dropout, scaling, kwargs.get("softcap"), segment,
                      sinks, kwargs)
    if segment is not None:
        segment.close(attention_mask, query=query)
    return out, None


def _hook_output(module, query, key, value, attention_mask, scaling, segment, kwargs) -> torch.Tensor | None:
    """What the hook of the enclosing `oscar_attention(model, hook)` returns for this call: its replacement output,
    or None (no hook, or one that lets the call run)."""
    hook = getattr(module, HOOK_ATTRIBUTE, None)
    if hook is None:
        return None
    return hook(AttentionCall(module, query, key, value, attention_mask, scaling, kwargs.get("softcap"), segment))


def _attend(module, query, key, value, attention_mask, dropout, scaling, softcap, segment, sinks,
            kwargs) -> torch.Tensor:
    if segment is not None:
        attention_mask = segment.tier_mask(attention_mask)
    if segment is None or (segment.history_length == 0 and softcap is None and sinks is None):
        q_len, kv_len = query.shape[2], key.shape[2]
        if attention_mask is None and 1 < q_len < kv_len:  # `oscar_mask`'s None; SDPA's is_causal is top-left
            attention_mask = causal_mask(q_len, kv_len, query.device)
        if softcap is None and sinks is None:
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                            scaling=scaling, **kwargs)
            return out
        return _reference_dense(query, key, value, attention_mask, scaling, softcap, sinks)
    if not segment.serves(getattr(module, "layer_idx", segment.layer_idx)):
        raise RuntimeError(f"OSCAR segment of layer {segment.layer_idx} reached layer {module.layer_idx}")
    return segment.backend.tiered_attention(query, key, value, attention_mask, segment.history, segment.sink_length,
                                            segment.query_rotation, segment.value_rotation, scaling, softcap,
                                            sinks=sinks)


def _reference_dense(query, key, value, attention_mask, scaling, softcap, sinks):
    """The dense attention SDPA does not compute: a softcap (Gemma 2) or learned sink logits (gpt-oss)."""
    q_len = query.shape[2]
    if attention_mask is None and q_len > 1:
        attention_mask = causal_mask(q_len, key.shape[2], query.device)
    out, lse = dense_partial(query, key, value, attention_mask, scaling, softcap)
    if sinks is not None:
        out = add_sinks(out, lse, sinks)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def oscar_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
               mask_function: Callable = causal_mask_function, attention_mask: torch.Tensor | None = None,
               local_size: int | None = None, allow_is_causal_skip: bool = True, **kwargs) -> torch.Tensor | None:
    """The "oscar" attention's mask: transformers' `sdpa_mask`, except that None also stands for a forward of
    several queries that are the last `q_length` of `kv_length` unpadded, causally attended positions (a chunk of a
    chunked prefill), where `sdpa_mask` builds a `[B, 1, q, kv]` tensor: 3.3 GB for an 8k chunk over 100k tokens at
    batch 4, built for every forward. The attention reads None as the bottom-right causal mask, and its kernels
    skip the key tiles above the diagonal instead of reading the mask."""
    if allow_is_causal_skip and _unpadded_causal_chunk(q_length, kv_length, q_offset, kv_offset, mask_function,
                                                       attention_mask, local_size):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def _unpadded_causal_chunk(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                           local_size) -> bool:
    if not 1 < q_length < kv_length or mask_function is not causal_mask_function or local_size is not None:
        return False
    if kv_offset != 0 or torch.compiler.is_compiling():  # a traced graph must not bake in the mask's values
        return False
    if int(q_offset) + q_length != kv_length:
        return False
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    return padding is None or bool(padding.all())


def register() -> None:
    """Register "oscar" with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(OSCAR_ATTENTION, oscar_attention_forward)
    AttentionMaskInterface.register(OSCAR_ATTENTION, oscar_mask)


def switch_to_oscar_attention(model) -> str | None:
    """Register "oscar" and switch `model` to it; returns the implementation it had. Raises
    `UnsupportedModelError` when the model does not take attention implementations from transformers'
    AttentionInterface (its attention could not see the cache's history)."""
    register()
    config = text_config_of(model.config)
    previous = getattr(config, "_attn_implementation", None)
    model.set_attn_implementation(OSCAR_ATTENTION)
    if getattr(config, "_attn_implementation", None) != OSCAR_ATTENTION:
        if previous is not None:
            model.set_attn_implementation(previous)
        raise UnsupportedModelError(
            f"{type(model).__name__} did not accept the 'oscar' attention implementation: it does not use "
            "transformers' AttentionInterface"
        )
    return previous


def takes_oscar_attention(model) -> bool:
    """Whether `model`'s layers take their attention from transformers' AttentionInterface, so that the "oscar"
    attention would run in them; the model's implementation is left as it was."""
    try:
        previous = switch_to_oscar_attention(model)
    except UnsupportedModelError:
        return False
    if previous is not None and previous != OSCAR_ATTENTION:
        model.set_attn_implementation(previous)
    return True


@contextlib.contextmanager
def oscar_attention(model, hook: AttentionHook | None = None) -> Iterator[None]:
    """Within the block `model` runs the "oscar" attention, every call of it seen by `hook` (module docstring);
    both restored afterwards."""
    previous = switch_to_oscar_attention(model)
    forget_reader_segments()
    modules = list(model.modules()) if hook is not None else []
    for module in modules:  # the attention function is handed its module, whichever arguments the layers pass
        setattr(module, HOOK_ATTRIBUTE, hook)
    try:
        yield
    finally:
        for module in modules:
            delattr(module, HOOK_ATTRIBUTE)
        if previous is not None and previous != OSCAR_ATTENTION:
            model.set_attn_implementation(previous)
