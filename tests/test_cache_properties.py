"""Property-based tests (hypothesis): random sequences of cache operations on a tiny model, OscarCache against
DynamicCache (issue 23).

With quantization off (method `none`) the OSCAR cache must give DynamicCache's logits after every operation
(within 1e-5: the tiers merge by log-sum-exp in float32) and finite logits always. Operations: chunked and
single-token forwards, `crop`, `reorder_cache`, `batch_select_indices`, `batch_repeat_interleave`, `deepcopy`,
`update()` outside a forward; prompts are left-padded per row at random (the attention mask follows every
operation). The per-row sink (issue 23, defect 1) is not built yet: these rows share a sink grown by the padding.

CI runs the derandomized `ci` profile (a fixed set of examples, bounded time); a longer search by hand:
`HYPOTHESIS_PROFILE=long python -m pytest tests/test_cache_properties.py`.
"""

from __future__ import annotations

import copy
import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import DynamicCache

from oscar_hf import OscarCache

from conftest import VOCAB, forward, tiny_model

settings.register_profile("ci", max_examples=12, stateful_step_count=12, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=300, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
PROFILE = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
TIERS = dict(sink_tokens=4, recent_tokens=8, demote_block=2)
MODEL = tiny_model("llama", seed=4)


class CacheOperations(RuleBasedStateMachine):
    @initialize(batch=st.integers(1, 3), prompt=st.integers(1, 40), seed=st.integers(0, 2**16), data=st.data())
    def prefill(self, batch, prompt, seed, data):
        self.generator = torch.Generator().manual_seed(seed)
        self.oscar = OscarCache(MODEL, method="none", **TIERS)
        self.dynamic = DynamicCache(config=MODEL.config)
        self.batch = batch
        pads = data.draw(st.lists(st.integers(0, prompt - 1), min_size=batch, max_size=batch))
        self.mask = torch.zeros(batch, 0, dtype=torch.long)
        self._forward(prompt, pads)

    def _ids(self, n):
        return torch.randint(1, VOCAB, (self.batch, n), generator=self.generator)

    def _forward(self, n, pads=None):
        ids = self._ids(n)
        new = torch.ones(self.batch, n, dtype=torch.long)
        for row, pad in enumerate(pads or []):
            new[row, :pad] = 0
        self.mask = torch.cat([self.mask, new], dim=1)
        with torch.no_grad():
            forward(MODEL, ids, self.oscar, attention_mask=self.mask)
            forward(MODEL, ids, self.dynamic, attention_mask=self.mask)

    @rule(n=st.sampled_from([1, 1, 1, 2, 5]))
    def step(self, n):
        self._forward(n)

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

    @invariant()
    def same_tokens(self):
        assert int(self.oscar.get_seq_length()) == self.dynamic.get_seq_length()

    @invariant()
    def same_next_logits(self):
        probe = self._ids(1)
        mask = torch.cat([self.mask, torch.ones(self.batch, 1, dtype=torch.long)], dim=1)
        a_cache, b_cache = copy.deepcopy(self.oscar), copy.deepcopy(self.dynamic)
        with torch.no_grad():
            a = forward(MODEL, probe, a_cache, attention_mask=mask).logits
            b = forward(MODEL, probe, b_cache, attention_mask=mask).logits
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


CacheOperations.TestCase.settings = PROFILE
test_cache_operations_match_dynamic_cache = CacheOperations.TestCase
