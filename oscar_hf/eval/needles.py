"""Needle retrieval in real text (RULER-style): a fact inside a passage of a play, asked for after it.

A probe is a chat-formatted prompt: an instruction, a passage of one of the held-out plays
(`assets.EVALUATION_PLAYS`, never used for calibration) with the needle sentence, and possibly distractors of the
same form, inserted between its speeches, then the question. Needle kinds:
- `number`: "The secret code of the cobalt vault is 2651247." (7 digits);
- `words`: "The secret phrase of the cobalt vault is amber harbor lantern." (3 words);
- `uuid`: "The secret identifier of the cobalt vault is 3f9a1c07-5b2e-4d8a." (UUID-like hex).
With `distractors` > 0 the passage also holds that many needles of other vaults; the question names one.
With `asked` = 2 the question names two vaults ("What are the secret codes of the cobalt vault and the amber vault?")
and a hit needs both values (probe kind e.g. `number x2`).

Depth is measured over the span the cache quantizes: 0 is the first token after the BF16 sink, 1 the last token
before the BF16 recent window (`sink` and `recent` default to `OscarConfig`'s), so every needle of the suite sits in
the 2-bit history of a prompt that was prefilled and then decoded (the second needle of `asked` = 2 sits at a random
speech boundary, as distractors do). Greedy generation; a hit when every asked value appears in the answer
(`retrieval.is_hit`).

    oscar-needles --model smollm2 --lengths 1024,2048,4096,8000 --methods bf16,hadamard,hadamard4 --out out/needles

The same probes are an lm-eval task (`oscar_needles`, in `oscar_hf/eval/lm_eval_tasks/`, found by `oscar-lm-eval`
without `--include_path`).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.utils import logging

from oscar_hf.config import OscarConfig
from oscar_hf.eval.assets import EVALUATION_PLAYS, play_text
from oscar_hf.eval.cli_options import comma_separated, fraction, non_negative_int, one_of, positive_int
from oscar_hf.eval.diagnostics.methods import parse_method_names
from oscar_hf.eval.retrieval import ANSWER_SEPARATOR, Probe, add_common_arguments, run_cli

logger = logging.get_logger(__name__)

KINDS = ("number", "words", "uuid")
INSTRUCTION = ("Below is a passage from a play. Somewhere in it is a secret that is not part of the play. "
               "Read it carefully: you will be asked about the secret afterwards.")
_NOUN = {"number": "code", "words": "phrase", "uuid": "identifier"}
COLORS = ("cobalt", "crimson", "amber", "teal", "ivory", "scarlet", "olive", "indigo", "silver", "golden",
          "violet", "emerald", "copper", "ochre", "azure", "maroon", "jade", "bronze", "coral", "slate")
WORDS = ("amber", "harbor", "lantern", "meadow", "falcon", "granite", "willow", "ember", "canyon", "thistle",
         "orchard", "compass", "glacier", "pepper", "saddle", "marble", "violin", "beacon", "ribbon", "tundra",
         "walnut", "cobweb", "pebble", "quarry", "summit", "tinder", "velvet", "zephyr", "anchor", "bramble",
         "cactus", "dynamo", "fresco", "garnet", "hazel", "igloo", "juniper", "kettle", "lagoon", "mosaic")


@dataclass(frozen=True)
class Needle:
    vault: str  # e.g. "cobalt vault"
    kind: str
    value: str

    @property
    def sentence(self) -> str:
        return f"The secret {_NOUN[self.kind]} of the {self.vault} is {self.value}."

    @property
    def question(self) -> str:
        return f"What is the secret {_NOUN[self.kind]} of the {self.vault}?"


def _question(asked: Sequence[Needle]) -> str:
    """The question for the needles `asked` (of one kind): "What are the secret codes of the cobalt vault and the
    amber vault?" for two, the needle's own question for one."""
    if len(asked) == 1:
        return asked[0].question
    vaults = [f"the {n.vault}" for n in asked]
    return f"What are the secret {_NOUN[asked[0].kind]}s of {', '.join(vaults[:-1])} and {vaults[-1]}?"


def _seed_key(asked: int, *parts) -> str:
    """The random seed of a probe's choices, from its parameters: a one-needle question keeps the seed the
    published results were measured with, more asked needles get their own."""
    return ":".join(map(str, parts)) + (f":{asked}" if asked > 1 else "")


def random_value(kind: str, rng: random.Random) -> str:
    if kind == "number":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return " ".join(rng.sample(WORDS, 3))
    if kind == "uuid":
        return "-".join("".join(rng.choice("0123456789abcdef") for _ in range(n)) for n in (8, 4, 4))
    raise ValueError(f"needle kind {kind!r}: expected one of {KINDS}")


def _passages(play: str) -> list[str]:
    """The speeches of a play (blank-line separated), stage text included."""
    return [p.strip() for p in play_text(play).split("\n\n") if p.strip()]


