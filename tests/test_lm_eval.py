"""The lm-eval wrapper on a tiny local task, run from outside the repository: scoring equals real decoding through
OscarCache whatever the batch rows end with, batches agree, generation runs through a fresh OscarCache per call, and
model_args that nothing takes are rejected with the valid ones. (The command line: test_lm_eval_cli.py.)"""

from __future__ import annotations

import os
import random
import re

import pytest
import torch
from transformers import DynamicCache

lm_eval = pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from oscar_hf import OscarCache  # noqa: E402
from oscar_hf.compat import cache_argument_name  # noqa: E402
from oscar_hf.eval.diagnostics.generation import greedy_through_cache  # noqa: E402
from oscar_hf.eval.diagnostics.methods import Method  # noqa: E402
from oscar_hf.eval.lm_eval import OscarLM  # noqa: E402

from conftest import LM_EVAL_TASKS as TASKS  # noqa: E402
from conftest import tiny_llama, tiny_tokenizer  # noqa: E402

LAYOUT = dict(sink_tokens=4, recent_tokens=8, demote_block=2)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_llama(seed=7, vocab=64), tiny_tokenizer()


_TASK_MANAGER = None


def evaluate(lm, task, limit=None):
    global _TASK_MANAGER
    if _TASK_MANAGER is None:  # index only the local tasks (the built-in index takes many seconds)
        _TASK_MANAGER = TaskManager(include_path=TASKS, include_defaults=False)
    return simple_evaluate(model=lm, tasks=[task], task_manager=_TASK_MANAGER, limit=limit, log_samples=True,
                           bootstrap_iters=0)


def oscar_lm(model, tokenizer, **kwargs):
    return OscarLM(pretrained=model, tokenizer=tokenizer, method="hadamard", device="cpu", **{**LAYOUT, **kwargs})


