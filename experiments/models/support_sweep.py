"""Which causal-LM families of the installed transformers `OscarCache` runs, checked on tiny random models.

    python -m experiments.models.support_sweep [--families llama,gemma3] [--out results.md]

Every family transformers registers as a causal LM (`tests/model_zoo.py`, read from transformers' own registry, so a
new release's families show up by themselves) is built tiny (float32, CPU, seed 0) and run greedily on a left-padded
batch of two (`PROMPT_TOKENS` tokens, the second row with `PAD_TOKENS` pads), rebuilt fresh for each check:

a. transformers itself: `generate` through `DynamicCache(config=model.config)`: the tokens and logits to match;
b. `OscarCache(model, method="none", sink_tokens=4, recent_tokens=16)`: same tokens, max |logit difference|;
c. the default `OscarCache(model, sink_tokens=4, recent_tokens=16)` (a data-free profile forward first): logits
   finite;
d. an error in (b) or (c) is recorded as refused (`UnsupportedModelError`) or crashed, with whether any forward of the
   model had run.

Each check runs under a time limit and records an error's type and first line. Prints a markdown table (family |
transformers runs | none == Dynamic | default runs | outcome), the families by outcome, the layer types and KV
features of each tiny config, and the total time.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import transformers
from tqdm import tqdm
from transformers import DynamicCache

from oscar_hf import OscarCache, UnsupportedModelError
from tests.model_zoo import (
    causal_lm_families,
    config_value,
    greedy,
    layer_types_of,
    padded_batch,
    tiny_config,
    tiny_model,
)

SEED = 0
CHECK_SECONDS = 120  # per check (build + generate); a tiny model takes seconds
LOGIT_TOLERANCE = 1e-4  # method="none" stores K/V unquantized: it must match DynamicCache to float32 rounding
OSCAR_OPTIONS = dict(sink_tokens=4, recent_tokens=16)

OUTCOMES = SUPPORTED, WRONG, REFUSED, CRASHED, TRANSFORMERS_FAILS = (
    "supported", "wrong output", "refused", "crashed", "transformers itself fails")


class CheckTimeout(Exception):
    """A check ran past `CHECK_SECONDS`."""


@contextlib.contextmanager
def time_limit(seconds: int):
    """Raise `CheckTimeout` in the main thread after `seconds` (SIGALRM; a long C call ends first)."""
    def expire(signum, frame):
        raise CheckTimeout(f"ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def error_line(error: BaseException) -> str:
    """`Type: first line of the message`."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".strip()


@dataclass
class Check:
    """One generate run: its tokens `[2, NEW_TOKENS]` and logits `[NEW_TOKENS, 2, vocab]`, or the error."""

    tokens: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    error: str | None = None
    refused: bool = False  # the error is an UnsupportedModelError
    before_forward: bool | None = None  # the error came before any forward of the model
    stage: str | None = None  # "build", "cache" or "generate": where the error came

    @property
    def ran(self) -> bool:
        return self.error is None


def run_check(config, make_cache, seed: int = SEED) -> Check:
    """Build the model of `config` fresh from `seed`, make its cache (`make_cache(model)`) and generate greedily."""
    check, forwards, stage = Check(), [], "build"
    try:
        with time_limit(CHECK_SECONDS):
            model = tiny_model(config, seed)
            model.register_forward_pre_hook(lambda module, args: forwards.append(1))
            stage = "cache"
            cache = make_cache(model)
            stage = "generate"
            ids, mask = padded_batch(config, seed)
            check.tokens, check.logits = greedy(model, cache, ids, mask)
    except Exception as error:  # every failure is a result here
        check.error, check.stage = error_line(error), stage
        check.refused = isinstance(error, UnsupportedModelError)
        check.before_forward = not forwards
    return check


def dynamic_cache(model):
    return DynamicCache(config=model.config)


def oscar_none(model):
    return OscarCache(model, method="none", **OSCAR_OPTIONS)


def oscar_default(model):
    return OscarCache(model, **OSCAR_OPTIONS)


