"""`graphed_generate` is greedy `model.generate` now (`oscar_hf.graph_decode`), and `generate_with_graphs` is gone
with an error that says what replaces it. Also: the pinned history that counted decode's replayed steps write
through."""

import pytest
import torch

import oscar_hf
from oscar_hf import GraphDecodeError, OscarCache, graphed_generate
from oscar_hf.compat import cache_argument_name
from oscar_hf.config import OscarConfig
from oscar_hf.history import QuantizedHistory
from oscar_hf.kernels.reference.backend import ReferenceBackend

from conftest import tiny_model

OPTIONS = dict(sink_tokens=4, recent_tokens=16, demote_block=4)


def test_graphed_generate_warns_and_gives_greedy_generates_tokens():
    model = tiny_model("llama", seed=3)
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    name = cache_argument_name(model)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                          **{name: OscarCache(model, **OPTIONS)})
    eos = int(free[0, 40 + 4])  # row 0 stops at step 5 at the latest; row 1 pads after its own EOS, if any
    want = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                          pad_token_id=0, **{name: OscarCache(model, **OPTIONS)})
    with pytest.warns(FutureWarning, match="model.generate"):
        got = graphed_generate(model, ids, OscarCache(model, **OPTIONS), 30, eos_token_id=eos, pad_token_id=0,
                               attention_mask=mask, use_graphs=False)
    assert torch.equal(got, want)
    assert bool((got[0, 40:] == eos).any())  # the EOS reached generate


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.quick
def test_graphed_generate_refuses_graphs_on_cpu():
    model = tiny_model("llama")
    with pytest.warns(FutureWarning), pytest.raises(GraphDecodeError, match="CUDA device"):
        graphed_generate(model, torch.randint(3, 96, (1, 8)), OscarCache(model, **OPTIONS), 4, use_graphs=True)


@pytest.mark.quick
def test_generate_with_graphs_is_gone_with_a_pointer_to_generate():
    with pytest.raises(AttributeError, match="drop the custom_generate= argument"):
        oscar_hf.generate_with_graphs  # noqa: B018
    with pytest.raises(ImportError):
        from oscar_hf import generate_with_graphs  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        oscar_hf.nothing_here


@pytest.mark.quick
def test_pinned_history_appends_the_same_codes_at_device_positions():
    config = OscarConfig.from_method("hadamard")
    plain = QuantizedHistory(2, 3, 64, 64, config, torch.device("cpu"))
    pinned = QuantizedHistory(2, 3, 64, 64, config, torch.device("cpu"))
    pinned.pin(40)
    assert pinned.capacity >= 40 and int(pinned.device_length) == 0
    backend = ReferenceBackend()
    for n in (5, 8, 8, 3):
        keys, values = torch.randn(2, 3, n, 64), torch.randn(2, 3, n, 64)
        plain.append(keys, values, None, None, backend)
        pinned.append(keys, values, None, None, backend)
    assert pinned.length == plain.length == int(pinned.device_length) == 24
    for name in QuantizedHistory._names:
        assert torch.equal(getattr(pinned, name)[:, :, :24], getattr(plain, name)[:, :, :24])
