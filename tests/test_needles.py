"""The real-text needle suite: prompts hold the asked-for fact inside the span the cache quantizes, distractors of
the same form beside it; runs through caches and through lm-eval score it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers

from oscar_hf.eval.diagnostics.methods import builtin_methods
from oscar_hf.eval.diagnostics.needle_attention import copy_targets, needle_attention, report_table
from oscar_hf.eval.needles import KINDS, WORDS, make_needle_probe, make_needle_suite
from oscar_hf.eval.retrieval import ANSWER_SEPARATOR, answer_values, is_hit, run_probes, summary_table

from conftest import char_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SINK, RECENT = 64, 256
FORMAT = {"number": r"\d{7}", "words": r"[a-z]+ [a-z]+ [a-z]+", "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("distractors", [0, pytest.param(2, marks=pytest.mark.quick)])
def test_the_needle_sits_in_the_quantized_span_among_its_distractors(kind, distractors):
    tokenizer = char_tokenizer()
    for depth in (0.0, 0.5, 1.0):
        probe = make_needle_probe(tokenizer, 1500, depth, kind, distractors, seed=1, sink=SINK, recent=RECENT)
        text = tokenizer.decode(probe.input_ids[0])
        found = list(re.finditer(rf"The secret \w+ of the (\w+) vault is ({FORMAT[kind]})\.", text))
        assert len(found) == distractors + 1 and len({m[1] for m in found}) == distractors + 1
        target = next(m for m in found if m[2] == probe.answer)
        assert re.fullmatch(FORMAT[kind], probe.answer) and text.count(probe.answer) == 1
        assert text.rstrip().endswith(f"of the {target[1]} vault?")  # the question asks for the target
        assert 1200 < probe.length <= 1500 and probe.input_ids.shape == (1, probe.length)
        at, stop = probe.span  # the sentence's tokens (one token per character)
        assert tokenizer.decode(probe.input_ids[0, at:stop]) == target[0]
        assert tokenizer.decode(probe.input_ids[0, slice(*probe.value_span)]) == probe.answer
        assert SINK <= at and stop <= probe.length - RECENT  # in the 2-bit history
    if kind == "words":
        assert all(word in WORDS for word in probe.answer.split())


def test_depths_order_the_needles_and_seeds_repeat():
    tokenizer = char_tokenizer()
    positions = [make_needle_probe(tokenizer, 3000, d, "number", sink=SINK, recent=RECENT).position
                 for d in (0.1, 0.5, 0.9)]
    assert positions == sorted(positions) and positions[2] - positions[0] > 1500
    one = make_needle_suite(tokenizer, [1000, 1400], [0.3], ["number", "uuid"], [0, 1], seed=4)
    again = make_needle_suite(tokenizer, [1000, 1400], [0.3], ["number", "uuid"], [0, 1], seed=4)
    other = make_needle_suite(tokenizer, [1000, 1400], [0.3], ["number", "uuid"], [0, 1], seed=5)
    assert len(one) == 8 and all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(one, again))
    assert [p.answer for p in one] != [p.answer for p in other]
    with pytest.raises(ValueError, match="no room"):
        make_needle_probe(tokenizer, 120, 0.5, "number", distractors=3)


@pytest.mark.quick
def test_hits_ignore_case_and_quotes():
    assert is_hit("amber harbor lantern", 'The phrase is "Amber Harbor Lantern".')
    assert not is_hit("2651247", "The code is 265124.")


@pytest.mark.quick
def test_a_hit_on_two_asked_values_needs_both():
    answer = ANSWER_SEPARATOR.join(["2651247", "amber harbor lantern"])
    assert answer_values(answer) == ["2651247", "amber harbor lantern"] and answer_values("2651247") == ["2651247"]
    assert is_hit(answer, "Amber Harbor Lantern, and the code is 2651247.")
    assert not is_hit(answer, "The code is 2651247.") and not is_hit(answer, "It is amber harbor lantern.")


def _fingerprint(probe) -> str:
    text = f"{probe.input_ids[0].tolist()}|{probe.answer}|{probe.span}|{probe.value_span}|{probe.kind}|{probe.requested}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def test_one_asked_needle_keeps_the_published_probes():
    # fingerprints of probes as built before probes could ask for several needles: published results were measured
    # on them, so their token ids, answers and spans must not move
    tokenizer = char_tokenizer()
    suite = make_needle_suite(tokenizer, [1500, 2500], [0.2, 0.8], KINDS, [0, 2], seed=0, sink=SINK, recent=RECENT)
    assert [_fingerprint(p) for p in suite[::3]] == [
        "63060c53a45386f1", "e20316899b3243cc", "aed88f87ed6637c7", "51a3fcddedf42cf8",
        "10355f270e371f8a", "8a98c9caf1581baa", "bde542b2f7e23ebb", "ec9004e918ba3d1c"]
    aligned = make_needle_probe(tokenizer, 1500, 0.5, "uuid", 3, seed=2, sink=SINK, recent=RECENT, align=32)
    assert _fingerprint(aligned) == "57307b159691dccb"
    one = [p for p in suite if p.requested == 2500]
    both = make_needle_suite(tokenizer, [2500], [0.2, 0.8], KINDS, [0, 2], seed=0, sink=SINK, recent=RECENT,
                             asked=[1, 2])
    assert [_fingerprint(p) for p in both[: len(one)]] == [_fingerprint(p) for p in one]
    assert [p.kind for p in both[len(one):]] == [f"{p.kind} x2" for p in one]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("distractors", [0, 2])
def test_two_asked_needles_are_both_in_the_prompt_and_in_the_plural_question(kind, distractors):
    tokenizer = char_tokenizer()
    noun = {"number": "codes", "words": "phrases", "uuid": "identifiers"}[kind]
    for length, depth in ((1500, 0.2), (2500, 0.8)):
        probe = make_needle_probe(tokenizer, length, depth, kind, distractors, seed=1, sink=SINK, recent=RECENT,
                                  asked=2)
        text = tokenizer.decode(probe.input_ids[0])
        found = {m[2]: m for m in re.finditer(rf"The secret \w+ of the (\w+) vault is ({FORMAT[kind]})\.", text)}
        assert len(found) == distractors + 2 and probe.kind == f"{kind} x2" and probe.distractors == distractors
        first, second = answer_values(probe.answer)
        assert text.count(first) == 1 and text.count(second) == 1
        question = f"What are the secret {noun} of the {found[first][1]} vault and the {found[second][1]} vault?"
        assert text.rstrip().endswith(question) and probe.message.endswith(question)
        assert length - 300 < probe.length <= length and probe.input_ids.shape == (1, probe.length)
        # span and value_span describe the first asked needle, placed at `depth` in the 2-bit history
        at, stop = probe.span
        assert tokenizer.decode(probe.input_ids[0, at:stop]) == found[first][0]
        assert tokenizer.decode(probe.input_ids[0, slice(*probe.value_span)]) == first
        assert SINK <= at and stop <= probe.length - RECENT
        assert is_hit(probe.answer, f"{second} and {first}") and not is_hit(probe.answer, first)
    with pytest.raises(ValueError, match="asked"):
        make_needle_probe(tokenizer, 1500, 0.5, kind, asked=0)


@pytest.mark.quick
def test_the_cli_asks_for_one_or_two_needles(monkeypatch, tmp_path):
    from oscar_hf.eval import needles

    built = []

    def probes_only(args, prog, argv, make, *rest, **options):  # the suite the CLI would run, without a model
        built.extend(make(char_tokenizer()))
        return 0

    monkeypatch.setattr(needles, "run_cli", probes_only)
    needles.main(["--lengths", "1500", "--depths", "0.5", "--kinds", "number", "--distractors", "0", "--asked", "1,2",
                  "--out", str(tmp_path)])
    assert [p.kind for p in built] == ["number", "number x2"] and ANSWER_SEPARATOR in built[1].answer


def test_an_unquantized_cache_retrieves_exactly_what_bf16_retrieves(tiny_llama_model):
    tokenizer = char_tokenizer()
    config = tiny_llama_model.config.to_dict() | {"vocab_size": 128}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    methods = builtin_methods(sink_tokens=8, recent_tokens=16, demote_block=4)
    probes = make_needle_suite(tokenizer, [700], [0.5], ["number"], [0, 1], sink=8, recent=16)
    results = run_probes(model, tokenizer, probes, [methods["bf16"], methods["none"], methods["hadamard"]],
                         max_new_tokens=6, progress=False)
    by_method = {m: [r for r in results if r.method == m] for m in ("bf16", "none", "hadamard")}
    assert [r.output for r in by_method["none"]] == [r.output for r in by_method["bf16"]]
    assert all(r.hit == is_hit(r.answer, r.output) and r.distractors in (0, 1) for r in results)
    table = summary_table(results, {}).splitlines()
    assert table[0].startswith("| method | 700 tok | total |") and len(table) == 2 + 3


@pytest.mark.quick
def test_lm_eval_task_generates_and_scores_the_suite(tmp_path):
    pytest.importorskip("lm_eval")
    from oscar_hf.eval.lm_eval_tasks.oscar_needles import needle_dataset, process_results

    char_tokenizer().save_pretrained(tmp_path / "tok")
    rows = needle_dataset(lengths=[1500], depths=[0.5], kinds=["uuid"], distractors=[0, 2],
                          pretrained=str(tmp_path / "tok"), version=1.0)["test"]
    assert len(rows) == 2 and all(row["answer"] in row["input"] for row in rows)
    assert process_results(rows[0], [f"It is {rows[0]['answer']}."]) == {"hit": 1.0}
    assert process_results(rows[0], ["no idea"]) == {"hit": 0.0}
    with pytest.raises(ValueError, match="pretrained"):
        needle_dataset(lengths=[800])


def test_oscar_lm_eval_runs_the_needle_task_from_any_directory(tiny_llama_model, tmp_path):
    pytest.importorskip("lm_eval")
    config = tiny_llama_model.config.to_dict() | {"vocab_size": 128, "max_position_embeddings": 2048}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(tmp_path / "model")
    char_tokenizer().save_pretrained(tmp_path / "model")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    metadata = {"lengths": [600], "depths": [0.5], "kinds": ["number"], "distractors": [0]}
    result = subprocess.run(
        [sys.executable, "-m", "oscar_hf.eval.lm_eval", "--model", str(tmp_path / "model"), "--model_args",
         "method=hadamard,sink_tokens=8,recent_tokens=16,demote_block=4",
         "--tasks", "oscar_needles", "--metadata", json.dumps(metadata), "--batch_size", "1", "--device", "cpu",
         "--output_path", str(tmp_path / "results")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "oscar_needles" in result.stdout and "hit" in result.stdout


def _tiny_char_model(tiny_llama_model):
    config = tiny_llama_model.config.to_dict() | {"vocab_size": 128}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()


@pytest.mark.quick
def test_copy_targets_are_the_answer_tokens_that_spell_the_fact():
    tokenizer = char_tokenizer()
    answer = tokenizer("It is 2651247.", add_special_tokens=False).input_ids
    assert copy_targets(tokenizer, answer, "2651247") == list(range(6, 13))
    assert copy_targets(tokenizer, answer, "7654321") == []


def test_needle_trace_sees_no_loss_without_quantization_and_a_loss_with_it(tiny_llama_model):
    from oscar_hf import OscarCache

    tokenizer = char_tokenizer()
    model = _tiny_char_model(tiny_llama_model)
    probes = make_needle_suite(tokenizer, [700], [0.3, 0.7], ["number"], [0], sink=8, recent=16)
    answers = [tokenizer(f"It is {p.answer}.", add_special_tokens=False).input_ids for p in probes]
    options = dict(sink_tokens=8, recent_tokens=16, demote_block=4)
    exact = needle_attention(model, tokenizer, probes, answers, OscarCache(model.config, method="none", **options),
                             progress=False)
    assert exact.probes == 2 and exact.queries == 14 and len(exact.layers) == 2
    assert torch.allclose(exact.tensor("mass_quantized"), exact.tensor("mass_bf16"), atol=1e-6)
    assert exact.tensor("value_error").abs().max() < 1e-5 and exact.tensor("mass_bf16").min() > 0
    assert exact.tensor("rank_quantized").equal(exact.tensor("rank_bf16"))
    # the teacher-forced copy accuracy is BF16's own (an unquantized history changes no argmax)
    bf16 = 0
    for probe, answer in zip(probes, answers):
        ids = torch.cat([probe.input_ids, torch.tensor([answer])], dim=1)
        logits = model(ids).logits[0]
        queries = [probe.length + i - 1 for i in copy_targets(tokenizer, answer, probe.answer) if i > 0]
        bf16 += int((logits[queries].argmax(-1) == ids[0, [q + 1 for q in queries]]).sum())
    assert exact.copy_accuracy == bf16 / 14
    naive = needle_attention(model, tokenizer, probes, answers,
                             OscarCache(model.config, method="identity", **options), progress=False)
    assert naive.tensor("value_error").min() > 0.05
    assert (naive.tensor("mass_quantized") - naive.tensor("mass_bf16")).abs().max() > 1e-5  # exact: < 1e-7
    # a row format passed in replaces the cache's quantizer: reading rows back exactly is the unquantized trace
    through = needle_attention(model, tokenizer, probes, answers,
                               OscarCache(model.config, method="identity", **options),
                               row_format=lambda rows, layer, side: rows, progress=False)
    assert torch.allclose(through.tensor("mass_quantized"), exact.tensor("mass_quantized"), atol=1e-6)
    report = report_table({"identity": naive})
    assert "copy accuracy" in report and report.count("\n| 1 |") + report.count("\n| 0 |") == 8
    with pytest.raises(ValueError, match="no probe"):
        needle_attention(model, tokenizer, probes, [answers[0][:3]] * 2,
                         OscarCache(model.config, method="none", **options), progress=False)


@pytest.mark.quick
def test_aligned_probes_have_lengths_a_grouping_cache_takes_and_keep_their_needles():
    tokenizer = char_tokenizer()
    for kind, distractors in (("number", 0), ("uuid", 3)):
        plain = make_needle_probe(tokenizer, 1500, 0.5, kind, distractors, seed=2, sink=SINK, recent=RECENT)
        aligned = make_needle_probe(tokenizer, 1500, 0.5, kind, distractors, seed=2, sink=SINK, recent=RECENT,
                                    align=32)
        assert aligned.length % 32 == 0 and plain.length - 32 < aligned.length <= plain.length
        assert aligned.answer == plain.answer
        text = tokenizer.decode(aligned.input_ids[0])
        assert tokenizer.decode(aligned.input_ids[0, slice(*aligned.value_span)]) == aligned.answer
        assert text.rstrip().endswith("vault?") and text.count("The secret") == distractors + 1
    default, = make_needle_suite(tokenizer, [1000], [0.3], ["number"], [0], seed=4)
    one, = make_needle_suite(tokenizer, [1000], [0.3], ["number"], [0], seed=4, align=1)
    assert torch.equal(default.input_ids, one.input_ids)  # align=1 leaves the probes of earlier runs
    with pytest.raises(ValueError, match="align"):
        make_needle_probe(tokenizer, 1500, 0.5, "number", align=0)


@pytest.mark.quick
def test_a_grouping_peer_refuses_unaligned_probes_before_any_work(tiny_llama_model, monkeypatch, tmp_path):
    from oscar_hf.eval import needles, retrieval

    monkeypatch.setattr(retrieval, "load_model", lambda *a, **k: (tiny_llama_model, char_tokenizer()))
    monkeypatch.setattr(retrieval, "run_probes", lambda *a, **k: pytest.fail("ran probes it should refuse"))
    with pytest.raises(SystemExit, match="--align 32"):
        needles.main(["--methods", "bf16,kivi2", "--lengths", "1000", "--depths", "0.5", "--kinds", "number",
                      "--distractors", "0", "--out", str(tmp_path), "--no-progress"])