@dataclass
class FamilyResult:
    family: str
    config_error: str | None = None
    layer_types: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    reference: Check = field(default_factory=Check)
    none: Check = field(default_factory=Check)
    default: Check = field(default_factory=Check)
    seconds: float = 0.0

    @property
    def tokens_equal(self) -> bool | None:
        if self.reference.tokens is None or self.none.tokens is None:
            return None
        return bool(torch.equal(self.reference.tokens, self.none.tokens))

    @property
    def max_logit_diff(self) -> float | None:
        """Max |logit difference| of `none` against DynamicCache over the steps up to the first differing token."""
        if self.reference.logits is None or self.none.logits is None:
            return None
        if self.reference.logits.shape != self.none.logits.shape:
            return float("inf")
        differs = (self.reference.tokens != self.none.tokens).any(dim=0).nonzero()
        steps = int(differs[0]) + 1 if len(differs) else self.reference.logits.shape[0]
        return float((self.reference.logits[:steps] - self.none.logits[:steps]).abs().max())

    @property
    def default_finite(self) -> bool | None:
        return None if self.default.logits is None else bool(torch.isfinite(self.default.logits).all())

    def outcome(self) -> tuple[str, str]:
        """(outcome class, reason)."""
        if self.config_error is not None:
            return TRANSFORMERS_FAILS, f"tiny config: {self.config_error}"
        if not self.reference.ran:
            return TRANSFORMERS_FAILS, f"{self.reference.stage}: {self.reference.error}"
        for name, check in (("none", self.none), ("default", self.default)):
            if check.refused:
                return REFUSED, f"{check.stage}, {_forward_note(check)}: {check.error}"
        for name, check in (("none", self.none), ("default", self.default)):
            if not check.ran:
                return CRASHED, f"{name} at {check.stage}, {_forward_note(check)}: {check.error}"
        problems = []
        if not self.tokens_equal:
            problems.append("none: tokens differ from DynamicCache")
        if self.max_logit_diff is not None and not self.max_logit_diff <= LOGIT_TOLERANCE:
            problems.append(f"none: max |logit diff| {self.max_logit_diff:.2e} > {LOGIT_TOLERANCE:g}")
        if not self.default_finite:
            problems.append("default: non-finite logits")
        return (WRONG, "; ".join(problems)) if problems else (SUPPORTED, "")


def _forward_note(check: Check) -> str:
    return "before any forward" if check.before_forward else "after a forward"


def kv_features(config, model) -> tuple[str, ...]:
    """The KV-cache features of a tiny config / model that OscarCache has to know about."""
    text = config.get_text_config(decoder=True)
    features = []
    if config_value(text, "kv_lora_rank"):
        features.append("MLA (kv_lora_rank)")
    if (config_value(text, "num_kv_shared_layers") or 0) > 0:
        features.append(f"num_kv_shared_layers={config_value(text, 'num_kv_shared_layers')}")
    modes = _safe(lambda: getattr(text, "kv_sharing_modes", None))
    if modes:
        features.append(f"kv_sharing_modes={sorted({str(m) for m in modes})}")
    sources = config_value(text, "kv_source_layers")
    if isinstance(sources, (list, tuple)) and list(sources) != list(range(len(sources))):
        features.append("kv_source_layers")
    if any(name.split(".")[-1] == "sinks" for name, _ in model.named_parameters()):
        features.append("attention sinks")
    if _uses_alibi(text, model):
        features.append("ALiBi")
    if config_value(text, "attention_chunk_size"):
        features.append("chunked attention")
    return tuple(features)


def _safe(read):
    try:
        return read()
    except Exception:
        return None


def _uses_alibi(text, model) -> bool:
    """ALiBi: a config switch saying so (`alibi`, MPT's `attn_config.alibi`), or, where the config has none, a
    modeling module that builds ALiBi biases (BLOOM)."""
    switches = [(name, value) for part in (text, getattr(text, "attn_config", None)) if part is not None
                for name, value in vars(part).items() if "alibi" in name.lower()]
    if switches:
        return any(bool(value) for _, value in switches)
    source = _safe(lambda: inspect.getsource(sys.modules[type(model).__module__])) or ""
    return "build_alibi_tensor" in source


