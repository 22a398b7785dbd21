"""Shared fixtures: tiny random models of several families, a tokenizer for the local lm-eval task, and the real
SmolLM2-135M (slow tests only)."""

from __future__ import annotations

import json
import os

import torch

# The Triton kernels' tests (tests/test_kernels_*.py) run through Triton's interpreter where there is no GPU. The
# variable must be set before anything imports triton (transformers and oscar_hf do), so it is set here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import transformers  # noqa: E402

from oscar_hf.compat import cache_argument_name  # noqa: E402

VOCAB = 96
LM_EVAL_TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_task")


def tiny_config(family: str, **overrides):
    """A 2-4 layer random config of `family` with GQA 4:2 and head_dim 16."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=0,
    )
    if family == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**common)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=None)
    elif family == "gemma2":
        cfg = transformers.Gemma2Config(**{**common, "num_hidden_layers": 4}, sliding_window=8,
                                        query_pre_attn_scalar=16)
    elif family == "gemma3":
        cfg = transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 4}, sliding_window=8,
                                            query_pre_attn_scalar=16,
                                            layer_types=["sliding_attention", "full_attention"] * 2)
    elif family in NEW_ARCHITECTURES:
        cfg = NEW_ARCHITECTURES[family](common)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _hybrid(common: dict, **extra) -> dict:
    """Linear attention in 3 of 4 layers (Qwen3.5, Qwen3-Next): small gated-delta-rule heads."""
    return dict(common, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                **extra)


# the architectures users move to (docs/models.md), each in the layout that makes it new: tiny, CPU-fast
NEW_ARCHITECTURES = {
    # linear attention beside full attention
    "qwen3_next": lambda c: transformers.Qwen3NextConfig(**_hybrid(
        c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "qwen3_5": lambda c: transformers.Qwen3_5TextConfig(**_hybrid(c)),
    # Mamba-2 blocks beside attention
    "nemotron_h": lambda c: transformers.NemotronHConfig(
        **{k: v for k, v in c.items() if k != "num_hidden_layers"}, layers_block_type=["mamba", "attention"] * 2,
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2),
    # the last two layers read the K/V of the last earlier layer of their type
    "gemma4": lambda c: transformers.Gemma4TextConfig(
        **dict(c, num_hidden_layers=6), num_kv_shared_layers=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 3, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=c["vocab_size"]),
    # learned sink logits, sliding and full layers
    "gpt_oss": lambda c: transformers.GptOssConfig(
        **dict(c, num_hidden_layers=4), num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2),
    # chunked attention in 3 of 4 layers (NoPE in the fourth)
    "llama4": lambda c: transformers.Llama4TextConfig(
        **dict(c, num_hidden_layers=4), attention_chunk_size=32, num_local_experts=2, intermediate_size_mlp=96,
        no_rope_layers=[1, 1, 1, 0]),
}


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    # transformers refuses sdpa for Gemma2 (soft-capping) and gpt-oss (sink logits)
    attn = "eager" if family in ("gemma2", "gpt_oss") else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    model.generation_config.pad_token_id = 0
    return model


def stored(layer, name: str) -> torch.Tensor:
    """The rows a layer's history holds of buffer `name` (`key_codes`, `value_codes`, ...), not its spare capacity."""
    return getattr(layer.history, name)[:, :, : layer.history_length]


def kernel_qwen3(head_dim: int = 64, layers: int = 2, seed: int = 0, device="cpu"):
    """A tiny Qwen3 whose head_dim the kernels take (GQA 4:2), float32. The output head is scaled up so that greedy
    choices are decisive (random weights otherwise give near-ties that any rounding flips)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=65536, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.to(device=device, dtype=torch.float32)


def forward(model, ids, cache, **kwargs):
    """One forward through `cache` under whichever argument name this transformers release uses."""
    return model(input_ids=ids, use_cache=True, **{cache_argument_name(model): cache}, **kwargs)


def poisoned_output_backend(**options):
    """A `TritonBackend(**options)` whose `tiered_attention` output starts as NaN, so that an element the kernels
    fail to write shows."""
    from oscar_hf.kernels.triton.backend import TritonBackend

    class PoisonedOutput(TritonBackend):
        def new_output(self, shape, dtype, device):
            return torch.full(shape, float("nan"), dtype=dtype, device=device)

    return PoisonedOutput(**options)


def generate(model, ids, cache, **kwargs):
    kwargs.setdefault("do_sample", False)
    return model.generate(ids, **{cache_argument_name(model): cache}, **kwargs)


@pytest.fixture(scope="session")
def smollm2():
    from oscar_hf.eval.assets import load_smollm2

    return load_smollm2()


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = 96, head_dim: int = 32):
    """A random 2-layer Llama with GQA 4:2 and head_dim 32, float32, eval mode (quality-harness tests)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=4 * head_dim, intermediate_size=8 * head_dim, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def tiny_llama_model():
    return tiny_llama()


def char_tokenizer():
    """One token per printable character (no chat template): prompt lengths in characters, for retrieval tests."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable))
    vocab = {c: i for i, c in enumerate(["[UNK]", "[EOS]", *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")


def tiny_tokenizer():
    """A whitespace word-level tokenizer over the words of the local lm-eval task (`lm_eval_task/tiny.jsonl`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = set()
    with open(os.path.join(LM_EVAL_TASKS, "tiny.jsonl")) as f:
        for line in f:
            doc = json.loads(line)
            words.update(doc["context"].split(), doc["answer"].split(), *(c.split() for c in doc["choices"]))
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[EOS]", *sorted(words)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


def extreme_rows(value: float, dim: int = 64, dtype=torch.float32) -> torch.Tensor:
    """Rows `[7, dim]` that put `value` where each encoder's arithmetic is weakest: one element, a +/- pair (the
    widest range), every element +/- (the largest standard deviation), a constant and a near-constant row (the
    zero point), a block of equal elements (what a Hadamard concentrates on one axis), and the negation."""
    g = torch.Generator().manual_seed(int(value) % 1000)
    rows = torch.randn(7, dim, generator=g)
    rows[0, 5] = value
    rows[1, 0], rows[1, 1] = value, -value
    rows[2] = torch.where(rows[2] >= 0, value, -value)
    rows[3] = value
    rows[4] = value * (1 + 1e-3 * torch.randn(dim, generator=g))
    rows[5, : dim // 4] = value
    rows[6] = -rows[4]
    return rows.to(dtype)