@torch.no_grad()
def decoded_loglikelihood(model, context, continuation) -> float:
    """Prefill the context into a fresh OscarCache, then decode the continuation token by token."""
    cache = OscarCache(model, method="hadamard", **LAYOUT)
    name = cache_argument_name(model)
    logits = model(input_ids=torch.tensor([context]), use_cache=True, **{name: cache}).logits[0, -1:]
    for token in continuation[:-1]:
        logits = torch.cat([logits, model(input_ids=torch.tensor([[token]]), use_cache=True,
                                          **{name: cache}).logits[0, -1:]])
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp[torch.arange(len(continuation)), torch.tensor(continuation)].sum().item()


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory):
    """Run from a folder outside the repository: the task files find their data beside themselves."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("elsewhere"))
    yield
    os.chdir(old)


@pytest.fixture(scope="module")
def batch_one(model_and_tokenizer, elsewhere):
    """(lm, multiple-choice samples, rolling samples) scored one request at a time."""
    model, tokenizer = model_and_tokenizer
    lm = oscar_lm(model, tokenizer, batch_size=1)
    return lm, evaluate(lm, "tiny_oscar_mc", limit=4)["samples"]["tiny_oscar_mc"], \
        evaluate(lm, "tiny_oscar_ppl", limit=3)["samples"]["tiny_oscar_ppl"]


def scores(mc, ppl):
    return [r[0][0] for s in mc for r in s["resps"]] + [s["resps"][0][0] for s in ppl]


def test_multiple_choice_scores_equal_token_by_token_decoding(model_and_tokenizer, batch_one):
    model, _ = model_and_tokenizer
    lm, samples, _ = batch_one
    checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            assert len(ctx_ids) > sum(LAYOUT.values())  # long enough for a quantized history
            assert resp[0][0] == pytest.approx(decoded_loglikelihood(model, ctx_ids, cont_ids), abs=1e-4)
            checked += 1
    assert checked == 12


def test_rolling_loglikelihood_decodes_every_token(model_and_tokenizer, batch_one):
    model, tokenizer = model_and_tokenizer
    lm, _, samples = batch_one
    for sample in samples:
        ids = tokenizer(sample["arguments"][0][0]).input_ids
        # lm-eval's rolling window: the prefix token, then every token of the document is predicted
        expected = decoded_loglikelihood(model, [lm.prefix_token_id], ids)
        assert sample["resps"][0][0] == pytest.approx(expected, abs=1e-4)


def test_batches_give_the_same_scores_and_quantization_matters(model_and_tokenizer, batch_one, elsewhere):
    model, tokenizer = model_and_tokenizer
    _, mc, ppl = batch_one
    batched = oscar_lm(model, tokenizer, batch_size=3)
    got = scores(evaluate(batched, "tiny_oscar_mc", limit=4)["samples"]["tiny_oscar_mc"],
                 evaluate(batched, "tiny_oscar_ppl", limit=3)["samples"]["tiny_oscar_ppl"])
    assert got == pytest.approx(scores(mc, ppl), abs=1e-4)
    plain = oscar_lm(model, tokenizer, batch_size=3, ll_mode="off")
    off = scores(evaluate(plain, "tiny_oscar_mc", limit=4)["samples"]["tiny_oscar_mc"], [])
    assert max(abs(a - b) for a, b in zip(off, scores(mc, []))) > 1e-3  # a plain forward misses the history


def test_generation_runs_through_a_fresh_oscar_cache_per_call(model_and_tokenizer, elsewhere):
    model, tokenizer = model_and_tokenizer
    lm = oscar_lm(model, tokenizer, batch_size=1)
    samples = evaluate(lm, "tiny_oscar_gen", limit=3)["samples"]["tiny_oscar_gen"]
    assert lm.caches_built == 3
    for sample in samples:
        prompt = torch.tensor([tokenizer(sample["arguments"][0][0]).input_ids])
        tokens = greedy_through_cache(model, OscarCache(model, method="hadamard", **LAYOUT), 6, prompt=prompt)
        expected = tokenizer.decode(tokens, skip_special_tokens=True)
        assert sample["resps"][0][0].strip() == expected.strip().split("[EOS]")[0].strip()
    batched = oscar_lm(model, tokenizer, batch_size=2)
    out = evaluate(batched, "tiny_oscar_gen", limit=3)["samples"]["tiny_oscar_gen"]
    assert len(out) == 3 and batched.caches_built == 2  # two batches, two fresh caches


@pytest.mark.quick
def test_scores_do_not_depend_on_which_token_pads_the_batch(model_and_tokenizer):
    """Rows that end in token 0 (lm-eval pads with 0), one of them the row of another request plus a 0 with
    another context length: every score still equals prefill + token-by-token decoding."""
    model, tokenizer = model_and_tokenizer
    rng = random.Random(3)
    text = [rng.randrange(1, 64) for _ in range(24)]
    zero_ended = text[:18] + [0]
    requests = [
        (text[:12], text[12:20] + [5]),  # row: text[:20]
        (text[:20], [0, 9]),  # row: text[:20] + [0], context 20: looks like the row above padded with a 0
        (text[:20], [0, 0, 7]),  # row: text[:20] + [0, 0]
        (zero_ended, [4, 2]),  # row ends in 0 itself
        (text[:6], text[6:22]),  # shorter context, same text
    ]
    lm = oscar_lm(model, tokenizer, batch_size=5)
    got = lm._loglikelihood_tokens([(None, context, continuation) for context, continuation in requests])
    for (context, continuation), (score, _) in zip(requests, got, strict=True):
        assert score == pytest.approx(decoded_loglikelihood(model, context, continuation), abs=1e-4)


@pytest.mark.quick
def test_an_oscar_model_arg_with_a_typo_is_rejected_before_loading_with_the_valid_ones(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match=r"unknown model_arg 'recent_token' \(did you mean 'recent_tokens'\?\)") as e:
        oscar_lm(model, tokenizer, recent_token=8)
    assert "sink_tokens, recent_tokens, demote_block" in str(e.value) and "rotations" in str(e.value)
    with pytest.raises(ValueError, match="unknown model_arg 'sinks'.*nothing would take it"):
        oscar_lm(model, tokenizer, sinks=4)  # a loaded model: nothing is passed on to from_pretrained
    with pytest.raises(ValueError, match="demote_block=0"):
        oscar_lm(model, tokenizer, demote_block=0)


@pytest.mark.quick
def test_a_model_arg_that_from_pretrained_refuses_is_rejected_with_the_valid_ones(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unknown model_arg 'recent'.*OSCAR model_args: rotations, method") as e:
        OscarLM(pretrained=str(tmp_path), device="cpu", recent=8)
    assert isinstance(e.value.__cause__, TypeError)  # what transformers said, kept as the cause
    with pytest.raises(ValueError, match=r"'recent_tokns' \(did you mean 'recent_tokens'\?\)"):
        OscarLM(pretrained=str(tmp_path), device="cpu", recent_tokns=8)
    # what from_pretrained does take still reaches it: a config attribute
    lm = OscarLM(pretrained=str(tmp_path), device="cpu", method="hadamard", rms_norm_eps=1e-3, **LAYOUT)
    assert lm.model.config.rms_norm_eps == 1e-3


# ---------------------------------------------------------------------------------------------- peer caches
class FirstForwardWidths(DynamicCache):
    """A BF16 cache that records how many tokens its first forward brought (what a group-quantizing peer checks)."""

    widths: list[int] = []

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0 and self.get_seq_length() == 0:
            FirstForwardWidths.widths.append(key_states.shape[-2])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def peer_lm(model, tokenizer, method, **kwargs):
    return OscarLM(pretrained=model, tokenizer=tokenizer, method=method, device="cpu", **kwargs)


def test_a_peer_method_generates_and_scores_through_its_own_cache(model_and_tokenizer, elsewhere):
    model, tokenizer = model_and_tokenizer
    lm = peer_lm(model, tokenizer, "bf16", batch_size=1)
    assert lm.ll_mode == "chunked" and lm.baseline.name == "bf16"
    samples = evaluate(lm, "tiny_oscar_gen", limit=3)["samples"]["tiny_oscar_gen"]
    assert lm.caches_built == 3
    for sample in samples:
        prompt = torch.tensor([tokenizer(sample["arguments"][0][0]).input_ids])
        tokens = greedy_through_cache(model, DynamicCache(config=model.config), 6, prompt=prompt)
        expected = tokenizer.decode(tokens, skip_special_tokens=True)
        assert sample["resps"][0][0].strip() == expected.strip().split("[EOS]")[0].strip()
    # the real BF16 cache in chunks scores what one plain forward scores
    chunked = scores(evaluate(peer_lm(model, tokenizer, "bf16", batch_size=3, ll_chunk=7), "tiny_oscar_mc",
                              limit=4)["samples"]["tiny_oscar_mc"], [])
    plain = scores(evaluate(peer_lm(model, tokenizer, "bf16", batch_size=3, ll_mode="off"), "tiny_oscar_mc",
                            limit=4)["samples"]["tiny_oscar_mc"], [])
    assert chunked == pytest.approx(plain, abs=1e-4)


def test_a_peer_that_quantizes_whole_groups_sees_padded_first_forwards_and_the_same_answers(
        model_and_tokenizer, elsewhere):
    model, tokenizer = model_and_tokenizer
    grouped = Method("grouped", "BF16 in groups of 5", lambda m: FirstForwardWidths(config=m.config),
                     prefix_multiple=5)
    FirstForwardWidths.widths = []
    got = evaluate(peer_lm(model, tokenizer, grouped, batch_size=1), "tiny_oscar_gen", limit=3)
    widths = list(FirstForwardWidths.widths)
    want = evaluate(peer_lm(model, tokenizer, "bf16", batch_size=1), "tiny_oscar_gen", limit=3)
    prompts = [len(tokenizer(s["arguments"][0][0]).input_ids) for s in want["samples"]["tiny_oscar_gen"]]
    assert any(n % 5 for n in prompts)  # some prompt needed padding
    assert sorted(widths) == sorted(-(-n // 5) * 5 for n in prompts)  # lm-eval runs them longest first
    assert [s["resps"] for s in got["samples"]["tiny_oscar_gen"]] == \
        [s["resps"] for s in want["samples"]["tiny_oscar_gen"]]
    FirstForwardWidths.widths = []
    padded = scores(evaluate(peer_lm(model, tokenizer, grouped, batch_size=1, ll_chunk=1000), "tiny_oscar_mc",
                             limit=4)["samples"]["tiny_oscar_mc"], [])
    assert FirstForwardWidths.widths and all(w % 5 == 0 for w in FirstForwardWidths.widths)
    plain = scores(evaluate(peer_lm(model, tokenizer, "bf16", batch_size=1, ll_mode="off"), "tiny_oscar_mc",
                            limit=4)["samples"]["tiny_oscar_mc"], [])
    assert padded == pytest.approx(plain, abs=1e-4)


@pytest.mark.parametrize("options, message", [
    (dict(recent_tokens=8), "recent_tokens=8: method=bf16 is a peer cache"),
    (dict(rotations="hadamard"), "rotations='hadamard': method=bf16 is a peer cache"),
    (dict(ll_mode="simulate"), "ll_mode=simulate models an OscarCache; method=bf16"),
])
@pytest.mark.quick
def test_a_peer_method_refuses_settings_only_an_oscar_cache_reads(model_and_tokenizer, options, message):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match=re.escape(message)):
        peer_lm(model, tokenizer, "bf16", **options)


def test_kivi2_runs_a_generation_task_when_quanto_is_installed(model_and_tokenizer, elsewhere):
    pytest.importorskip("optimum.quanto")
    model, tokenizer = model_and_tokenizer
    lm = peer_lm(model, tokenizer, "kivi2", batch_size=1)
    samples = evaluate(lm, "tiny_oscar_gen", limit=2)["samples"]["tiny_oscar_gen"]
    assert len(samples) == 2 and lm.caches_built == 2
