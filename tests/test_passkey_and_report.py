"""Passkey prompts are built as specified and scored end to end; reports round-trip through results.json."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from oscar_hf.eval.diagnostics.methods import builtin_methods
from oscar_hf.eval.diagnostics.report import load_results, write_report
from oscar_hf.eval.diagnostics.run import RunSettings, run_methods
from oscar_hf.eval.passkey import INTRO, NEEDLE, QUESTION, make_probe, make_probes
from oscar_hf.eval.retrieval import run_probes, summary_table

from conftest import char_tokenizer


@pytest.mark.quick
def test_probe_has_the_requested_length_and_the_key_at_its_depth():
    tokenizer = char_tokenizer()
    needle = NEEDLE.format(key="12345")
    for depth in (0.1, 0.5, 0.9):
        probe = make_probe(tokenizer, 4010, depth, "12345")
        assert probe.length == 4000 and probe.input_ids.shape == (1, 4000)  # a multiple of 32, at most 4010
        text = tokenizer.decode(probe.input_ids[0])
        assert text.startswith(INTRO) and text.endswith(QUESTION) and text.count(needle) == 1
        haystack = len(text) - len(INTRO) - len(needle) - len(QUESTION)
        assert abs((text.index(needle) - len(INTRO)) / haystack - depth) < 0.03  # within one filler sentence
    keys = [p.answer for p in make_probes(tokenizer, [400, 600], [0.2, 0.8], seed=3)]
    assert len(set(keys)) == 4 and all(len(k) == 5 and k.isdigit() for k in keys)
    assert keys == [p.answer for p in make_probes(tokenizer, [400, 600], [0.2, 0.8], seed=3)]  # reproducible


def test_passkey_runs_every_method_and_scores_hits(tiny_llama_model):
    tokenizer = char_tokenizer()
    config = tiny_llama_model.config
    model = tiny_llama_model.__class__(config.__class__(**{**config.to_dict(), "vocab_size": 128}))
    model.eval()
    methods = builtin_methods(sink_tokens=4, recent_tokens=8, demote_block=4)
    probes = make_probes(tokenizer, [480], [0.5])
    results = run_probes(model, tokenizer, probes, [methods["bf16"], methods["hadamard"]], max_new_tokens=5,
                          progress=False)
    assert [r.method for r in results] == ["bf16", "hadamard"]
    assert all(r.hit == (r.answer in r.output) for r in results)
    plain = run_probes(model, tokenizer, probes, [methods["hadamard"]], max_new_tokens=5, shared_prefill=False,
                        progress=False)
    assert plain[0].output == results[1].output
    assert summary_table(results, {}).splitlines()[2].startswith("| bf16 | ")


@pytest.mark.quick
def test_report_round_trips_through_results_json(tiny_llama_model, tmp_path):
    methods = builtin_methods(sink_tokens=4, recent_tokens=8, demote_block=4)
    ids = torch.randint(0, tiny_llama_model.config.vocab_size, (1, 40))
    results = run_methods(tiny_llama_model, ids, [methods["bf16"], methods["identity"]],
                          RunSettings(tokens=40, prefill=16, chunk=4, replay_chunk=4, generate=4, progress=False))
    report = write_report(results, str(tmp_path), "tiny", "cmd", {"tokens": 40})
    text = open(report).read()
    assert "| identity |" in text and "- `identity`: naive INT2" in text
    if importlib.util.find_spec("matplotlib") is not None:  # plots need the [eval] extra; the report does not
        assert os.path.isfile(tmp_path / "layers.png") and "](layers.png)" in text
    loaded, data = load_results(str(tmp_path / "results.json"))
    assert [r.name for r in loaded] == ["bf16", "identity"] and data["command"] == "cmd"
    assert loaded[1].perplexity == pytest.approx(results[1].perplexity)
    assert loaded[1].layers[0].attention_kl == pytest.approx(results[1].layers[0].attention_kl)
    assert results[0].next_token_kl == 0.0 and results[1].next_token_kl > 0
    # chunks of the demotion block after a block-aligned prefill are decode-exact (see run.py)
    assert results[1].perplexity == pytest.approx(results[1].decode_perplexity, rel=1e-5)


@pytest.mark.quick
def test_a_rotations_folder_drops_into_the_oscar_rows(tiny_llama_model, tmp_path):
    from oscar_hf import Rotations
    from oscar_hf.rotations.math import hadamard_matrix

    # any orthogonal per-layer rotations saved in the library's format stand in for calibrated ones
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))
    r = (q @ hadamard_matrix(32)).float()
    Rotations({0: r, 1: r}, {0: r, 1: r}, metadata={"objective": "test"}).save_pretrained(tmp_path)
    methods = builtin_methods(rotations=str(tmp_path), sink_tokens=4, recent_tokens=8, demote_block=4)
    assert methods["oscar"].label == "OSCAR (calibrated), with demote_block=4, recent_tokens=8, sink_tokens=4"
    cache = methods["oscar"].build(tiny_llama_model)
    assert cache.oscar_config.method == "oscar" and torch.allclose(cache.layers[0].key_rotation, r)
    assert methods["oscar4"].build(tiny_llama_model).oscar_config.bits == 4
    # without rotations `oscar` is not Hadamard in disguise: the cache refuses it, `hadamard` is the data-free row
    with pytest.raises(ValueError, match="calibrated rotations"):
        builtin_methods()["oscar"].build(tiny_llama_model)
    assert builtin_methods()["hadamard"].build(tiny_llama_model).oscar_config.method == "hadamard"