def _token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def _chat(tokenizer, message: str) -> str:
    """`message` as a user turn of the tokenizer's chat template, ready for the answer (or as it is, without one)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)
    return message + "\n"


def make_needle_probe(tokenizer, length: int, depth: float, kind: str, distractors: int = 0, seed: int = 0,
                      play: str = EVALUATION_PLAYS[0], sink: int | None = None, recent: int | None = None,
                      align: int = 1, asked: int = 1) -> Probe:
    """A chat prompt of at most `length` tokens with one needle of `kind` at `depth` of the quantized span and
    `distractors` others; `Probe.answer` is the asked-for value, `Probe.span` / `Probe.value_span` the tokens of its
    sentence and of the value. With `asked` > 1 the question asks for that many needles: the first at `depth` (the
    one `span` / `value_span` describe), the others at random speech boundaries as distractors are placed, besides
    the `distractors`; `Probe.answer` joins their values with `retrieval.ANSWER_SEPARATOR` and `Probe.kind` is e.g.
    `number x2`. With `align` > 1 the prompt's length is a multiple of it (the last speech loses characters until it
    is): caches that quantize whole groups of tokens (`kivi2`: 32) take only such prefixes. `align=1` and `asked=1`
    leave every probe as it was."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth}: expected a fraction in [0, 1]")
    if align < 1:
        raise ValueError(f"align={align}: expected a positive number of tokens")
    if asked < 1:
        raise ValueError(f"asked={asked}: expected a positive number of needles")
    defaults = OscarConfig()
    sink = defaults.sink_tokens if sink is None else sink
    recent = defaults.recent_tokens if recent is None else recent
    rng = random.Random(_seed_key(asked, seed, kind, length, depth, distractors, play))
    colors = rng.sample(COLORS, distractors + asked)
    needles = [Needle(f"{color} vault", kind, random_value(kind, rng)) for color in colors]
    question = _question(needles[:asked])
    passages = _passages(play)
    start = rng.randrange(len(passages) // 2)
    passages = passages[start:] + passages[:start]
    # speeches while they fit beside the fixed parts and the needles (pieces are counted apart: the whole is
    # checked, and shortened, below)
    budget = length - _token_count(tokenizer, _chat(tokenizer, f"{INSTRUCTION}\n\n\n\n{question}"))
    budget -= sum(_token_count(tokenizer, "\n\n" + n.sentence) for n in needles)
    chosen, used = [], 0
    for passage in passages:
        cost = _token_count(tokenizer, "\n\n" + passage)
        if used + cost > budget:  # the first speech that does not fit: as many of its lines as do
            lines = passage.split("\n")
            while lines and used + _token_count(tokenizer, "\n\n" + "\n".join(lines)) > budget:
                lines.pop()
            if lines:
                chosen.append("\n".join(lines))
            break
        chosen.append(passage)
        used += cost
    while True:
        if len(chosen) < distractors + asked + 1:
            raise ValueError(f"length={length} leaves no room for a passage around {distractors + asked} needles")
        message, text, span, value_span = _build(tokenizer, chosen, needles, question, depth, sink, recent,
                                                 rng.getstate())
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) <= length and len(ids) % align == 0:
            answer = ANSWER_SEPARATOR.join(n.value for n in needles[:asked])
            # several asked needles are a kind of their own in the summary tables
            label = kind if asked == 1 else f"{kind} x{asked}"
            return Probe(len(ids), depth, answer, torch.tensor([ids]), kind=label, distractors=distractors,
                         span=span, value_span=value_span, message=message, requested=length)
        if len(ids) <= length and len(chosen[-1].rstrip()) > 1:  # off a multiple of `align`: one character fewer
            chosen[-1] = chosen[-1].rstrip()[:-1]
        else:
            chosen.pop()


def _build(tokenizer, passages: list[str], needles: list[Needle], question: str, depth: float, sink: int, recent: int,
           state) -> tuple[str, str, tuple[int, int], tuple[int, int]]:
    """The prompt ending in `question` with `needles[1:]` (distractors, and further asked needles) at random speech
    boundaries and the target (`needles[0]`) at the boundary nearest to `depth` of the tokens between the first `sink`
    and the last `recent`: (message, chat text, tokens of the target's sentence, tokens of its value)."""
    rng = random.Random()
    rng.setstate(state)
    target = needles[0]
    boundaries = range(1, len(passages))
    others = dict(zip(rng.sample(list(boundaries), len(needles) - 1), needles[1:]))
    marker = "\u2063"  # where the passage goes in the template
    frame = _chat(tokenizer, INSTRUCTION + "\n\n" + marker)
    at = _token_count(tokenizer, frame[: frame.index(marker)])
    tail = _token_count(tokenizer, "\n\n" + question + frame[frame.index(marker) + len(marker):])
    offsets = {}
    for i, passage in enumerate(passages):
        if i in others:
            at += _token_count(tokenizer, "\n\n" + others[i].sentence)
        offsets[i] = at
        at += _token_count(tokenizer, "\n\n" + passage)
    span_start = sink
    end = max(span_start + 1, at + tail - recent - _token_count(tokenizer, "\n\n" + target.sentence))
    wanted = span_start + depth * (end - span_start)
    free = [i for i in boundaries if i not in others]
    inside = [i for i in free if span_start <= offsets[i] <= end] or free  # the quantized span, when it has one
    spot = min(inside, key=lambda i: abs(offsets[i] - wanted))
    parts = []
    for i, passage in enumerate(passages):
        if i in others:
            parts.append(others[i].sentence)
        if i == spot:
            parts.append(target.sentence)
        parts.append(passage)
    message = INSTRUCTION + "\n\n" + "\n\n".join(parts) + "\n\n" + question
    text = _chat(tokenizer, message)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
    char = text.index(target.sentence)
    value = char + target.sentence.index(target.value)
    return (message, text, _token_span(offsets, char, char + len(target.sentence)),
            _token_span(offsets, value, value + len(target.value)))


