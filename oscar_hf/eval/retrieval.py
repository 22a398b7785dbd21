"""Retrieval probes run through every cache: a prompt with a fact in it, greedy generation, a hit when the fact comes
back. The probes come from `passkey` (a key in repeated filler) or `needles` (facts in real text, with
distractors); this module runs them and reports.

Every method sees the same token ids. By default the prompt is prefilled once in full precision and its K/V are
replayed into each method's fresh cache (`diagnostics.generation`): every cache here attends to its prefill in full
precision, so this equals `model.generate(prompt, cache)` and saves one long prefill per method.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from oscar_hf.eval.assets import load_model
from oscar_hf.eval.cli_options import (
    add_logging_argument,
    add_model_arguments,
    add_oscar_options_argument,
    add_progress_argument,
    check_rotations,
    configure_logging,
    positive_int,
    resolve_device,
    resolve_dtype,
    timed,
)
from oscar_hf.eval.diagnostics.generation import full_precision_prefill, greedy_through_cache
from oscar_hf.eval.diagnostics.methods import ROTATION_METHODS, Method, builtin_methods, default_methods, select_methods

logger = logging.get_logger(__name__)


@dataclass
class Probe:
    """One prompt `input_ids` `[1, length]` holding `answer` at `depth`, the fact it must give back."""

    length: int  # prompt tokens
    depth: float
    answer: str  # several facts asked at once: their values joined by `ANSWER_SEPARATOR`
    input_ids: torch.Tensor
    kind: str = "passkey"
    distractors: int = 0  # other facts of the same form in the prompt
    span: tuple[int, int] = (-1, -1)  # prompt tokens [start, stop) of the (first) fact's sentence (-1: not recorded)
    value_span: tuple[int, int] = (-1, -1)  # prompt tokens [start, stop) of (the first value of) `answer` in it
    message: str = ""  # the prompt as text before any chat template (what an lm-eval document holds)
    requested: int = 0  # the length asked for (prompts cut at speech boundaries fall short of it); 0: `length`

    @property
    def position(self) -> int:
        """The prompt token the fact starts at (-1: not recorded)."""
        return self.span[0]

    @property
    def group(self) -> int:
        return self.requested or self.length


@dataclass
class ProbeResult:
    method: str
    kind: str
    group: int  # the requested length
    length: int
    depth: float
    distractors: int
    answer: str
    output: str
    hit: bool
    seconds: float
    tokens: list[int] = field(default_factory=list)  # the generated token ids
    error: str = ""  # what the method raised on this probe ("" when it answered); `output` shows it too


# Joins the values of a probe that asks for several facts into one `answer` (a string, so that results, reports and
# lm-eval documents keep one field); no value holds it, and it leaves the markdown tables of `write_results` intact.
ANSWER_SEPARATOR = " && "


def answer_values(answer: str) -> list[str]:
    """The values an `answer` asks for: one, or several joined by `ANSWER_SEPARATOR`."""
    return answer.split(ANSWER_SEPARATOR)


def is_hit(answer: str, output: str) -> bool:
    """Whether the generated `output` contains every value of `answer` (`answer_values`; case and surrounding quotes
    ignored)."""
    return all(value.strip().strip('"').lower() in output.lower() for value in answer_values(answer))


def run_probes(model, tokenizer, probes: Sequence[Probe], methods: Sequence[Method], max_new_tokens: int = 8,
               shared_prefill: bool = True, progress: bool = True, compiled: bool = False) -> list[ProbeResult]:
    """Greedy-generate `max_new_tokens` after each probe through a fresh cache of every method (`compiled`: with
    the decode step compiled, `greedy_through_cache`)."""
    results = []
    device = next(model.parameters()).device
    bar = tqdm(total=len(probes) * len(methods), desc="probes", disable=not progress)
    for probe in probes:
        prompt = probe.input_ids.to(device)
        prefill = full_precision_prefill(model, prompt) if shared_prefill else None
        for method in methods:
            start = time.time()
            tokens, error = [], ""
            try:
                tokens = greedy_through_cache(model, method.build(model), max_new_tokens, prefill=prefill,
                                              prompt=prompt, compiled=compiled)
                text = tokenizer.decode(tokens, skip_special_tokens=True)
            except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal (`failed_methods`)
                error = f"{type(e).__name__}: {e}"
                text = f"<error {error}>"
            results.append(ProbeResult(method.name, probe.kind, probe.group, probe.length, probe.depth,
                                       probe.distractors, probe.answer, text, not error and is_hit(probe.answer, text),
                                       time.time() - start, tokens, error))
            bar.update(1)
        del prefill
    bar.close()
    return results


def failed_methods(results: Sequence[ProbeResult]) -> dict[str, str]:
    """The methods that raised on every probe they ran, each with its first error: their rows score no retrieval
    (a missing rotations file would read as 0 hits), so a run that holds one has failed."""
    errors: dict[str, list[str]] = {}
    for r in results:
        errors.setdefault(r.method, []).append(r.error)
    return {method: found[0] for method, found in errors.items() if all(found)}


def summary_table(results: Sequence[ProbeResult], labels: dict[str, str]) -> str:
    """Hits per method (rows) and probe group (columns: kind and requested length), with totals and, when a `bf16`
    row is present, each method's hits as a share of BF16's."""
    groups = sorted({(r.kind, r.group) for r in results})
    several_kinds = len({kind for kind, _ in groups}) > 1
    methods = list(dict.fromkeys(r.method for r in results))
    reference = sum(r.hit for r in results if r.method == "bf16")
    names = [f"{kind} {length} tok" if several_kinds else f"{length} tok" for kind, length in groups]
    header = "| method | " + " | ".join(names) + " | total |" + (" vs BF16 |" if reference else "")
    lines = [header, "|" + "---|" * (len(groups) + 2 + bool(reference))]
    for m in methods:
        rows = [r for r in results if r.method == m]
        cells = []
        for kind, length in groups:
            at = [r for r in rows if r.kind == kind and r.group == length]
            cells.append(f"{sum(r.hit for r in at)}/{len(at)}")
        hits = sum(r.hit for r in rows)
        line = f"| {labels.get(m, m)} | " + " | ".join(cells) + f" | {hits}/{len(rows)} |"
        lines.append(line + (f" {hits / reference:.0%} |" if reference else ""))
    return "\n".join(lines)


def write_results(results: Sequence[ProbeResult], methods: Sequence[Method], out: str, title: str, command: str,
                  seconds: float, basename: str) -> str:
    """Write `<basename>.json` (every result) and `<basename>.md` (the summary and every output) into `out`; returns
    the summary table."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{basename}.json"), "w") as f:
        json.dump({"command": command, "seconds": seconds, "results": [asdict(r) for r in results]}, f, indent=1)
    table = summary_table(results, {m.name: m.label for m in methods})
    with open(os.path.join(out, f"{basename}.md"), "w") as f:
        f.write(f"# {title}\n\nCommand: `{command}` ({seconds:.0f} s)\n\n{table}\n\n"
                "| method | kind | length | depth | distractors | answer | output |\n|---|---|---|---|---|---|---|\n")
        for r in results:
            f.write(f"| {r.method} | {r.kind} | {r.length} | {r.depth} | {r.distractors} | {r.answer} | "
                    f"{r.output.strip()!r} |\n")
    return table


