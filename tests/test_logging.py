"""oscar_hf's log records follow `transformers.logging.set_verbosity_*` (`oscar_hf.verbosity`), and the attention
switch of `OscarCache(model)` is logged at info."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from oscar_hf import OscarCache

from conftest import cache_argument_name, tiny_model

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second

SWITCH = "OscarCache: switched LlamaForCausalLM's attention implementation from 'sdpa' to 'oscar'"
FALLBACK = "OscarCache returns dequantized K/V"


@pytest.fixture(autouse=True)
def transformers_verbosity():
    before = transformers.logging.get_verbosity()
    yield
    transformers.logging.set_verbosity(before)


def oscar_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("oscar_hf")]


def test_the_attention_switch_is_logged_at_info_once(caplog):
    transformers.logging.set_verbosity_info()
    model = tiny_model()
    OscarCache(model, method="hadamard")
    switches = [r for r in caplog.records if r.getMessage().startswith(SWITCH)]
    assert [(r.name, r.levelno) for r in switches] == [("oscar_hf.cache", logging.INFO)]
    OscarCache(model, method="hadamard")  # already "oscar": nothing switched, nothing logged
    assert sum(m.startswith(SWITCH) for m in oscar_messages(caplog)) == 1


def test_the_attention_switch_is_not_shown_at_warning_verbosity(caplog):
    transformers.logging.set_verbosity_warning()
    OscarCache(tiny_model(), method="hadamard")
    assert not any(m.startswith(SWITCH) for m in oscar_messages(caplog))


def fallback_warning(model) -> None:
    """Run a forward through a new cache under another attention than "oscar": the cache warns once per cache."""
    cache = OscarCache(model, method="hadamard")
    model.set_attn_implementation("sdpa")
    model(torch.tensor([[1, 2, 3]]), **{cache_argument_name(model): cache})


def test_warnings_follow_transformers_verbosity(caplog):
    model = tiny_model()
    transformers.logging.set_verbosity_warning()
    fallback_warning(model)
    assert [m for m in oscar_messages(caplog) if FALLBACK in m]
    caplog.clear()
    transformers.logging.set_verbosity_error()  # after a lookup that loggers cache
    fallback_warning(model)
    assert not oscar_messages(caplog)
    transformers.logging.set_verbosity_warning()
    fallback_warning(model)
    assert [m for m in oscar_messages(caplog) if FALLBACK in m]


def test_a_level_set_on_the_package_logger_wins(caplog):
    """The command lines' --verbosity sets the `oscar_hf` logger's level; transformers' then does not apply."""
    transformers.logging.set_verbosity_error()
    with caplog.at_level(logging.INFO, logger="oscar_hf"):
        OscarCache(tiny_model(), method="hadamard")
    assert any(m.startswith(SWITCH) for m in oscar_messages(caplog))
    assert logging.getLogger("oscar_hf").level == logging.NOTSET  # restored: transformers' verbosity again