def _token_span(offsets: Sequence[tuple[int, int]], begin: int, end: int) -> tuple[int, int]:
    """The tokens [start, stop) whose characters overlap `[begin, end)`."""
    inside = [i for i, (a, b) in enumerate(offsets) if b > begin and a < end]
    return inside[0], inside[-1] + 1


def make_needle_suite(tokenizer, lengths: Sequence[int], depths: Sequence[float], kinds: Sequence[str] = KINDS,
                      distractors: Sequence[int] = (0,), seed: int = 0, sink: int | None = None,
                      recent: int | None = None, plays: Sequence[str] = EVALUATION_PLAYS,
                      align: int = 1, asked: Sequence[int] = (1,)) -> list[Probe]:
    """Every combination of asked-needle count, kind, distractor count, length and depth. Each probe's play (one of
    `plays`, by default the held-out ones) follows from its own parameters and the seed, so a probe is the same in
    every suite that holds it. Choices fitted on probes (which layers to keep at higher precision, say) take
    `assets.CALIBRATION_PLAYS`."""
    probes = []
    grid = ((a, k, c, n, d) for a in asked for k in kinds for c in distractors for n in lengths for d in depths)
    for count_asked, kind, count, length, depth in grid:
        play = random.Random(_seed_key(count_asked, seed, kind, length, depth, count)).choice(list(plays))
        probes.append(make_needle_probe(tokenizer, length, depth, kind, count, seed, play, sink, recent, align,
                                        count_asked))
    return probes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="oscar-needles", description=__doc__.split("\n\n")[0])
    add_common_arguments(p, out="out/needles", max_new_tokens=32)
    p.add_argument("--lengths", type=comma_separated(positive_int, "1024,2048"), default="1024,2048,4096,8000",
                   help="prompt lengths in tokens, comma-separated")
    p.add_argument("--depths", type=comma_separated(fraction, "0.2,0.5"), default="0.2,0.5,0.8",
                   help="where the needle sits, as fractions of the quantized span, comma-separated")
    p.add_argument("--kinds", type=comma_separated(one_of(KINDS), "number,words"), default=",".join(KINDS),
                   help=f"needle kinds, comma-separated ({', '.join(KINDS)})")
    p.add_argument("--distractors", type=comma_separated(non_negative_int, "0,3"), default="0,3",
                   help="needle counts besides the asked ones, comma-separated")
    p.add_argument("--asked", type=comma_separated(positive_int, "1,2"), default="1",
                   help="how many needles one question asks for, comma-separated (2: 'What are the secret codes of "
                        "the cobalt vault and the amber vault?', a hit needs both values)")
    p.add_argument("--align", type=positive_int, default=1,
                   help="make every prompt's length a multiple of this (32 for kivi2, which quantizes whole groups "
                        "of 32 tokens); 1 keeps the probes of earlier runs")
    p.add_argument("--attention", action="store_true",
                   help="also trace, per layer and head, the fact's attention and value read-out of every OSCAR "
                        "method on the probes BF16 answers (needs bf16 among the methods; writes needle_attention.*)")
    args = p.parse_args(argv)
    if args.attention and args.methods is not None and "bf16" not in parse_method_names(args.methods):
        p.error("--attention compares against BF16's answers: add bf16 to --methods")

    def make(tokenizer):
        return make_needle_suite(tokenizer, args.lengths, args.depths, args.kinds, args.distractors, seed=args.seed,
                                 align=args.align, asked=args.asked)

    def trace(model, tokenizer, probes, results, methods, command):
        from oscar_hf.eval.diagnostics.needle_attention import needle_attention, write_report

        bf16 = [r for r in results if r.method == "bf16"]  # in probe order
        found = [(p, r.tokens) for p, r in zip(probes, bf16) if r.hit]
        if not found:
            logger.warning("--attention: BF16 answers no probe; nothing to trace")
            return
        traced = {m.name: needle_attention(model, tokenizer, [p for p, _ in found], [a for _, a in found],
                                           m.oscar_template(model))
                  for m in methods if m.oscar}
        print(write_report(traced, args.out, command))

    return run_cli(args, "oscar-needles", argv, make, "Needle retrieval in real text", "needles",
                   after=trace if args.attention else None)


if __name__ == "__main__":
    raise SystemExit(main())
