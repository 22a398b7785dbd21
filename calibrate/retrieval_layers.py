"""Which layers and KV heads retrieval depends on, ranked for `OscarConfig.high_precision_layers` (the `oscar-hifi`
preset) and `OscarConfig.high_precision_heads` (the `oscar-next` preset).

Needle probes are built from the calibration plays (`assets.CALIBRATION_PLAYS`, never the evaluation ones) and the
model answers them greedily in full precision; the probes whose answer spells the fact are traced with that answer
(`eval.diagnostics.needle_attention`) under the cache's 2-bit settings, and every layer is scored by the fact's
attention mass its history loses and the error of its value read-out (`layer_sensitivity`). The model's own
answers matter: teacher-forcing the needle sentence instead ranked SmolLM2's Hadamard layers worse (8 of 36 greedy
hits for the resulting `oscar-hifi` against 14; docs/retrieval.md). A model that answers none of the probes is
ranked on the needle sentences. The ranking, most sensitive first, is recorded in the rotations' metadata
(`retrieval_layers`), where `OscarCache(..., method="oscar-hifi")` finds it.

KV heads are ranked the same way, per KV head (`kv_head_sensitivity`), under the history format the heads' preset
stores the other heads in (`oscar-next`: sigma rows, compact pairs, no clip): `retrieval_heads` in the metadata.

    ranking = rank_retrieval_layers(model, tokenizer, OscarCache(model.config, rotations=rotations))
    record_retrieval_layers(rotations, ranking); rotations.save_pretrained(folder)
    rank_and_record(model, tokenizer, rotations)  # both rankings, with the presets' settings

From the command line, for an existing rotations folder (rewritten in place) or for the data-free Hadamard rotations
(written to `--out`):

    python -m oscar_hf.calibrate.retrieval_layers --model smollm2 --rotations rotations/smollm2-135m
    python -m oscar_hf.calibrate.retrieval_layers --model smollm2 --rotations hadamard --out rotations/hadamard-ranked
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from oscar_hf.eval.assets import CALIBRATION_PLAYS
from oscar_hf.eval.diagnostics.generation import greedy_through_cache
from oscar_hf.config import PRESETS
from oscar_hf.eval.diagnostics.needle_attention import (
    NeedleAttention,
    copy_targets,
    kv_head_sensitivity,
    layer_sensitivity,
    needle_attention,
)
from oscar_hf.eval.needles import KINDS, make_needle_suite
from oscar_hf.rotations.io import SAFETENSORS_NAME
from oscar_hf.rotations.rotations import RETRIEVAL_HEADS_KEY, RETRIEVAL_LAYERS_KEY, RETRIEVAL_RANKING_KEY, Rotations

DEFAULT_LENGTHS = (1024, 2048)
DEFAULT_DEPTHS = (0.35, 0.65)
ANSWER_TOKENS = 40


@torch.no_grad()
def probe_lengths(text: str, sink: int, recent: int, option: str = "--lengths") -> list[int]:
    """The probe lengths of a comma-separated `option` value; ValueError (naming `option`) unless every one is a
    token count longer than the BF16 tiers, so that its needle reaches the 2-bit history."""
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected comma-separated token counts") from None
    if any(n <= sink + recent for n in lengths):
        raise ValueError(f"{option} {text}: each probe must be longer than --sink + --recent = {sink + recent} "
                         "tokens, or no needle reaches the 2-bit history")
    return lengths


def rank_retrieval_layers(model, tokenizer, template, lengths: Sequence[int] = DEFAULT_LENGTHS,
                          depths: Sequence[float] = DEFAULT_DEPTHS, kinds: Sequence[str] = KINDS, seed: int = 1,
                          progress: bool = True, row_format=None) -> list[int]:
    """The full-attention layers of `template` (an unused `OscarCache` with the settings to rank for), most
    retrieval-sensitive first. Probes of `lengths` tokens must leave room for the cache's sink and recent window.
    `row_format` ranks for a history format the cache does not store (see `decode_equivalent.SimulationPlan`)."""
    trace = retrieval_trace(model, tokenizer, template, lengths, depths, kinds, seed, progress, row_format)
    score = layer_sensitivity(trace)
    return [trace.layers[int(i)] for i in score.argsort(descending=True)]


def rank_retrieval_heads(model, tokenizer, template, lengths: Sequence[int] = DEFAULT_LENGTHS,
                         depths: Sequence[float] = DEFAULT_DEPTHS, kinds: Sequence[str] = KINDS, seed: int = 1,
                         progress: bool = True, row_format=None) -> list[tuple[int, int]]:
    """Every (layer, KV head) of `template`'s full-attention layers, most retrieval-sensitive first: the probes of
    `rank_retrieval_layers`, scored per KV head (`kv_head_sensitivity`)."""
    trace = retrieval_trace(model, tokenizer, template, lengths, depths, kinds, seed, progress, row_format)
    kv_heads = template.shape.num_kv_heads
    order = kv_head_sensitivity(trace, kv_heads).flatten().argsort(descending=True)
    return [(trace.layers[int(i) // kv_heads], int(i) % kv_heads) for i in order]


# the history format `oscar-next` stores its 2-bit heads in: what its heads are ranked under
HEAD_RANKING_SETTINGS = {name: getattr(PRESETS["oscar-next"], name)
                         for name in ("key_clip_ratio", "value_clip_ratio", "encoder", "scale_dtype")}


def rank_and_record(model, tokenizer, rotations: Rotations, data_free: bool = False, sink: int = 64,
                    recent: int = 256, lengths: Sequence[int] = DEFAULT_LENGTHS, progress: bool = True) -> None:
    """Rank `rotations`' layers (under the 2-bit default, `oscar` or for `data_free` rotations `hadamard`) and KV
    heads (under `HEAD_RANKING_SETTINGS`) on the calibration-play probes, and record both in its metadata."""
    from oscar_hf import OscarCache

    method = "hadamard" if data_free else "oscar"
    layout = dict(sink_tokens=sink, recent_tokens=recent)
    layers = OscarCache(model.config, rotations=rotations, method=method, **layout)
    record_retrieval_layers(rotations, rank_retrieval_layers(model, tokenizer, layers, lengths, progress=progress))
    heads = OscarCache(model.config, rotations=rotations, method=method, **layout, **HEAD_RANKING_SETTINGS)
    record_retrieval_heads(rotations, rank_retrieval_heads(model, tokenizer, heads, lengths, progress=progress))
    rotations.metadata[RETRIEVAL_RANKING_KEY] = "needle probes in the calibration plays, answered by the model"


def retrieval_trace(model, tokenizer, template, lengths: Sequence[int] = DEFAULT_LENGTHS,
                    depths: Sequence[float] = DEFAULT_DEPTHS, kinds: Sequence[str] = KINDS, seed: int = 1,
                    progress: bool = True, row_format=None) -> NeedleAttention:
    """The needle statistics `rank_retrieval_layers` ranks by: calibration-play probes, traced with the model's own
    full-precision answers (or the needle sentences when it answers none)."""
    config = template.oscar_config
    probes = make_needle_suite(tokenizer, lengths, depths, kinds, (0,), seed=seed, sink=config.sink_tokens,
                               recent=config.recent_tokens, plays=CALIBRATION_PLAYS)
    answers = full_precision_answers(model, probes, progress)
    if not any(copy_targets(tokenizer, a, p.answer) for p, a in zip(probes, answers)):
        answers = [probe.input_ids[0, probe.span[0]:probe.span[1]].tolist() for probe in probes]
    return needle_attention(model, tokenizer, probes, answers, template, row_format=row_format, progress=progress,
                            with_copy_accuracy=False)


def full_precision_answers(model, probes, progress: bool = True) -> list[list[int]]:
    """Each probe's greedy answer (`ANSWER_TOKENS` token ids) through a full-precision `DynamicCache`."""
    device = next(model.parameters()).device
    return [greedy_through_cache(model, DynamicCache(config=model.config), ANSWER_TOKENS,
                                 prompt=probe.input_ids.to(device))
            for probe in tqdm(probes, desc="full-precision answers", disable=not progress, leave=False)]


