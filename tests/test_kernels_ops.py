"""The custom ops (`kernels.ops`): a call object flattened into an op's schema and back is the same call, a backend
is named by its settings (no registry of backend objects), and a compiled step runs what the eager step runs."""

from __future__ import annotations

import json

import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.kernels import ops
from oscar_hf.kernels.interface import DecodeCall, HeadRun, HeadSplitTensors, HistoryTensors
from oscar_hf.kernels.reference.backend import ReferenceBackend
from oscar_hf.kernels.select import backend_for, backend_from_spec, backend_spec

from conftest import cache_argument_name, forward, tiny_model

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second

OPTIONS = dict(sink_tokens=4, recent_tokens=8, demote_block=8)


def _history(heads: int, bits: int, length: torch.Tensor) -> HistoryTensors:
    codes = torch.randint(0, 255, (2, heads, 24, 8 * bits), dtype=torch.uint8)
    pairs = torch.rand(2, heads, 24, 2).half()
    return HistoryTensors(codes, codes.clone(), pairs, pairs.clone(), 24, bits, length)


def _decode_call(history) -> DecodeCall:
    return DecodeCall(torch.randn(2, 6, 1, 64), torch.randn(2, 3, 20, 64), torch.randn(2, 3, 20, 64),
                      torch.tensor([17], dtype=torch.int32), history, torch.randn(64, 64), torch.randn(3, 64, 64),
                      0.125, 30.0, torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32))


@pytest.mark.parametrize("history", ["none", "whole", "split"])
def test_a_decode_call_flattened_for_the_op_reads_back_as_the_same_call(history):
    length = torch.tensor([11], dtype=torch.int32)
    histories = {"none": None, "whole": _history(3, 2, length),
                 "split": HeadSplitTensors((HeadRun(0, 1, _history(1, 4, length)), HeadRun(1, 3, _history(2, 2, length))))}
    call = _decode_call(histories[history])
    arguments = ops._decode_arguments(call, "spec")
    assert arguments[-1] == "spec"
    assert ops._decode_call(*arguments[:-1]) == call  # dataclass equality: the same tensors, runs and scalars
    reference = ReferenceBackend()
    torch.testing.assert_close(torch.ops.oscar_hf.decode_attention(*ops._decode_arguments(call, backend_spec(reference))),
                               reference.decode_attention(call), rtol=0, atol=0)


def test_a_backend_is_named_by_its_settings_and_one_instance_serves_each():
    default = backend_for(torch.device("cpu"), 4096)
    assert backend_from_spec(backend_spec(default)) is default
    chunked = ReferenceBackend(history_chunk=96)
    twin = backend_from_spec(backend_spec(chunked))
    assert twin is not chunked and twin.history_chunk == 96  # the shared instance of those settings
    assert backend_from_spec(backend_spec(ReferenceBackend(history_chunk=96))) is twin
    assert json.loads(backend_spec(chunked)) == {"kind": "reference", "settings": {"history_chunk": 96}}


def test_triton_settings_round_trip_through_a_spec():
    pytest.importorskip("triton")
    from oscar_hf.kernels.triton.backend import TritonBackend
    from oscar_hf.kernels.triton.launch_plan import LaunchConfig

    backend = TritonBackend(launch=LaunchConfig(num_warps=2, block_m=8), min_history_tokens=32, split_waves=2,
                            eager_graphs=False, dequantize_from_rows=None)
    rebuilt = backend_from_spec(backend_spec(backend))
    assert rebuilt.settings() == backend.settings() and rebuilt.launch == backend.launch
    assert rebuilt.dequantize_from_rows is None
    assert rebuilt.graphs is None and rebuilt.cuda_history_config == backend.cuda_history_config


def test_a_compiled_step_with_a_backend_that_has_no_settings_says_why_it_cannot():
    """A user's own backend class decodes eagerly; traced, its cache raises a clear error instead of running
    another backend in its place."""

    class Own(ReferenceBackend):
        pass

    torch._dynamo.reset()  # a fresh recompile budget, whatever compiled before in this process
    model = tiny_model("llama", seed=0)
    cache = OscarCache(model, method="hadamard", backend=Own(), **OPTIONS)
    ids = torch.randint(1, 96, (1, 20))
    with torch.no_grad():
        forward(model, ids, cache)
        forward(model, ids[:, :1], cache)  # eager decode steps run it
        assert not cache.can_compile and not cache.is_compileable  # so generate decodes it eagerly
        compiled = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        with pytest.raises(Exception, match="Own is not one of them"):
            compiled(input_ids=ids[:, :1], use_cache=True, **{cache_argument_name(model): cache})
