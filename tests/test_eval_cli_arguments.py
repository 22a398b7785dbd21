"""The evaluation command lines check every argument before the model loads, naming the option, and a run whose
method failed on every probe exits non-zero instead of reporting its errors as retrieval misses."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from oscar_hf import Rotations
from oscar_hf.eval import needles, passkey, retrieval
from oscar_hf.eval.diagnostics import cli as diagnostics
from oscar_hf.eval.retrieval import ProbeResult, failed_methods

from conftest import char_tokenizer, tiny_llama

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second


@pytest.fixture(autouse=True)
def package_logger():
    """The command lines configure the `oscar_hf` logger (`cli_options.configure_logging`): put it back after."""
    package = logging.getLogger("oscar_hf")
    handlers, level = list(package.handlers), package.level
    yield
    package.handlers[:] = handlers
    package.setLevel(level)


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to load a model fails the test: the arguments must be refused first."""
    def refuse(*args, **kwargs):
        pytest.fail("the model loaded before the arguments were checked")

    monkeypatch.setattr(retrieval, "load_model", refuse)
    monkeypatch.setattr(diagnostics, "load_model", refuse)


@pytest.mark.parametrize("main, argv, message", [
    (passkey.main, ["--lengths", "2k"], "argument --lengths: '2k' is not a positive integer"),
    (needles.main, ["--lengths", "1024,2k"], "argument --lengths: '2k' is not a positive integer"),
    (needles.main, ["--depths", "0.5,1.5"], "argument --depths: '1.5' is not a fraction in"),
    (passkey.main, ["--depths", "middle"], "argument --depths: 'middle' is not a fraction in"),
    (needles.main, ["--kinds", "number,uid"], "argument --kinds: 'uid' is not one of number, words, uuid"),
    (needles.main, ["--distractors", "-1"], "argument --distractors: '-1' is not a non-negative integer"),
    (needles.main, ["--asked", "0"], "argument --asked: '0' is not a positive integer"),
    (needles.main, ["--align", "x"], "argument --align: 'x' is not a positive integer"),
    (passkey.main, ["--max-new-tokens", "0"], "argument --max-new-tokens: '0' is not a positive integer"),
    (diagnostics.main, ["--tokens", "2k"], "argument --tokens: '2k' is not a positive integer"),
    (diagnostics.main, ["--text", "no-such-play.txt"], "--text 'no-such-play.txt' is neither a file nor a play"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_a_malformed_argument_stops_the_command_line_naming_its_option(main, argv, message, no_model_loads, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2  # argparse's usage error
    assert message in capsys.readouterr().err


def test_the_list_arguments_parse_to_values(monkeypatch, tmp_path):
    built = {}

    def probes_only(args, *rest, **options):
        built.update(vars(args))
        return 0

    monkeypatch.setattr(needles, "run_cli", probes_only)
    needles.main(["--lengths", "1024, 2048", "--depths", "0,1", "--kinds", "uuid", "--distractors", "0,3",
                  "--out", str(tmp_path)])
    assert built["lengths"] == [1024, 2048] and built["depths"] == [0.0, 1.0] and built["kinds"] == ["uuid"]
    assert built["distractors"] == [0, 3] and built["asked"] == [1]  # a default goes through its type too


@pytest.mark.parametrize("main", [needles.main, passkey.main, diagnostics.main],
                         ids=["oscar-needles", "oscar-passkey", "oscar-diagnostics"])
def test_rotations_that_do_not_exist_stop_the_run_before_the_model_loads(main, no_model_loads, tmp_path, capsys):
    missing = str(tmp_path / "no-such-rotations")
    with pytest.raises(SystemExit) as stop:
        main(["--rotations", missing, "--methods", "oscar", "--out", str(tmp_path)])
    said = str(stop.value.code) + capsys.readouterr().err
    assert stop.value.code != 0 and "--rotations" in said and "no such local folder" in said


def test_damaged_rotations_stop_the_run_before_the_model_loads(no_model_loads, tmp_path):
    (tmp_path / "rotations").mkdir()
    (tmp_path / "rotations" / "oscar_rotations.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(SystemExit, match="--rotations: .*not a readable safetensors file"):
        passkey.main(["--rotations", str(tmp_path / "rotations"), "--methods", "oscar", "--out", str(tmp_path)])


def test_a_method_that_fails_on_every_probe_fails_the_run_after_writing_the_results(monkeypatch, tmp_path):
    """Rotations for another model (head_dim 16; the model's is 32) load, then fail every cache built on them: the
    run must not end as if the method had found nothing."""
    eye = torch.eye(16)
    Rotations({0: eye, 1: eye}, {0: eye, 1: eye}, metadata={"objective": "test"}).save_pretrained(tmp_path / "r")
    monkeypatch.setattr(retrieval, "load_model", lambda *a, **k: (tiny_llama(vocab=128), char_tokenizer()))
    with pytest.raises(SystemExit) as stop:
        passkey.main(["--rotations", str(tmp_path / "r"), "--methods", "bf16,oscar", "--lengths", "480",
                      "--depths", "0.5", "--max-new-tokens", "2", "--no-progress", "--out", str(tmp_path / "out")])
    assert stop.value.code not in (0, None)
    assert "1 method(s) failed on every probe" in str(stop.value.code) and "oscar: RotationFileError" in str(
        stop.value.code)
    results = json.loads((tmp_path / "out" / "passkey.json").read_text())["results"]
    assert [(r["method"], bool(r["error"])) for r in results] == [("bf16", False), ("oscar", True)]


def test_a_method_that_answers_some_probes_has_not_failed():
    def result(method, error):
        return ProbeResult(method, "passkey", 480, 480, 0.5, 0, "12345", "x", False, 0.0, [], error)

    results = [result("a", "ValueError: x"), result("a", ""), result("b", "OSError: y"), result("b", "OSError: z")]
    assert failed_methods(results) == {"b": "OSError: y"}
