"""Metric definitions on hand-built cases: zero for identical inputs, the closed-form value for planted errors."""

from __future__ import annotations

import math

import pytest
import torch

from oscar_hf.eval.diagnostics.metrics import (
    attention_kl,
    greedy_agreement_length,
    mean_squared_error,
    negative_log_likelihood,
    next_token_kl,
    perplexity,
    relative_mse,
    top1_agreement,
)

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second


def test_identical_inputs_give_zero_error():
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 5, 7)
    assert attention_kl(scores, scores).item() == 0.0
    assert relative_mse(scores, scores) == 0.0 and mean_squared_error(scores, scores) == 0.0
    assert next_token_kl(scores, scores) == 0.0
    # a constant shift of the scores leaves the softmax, hence the KL, unchanged
    assert attention_kl(scores, scores + 3.0).item() == pytest.approx(0.0, abs=1e-12)


def test_attention_kl_of_a_planted_perturbation():
    # two keys: P = (1/2, 1/2); the test scores favour key 0 by log(3): Q = (3/4, 1/4)
    ref = torch.zeros(1, 2)
    test = torch.tensor([[math.log(3.0), 0.0]], dtype=torch.float64)
    expected = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert attention_kl(ref, test).item() == pytest.approx(expected, rel=1e-12)
    # KL is not symmetric: the reference distribution weights the log-ratio
    assert attention_kl(test, ref).item() != pytest.approx(expected, rel=1e-3)


def test_attention_kl_ignores_masked_keys():
    ref = torch.tensor([[0.0, 0.0, 5.0]])
    test = torch.tensor([[math.log(3.0), 0.0, -9.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    expected = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert attention_kl(ref, test, mask).item() == pytest.approx(expected, rel=1e-12)
    # a fully masked row contributes 0, and the mean runs over rows
    rows = attention_kl(torch.cat([ref, ref]), torch.cat([test, test]),
                        torch.stack([mask[0], torch.zeros(3, dtype=torch.bool)]), reduce=False)
    assert rows.tolist() == pytest.approx([expected, 0.0])


def test_relative_and_absolute_mse_of_a_planted_error():
    ref = torch.tensor([3.0, 4.0])  # ‖ref‖² = 25
    test = ref + torch.tensor([1.0, 0.0])
    assert relative_mse(ref, test) == pytest.approx(1.0 / 25.0)
    assert mean_squared_error(ref, test) == pytest.approx(0.5)


def test_perplexity_and_agreement_of_known_logits():
    # uniform over 4 tokens: NLL = log 4, perplexity 4
    logits = torch.zeros(3, 4)
    targets = torch.tensor([0, 1, 3])
    assert negative_log_likelihood(logits, targets) == pytest.approx(math.log(4.0))
    assert perplexity(logits, targets) == pytest.approx(4.0)
    a = torch.tensor([[5.0, 0, 0], [0, 5.0, 0]])
    b = torch.tensor([[5.0, 0, 0], [5.0, 0, 0]])
    assert top1_agreement(a, b) == 0.5
    assert greedy_agreement_length([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert greedy_agreement_length([1, 2], [1, 2, 3]) == 2
    assert greedy_agreement_length([7], [8]) == 0
