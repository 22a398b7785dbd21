"""lm-evaluation-harness (0.4.x) through `OscarCache`: the lm-eval model `oscar` (`OscarLM`, an `HFLM`) and the
command line `oscar-lm-eval` (also `python -m oscar_hf.eval.lm_eval`).

    oscar-lm-eval --model smollm2 --tasks romeo_ppl --limit 2
    oscar-lm-eval --model Qwen/Qwen3-8B --dtype bfloat16 --model_args rotations=<folder>,method=oscar \
        --tasks gsm8k --limit 50 --batch_size 4

`--model`, `--dtype`, `--device` and `--no-progress` mean what they mean in every oscar-hf command (`--model` is
the checkpoint: a folder, a Hub repo id or `smollm2`); every other flag is lm-eval's own. `oscar-lm-eval --help`
lists the model_args (`MODEL_ARGS`): the `OscarConfig` fields, `rotations`, `method`, and how loglikelihood
requests are scored (`ll_mode`):
- `simulate` (default): decode-equivalent scoring (`oscar_hf.eval.decode_equivalent`). Each request is scored as
  if its context had been prefilled into a fresh `OscarCache` and its continuation then decoded token by token,
  so every scored token from the second continuation token on attends to the quantized history exactly as in
  generation (the first is predicted by the prefill, which is BF16 in the real cache too). One forward per batch.
- `chunked`: the real cache, fed in forwards of `ll_chunk` tokens (a cross-check; depends on the chunk size).
- `off`: plain HFLM (one prefill forward: KV quantization has no effect at all).
`generate_until` requests get one fresh `OscarCache` per `generate` call (per batch).

`method` may also name a peer cache of the side-by-side tables (`BASELINES`: `bf16`, `kivi2`, `turboquant2`, ...,
`eval.diagnostics.methods`), run in place of the OscarCache, so a task scores OSCAR and its peers the same way:

    oscar-lm-eval --model smollm2 --model_args method=kivi2 --tasks oscar_needles --limit 6

A peer is scored with its real cache (`ll_mode=chunked`, the default for peers; `simulate` models OscarCache
only). A peer that quantizes whole groups of tokens from its first forward (`kivi2`: 32) gets prompts left-padded
to a multiple of the group, the padding masked out, and a first scoring forward right-padded the same way.

lm-eval 0.4.13 resolves `--model` names from its own static table only (entry points of installed packages are
read from its next release on), so `lm_eval --model oscar` needs this module imported first: `oscar-lm-eval`
does that. The package declares the `lm_eval.models` entry point `oscar` for the releases that read it.
lm-eval is an optional dependency (`pip install oscar-hf[eval]`); `oscar_hf` imports without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import json
import os
import re
import shutil
import sys
import textwrap

import torch
from transformers.utils import logging

try:
    from lm_eval._cli.utils import MergeDictAction
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("oscar_hf.eval.lm_eval needs lm-eval: pip install 'oscar-hf[eval]' (lm-eval==0.4.13)") from e

from oscar_hf.cache import OscarCache, use_oscar_attention
from oscar_hf.compat import cache_argument_name
from oscar_hf.config import PRESETS, SCALE_DTYPES, OscarConfig
from oscar_hf.eval.assets import SMOLLM2_ALIASES, load_model
from oscar_hf.eval.cli_options import (
    add_model_arguments,
    add_progress_argument,
    default_device,
    resolve_device,
    resolve_dtype,
)
from oscar_hf.eval.decode_equivalent import SimulationPlan, simulate_logits
from oscar_hf.eval.diagnostics.methods import PEER_METHODS, Method, builtin_methods
from oscar_hf.eval.lm_eval_rows import RowIndex, rounds

logger = logging.get_logger(__name__)

LL_MODES = ("simulate", "chunked", "off")
BASELINES = ("bf16", *PEER_METHODS)  # `method` names that run a peer cache instead of an OscarCache
TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
SHIPPED_TASKS = ("romeo_ppl", "oscar_needles")  # the task files in TASKS

# model_args of OscarLM itself (the OscarConfig fields come on top): name -> (default shown, help)
WRAPPER_ARGS: dict[str, tuple[str, str]] = {
    "rotations": ("the method's", "a folder or file written by oscar-calibrate, a Hub repo id, 'hadamard' or "
                                  "'identity'"),
    "method": ("'oscar' with rotations from a file, folder or repo, else 'hadamard'",
               "the OscarConfig preset: " + ", ".join(PRESETS) + "; or a peer cache run instead of the OscarCache: "
               + ", ".join(BASELINES)),
    "ll_mode": ("simulate; chunked for a peer method",
                "loglikelihood scoring: simulate (decode-equivalent, as if the context were prefilled into a fresh "
                "cache and the continuation decoded), chunked (the real cache in ll_chunk-token forwards), off "
                "(plain HFLM: quantization has no effect)"),
    "ll_prefill": ("context", "prefill of simulated scoring: 'context', or N (only the first N tokens; 1 decodes "
                              "everything)"),
    "ll_chunk": ("64", "forward size of ll_mode=chunked, in tokens"),
    "progress": ("True", "False hides the request progress bars (what oscar-lm-eval --no-progress sets)"),
}
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(OscarConfig) if f.name != "method")
HFLM_ARGS = tuple(name for name in inspect.signature(HFLM.__init__).parameters if name not in ("self", "kwargs"))


def _config_field_help() -> dict[str, str]:
    """First sentence of each field's entry in `OscarConfig`'s docstring (`a / b: text` documents both)."""
    text = inspect.getdoc(OscarConfig).split("Args:", 1)[1]
    entries: dict[str, str] = {}
    names: list[str] = []
    for line in text.splitlines():
        entry = re.match(r"^ {4}(\w+(?: / \w+)*): (.*)$", line)
        if entry:
            names = entry.group(1).split(" / ")
            entries.update(dict.fromkeys(names, entry.group(2)))
        elif line.startswith(" " * 8):
            for name in names:
                entries[name] += " " + line.strip()
    return {name: re.split(r"(?<=\.)\s+(?=[A-Z`])", doc)[0].rstrip(".") for name, doc in entries.items()}


def _shown_default(field: dataclasses.Field) -> str:
    if field.default == ():
        shown = "none"
    elif isinstance(field.default, torch.dtype):
        shown = next(name for name, dtype in SCALE_DTYPES.items() if dtype == field.default)
    else:
        shown = str(field.default)
    return f"the method's; hadamard: {shown}" if any(getattr(preset, field.name) != field.default for preset in PRESETS.values()) else shown


def model_args_help() -> dict[str, tuple[str, str]]:
    """Every OSCAR model_arg: name -> (default shown, help). The `OscarConfig` fields take their help from its
    docstring, so a new field is documented here once it is documented there."""
    docs = _config_field_help()
    fields = {f.name: f for f in dataclasses.fields(OscarConfig)}
    config = {name: (_shown_default(fields[name]), docs.get(name, "")) for name in CONFIG_FIELDS}
    return {"rotations": WRAPPER_ARGS["rotations"], "method": WRAPPER_ARGS["method"], **config,
            **{k: v for k, v in WRAPPER_ARGS.items() if k not in ("rotations", "method")}}


MODEL_ARGS = tuple(model_args_help())


def _unknown_model_arg(name: str, reason: str) -> ValueError:
    near = difflib.get_close_matches(name, MODEL_ARGS + HFLM_ARGS, n=1, cutoff=0.75)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ValueError(f"unknown model_arg {name!r}{hint}: {reason}. OSCAR model_args: {', '.join(MODEL_ARGS)}; "
                      f"lm-eval HFLM's: {', '.join(HFLM_ARGS)} (`oscar-lm-eval --help` describes the OSCAR ones)")


def check_model_args(pretrained, model_args: dict) -> list[str]:
    """The model_args that neither OscarLM nor HFLM takes (they go on to `from_pretrained`), after rejecting those
    that nothing would take: one that looks like an OSCAR or HFLM argument, and any at all when `pretrained` is a
    loaded model or `smollm2` (no `from_pretrained` call)."""
    passed_on = [k for k in model_args if k not in MODEL_ARGS and k not in HFLM_ARGS]
    preloaded = not isinstance(pretrained, str) or pretrained in SMOLLM2_ALIASES
    for name in passed_on:
        if preloaded:
            raise _unknown_model_arg(name, f"pretrained={pretrained if isinstance(pretrained, str) else 'a model'} "
                                           "is loaded without from_pretrained, so nothing would take it")
        if difflib.get_close_matches(name, MODEL_ARGS + HFLM_ARGS, n=1, cutoff=0.75):
            raise _unknown_model_arg(name, "it would go to from_pretrained")
    return passed_on


@register_model("oscar")
class OscarLM(HFLM):
    """HFLM whose generation runs through `OscarCache` and whose scoring sees the quantized history.

    Takes HFLM's arguments, `rotations`, `method`, any `OscarConfig` field, and the scoring options `ll_mode`,
    `ll_prefill`, `ll_chunk`, `progress` (`MODEL_ARGS`); other arguments go to `from_pretrained` when `pretrained`
    names a checkpoint, and are rejected with the list of valid ones when nothing takes them. `pretrained` may be
    a folder, a Hub repo id, one of `SMOLLM2_ALIASES` (the offline SmolLM2-135M) or a loaded model. `method` may
    name a peer cache (`BASELINES`) or be an `eval.diagnostics.methods.Method`: that cache then replaces the
    OscarCache, scored with `ll_mode=chunked`.
    """

    def __init__(self, pretrained, rotations: str | None = None, method: str | Method | None = None,
                 ll_mode: str | None = None, ll_prefill: str | int = "context", ll_chunk: int = 64,
                 progress: bool = True, **kwargs):
        if ll_mode is not None and ll_mode not in LL_MODES:
            raise ValueError(f"ll_mode={ll_mode!r}: expected one of {LL_MODES}")
        if ll_prefill != "context" and (not isinstance(ll_prefill, int) or ll_prefill < 1):
            raise ValueError(f"ll_prefill={ll_prefill!r}: expected 'context' or an integer >= 1")
        passed_on = check_model_args(pretrained, kwargs)
        self.oscar_options = {k: kwargs.pop(k) for k in list(kwargs) if k in CONFIG_FIELDS}
        self.baseline = _baseline(method, rotations, self.oscar_options, ll_mode)
        if self.baseline is None:
            OscarConfig.from_method(method or "hadamard", **self.oscar_options)  # bad values fail before loading
        ll_mode = ll_mode or ("chunked" if self.baseline is not None else "simulate")
        self.oscar_rotations, self.oscar_method = rotations, method
        self.ll_mode, self.ll_prefill, self.ll_chunk = ll_mode, ll_prefill, int(ll_chunk)
        self.progress = bool(progress)
        if kwargs.get("device") is None:
            kwargs["device"] = default_device()
        if pretrained in SMOLLM2_ALIASES:
            dtype = kwargs.pop("dtype", "float32")
            model, tokenizer = load_model(pretrained, dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype),
                                          kwargs["device"])
            pretrained, kwargs["tokenizer"] = model, kwargs.get("tokenizer") or tokenizer
        try:
            super().__init__(pretrained=pretrained, **kwargs)
        except TypeError as e:  # from_pretrained hands what it does not know to the model class
            rejected = [name for name in passed_on if repr(name) in str(e)]
            if rejected:
                raise _unknown_model_arg(rejected[0], f"{type(e).__name__}: {e}") from e
            raise
        self._row_index: RowIndex | None = None
        self.caches_built = 0
        if self.baseline is not None:
            self._template = None
            logger.info("lm-eval model oscar: peer cache %s (%s), ll_mode=%s", self.baseline.name, self.baseline.label,
                        ll_mode)
            return
        use_oscar_attention(self.model)
        self._template = self.new_cache(template=True)
        logger.info("lm-eval model oscar: %s, rotations=%s, ll_mode=%s", self._template.oscar_config,
                    rotations if rotations is not None else self._template.oscar_config.rotation, ll_mode)

    # ------------------------------------------------------------------------------------------ caches
    def new_cache(self, template: bool = False):
        """A fresh cache for one generate call (or, `template=True`, an unused OscarCache for its settings): the
        OscarCache, or the peer's cache when `method` names one."""
        if self.baseline is not None and not template:
            self.caches_built += 1
            return self.baseline.build(self.model)
        target = self.model.config if template else self.model
        if not template:
            self.caches_built += 1
        return OscarCache(target, rotations=self.oscar_rotations, method=self.oscar_method, **self.oscar_options)

    @property
    def _group(self) -> int:
        """Prompt lengths the cache takes in its first forward (a multiple of this)."""
        return self.baseline.prefix_multiple if self.baseline is not None else 1

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        generation_kwargs[cache_argument_name(self.model)] = self.new_cache()
        pad = -context.shape[1] % self._group
        if not pad:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        # Left padding, masked out, as HFLM pads the shorter prompts of a batch; HFLM cuts the answer at the
        # prompt's unpadded width, so the padding comes off again.
        mask = generation_kwargs.pop("attention_mask", None)
        if mask is None:
            mask = torch.ones_like(context)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        context = torch.nn.functional.pad(context, (pad, 0), value=pad_id)
        generation_kwargs["attention_mask"] = torch.nn.functional.pad(mask, (pad, 0), value=0)
        return super()._model_generate(context, max_length + pad, stop, **generation_kwargs)[:, pad:]

    # ------------------------------------------------------------------------------------------ requests
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm or not self.progress)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return super().generate_until(requests, disable_tqdm=disable_tqdm or not self.progress)

    # ------------------------------------------------------------------------------------------ scoring
    def _input_row(self, context: list[int], continuation: list[int]) -> tuple[int, ...]:
        """The input row HFLM builds for a causal request: context + continuation without its last token, cut
        from the left to `max_length`."""
        return tuple((context + continuation)[-(self.max_length + 1):][:-1])

    def _request_prefill(self, row: tuple[int, ...], continuation: list[int]) -> int:
        context_part = len(row) - len(continuation) + 1
        prefill = context_part if self.ll_prefill == "context" else min(int(self.ll_prefill), context_part)
        return max(prefill, 1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        if self.ll_mode != "simulate" or self.backend != "causal" or not requests:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        # Each batch row's prefill is looked up among the rows of the requests scored with it (`lm_eval_rows`);
        # requests whose rows would make that ambiguous are scored in separate rounds.
        rows = [self._input_row(context, continuation) for _, context, continuation in requests]
        prefills = [self._request_prefill(row, continuation) for row, (_, _, continuation) in zip(rows, requests)]
        assigned = rounds(rows, prefills)
        results = [None] * len(requests)
        for round_ in range(max(assigned) + 1):
            members = [i for i, r in enumerate(assigned) if r == round_]
            self._row_index = RowIndex({rows[i]: prefills[i] for i in members})
            try:
                scored = super()._loglikelihood_tokens([requests[i] for i in members], disable_tqdm=disable_tqdm,
                                                       override_bs=override_bs)
            finally:
                self._row_index = None
            for i, result in zip(members, scored, strict=True):
                results[i] = result
        return results

    def _row_prefill(self, row: list[int]) -> int:
        """Prefill length of one right-padded batch row: its request's, or 1 for a row HFLM made up itself (its
        batch-size probe)."""
        found = self._row_index.prefill_of(row) if self._row_index is not None else None
        return 1 if found is None else found

    def _model_call(self, inps, attn_mask=None, labels=None):
        if self.backend != "causal" or self.ll_mode == "off" or attn_mask is not None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        with torch.no_grad():
            if self.ll_mode == "simulate":
                prefills = [self._row_prefill(row) for row in inps.tolist()]
                plan = SimulationPlan.from_cache(self._template, prefill=prefills)
                return simulate_logits(self.model, inps, plan)
            return self._chunked_logits(inps)

    def _chunked_logits(self, inps: torch.Tensor) -> torch.Tensor:
        """The real cache fed `ll_chunk` tokens per forward; the first forward is rounded up to the cache's group,
        and when it is the whole row and shorter, right-padded to it (causal: the padding changes no logit kept,
        and no later forward reads it)."""
        cache = self.new_cache()
        name = cache_argument_name(self.model)
        group = self._group
        first = -(-self.ll_chunk // group) * group
        starts = [0, *range(first, inps.shape[1], self.ll_chunk)]
        pieces = []
        for start, stop in zip(starts, [*starts[1:], inps.shape[1]]):
            piece = inps[:, start:stop]
            width = piece.shape[1]
            if start == 0 and width % group:
                piece = torch.nn.functional.pad(piece, (0, -width % group), value=0)
            pieces.append(self.model(input_ids=piece, use_cache=True, **{name: cache}).logits[:, :width])
        return torch.cat(pieces, dim=1)


def _baseline(method, rotations, oscar_options: dict, ll_mode: str | None) -> Method | None:
    """The peer `Method` that `method` names (or is), else None (an OscarConfig preset); ValueError for settings
    that only an OscarCache reads."""
    if isinstance(method, Method):
        found = method
    elif method in BASELINES:
        found = builtin_methods()[method]
    else:
        return None
    if found.oscar:
        raise ValueError(f"method={found.name!r} builds an OscarCache: pass its preset name instead")
    for name, value in (("rotations", rotations), *oscar_options.items()):
        if value is not None:
            raise ValueError(f"{name}={value!r}: method={found.name} is a peer cache ({found.label}), which takes "
                             "no OSCAR settings")
    if ll_mode == "simulate":
        raise ValueError(f"ll_mode=simulate models an OscarCache; method={found.name} is scored with its real "
                         "cache: ll_mode=chunked (the default for peers) or off")
    return found


# ---------------------------------------------------------------------------------------------- command line
def _given(args: list[str], *flags: str) -> bool:
    return any(a in flags or a.split("=", 1)[0] in flags for a in args)


def _model_args_epilog(width: int) -> str:
    lines = ["OSCAR model_args (--model_args key=value,key=value; oscar_hf.OscarConfig documents the fields):"]
    for name, (default, text) in model_args_help().items():
        lines.append(f"  {name} (default: {default})")
        lines += textwrap.wrap(text, width=width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                               break_on_hyphens=False)
    notes = [
        "Other model_args go to lm-eval's HFLM (batch_size, max_length, trust_remote_code, add_bos_token, ...) and, "
        "for a checkpoint loaded from a folder or the Hub, to from_pretrained; a name that none of them takes is "
        "rejected with the lists of valid ones.",
        "Every other flag is lm-eval's own (--tasks, --limit, --batch_size, --num_fewshot, --gen_kwargs, "
        "--output_path, --log_samples, ...): `lm-eval run --help` lists them. `oscar-lm-eval ls tasks` and "
        "`oscar-lm-eval validate --tasks ...` are lm-eval's subcommands. This package's tasks "
        f"({', '.join(SHIPPED_TASKS)}) are on the include path unless --include_path names another folder.",
        "lm_eval --model oscar: lm-eval 0.4.13 resolves model names from its own table only, so it finds `oscar` "
        "only once this module is imported, which oscar-lm-eval (or python -m oscar_hf.eval.lm_eval) does; the "
        "package declares the lm_eval.models entry point for the lm-eval releases that read entry points.",
    ]
    for note in notes:
        lines += ["", *textwrap.wrap(note, width=width, break_on_hyphens=False)]
    lines += ["", "examples:", "  oscar-lm-eval --model smollm2 --tasks romeo_ppl --limit 2",
              "  oscar-lm-eval --model Qwen/Qwen3-8B --dtype bfloat16 --model_args rotations=<folder>,method=oscar "
              "--tasks gsm8k --batch_size 8"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The options oscar-lm-eval reads itself; the rest go to lm-eval unchanged."""
    width = min(shutil.get_terminal_size().columns, 120) - 2
    description = ("lm-eval's `run` with the model `oscar`: HFLM whose generation runs through a fresh OscarCache "
                   "per batch and whose loglikelihood requests are scored decode-equivalently.")
    parser = argparse.ArgumentParser(
        prog="oscar-lm-eval", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="oscar-lm-eval --model MODEL [--model_args KEY=VALUE,...] --tasks TASK[,TASK] [lm-eval options]",
        description=textwrap.fill(description, width=width), epilog=_model_args_epilog(width))
    add_model_arguments(parser)
    parser.add_argument("--model_args", "-a", nargs="+", action=MergeDictAction, default=None, metavar="KEY=VALUE",
                        help="model_args, as lm-eval takes them (key=value,key=value or JSON): the OSCAR ones below, "
                             "HFLM's, from_pretrained's")
    add_progress_argument(parser)
    return parser


def lm_eval_arguments(args: list[str]) -> list[str]:
    """The `lm-eval run` arguments of an oscar-lm-eval command line (exits with a usage error on a bad one)."""
    from lm_eval.models import MODEL_MAPPING

    parser = build_parser()
    known, rest = parser.parse_known_args(args)
    model_args = dict(known.model_args or {})
    if _given(rest, "-M") or ((known.model in MODEL_MAPPING or known.model == "oscar")
                              and not os.path.exists(known.model)):
        parser.error("--model names the checkpoint here (a folder, a Hub repo id or smollm2), as in every oscar-hf "
                     "command, not an lm-eval model class: oscar-lm-eval always evaluates through 'oscar' (run "
                     "lm-eval itself for another one)")
    if model_args.get("pretrained", known.model) != known.model:
        parser.error(f"--model {known.model} and --model_args pretrained={model_args['pretrained']} disagree")
    model_args["pretrained"] = known.model
    if _given(args, "--dtype"):
        if model_args.get("dtype", known.dtype) != known.dtype:
            parser.error(f"--dtype {known.dtype} and --model_args dtype={model_args['dtype']} disagree")
        model_args["dtype"] = known.dtype
    model_args.setdefault("dtype", known.dtype)
    if known.no_progress:
        model_args["progress"] = False  # HFLM's request bars, which set `disable` themselves
    command = ["--model", "oscar", "--model_args", json.dumps(model_args), "--device", resolve_device(known.device),
               *rest]
    return command if _given(rest, "--include_path") else [*command, "--include_path", TASKS]


def hide_progress_bars() -> None:
    """No progress bars in this process: transformers' and datasets' through their switches, and every other tqdm
    bar that does not set `disable` itself through tqdm's default, as `TQDM_DISABLE=1` would set it had it been in
    the environment before tqdm was imported (lm-eval's own bars; its request bars follow `progress=False`)."""
    import datasets
    import tqdm

    logging.disable_progress_bar()
    datasets.disable_progress_bars()
    tqdm.tqdm.__init__ = functools.partialmethod(tqdm.tqdm.__init__, disable=True)


def main(argv: list[str] | None = None) -> None:
    """`oscar-lm-eval`: lm-eval's CLI with the model `oscar`, the shared oscar-hf options and this package's tasks
    on the include path (unless another folder is named)."""
    from lm_eval.__main__ import cli_evaluate

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["ls"], ["validate"]):
        command = args if _given(args, "--include_path") else [*args, "--include_path", TASKS]
    else:
        if args[:1] == ["run"]:
            args = args[1:]
        if not args:
            build_parser().print_help()
            return
        command = ["run", *lm_eval_arguments(args)]
        if "--no-progress" in args:
            hide_progress_bars()
    sys.argv = ["lm-eval", *command]
    cli_evaluate()


if __name__ == "__main__":
    main()
