"""lm-eval glue of the `oscar_needles` task: the needle suite of `oscar_hf.eval.needles` as documents, and its hit
score. The documents are generated for the evaluated model's tokenizer (`pretrained` or `tokenizer` of
`--model_args`); `--metadata` JSON may set `lengths`, `depths`, `kinds`, `distractors` and `seed`."""

from __future__ import annotations

import datasets

from oscar_hf.eval.assets import load_tokenizer
from oscar_hf.eval.needles import KINDS, make_needle_suite
from oscar_hf.eval.retrieval import is_hit


def needle_dataset(lengths=(1024, 2048, 4096), depths=(0.2, 0.5, 0.8), kinds=KINDS, distractors=(0, 3), seed=0,
                   **model_args) -> dict[str, datasets.Dataset]:
    name = model_args.get("tokenizer") or model_args.get("pretrained")
    if not isinstance(name, str) or not name:
        raise ValueError("oscar_needles sizes its prompts with the model's tokenizer: pass --model_args "
                         "pretrained=<name> (or tokenizer=<name>)")
    tokenizer = load_tokenizer(name)
    probes = make_needle_suite(tokenizer, list(lengths), list(depths), list(kinds), list(distractors), seed=seed)
    rows = [dict(input=p.message, answer=p.answer, kind=p.kind, length=p.length, depth=p.depth,
                 distractors=p.distractors) for p in probes]
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"hit": float(is_hit(doc["answer"], results[0]))}
