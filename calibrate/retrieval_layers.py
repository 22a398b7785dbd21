"""Which layers retrieval depends on, ranked for `OscarConfig.high_precision_layers` (the `oscar-hifi` preset).

Needle probes are built from the calibration plays (`assets.CALIBRATION_PLAYS`, never the evaluation ones), and each
probe's own needle sentence is teacher-forced as its answer, so no generation is needed and a weak model ranks as
well as a strong one. The needle-attention trace (`eval.diagnostics.needle_attention`) of the cache's 2-bit
settings then scores every layer by the fact's attention mass its history loses and the error of its value
read-out (`layer_sensitivity`); the ranking, most sensitive first, is recorded in the rotations' metadata
(`retrieval_layers`), where `OscarCache(..., method="oscar-hifi")` finds it.

    ranking = rank_retrieval_layers(model, tokenizer, OscarCache(model.config, rotations=rotations))
    record_retrieval_layers(rotations, ranking); rotations.save_pretrained(folder)
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from oscar_hf.eval.assets import CALIBRATION_PLAYS
from oscar_hf.eval.diagnostics.needle_attention import layer_sensitivity, needle_attention
from oscar_hf.eval.needles import KINDS, make_needle_suite
from oscar_hf.rotations.rotations import RETRIEVAL_LAYERS_KEY, Rotations

DEFAULT_LENGTHS = (1024, 2048)
DEFAULT_DEPTHS = (0.2, 0.5, 0.8)


@torch.no_grad()
def rank_retrieval_layers(model, tokenizer, template, lengths: Sequence[int] = DEFAULT_LENGTHS,
                          depths: Sequence[float] = DEFAULT_DEPTHS, kinds: Sequence[str] = KINDS, seed: int = 0,
                          progress: bool = True) -> list[int]:
    """The full-attention layers of `template` (an unused `OscarCache` with the settings to rank for), most
    retrieval-sensitive first. Probes of `lengths` tokens must leave room for the cache's sink and recent window."""
    config = template.oscar_config
    probes = make_needle_suite(tokenizer, lengths, depths, kinds, (0,), seed=seed, sink=config.sink_tokens,
                               recent=config.recent_tokens, plays=CALIBRATION_PLAYS)
    answers = [probe.input_ids[0, probe.span[0]:probe.span[1]].tolist() for probe in probes]
    trace = needle_attention(model, tokenizer, probes, answers, template, progress=progress)
    score = layer_sensitivity(trace)
    return [trace.layers[int(i)] for i in score.argsort(descending=True)]


def record_retrieval_layers(rotations: Rotations, ranking: Sequence[int]) -> None:
    """Store `ranking` (layer indices, most sensitive first) in `rotations.metadata`."""
    rotations.metadata[RETRIEVAL_LAYERS_KEY] = json.dumps([int(i) for i in ranking])
