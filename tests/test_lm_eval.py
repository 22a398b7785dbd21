"""The lm-eval wrapper on a tiny local task: scoring equals real decoding through OscarCache, batches agree,
generation runs through a fresh OscarCache per call, and the CLI entry point runs end to end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from oscar_hf import OscarCache  # noqa: E402
from oscar_hf.compat import cache_argument_name  # noqa: E402
from oscar_hf.eval.diagnostics.generation import greedy_through_cache  # noqa: E402
from oscar_hf.eval.lm_eval import OscarLM  # noqa: E402

from conftest import LM_EVAL_TASKS as TASKS  # noqa: E402
from conftest import tiny_llama, tiny_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
def repo_cwd():
    old = os.getcwd()
    os.chdir(REPO)  # the task YAML names its jsonl relative to the repository root
    yield
    os.chdir(old)


@pytest.fixture(scope="module")
def batch_one(model_and_tokenizer, repo_cwd):
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


def test_batches_give_the_same_scores_and_quantization_matters(model_and_tokenizer, batch_one, repo_cwd):
    model, tokenizer = model_and_tokenizer
    _, mc, ppl = batch_one
    batched = oscar_lm(model, tokenizer, batch_size=3)
    got = scores(evaluate(batched, "tiny_oscar_mc", limit=4)["samples"]["tiny_oscar_mc"],
                 evaluate(batched, "tiny_oscar_ppl", limit=3)["samples"]["tiny_oscar_ppl"])
    assert got == pytest.approx(scores(mc, ppl), abs=1e-4)
    plain = oscar_lm(model, tokenizer, batch_size=3, ll_mode="off")
    off = scores(evaluate(plain, "tiny_oscar_mc", limit=4)["samples"]["tiny_oscar_mc"], [])
    assert max(abs(a - b) for a, b in zip(off, scores(mc, []))) > 1e-3  # a plain forward misses the history


def test_generation_runs_through_a_fresh_oscar_cache_per_call(model_and_tokenizer, repo_cwd):
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


def test_command_line_entry_point_runs_the_local_task(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "oscar_hf.eval.lm_eval", "--model_args",
         f"pretrained={tmp_path / 'model'},method=hadamard,sink_tokens=4,recent_tokens=8,demote_block=2",
         "--tasks", "tiny_oscar_mc,tiny_oscar_gen", "--include_path", TASKS, "--limit", "2", "--batch_size", "2",
         "--device", "cpu", "--output_path", str(tmp_path / "results")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tiny_oscar_mc" in result.stdout and "tiny_oscar_gen" in result.stdout
