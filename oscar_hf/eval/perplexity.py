"""Teacher-forced scoring through a cache: perplexity and next-token KL against a reference cache.

The text is fed as a `prefill` forward followed by `chunk`-token forwards through each cache, the same way a
chunked prefill or a decode loop feeds it, so every scored token attends to the quantized history of the tokens
before its chunk (its own chunk and the BF16 sink/recent tiers in BF16). With `chunk=1` this is exactly decoding.
Scored targets are the tokens after `prefill + 1`: they are predicted by the chunked forwards only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from oscar_hf.compat import cache_argument_name


@dataclass
class ScoreResult:
    nll: float  # mean negative log-likelihood of the scored tokens (nats)
    kl: float  # mean KL(reference || this) of the next-token distributions (nats); 0 for the reference
    top1_agreement: float  # fraction of positions whose argmax equals the reference's
    tokens: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll)


@torch.no_grad()
def compare_caches(
    model,
    input_ids: torch.Tensor,
    make_caches: dict[str, Callable[[], object]],
    prefill: int = 512,
    chunk: int = 32,
    progress: bool = True,
    forwards: dict[str, Callable] | None = None,
) -> dict[str, ScoreResult]:
    """Score `input_ids` `[1, L]` through one fresh cache per entry; the first entry is the KL reference.

    `make_caches` maps a name to a zero-argument factory (e.g. `lambda: DynamicCache(config=model.config)`);
    `forwards` the names whose scored forwards run through another callable than `model` (a compiled forward).
    """
    if input_ids.shape[0] != 1:
        raise ValueError("compare_caches scores one sequence at a time (batch 1)")
    length = input_ids.shape[1]
    if not 0 < prefill < length - 1:
        raise ValueError(f"prefill={prefill} must leave tokens to score in a sequence of {length}")
    argument = cache_argument_name(model)
    names = list(make_caches)
    caches = {name: factory() for name, factory in make_caches.items()}
    device = next(model.parameters()).device
    ids = input_ids.to(device)
    totals = {name: [0.0, 0.0, 0] for name in names}  # nll sum, kl sum, top1 matches
    scored = 0
    starts = list(range(prefill, length - 1, chunk))
    for name in names:
        model(input_ids=ids[:, :prefill], use_cache=True, **{argument: caches[name]})
    for start in tqdm(starts, desc="scoring", disable=not progress, leave=False):
        end = min(start + chunk, length - 1)
        targets = ids[0, start + 1 : end + 1]
        reference_logp = None
        for name in names:
            run = (forwards or {}).get(name, model)
            logits = run(input_ids=ids[:, start:end], use_cache=True, **{argument: caches[name]}).logits[0]
            logp = torch.log_softmax(logits.float(), dim=-1)
            total = totals[name]
            total[0] -= logp.gather(1, targets[:, None]).sum().item()
            if reference_logp is None:
                reference_logp = logp
            else:
                total[1] += torch.sum(reference_logp.exp() * (reference_logp - logp)).item()
                total[2] += (logp.argmax(-1) == reference_logp.argmax(-1)).sum().item()
        totals[names[0]][2] += end - start
        scored += end - start
    return {
        name: ScoreResult(nll=t[0] / scored, kl=t[1] / scored, top1_agreement=t[2] / scored, tokens=scored)
        for name, t in totals.items()
    }