def add_common_arguments(parser: argparse.ArgumentParser, out: str, max_new_tokens: int) -> None:
    """The options every retrieval CLI shares: model, methods, decoding, device, output, progress and logging
    (the vocabulary of `oscar_hf.eval.cli_options`)."""
    add_model_arguments(parser, default_model="smollm2")
    parser.add_argument("--rotations", default=None,
                        help="calibrated rotations (folder/file/Hub id, or 'hadamard') for "
                             f"{', '.join(ROTATION_METHODS)}; those methods need them")
    parser.add_argument("--methods", default=None,
                        help="comma-separated method names: the OscarConfig presets, hadamard4, oscar4, bf16 and the "
                             f"peers ({', '.join(builtin_methods())}; default: "
                             f"{','.join(default_methods())}, with oscar,oscar4 for hadamard,hadamard4 when "
                             "--rotations is given)")
    add_oscar_options_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens)
    parser.add_argument("--no-shared-prefill", action="store_true", help="plain generate (one prefill per method)")
    parser.add_argument("--compile", action="store_true",
                        help="generate compiles the decode step of OSCAR caches on any device (on CUDA it does "
                             "by itself), so the answers come from the compiled path")
    parser.add_argument("--out", default=out)
    add_progress_argument(parser)
    add_logging_argument(parser)


def selected_methods(args: argparse.Namespace, **oscar_options) -> list[Method]:
    """The `--methods` of the parsed arguments (`diagnostics.methods.select_methods`): unknown names, methods that
    need `--rotations` without them, `--rotations` that do not load (`cli_options.check_rotations`), or
    `--oscar-options` that are not OscarConfig fields exit with what to do."""
    options = {**getattr(args, "oscar_options", {}), **oscar_options}
    try:
        methods = select_methods(args.methods, args.rotations, **options)
        check_rotations(args.rotations)
        return methods
    except ValueError as error:
        raise SystemExit(f"{error}") from error


AfterRun = Callable[[object, object, list[Probe], list[ProbeResult], list[Method], str], None]


def run_cli(args: argparse.Namespace, prog: str, argv: list[str] | None, make: Callable[[object], list[Probe]],
            title: str, basename: str, after: AfterRun | None = None) -> int:
    """Load the model, build the probes with `make(tokenizer)`, run every method, write and print the summary, then
    call `after(model, tokenizer, probes, results, methods, command)` when given. Exits non-zero, after writing the
    results, when a method raised on every probe (`failed_methods`)."""
    configure_logging(getattr(args, "verbosity", "info"))
    methods = selected_methods(args)
    with timed(f"loading {args.model}", logger):
        model, tokenizer = load_model(args.model, resolve_dtype(args.dtype), resolve_device(args.device))
    probes = make(tokenizer)
    for method in methods:
        unfit = sorted({p.length for p in probes if p.length % method.prefix_multiple})
        if unfit:
            raise SystemExit(f"{method.name} quantizes whole groups of {method.prefix_multiple} tokens, and prompts "
                             f"of {', '.join(map(str, unfit[:4]))}{' ...' if len(unfit) > 4 else ''} tokens are not "
                             f"multiples of it: build the probes with --align {method.prefix_multiple}")
    with timed(f"{len(probes)} probes through {', '.join(m.name for m in methods)}", logger) as watch:
        results = run_probes(model, tokenizer, probes, methods, args.max_new_tokens, not args.no_shared_prefill,
                             progress=not args.no_progress, compiled=args.compile)
    command = f"{prog} " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    print(write_results(results, methods, args.out, title, command, watch.seconds, basename))
    failed = failed_methods(results)
    if failed:
        raise SystemExit(f"{prog}: {len(failed)} method(s) failed on every probe, so their rows are no scores: "
                         + "; ".join(f"{name}: {error}" for name, error in failed.items()))
    if after is not None:
        after(model, tokenizer, probes, results, methods, command)
    return 0
