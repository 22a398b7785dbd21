"""`oscar-lm-eval`: its help documents the OSCAR model_args, its options are the shared oscar-hf ones, the shipped
tasks read their data from any working directory, the package declares lm-eval's model entry point, and the
command runs end to end from outside the repository."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager  # noqa: E402

from oscar_hf.config import OscarConfig  # noqa: E402
from oscar_hf.eval import lm_eval as oscar_lm_eval  # noqa: E402
from oscar_hf.eval.cli_options import default_device  # noqa: E402
from oscar_hf.eval.lm_eval import TASKS, OscarLM, build_parser, lm_eval_arguments, model_args_help  # noqa: E402

from conftest import LM_EVAL_TASKS, tiny_llama, tiny_tokenizer  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.quick
def test_help_documents_every_oscar_model_arg():
    text = build_parser().format_help()
    documented = model_args_help()
    for field in dataclasses.fields(OscarConfig):
        assert documented[field.name][1], f"OscarConfig.{field.name} has no help"  # from OscarConfig's docstring
        assert f"  {field.name} (default: " in text
    for name in ("rotations", "method", "ll_mode", "ll_prefill", "ll_chunk", "progress"):
        assert f"  {name} (default: " in text
    assert "  sink_tokens (default: 64)\n      leading tokens kept in BF16" in text
    assert "hadamard, quarot" in text and "default: hf" not in text
    assert "--model MODEL" in text and "smollm2" in text and "--no-progress" in text


def passed_model_args(command: list[str]) -> dict:
    return json.loads(command[command.index("--model_args") + 1])


@pytest.mark.quick
def test_the_shared_options_become_lm_eval_arguments():
    command = lm_eval_arguments(["--model", "smollm2", "--tasks", "romeo_ppl", "--limit", "2", "--no-progress"])
    assert command[:2] == ["--model", "oscar"]
    assert passed_model_args(command) == {"pretrained": "smollm2", "dtype": "float32", "progress": False}
    assert command[command.index("--device") + 1] == default_device()
    assert command[-2:] == ["--include_path", TASKS] and "--tasks" in command and "--limit" in command

    command = lm_eval_arguments(["--model", "smollm2", "--model_args", "pretrained=smollm2,method=quarot",
                                 "dtype=bfloat16", "--device", "cpu", "--include_path", "mine", "--tasks", "x"])
    assert passed_model_args(command) == {"pretrained": "smollm2", "method": "quarot", "dtype": "bfloat16"}
    assert command[command.index("--device") + 1] == "cpu" and TASKS not in command  # another folder was named
    command = lm_eval_arguments(["--model", "smollm2", "--dtype", "bfloat16", "-a", "sink_tokens=4", "--tasks", "x"])
    assert passed_model_args(command) == {"pretrained": "smollm2", "dtype": "bfloat16", "sink_tokens": 4}


@pytest.mark.parametrize("args, message", [
    (["--model", "hf", "--tasks", "x"], "not an lm-eval model class"),
    (["--model", "oscar", "--tasks", "x"], "not an lm-eval model class"),
    (["--model", "smollm2", "-M", "hf", "--tasks", "x"], "not an lm-eval model class"),
    (["--model", "smollm2", "--model_args", "pretrained=gpt2", "--tasks", "x"], "disagree"),
    (["--model", "smollm2", "--dtype", "float16", "--model_args", "dtype=bfloat16"], "disagree"),
    (["--model_args", "pretrained=smollm2", "--tasks", "x"], "required: --model"),
])
@pytest.mark.quick
def test_contradicting_or_missing_options_are_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        lm_eval_arguments(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.quick
def test_shipped_tasks_read_their_data_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    manager = TaskManager(include_path=[TASKS, LM_EVAL_TASKS], include_defaults=False)
    tasks = manager.load(["romeo_ppl", "tiny_oscar_mc"])["tasks"]
    docs = list(tasks["romeo_ppl"].test_docs())
    assert len(list(tasks["tiny_oscar_mc"].test_docs())) == 6
    assert len(docs) == 2 and docs[0]["text"].startswith("ACT I.")
    assert os.listdir(tmp_path) == []  # nothing was looked for or written here


@pytest.mark.quick
def test_the_package_declares_lm_evals_model_entry_point():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"]["lm_eval.models"]
    assert declared == {"oscar": "oscar_hf.eval.lm_eval:OscarLM"}
    entry = importlib.metadata.EntryPoint(name="oscar", value=declared["oscar"], group="lm_eval.models")
    assert entry.load() is OscarLM
    installed = {e.name: e.value for e in importlib.metadata.entry_points(group="lm_eval.models")}
    if installed:  # an install made from this pyproject (older editable installs lack the group)
        assert installed.get("oscar") == declared["oscar"]


@pytest.mark.slow  # a fresh interpreter importing lm-eval and indexing its tasks: 15-35 s on a shared 2-core CPU
def test_console_script_runs_a_task_from_outside_the_repository(tmp_path):
    model, tokenizer = tiny_llama(seed=7, vocab=64), tiny_tokenizer()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", oscar_lm_eval.__name__, "--model", str(tmp_path / "model"), "--model_args",
         "method=hadamard,sink_tokens=4,recent_tokens=8,demote_block=2", "--tasks", "tiny_oscar_mc,tiny_oscar_gen",
         "--include_path", LM_EVAL_TASKS, "--limit", "2", "--batch_size", "2", "--device", "cpu", "--no-progress",
         "--output_path", str(tmp_path / "results")],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tiny_oscar_mc" in result.stdout and "tiny_oscar_gen" in result.stdout
    assert "it/s]" not in result.stderr  # --no-progress: no tqdm bar at all
    assert time.perf_counter() - start < 300
