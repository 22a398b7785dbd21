"""Finding the request of a right-padded lm-eval batch row (`oscar_hf.eval.lm_eval_rows`): the answer never
depends on what the padding is, and requests that would make it ambiguous are put in separate rounds."""

from __future__ import annotations

import random

import pytest

from oscar_hf.eval.lm_eval_rows import RowIndex, rounds

pytestmark = pytest.mark.quick  # every test here is an essential of well under a second


def padded(row, length, pad):
    return list(row) + [pad] * (length - len(row))


@pytest.mark.parametrize("pad", [0, 7, 9])
def test_a_padded_row_finds_its_prefill_whatever_the_pad_token(pad):
    # rows ending in 0, 7 and 9: whichever token pads the batch, it continues some row exactly as that row's
    # request would; prefixes share their prefill, as rows of one round do
    rows = {(5, 3, 0): 2, (5, 3, 0, 0): 2, (5, 3, 7): 2, (5, 3, 7, 7, 9): 2, (4, 9): 1, (4, 9, 9, 9): 1, (8,): 1}
    index = RowIndex(rows)
    for row, prefill in rows.items():
        for length in range(len(row), 8):
            assert index.prefill_of(padded(row, length, pad)) == prefill


def test_a_row_that_starts_with_no_request_finds_nothing():
    index = RowIndex({(1, 2, 3): 2, (1, 2, 3, 4): 2})
    assert index.prefill_of([1, 1, 1, 1]) is None  # HFLM's batch-size probe: rows of ones
    assert index.prefill_of([2, 1, 2, 3]) is None
    assert index.prefill_of([1, 2]) is None  # shorter than every row
    assert RowIndex({}).prefill_of([1, 2]) is None


def test_rows_that_start_another_row_with_another_prefill_are_scored_in_separate_rounds():
    # (ctx + cont[:-1]) rows: B's row is A's row plus a 0, which the batch's padding could also be
    rows = [(5, 3, 2), (5, 3, 2, 0), (5, 3, 2, 0), (6, 1), (6, 1)]
    prefills = [2, 4, 4, 1, 2]  # the last two: one row, two context lengths (HFLM would share their logits)
    assigned = rounds(rows, prefills)
    assert assigned[0] != assigned[1] and assigned[1] == assigned[2] and assigned[3] != assigned[4]
    assert max(assigned) == 1


def test_requests_that_cannot_be_confused_stay_in_one_round():
    rows = [(5, 3, 2), (5, 3, 2, 0), (5, 3, 2, 0, 4), (6, 1), (6, 2), (6,)]
    prefills = [2, 2, 2, 1, 1, 1]  # multiple-choice requests of one context: every prefix has the same prefill
    assert rounds(rows, prefills) == [0] * len(rows)
    with pytest.raises(ValueError, match="2 rows but 1 prefill"):
        rounds(rows[:2], prefills[:1])


def test_random_requests_find_their_prefill_within_their_round_for_any_padding():
    rng = random.Random(0)
    checked = 0
    for _ in range(200):
        # a 3-token vocabulary with 0 in it: rows are often prefixes of each other, and padding often equals a
        # row's next token
        rows = [tuple(rng.randrange(3) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 12))]
        prefills = [rng.randint(1, len(row)) for row in rows]
        assigned = rounds(rows, prefills)
        for round_ in set(assigned):
            members = [i for i, r in enumerate(assigned) if r == round_]
            registered = {}
            for i in members:
                assert registered.setdefault(rows[i], prefills[i]) == prefills[i]  # one prefill per row in a round
            index = RowIndex(registered)
            longest = max(len(rows[i]) for i in members)
            for i in members:
                for pad in range(3):
                    assert index.prefill_of(padded(rows[i], longest, pad)) == prefills[i]
                    checked += 1
    assert checked > 1000
