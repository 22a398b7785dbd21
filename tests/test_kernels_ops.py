"""How the custom ops (`kernels.ops`) name a backend: by a key that lives as long as the backend does and is never
given to another one."""

from __future__ import annotations

import copy
import gc

import torch

from oscar_hf import OscarCache
from oscar_hf.kernels import ops
from oscar_hf.kernels.reference.backend import ReferenceBackend

from conftest import forward, tiny_model

OPTIONS = dict(sink_tokens=4, recent_tokens=8, demote_block=8)


def test_a_freed_cache_takes_its_backend_out_of_the_ops_lookup():
    model = tiny_model("llama", seed=0)
    cache = OscarCache(model, method="hadamard", backend=ReferenceBackend(), **OPTIONS)
    with torch.no_grad():
        forward(model, torch.randint(1, 96, (1, 20)), cache)
    key = cache.layers[0].op_backend.key
    assert ops._backend(key) is cache.layers[0].backend
    assert {layer.op_backend.key for layer in cache.layers} == {key}  # one backend, one key
    del cache
    gc.collect()
    assert key not in ops._BACKENDS


def test_two_backends_never_share_a_key():
    first, second = ReferenceBackend(), ReferenceBackend()
    keys = {ops.register_backend(first), ops.register_backend(second)}
    assert len(keys) == 2
    assert ops.register_backend(first) in keys  # a backend keeps its key while it lives
    old = ops.register_backend(first)
    del first
    gc.collect()
    assert ops.register_backend(ReferenceBackend()) not in keys | {old}  # a freed backend's key is not reissued


def test_a_copied_op_backend_names_its_own_backend():
    shared = ops.OpBackend(ReferenceBackend())
    assert copy.deepcopy(shared, {id(shared.inner): shared.inner}).key == shared.key
    copied = copy.deepcopy(shared)
    assert copied.inner is not shared.inner and copied.key != shared.key
    assert ops._backend(copied.key) is copied.inner
