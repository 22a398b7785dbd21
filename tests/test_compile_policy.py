"""When `generate` compiles an OscarCache's decode step (`compile_policy`): not on a model's first calls, once its
eager decode steps have cost what a compile is expected to, and always or never when `compile_decode` says so."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.compat import compile_config_anywhere
from oscar_hf.compile_policy import (
    EXPECTED_COMPILE_SECONDS,
    LONGEST_STEP_SECONDS,
    WARM_COMPILE_SECONDS,
    DecodeLedger,
    ledger_of,
    note_traced_step,
)

from conftest import cache_argument_name, tiny_model

OPTIONS = dict(sink_tokens=4, recent_tokens=8, demote_block=8)


def _generate(model, cache, steps=6):
    ids = torch.randint(1, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    # compile_config_anywhere: generate would compile here on the CPU too, if the cache lets it
    return model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0,
                          compile_config=compile_config_anywhere(fullgraph=True),
                          **{cache_argument_name(model): cache})


def _compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.quick
def test_the_ledger_buys_once_eager_steps_cost_a_compile_and_keeps_it():
    ledger = DecodeLedger()
    step = EXPECTED_COMPILE_SECONDS / 30
    assert step <= LONGEST_STEP_SECONDS
    for _ in range(29):
        ledger.add_step(step)
    ledger.add_step(LONGEST_STEP_SECONDS + 1)  # a pause between calls, not a step
    assert not ledger.may_compile(EXPECTED_COMPILE_SECONDS)
    ledger.add_step(step)
    assert ledger.may_compile(EXPECTED_COMPILE_SECONDS)
    ledger.eager_seconds = 0.0
    assert ledger.may_compile(EXPECTED_COMPILE_SECONDS)  # bought for good


@torch.no_grad()
@pytest.mark.quick
def test_a_models_first_calls_decode_eagerly_and_count_only_their_decode_steps():
    torch._dynamo.reset()
    model = tiny_model("llama", seed=1)
    cache = OscarCache(model, method="hadamard", **OPTIONS)
    assert cache.compile_decode is None and cache.can_compile and not cache.is_compileable
    graphs = _compiled_graphs()
    began = time.perf_counter()
    _generate(model, cache, steps=6)
    wall = time.perf_counter() - began
    assert _compiled_graphs() == graphs  # generate did not compile
    ledger = ledger_of(model)
    assert 0.0 < ledger.eager_seconds < wall  # the gaps between decode steps, not the prefill
    # a second cache on the same model adds to the same ledger; a copy too
    second = OscarCache(model, method="hadamard", **OPTIONS)
    before = ledger.eager_seconds
    _generate(model, copy.deepcopy(second), steps=6)
    assert ledger.eager_seconds > before


@torch.no_grad()
def test_once_eager_steps_have_cost_a_compile_generate_compiles_and_stores_what_eager_stores():
    torch._dynamo.reset()
    model = tiny_model("llama", seed=2)
    eager = OscarCache(model, method="hadamard", **OPTIONS)
    want = _generate(model, eager, steps=24)
    ledger_of(model).eager_seconds = EXPECTED_COMPILE_SECONDS  # as after a minute of eager decode steps
    compiled = OscarCache(model, method="hadamard", **OPTIONS)
    assert compiled.is_compileable
    graphs = _compiled_graphs()
    got = _generate(model, compiled, steps=24)
    assert _compiled_graphs() > graphs
    assert torch.equal(got, want)
    for a, b in zip(eager.layers, compiled.layers):
        assert a.history_length == b.history_length > 0
        for x, y in zip(a.history.buffers(), b.history.buffers()):
            assert torch.equal(x[:, :, : a.history_length], y[:, :, : b.history_length])


@pytest.mark.parametrize("setting", [True, False])
@pytest.mark.quick
def test_compile_decode_overrides_the_rule(setting):
    model = tiny_model("llama", seed=3)
    ledger_of(model).eager_seconds = 0.0 if setting else EXPECTED_COMPILE_SECONDS
    cache = OscarCache(model, method="hadamard", compile_decode=setting, **OPTIONS)
    assert cache.is_compileable is setting
    cache.compile_decode = None
    assert cache.is_compileable is not setting  # back to the rule
    with pytest.raises((TypeError, ValueError), match="compile_decode"):
        OscarCache(model, method="hadamard", compile_decode="yes")


@pytest.mark.quick
def test_a_cache_that_cannot_compile_says_so_whatever_compile_decode_says():
    model = tiny_model("llama", seed=4)
    model.set_attn_implementation("sdpa")  # dequantized K/V grow by a token a step: never compileable
    cache = OscarCache(model.config, method="hadamard", compile_decode=True, **OPTIONS)
    assert not cache.can_compile and not cache.is_compileable


@torch.no_grad()
def test_a_forward_compiled_by_the_user_names_compile_decode_when_generate_did_not_build_its_mask():
    """A second chat turn through a user's own fullgraph compile needs the mask built outside the forward, which
    generate does only for a cache that lets it compile: the error says how."""
    torch._dynamo.reset()
    model = tiny_model("llama", seed=5)
    name = cache_argument_name(model)
    options = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, disable_compile=True)
    cache = OscarCache(model, method="hadamard", **OPTIONS)
    eager_forward = model.forward
    model.forward = torch.compile(model.forward, fullgraph=True)
    try:
        first = model.generate(torch.randint(1, 96, (1, 40)), **options, **{name: cache})
        with pytest.raises(Exception, match=r"compile_decode=True"):
            model.generate(torch.cat([first, torch.randint(1, 96, (1, 10))], dim=1), **options, **{name: cache})
    finally:
        model.forward = eager_forward


@torch.no_grad()
def test_a_machine_that_compiled_the_step_before_expects_a_cheaper_compile(tmp_path, monkeypatch):
    """The first process whose generate compiles the step leaves a marker beside torch's compiled artifacts; a later
    process's cache, finding it, lets generate compile after the warm price of eager steps, not the cold one."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    first = tiny_model("llama", seed=6)
    cache = OscarCache(first, method="hadamard", compile_decode=True, **OPTIONS)
    assert cache.is_compileable
    assert not (tmp_path / "oscar_hf").exists()  # allowed to compile is not compiled
    graphs = _compiled_graphs()
    _generate(first, cache, steps=4)
    assert _compiled_graphs() > graphs
    assert len(list((tmp_path / "oscar_hf").iterdir())) == 1
    later = tiny_model("llama", seed=6)  # as in a new process: its own ledger
    ledger_of(later).eager_seconds = (WARM_COMPILE_SECONDS + EXPECTED_COMPILE_SECONDS) / 2
    assert OscarCache(later, method="hadamard", **OPTIONS).is_compileable
    other = tiny_model("llama", seed=6)  # another setting is another step: the cold price
    ledger_of(other).eager_seconds = (WARM_COMPILE_SECONDS + EXPECTED_COMPILE_SECONDS) / 2
    assert not OscarCache(other, method="hadamard", recent_tokens=16, sink_tokens=4, demote_block=8).is_compileable


