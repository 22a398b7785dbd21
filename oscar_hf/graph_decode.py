"""Greedy decoding with the decode step replayed from CUDA graphs.

Once an `OscarCache` is at the start of a demotion cycle (history present, exactly `recent_tokens` recent
tokens), its decode steps repeat with period b = `demote_block`: step p of a cycle writes the new token at the
same BF16 position, and the b-th step demotes the same b buffer rows into the history. Only the history length
changes from cycle to cycle, and a pinned history keeps it on the device, where the kernels and the demotion read
it. So each of the b phases is captured once as a CUDA graph (model forward, greedy argmax, bookkeeping on static
buffers), and a step costs one graph launch instead of the forward's Python and its ~50 kernel launches per layer.

```python
cache = OscarCache(model, rotations="hadamard")
tokens = graphed_generate(model, input_ids, cache, max_new_tokens=256)   # [B, prompt + new]
# or through generate (greedy, no logits processors):
tokens = model.generate(input_ids, past_key_values=cache, custom_generate=generate_with_graphs, max_new_tokens=256)
```

Steps before the first cycle start (short prompts) and the warm-up cycle run eagerly through the same step
function; on CPU, or with `use_graphs=False`, every step does, with the same pinned histories (the tests compare
that path with `model.generate`). The host-side counters of the cache are fast-forwarded after the replays and
checked against the device's history lengths.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from oscar_hf.cache import OscarCache
from oscar_hf.compat import cache_argument_name
from oscar_hf.layer import OscarLayer
from oscar_hf.parallel import tensor_parallel_position

_EOS_CHECK_EVERY = 32  # replays between host checks for "every row has finished" (each check synchronizes)


class GraphDecodeError(ValueError):
    """The model, cache or inputs cannot be decoded with captured graphs."""


def graphed_generate(model, input_ids: torch.LongTensor, cache, max_new_tokens: int,
                     eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                     attention_mask: torch.Tensor | None = None, use_graphs: bool | None = None,
                     stats: dict | None = None) -> torch.LongTensor:
    """Greedy decoding of `input_ids` `[B, L]` through `cache`, an `OscarCache` of `model`.

    `attention_mask` `[B, L]` (1 = token, 0 = padding) may pad rows on the left only; decode steps then skip each
    row's pad columns by count (the kernels take a per-row start), so the graphs need no mask.

    As with `generate`, a cache that already holds the first c < L tokens continues from there (only
    `input_ids[:, c:]` is run). Returns `[B, L + n]` token ids, n <= `max_new_tokens` (fewer when every row has
    produced an `eos_token_id`; after its EOS a row holds `pad_token_id`, default the first EOS id, as `generate`
    does). `use_graphs`: capture the decode step in CUDA graphs (default: on CUDA devices). `stats`: a dict to
    receive `eager_steps`, `graph_steps` and `graph_seconds` (the replays' wall time, synchronized).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise GraphDecodeError(f"input_ids must be [batch, length >= 1], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise GraphDecodeError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    layers = _oscar_layers(cache, input_ids)
    use_graphs = input_ids.device.type == "cuda" if use_graphs is None else use_graphs
    if use_graphs and input_ids.device.type != "cuda":
        raise GraphDecodeError("CUDA graphs need the model and input_ids on a CUDA device; pass use_graphs=False")
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    padding = _left_padding(attention_mask, input_ids)
    for layer in layers:
        layer.set_mask_free_decode(True, padding)  # a decode step attends to every cached token but the row's pads
    try:
        with torch.no_grad():
            decoder = _StepDecoder(model, cache, layers, input_ids, max_new_tokens, attention_mask)
            decoder.prefill(input_ids, cache.get_seq_length())
            decoder.run_eagerly(eos, until_cycle_start=True)
            if decoder.remaining:
                decoder.pin()  # also without graphs: one code path for the histories, tested on CPU
            if use_graphs and decoder.remaining >= 2 * decoder.period:
                _check_capturable(model, layers, input_ids.device)
                decoder.run_graphs(eos)
            decoder.run_eagerly(eos, until_cycle_start=False)
            new = decoder.generated[:, : decoder.produced]
    finally:
        for layer in layers:
            layer.set_mask_free_decode(False)
    if stats is not None:
        stats.update(graph_steps=decoder.replays, graph_seconds=decoder.replay_seconds,
                     eager_steps=decoder.produced - 1 - decoder.replays)
    return torch.cat([input_ids, _pad_after_eos(new, eos, pad_token_id)], dim=1)


class _StepDecoder:
    """Static input buffers and the one step function that eager runs and graph captures share."""

    def __init__(self, model, cache, layers: list[OscarLayer], input_ids: torch.LongTensor, max_new_tokens: int,
                 attention_mask: torch.Tensor | None = None):
        batch, prompt = input_ids.shape
        device = input_ids.device
        self.model, self.cache, self.layers = model, cache, layers
        self.cache_kwarg = cache_argument_name(model)
        self.period = layers[0].config.demote_block
        self.max_new_tokens = max_new_tokens
        self.attention_mask = attention_mask
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=device)
        if attention_mask is None:
            self.prompt_positions = torch.arange(prompt, device=device)[None]
        else:  # as generate: a row's positions count its tokens, pads excluded
            self.prompt_positions = (attention_mask.long().cumsum(dim=-1) - 1).clamp_min(0)
        self.position = self.prompt_positions[:, -1:].expand(batch, 1) + 1  # static: steps add to it in place
        self.generated = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # column of `generated` the next step fills
        self.produced = 0
        self.finished = False
        self.replays, self.replay_seconds = 0, 0.0

    @property
    def remaining(self) -> int:
        return 0 if self.finished else self.max_new_tokens - self.produced

    def _count(self, eos: list[int]) -> None:
        """Book one produced token; every `_EOS_CHECK_EVERY` tokens, stop once every row has emitted an EOS."""
        self.produced += 1
        if eos and self.produced % _EOS_CHECK_EVERY == 0:
            self.finished = bool(_is_eos(self.generated[:, : self.produced], eos).any(dim=1).all())

    def _forward(self, **inputs) -> torch.Tensor:
        out = self.model(**inputs, **{self.cache_kwarg: self.cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(dim=-1)

    def prefill(self, input_ids: torch.LongTensor, cached: int) -> None:
        inputs = dict(input_ids=input_ids[:, cached:], position_ids=self.prompt_positions[:, cached:])
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        chosen = self._forward(**inputs)
        self.token.copy_(chosen[:, None])
        self.generated[:, 0] = chosen
        self.slot.fill_(1)
        self.produced = 1

    def step(self) -> None:
        """One decode step on the static buffers (also what each graph records)."""
        chosen = self._forward(input_ids=self.token, position_ids=self.position)
        self.token.copy_(chosen[:, None])
        self.position.add_(1)
        self.generated.index_copy_(1, self.slot, chosen[:, None])
        self.slot.add_(1)

    def run_eagerly(self, eos: list[int], until_cycle_start: bool) -> None:
        while self.remaining and not (until_cycle_start and all(layer.at_cycle_start() for layer in self.layers)):
            self.step()
            self._count(eos)

    def pin(self) -> None:
        for layer in self.layers:
            layer.history.pin(layer.history_length + self.remaining + self.period)

    def run_graphs(self, eos: list[int]) -> None:
        """Warm up one cycle on a side stream, capture the `period` phases, replay them until done."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.period):  # compiles the pinned-history kernels; ends at a cycle start again
                self.step()
                self._count([])
        torch.cuda.current_stream().wait_stream(side)

        start = [layer.host_state() for layer in self.layers]
        graphs, after = [], []
        pool = torch.cuda.graph_pool_handle()
        try:
            for _ in range(self.period):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.step()
                graphs.append(graph)
                after.append([layer.host_state() for layer in self.layers])
        finally:
            for layer, state in zip(self.layers, start):  # capturing ran no kernel: back to the real state
                layer.restore_host_state(state)

        torch.cuda.synchronize()
        began = time.perf_counter()
        replays = 0
        while self.remaining:
            graphs[replays % self.period].replay()
            replays += 1
            self._count(eos)
        torch.cuda.synchronize()
        self.replays, self.replay_seconds = replays, time.perf_counter() - began
        if replays:
            cycles, phase = divmod(replays - 1, self.period)
            for layer, state in zip(self.layers, after[phase]):
                layer.restore_host_state(state, advance=cycles * self.period)
        self._check_lengths()

    def _check_lengths(self) -> None:
        on_device = torch.cat([layer.history.device_length for layer in self.layers]).tolist()
        on_host = [layer.history_length for layer in self.layers]
        if on_device != on_host:
            raise RuntimeError(f"graph replay lost track of the history lengths: device {on_device}, host {on_host}")


def generate_with_graphs(model, input_ids: torch.LongTensor, logits_processor=None, stopping_criteria=None,
                         generation_config=None, synced_gpus: bool = False, streamer=None, **model_kwargs):
    """`model.generate(..., custom_generate=generate_with_graphs)`: `generate`'s greedy search through
    `graphed_generate`, with the cache passed to `generate` (an `OscarCache`).

    What it cannot replay is refused, not ignored: sampling or beams, logits processors (`repetition_penalty`,
    `min_new_tokens`, ...), stopping criteria other than the length and EOS, streamers, dict outputs, right padding.
    """
    config = generation_config
    refused = []
    if config.do_sample or config.num_beams > 1:
        refused.append("sampling or beam search (pass do_sample=False, num_beams=1)")
    if logits_processor:
        refused.append("logits processors " + ", ".join(type(p).__name__ for p in logits_processor))
    stops = [c for c in (stopping_criteria or []) if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    if stops:
        refused.append("stopping criteria " + ", ".join(type(c).__name__ for c in stops))
    if streamer is not None or synced_gpus:
        refused.append("streamers and synced GPUs")
    if config.return_dict_in_generate:
        refused.append("return_dict_in_generate")
    if refused:
        raise GraphDecodeError("generate_with_graphs does not support " + "; ".join(refused))
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    eos = config._eos_token_tensor
    pad = config._pad_token_tensor
    return graphed_generate(model, input_ids, cache, config.max_length - input_ids.shape[1],
                            eos_token_id=None if eos is None else eos.flatten().tolist(),
                            pad_token_id=None if pad is None else int(pad),
                            attention_mask=model_kwargs.get("attention_mask"))


def _left_padding(attention_mask: torch.Tensor | None, input_ids: torch.LongTensor) -> torch.Tensor | None:
    """Pad columns per row (int32 `[B]`) of a left-padded mask; None without padding."""
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise GraphDecodeError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                               f"{tuple(input_ids.shape)}")
    real = attention_mask.to(torch.bool)
    pads = (~real).sum(dim=-1)
    left_padded = real == (torch.arange(real.shape[1], device=real.device)[None, :] >= pads[:, None])
    if not bool(left_padded.all()):
        raise GraphDecodeError("attention_mask must pad on the left only (zeros, then ones, in every row)")
    if not bool(real[:, -1].all()):
        raise GraphDecodeError("a row of attention_mask has no tokens")
    return pads.to(torch.int32) if bool(pads.any()) else None


def _oscar_layers(cache, input_ids: torch.LongTensor) -> list[OscarLayer]:
    if not isinstance(cache, OscarCache):
        raise GraphDecodeError(f"graph decode needs an OscarCache, got {type(cache).__name__}: pass "
                               "past_key_values=OscarCache(model) (cache= on transformers >= 5.24)")
    layers = list(cache.layers)
    if not layers or not all(isinstance(layer, OscarLayer) for layer in layers):
        raise GraphDecodeError(
            "graphed_generate needs an OscarCache whose layers are all full-attention OSCAR layers (sliding-window "
            "layers re-concatenate their keys every step); use model.generate for this model"
        )
    if not getattr(cache, "uses_oscar_attention", False):
        raise GraphDecodeError("the model's attention is not 'oscar': build the OscarCache from the model itself")
    cached = cache.get_seq_length()
    if cached >= input_ids.shape[1]:
        raise GraphDecodeError(f"the cache already holds {cached} tokens, input_ids only {input_ids.shape[1]}: "
                               "pass the whole sequence (cached tokens included), as to generate")
    if cached and layers[0].batch_size != input_ids.shape[0]:
        raise GraphDecodeError(f"the cache holds a batch of {layers[0].batch_size}, input_ids has "
                               f"{input_ids.shape[0]} rows")
    return layers


def _check_capturable(model, layers: list[OscarLayer], device: torch.device) -> None:
    if tensor_parallel_position(model)[1] > 1:
        raise GraphDecodeError("graph decode of a tensor-parallel model is not supported (its collectives would be "
                               "captured per rank); pass use_graphs=False")
    for layer in layers:
        reason = None
        if layer.keys_buffer.device != device:
            reason = f"it lives on {layer.keys_buffer.device}, the inputs on {device} (one graph spans one device)"
        else:
            reason = layer.graph_problem(device, layer.keys_buffer.shape[-1], layer.values_buffer.shape[-1])
        if reason:
            raise GraphDecodeError(f"layer {layer.layer_idx} cannot be captured in a CUDA graph: {reason}; "
                                   "pass use_graphs=False")


def _is_eos(tokens: torch.Tensor, eos: list[int]) -> torch.Tensor:
    return torch.isin(tokens, torch.tensor(eos, device=tokens.device))


def _pad_after_eos(tokens: torch.Tensor, eos: list[int], pad_token_id: int | None) -> torch.Tensor:
    """Tokens after each row's first EOS replaced by the pad id; trailing all-pad columns dropped."""
    if not eos:
        return tokens
    is_eos = _is_eos(tokens, eos)
    after = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
    pad = eos[0] if pad_token_id is None else pad_token_id
    tokens = tokens.masked_fill(after, pad)
    live = (~after).any(dim=0).nonzero()
    return tokens[:, : int(live.max()) + 1] if len(live) else tokens[:, :0]