def check_family(family: str) -> FamilyResult:
    """Checks (a)-(d) of the module docstring for one family."""
    result, start = FamilyResult(family), time.perf_counter()
    try:
        config = tiny_config(family)
        result.layer_types = tuple(dict.fromkeys(layer_types_of(config) or ()))
    except Exception as error:
        result.config_error = error_line(error)
        result.seconds = time.perf_counter() - start
        return result
    result.reference = run_check(config, dynamic_cache)
    if result.reference.ran:
        result.features = kv_features(config, tiny_model(config, SEED))
        result.none = run_check(config, oscar_none)
        result.default = run_check(config, oscar_default)
    result.seconds = time.perf_counter() - start
    return result


def _cell(check: Check) -> str:
    return "yes" if check.ran else f"no: {check.error}"[:90]


def table(results: list[FamilyResult]) -> str:
    rows = ["| family | transformers runs | none == Dynamic (max logit diff) | default runs (finite) "
            "| outcome: reason |", "|---|---|---|---|---|"]
    for r in results:
        outcome, reason = r.outcome()
        if r.config_error is not None:
            reference, none, default = f"no: {r.config_error}"[:90], "—", "—"
        else:
            reference = _cell(r.reference)
            if not r.reference.ran:
                none = default = "—"
            else:
                none = _cell(r.none) if not r.none.ran else (
                    f"{'same' if r.tokens_equal else 'DIFFERENT'} tokens ({r.max_logit_diff:.1e})")
                default = _cell(r.default) if not r.default.ran else (
                    "yes (finite)" if r.default_finite else "yes (NON-FINITE)")
        rows.append(f"| {r.family} | {reference} | {none} | {default} | {outcome}{': ' + reason if reason else ''} |"
                    .replace("\n", " "))
    return "\n".join(rows)


def summary(results: list[FamilyResult]) -> str:
    by_outcome = collections.defaultdict(list)
    for r in results:
        by_outcome[r.outcome()[0]].append(r)
    lines = [f"**{len(results)} families**: " + ", ".join(
        f"{outcome} {len(by_outcome[outcome])}" for outcome in OUTCOMES)]
    for outcome in OUTCOMES:
        if not by_outcome[outcome]:
            continue
        lines.append(f"\n### {outcome} ({len(by_outcome[outcome])})\n")
        if outcome == SUPPORTED:
            lines.append(", ".join(r.family for r in by_outcome[outcome]))
            continue
        reasons = collections.defaultdict(list)
        for r in by_outcome[outcome]:
            reasons[r.outcome()[1]].append(r.family)
        for reason, families in sorted(reasons.items(), key=lambda item: -len(item[1])):
            lines.append(f"- {', '.join(families)}: {reason}")
    return "\n".join(lines)


def features_table(results: list[FamilyResult]) -> str:
    by_types = collections.defaultdict(list)
    for r in results:
        if r.config_error is None:
            by_types[", ".join(sorted(r.layer_types)) or "(no layer_types)"].append(r.family)
    lines = ["| tiny config's layer_types | families |", "|---|---|"]
    lines += [f"| {types} | {', '.join(families)} |" for types, families in sorted(by_types.items())]
    by_feature = collections.defaultdict(list)
    for r in results:
        for feature in r.features:
            by_feature[feature].append(r.family)
    lines += ["", "| KV feature | families |", "|---|---|"]
    lines += [f"| {feature} | {', '.join(families)} |" for feature, families in sorted(by_feature.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", help="comma-separated model types (default: every causal-LM family)")
    parser.add_argument("--out", help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    families = args.families.split(",") if args.families else causal_lm_families()
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    results = []
    for family in (bar := tqdm(families, unit="family")):
        bar.set_postfix_str(family)
        results.append(check_family(family))
    seconds = time.perf_counter() - start
    slowest = sorted(results, key=lambda r: -r.seconds)[:5]
    report = "\n\n".join([
        f"# OscarCache support sweep: transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}",
        f"`python -m experiments.models.support_sweep`; CPU, float32, {len(results)} families in {seconds:.0f} s "
        f"(slowest: {', '.join(f'{r.family} {r.seconds:.1f} s' for r in slowest)})",
        summary(results), "## Per family", table(results), "## Layer types and KV features", features_table(results)])
    print(report)
    if args.out:
        with open(args.out, "w") as out:
            out.write(report + "\n")


if __name__ == "__main__":
    main()