@torch.no_grad()
@pytest.mark.quick
def test_a_cpu_generate_that_compiles_nothing_leaves_no_marker(tmp_path, monkeypatch):
    """On a CPU `generate` compiles nothing unless its compile_config says to, whatever the cache allows: no marker
    may then promise the next process a warm compile, neither now nor when a later trace runs."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    model = tiny_model("llama", seed=8)
    cache = OscarCache(model, method="hadamard", compile_decode=True, **OPTIONS)
    assert cache.is_compileable
    ids = torch.randint(1, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    graphs = _compiled_graphs()
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                   **{cache_argument_name(model): cache})
    assert _compiled_graphs() == graphs
    note_traced_step()  # a trace after the eager steps (another model's, say) does not leave this step's marker
    assert not (tmp_path / "oscar_hf").exists()


@pytest.mark.quick
def test_compile_decode_is_a_runtime_choice_that_from_pretrained_takes(tmp_path):
    model = tiny_model("llama", seed=7)
    OscarCache(model, method="hadamard", compile_decode=True, **OPTIONS).save_pretrained(tmp_path)
    assert OscarCache.from_pretrained(model, tmp_path).compile_decode is None  # not part of the saved setup
    assert OscarCache.from_pretrained(model, tmp_path, compile_decode=True).compile_decode is True
