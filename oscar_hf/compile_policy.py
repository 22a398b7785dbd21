"""When `generate` may compile the decode step of an OscarCache: a rent-or-buy rule over a model's calls.

Compiling the decode step is a price paid once per process and model (about a minute for an 8B model the first
time on a machine, about 13 s in a later process, whose compile finds torch's on-disk caches filled); every later
step is then about three times faster than an eager one. `generate` decides before the prefill, and a cache never
sees `max_new_tokens`, so a call's length is unknown when the choice is made. The rule: decode eagerly until the
eager decode steps of this model have taken as long as a compile is expected to, then let `generate` compile, for
good. A one-off question never waits for a compile, and a long session pays at most about twice what the better
choice in hindsight costs. What a compile is expected to cost depends on whether a process on this machine has
compiled the same step before: a marker file beside torch's compiled artifacts says so (`compiled_marker`), and
goes when they go. The marker is left when a step is traced (`note_traced_step`), not when `generate` is allowed to
compile: on a CPU `generate` compiles nothing whatever the cache allows, and a marker then would promise the next
process a warm compile that never happened.

`OscarCache(compile_decode=True)` compiles from the first call (benchmarks of the steady state, tests of the
compiled path); `False` never does (as `generate(disable_compile=True)` does for one call).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import torch

# generate's first compile of the decode step, Qwen3-8B (36 layers), H200, torch 2.11: 57-110 s (issue 45). A lower
# bound of what a new model costs: compiling sooner than this could not have paid for itself on that model.
EXPECTED_COMPILE_SECONDS = 60.0
# the same in a later process on the machine, torch's disk caches hit: 23.4 s for a whole 256-token call at 32k/4 that
# takes 10.1 s compiled (H100, 2026-12-06, docs/performance.md)
WARM_COMPILE_SECONDS = 15.0
# a gap longer than this between two one-token steps of a cache is not a decode step (the user paused, or a
# forward of another kind ran between them) and is not counted
LONGEST_STEP_SECONDS = 5.0


@dataclasses.dataclass
class DecodeLedger:
    """The eager decode seconds one model has spent in this process, and whether it may compile now."""

    eager_seconds: float = 0.0
    compiles: bool = False
    announced: bool = False  # whether the cache has said, once, that it holds the compile back

    def may_compile(self, expected_compile_seconds: float = EXPECTED_COMPILE_SECONDS) -> bool:
        if not self.compiles and self.eager_seconds >= expected_compile_seconds:
            self.compiles = True  # for good: the compiled step stays with the model, so later calls reuse it
        return self.compiles

    def add_step(self, seconds: float) -> None:
        if 0.0 <= seconds <= LONGEST_STEP_SECONDS:
            self.eager_seconds += seconds


def compiled_marker(*parts) -> str | None:
    """The file that says a process on this machine compiled the decode step that `parts` (anything JSON can write:
    versions, the model's config, the cache's settings, the device type) identify; it lives in torch inductor's cache
    folder, so that clearing those artifacts clears it too. None where that folder cannot be found."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        folder = os.path.join(cache_dir(), "oscar_hf")
    except (ImportError, OSError):  # a torch without that (private) module, or a folder it cannot make
        return None
    key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()[:24]
    return os.path.join(folder, f"decode-step-{key}")


def expected_compile_seconds(marker: str | None) -> float:
    return WARM_COMPILE_SECONDS if marker is not None and os.path.exists(marker) else EXPECTED_COMPILE_SECONDS


# The markers (`compiled_marker`) of the steps `generate` was last allowed to compile (`await_compile`), until a
# trace leaves them (`note_traced_step`) or an eager decode step shows that it compiled nothing (`StepClock.tick`);
# and those this process has left, each written once. Process-wide: the trace that leaves them runs inside dynamo,
# which hands a function it runs for real no cache to read them from.
_AWAITING_TRACE: set[str] = set()
_LEFT: set[str] = set()


def await_compile(marker: str | None) -> None:
    """Note that `generate` may now compile the step `marker` names: its marker is left if a trace follows
    (`note_traced_step`), before the next eager decode step."""
    if marker is not None and marker not in _LEFT:
        _AWAITING_TRACE.add(marker)


@torch.compiler.assume_constant_result
def note_traced_step() -> None:
    """Leave the markers of the steps awaiting a compile: called from `OscarCache.update` while dynamo traces it,
    which runs this function for real, once per trace, and puts nothing of it in the graph (its result, None, is a
    constant). A failed write changes nothing but the next process's estimate."""
    for marker in sorted(_AWAITING_TRACE):
        _LEFT.add(marker)
        try:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            with open(marker, "w", encoding="utf-8"):
                pass
        except OSError:
            pass
    _AWAITING_TRACE.clear()


def ledger_of(owner) -> DecodeLedger:
    """The ledger of `owner` (the model, shared by every cache built on it; or a cache built from a config)."""
    ledger = owner.__dict__.get("_oscar_decode_ledger")
    if ledger is None:
        ledger = owner.__dict__["_oscar_decode_ledger"] = DecodeLedger()
    return ledger


class StepClock:
    """Times a cache's eager one-token steps into a ledger: the gap between two consecutive ones is a step."""

    def __init__(self, ledger: DecodeLedger):
        self.ledger = ledger
        self.last: float | None = None

    def tick(self, tokens: int) -> None:
        """Called once per eager forward, with the tokens it appends per row. An eager decode step means `generate`
        did not compile this call's steps: the markers awaiting a trace (`await_compile`) are dropped."""
        if tokens == 1:
            _AWAITING_TRACE.clear()
        now = time.perf_counter()
        if tokens == 1 and self.last is not None:
            self.ledger.add_step(now - self.last)
        self.last = now if tokens == 1 else None
