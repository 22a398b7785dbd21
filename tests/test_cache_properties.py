"""Property-based tests (hypothesis): random sequences of cache operations on a tiny model, OscarCache against
DynamicCache (issue 23).

Operations: chunked and single-token forwards, single-token forwards through `torch.compile(model.forward,
fullgraph=True)` (so eager and compiled steps interleave with everything else), `crop`, `reorder_cache`, `batch_select_indices`,
`batch_repeat_interleave`, `deepcopy`, `reset`, `update()` outside a forward, and a forward that an exception
stops inside one layer's attention; prompts are left-padded per row at random (the attention mask follows every
operation). Invariants after every operation:
- with quantization off (method `none`) the OSCAR cache gives DynamicCache's logits (within 1e-5: the tiers merge
  by log-sum-exp in float32);
- quantized (method `hadamard`), it gives the logits of plain attention over what it stores: its K/V, history
  dequantized and rotated back (`dense_kv`), in a DynamicCache (within 1e-4);
- logits are finite;
- `nbytes()` is the documented formula: per KV head and token, the BF16 tiers' K and V in the model dtype, the
  history's `bits` per element plus one (scale, zero) float16 pair per row of K and of V (2.5 bits at head_dim
  64);
- the tiers add up: sink + history + recent = tokens, the sink at most `sink_tokens`.

CI runs the derandomized `ci` profile (a fixed set of examples, bounded time); a longer search by hand:
`HYPOTHESIS_PROFILE=long python -m pytest tests/test_cache_properties.py`.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from transformers import DynamicCache

from oscar_hf.layer import OscarLayer

from oscar_hf import OscarCache

from conftest import VOCAB, cache_argument_name, forward, tiny_model

settings.register_profile("ci", max_examples=12, stateful_step_count=12, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
# the quick subset's share of the search: two fixed sequences of a few operations each
settings.register_profile("quick", max_examples=2, stateful_step_count=5, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=300, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
TIERS = dict(sink_tokens=4, recent_tokens=8, demote_block=2)
MODEL = tiny_model("llama", seed=4)
# aot_eager: dynamo's trace and functionalization of the cache's ops (their declared reads, writes and order) in
# every state the machine reaches; inductor's code generation is `test_paths_differential`'s, whose compiles
# would cost this search minutes per batch size and mask width
COMPILED_FORWARD = torch.compile(MODEL.forward, fullgraph=True, backend="aot_eager")


class CacheOperations(RuleBasedStateMachine):
    method = "none"

    @initialize(batch=st.integers(1, 3), prompt=st.integers(1, 40), seed=st.integers(0, 2**16), data=st.data())
    def prefill(self, batch, prompt, seed, data):
        self.generator = torch.Generator().manual_seed(seed)
        self.oscar = OscarCache(MODEL, method=self.method, **TIERS)
        self.batch = batch
        self._prefill(prompt, data)

    def _prefill(self, prompt, data):
        self.dynamic = DynamicCache(config=MODEL.config)
        pads = data.draw(st.lists(st.integers(0, prompt - 1), min_size=self.batch, max_size=self.batch))
        self.mask = torch.zeros(self.batch, 0, dtype=torch.long)
        self._forward(prompt, pads)

    def _ids(self, n):
        return torch.randint(1, VOCAB, (self.batch, n), generator=self.generator)

    def _forward(self, n, pads=None, compiled=False):
        ids = self._ids(n)
        new = torch.ones(self.batch, n, dtype=torch.long)
        for row, pad in enumerate(pads or []):
            new[row, :pad] = 0
        self.mask = torch.cat([self.mask, new], dim=1)
        with torch.no_grad():
            if compiled:
                with torch._dynamo.config.patch(recompile_limit=256):  # batch sizes, mask widths, tiers' phases
                    COMPILED_FORWARD(input_ids=ids, use_cache=True, attention_mask=self.mask,
                                     **{cache_argument_name(MODEL): self.oscar})
            else:
                forward(MODEL, ids, self.oscar, attention_mask=self.mask)
            forward(MODEL, ids, self.dynamic, attention_mask=self.mask)

    @rule(n=st.sampled_from([1, 1, 1, 2, 5]))
    def step(self, n):
        self._forward(n)

    @rule()
    def compiled_step(self):
        """A decode step through the compiled forward (the DynamicCache's runs eagerly)."""
        self._forward(1, compiled=True)

    @rule(n=st.integers(1, 4))
    def crop(self, n):
        if n >= self.dynamic.get_seq_length() or any(layer.crop_problem(-n) for layer in self.oscar.layers):
            return  # older tokens are quantized (OscarCache refuses, tested elsewhere)
        self.oscar.crop(-n)
        self.dynamic.crop(-n)
        self.mask = self.mask[:, :-n]

    @rule(data=st.data())
    def reorder(self, data):
        order = torch.tensor(data.draw(st.permutations(range(self.batch))))
        self.oscar.reorder_cache(order)
        self.dynamic.reorder_cache(order)
        self.mask = self.mask[order]

    @precondition(lambda self: self.batch > 1)
    @rule(data=st.data())
    def select(self, data):
        keep = sorted(data.draw(st.sets(st.integers(0, self.batch - 1), min_size=1)))
        index = torch.tensor(keep)
        self.oscar.batch_select_indices(index)
        self.dynamic.batch_select_indices(index)
        self.mask = self.mask[index]
        self.batch = len(keep)

    @precondition(lambda self: self.batch < 3)
    @rule()
    def repeat(self):
        self.oscar.batch_repeat_interleave(2)
        self.dynamic.batch_repeat_interleave(2)
        self.mask = self.mask.repeat_interleave(2, dim=0)
        self.batch *= 2

    @rule()
    def deepcopy(self):
        self.oscar = copy.deepcopy(self.oscar)

    @rule(n=st.integers(1, 3))
    def update_outside_a_forward(self, n):
        """The same K/V into both caches through `update` (prefix caching, KV transfer)."""
        for i in range(len(self.dynamic.layers)):
            k = torch.randn(self.batch, 2, n, 16, generator=self.generator)
            v = torch.randn(self.batch, 2, n, 16, generator=self.generator)
            self.oscar.update(k, v, i)
            self.dynamic.update(k, v, i)
        self.mask = torch.cat([self.mask, torch.ones(self.batch, n, dtype=torch.long)], dim=1)

    @rule(prompt=st.integers(1, 40), data=st.data())
    def reset(self, prompt, data):
        self.oscar.reset()
        self._prefill(prompt, data)

    @rule(layer=st.integers(0, len(MODEL.model.layers) - 1), n=st.sampled_from([1, 3]))
    def forward_that_fails_in_one_layer(self, layer, n):
        """An exception (an OOM, say) inside one layer's attention: the cache is either as it was, or the next
        forward says so and names the recovery that this rule then takes (a copy taken before the forward)."""
        before = copy.deepcopy(self.oscar)
        attention = MODEL.model.layers[layer].self_attn

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("injected")

        attention.forward = out_of_memory
        try:
            with torch.no_grad(), pytest.raises(torch.OutOfMemoryError):
                forward(MODEL, self._ids(n), self.oscar,
                        attention_mask=torch.cat([self.mask, torch.ones(self.batch, n, dtype=torch.long)], dim=1))
        finally:
            del attention.forward
        if layer == 0:  # no layer took the forward's tokens
            assert [repr(x) for x in self.oscar.layers] == [repr(x) for x in before.layers]
            return
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"stopped part-way.*copy\.deepcopy\(cache\)"):
            forward(MODEL, self._ids(1), copy.deepcopy(self.oscar),
                    attention_mask=torch.cat([self.mask, torch.ones(self.batch, 1, dtype=torch.long)], dim=1))
        self.oscar = before

    @invariant()
    def same_tokens(self):
        assert int(self.oscar.get_seq_length()) == self.dynamic.get_seq_length()

    @invariant()
    def tiers_add_up_and_bytes_follow_the_formula(self):
        expected = 0
        bits = 8 * MODEL.dtype.itemsize if self.method == "none" else self.oscar.oscar_config.bits
        pair_bits = 0 if self.method == "none" else 32  # a float16 (scale, zero) per row of K and of V
        for layer in self.oscar.layers:
            if not layer.is_initialized:
                continue
            tokens, bf16_rows, history_rows = layer.counts()  # the device's, during counted decode
            assert layer.sink_length <= TIERS["sink_tokens"]
            assert history_rows + bf16_rows == tokens  # sink and recent are the BF16 tiers
            b, h, _, dk = layer.keys_buffer.shape
            dv = layer.values_buffer.shape[3]
            bf16 = bf16_rows * (dk + dv) * layer.keys_buffer.element_size()
            history = history_rows * ((dk + dv) * bits + 2 * pair_bits) // 8
            expected += b * h * (bf16 + history)
        assert self.oscar.nbytes() == expected

    @invariant()
    def same_next_logits(self):
        probe = self._ids(1)
        mask = torch.cat([self.mask, torch.ones(self.batch, 1, dtype=torch.long)], dim=1)
        a_cache, b_cache = copy.deepcopy(self.oscar), self._reference_cache()
        with torch.no_grad():
            a = forward(MODEL, probe, a_cache, attention_mask=mask).logits
            b = forward(MODEL, probe, b_cache, attention_mask=mask).logits
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 if self.method == "none" else 1e-4)

    def _reference_cache(self) -> DynamicCache:
        """Method none: the DynamicCache that took every operation. Quantized: a DynamicCache holding what the
        OSCAR cache stores, in time order, after the demotions a next forward would settle first."""
        if self.method == "none":
            return copy.deepcopy(self.dynamic)
        stored = copy.deepcopy(self.oscar)
        reference = DynamicCache(config=MODEL.config)
        for i, layer in enumerate(stored.layers):
            assert isinstance(layer, OscarLayer)
            layer.settle()
            keys, values = layer.dense_kv()
            reference.update(keys, values, i)
        return reference


class QuantizedCacheOperations(CacheOperations):
    method = "hadamard"


CacheOperations.TestCase.settings = PROFILE
QuantizedCacheOperations.TestCase.settings = PROFILE
test_cache_operations_match_dynamic_cache = CacheOperations.TestCase
test_quantized_cache_operations_match_attention_over_what_it_stores = QuantizedCacheOperations.TestCase


@pytest.mark.quick
@pytest.mark.parametrize("machine", [CacheOperations, QuantizedCacheOperations], ids=["none", "hadamard"])
def test_a_few_operation_sequences_keep_the_invariants(machine):
    """Two short derandomized sequences of each machine (the `quick` profile), for the quick subset."""
    run_state_machine_as_test(machine, settings=settings.get_profile("quick"))