def record_retrieval_layers(rotations: Rotations, ranking: Sequence[int]) -> None:
    """Store `ranking` (layer indices, most sensitive first) in `rotations.metadata`."""
    rotations.metadata[RETRIEVAL_LAYERS_KEY] = json.dumps([int(i) for i in ranking])


def record_retrieval_heads(rotations: Rotations, ranking: Sequence[tuple[int, int]]) -> None:
    """Store `ranking` ((layer, KV head) pairs, most sensitive first) in `rotations.metadata`."""
    rotations.metadata[RETRIEVAL_HEADS_KEY] = json.dumps([[int(layer), int(head)] for layer, head in ranking])


def main(argv: list[str] | None = None) -> int:
    from oscar_hf.eval.cli_options import add_model_arguments, add_progress_argument, resolve_device, resolve_dtype

    p = argparse.ArgumentParser(prog="python -m oscar_hf.calibrate.retrieval_layers",
                                description="Rank a model's layers and KV heads by retrieval sensitivity for "
                                            "method='oscar-hifi' and method='oscar-next'.")
    add_model_arguments(p)
    p.add_argument("--rotations", required=True, help='a rotations folder (rewritten in place) or "hadamard"')
    p.add_argument("--out", default=None, help="folder to write (required for hadamard; default: --rotations)")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="needle probe lengths in tokens")
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--recent", type=int, default=256)
    add_progress_argument(p)
    args = p.parse_args(argv)
    if args.rotations == "hadamard" and not args.out:
        p.error("--rotations hadamard needs --out")
    if args.sink < 0 or args.recent < 0:
        p.error(f"--sink {args.sink} and --recent {args.recent} must be >= 0")
    try:
        lengths = probe_lengths(args.lengths, args.sink, args.recent)
    except ValueError as e:
        p.error(str(e))
    from oscar_hf.eval.assets import load_model
    from oscar_hf.model_support import attention_shape

    start = time.time()
    rotations = None if args.rotations == "hadamard" else Rotations.from_pretrained(args.rotations)
    model, tokenizer = load_model(args.model, resolve_dtype(args.dtype), resolve_device(args.device))
    if rotations is None:
        shape = attention_shape(model.config)
        rotations = Rotations.hadamard(shape.oscar_layer_ids, shape.head_dim)
        rotations.metadata.update(model=args.model, objective="hadamard")
    rank_and_record(model, tokenizer, rotations, args.rotations == "hadamard", args.sink, args.recent, lengths,
                    progress=not args.no_progress)
    folder = args.out or args.rotations
    rotations.save_pretrained(folder)
    heads = " ".join(f"{layer}.{head}" for layer, head in rotations.retrieval_heads()[:12])
    print(f"retrieval ranking (most sensitive first): layers {rotations.retrieval_layers()}\n  KV heads {heads} ...\n"
          f"  wrote {os.path.join(folder, SAFETENSORS_NAME)} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
