"""Metric definitions of the quality harness, each on plain tensors (all reductions in float64, natural log).

- `attention_kl(ref_scores, test_scores, mask)`: per query row, `KL(P || P̂) = Σ_j P_j (log P_j − log P̂_j)` with
  `P = softmax(ref_scores)`, `P̂ = softmax(test_scores)` over the allowed keys (mask True); mean over rows.
- `relative_mse(ref, test)`: `‖ref − test‖² / ‖ref‖²` over all elements (0 for identical inputs).
- `mean_squared_error(ref, test)`: `mean((ref − test)²)`.
- `next_token_kl(ref_logits, test_logits)`: mean over positions of `KL(softmax(ref) || softmax(test))`.
- `negative_log_likelihood(logits, targets)`: mean `−log softmax(logits)[target]`; `perplexity = exp(nll)`.
- `top1_agreement(ref_logits, test_logits)`: fraction of positions whose argmax agrees.
- `greedy_agreement_length(ref_tokens, test_tokens)`: number of leading generated tokens that agree.
"""

from __future__ import annotations

import math

import torch


def attention_kl(ref_scores: torch.Tensor, test_scores: torch.Tensor, mask: torch.Tensor | None = None,
                 reduce: bool = True) -> torch.Tensor:
    """KL(softmax(ref) || softmax(test)) over the last dim, per row; `mask` (bool, True = attend) broadcasts.

    Rows with no allowed key count as 0. Returns the mean over rows (a 0-d float64 tensor), or the per-row
    values when `reduce=False`.
    """
    ref, test = ref_scores.double(), test_scores.double()
    if mask is not None:
        ref = ref.masked_fill(~mask, float("-inf"))
        test = test.masked_fill(~mask, float("-inf"))
    log_p = torch.log_softmax(ref, dim=-1)
    log_q = torch.log_softmax(test, dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    per_row = terms.sum(dim=-1).nan_to_num(0.0)
    return per_row.mean() if reduce else per_row


def mean_squared_error(ref: torch.Tensor, test: torch.Tensor) -> float:
    return torch.mean((ref.double() - test.double()) ** 2).item()


def squared_error_sums(ref: torch.Tensor, test: torch.Tensor) -> tuple[float, float]:
    """(‖ref − test‖², ‖ref‖²): the two sums of `relative_mse`, for accumulating over many pieces."""
    ref = ref.double()
    return torch.sum((ref - test.double()) ** 2).item(), torch.sum(ref**2).item()


def relative_mse(ref: torch.Tensor, test: torch.Tensor) -> float:
    error, norm = squared_error_sums(ref, test)
    return error / norm if norm > 0 else (0.0 if error == 0 else math.inf)


def next_token_kl(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(test)); logits `[..., vocab]`."""
    return attention_kl(ref_logits.reshape(-1, ref_logits.shape[-1]),
                        test_logits.reshape(-1, test_logits.shape[-1])).item()


def negative_log_likelihood(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean NLL (nats) of `targets` `[...]` under `logits` `[..., vocab]`."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(-1, targets[..., None]).mean().item()


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(negative_log_likelihood(logits, targets))


def top1_agreement(ref_logits: torch.Tensor, test_logits: torch.Tensor) -> float:
    return (ref_logits.argmax(-1) == test_logits.argmax(-1)).double().mean().item()


def greedy_agreement_length(ref_tokens, test_tokens) -> int:
    """Leading tokens on which two generations agree (the shorter length if one is a prefix of the other)."""
    ref, test = list(map(int, ref_tokens)), list(map(int, test_tokens))
    for i, (a, b) in enumerate(zip(ref, test)):
        if a != b:
            return i
    return min(len(ref), len(test))
