"""Which loglikelihood request a row of an lm-eval batch came from, whatever lm-eval pads it with.

lm-eval's `HFLM` scores `loglikelihood` requests in batches of input rows (`(context + continuation)[:-1]`, left
truncated), right-padded to the batch's longest row, and hands `_model_call` only the padded batch. The
decode-equivalent scoring of `oscar_hf.eval.lm_eval` needs each row's prefill length, which is a property of the
request, so it looks the row up among the requests' rows. No token value is taken for padding: a batch row's
request row is one of the registered rows that the batch row starts with.

That lookup is exact when the registered rows that are prefixes of one another agree on the prefill. `rounds`
splits a set of requests into rounds where this holds (one round unless some request's row is a prefix of another
request's row, or equal to it, with a different prefill), and `RowIndex` finds a batch row's prefill within one.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

Row = tuple[int, ...]


def _starts_with(row: Sequence[int], prefix: Row) -> bool:
    return len(prefix) <= len(row) and tuple(row[:len(prefix)]) == prefix


def rounds(rows: Sequence[Row], prefills: Sequence[int]) -> list[int]:
    """Round number (0, 1, ...) of each request such that within a round no row is a prefix of (or equal to)
    another row with a different prefill. Requests with equal rows and equal prefills share a round.

    One pass over the rows in lexicographic order: the rows that are prefixes of the current one are exactly the
    chain kept on a stack (a row's prefixes sort before it, and every row between a prefix and it extends that
    prefix), and each row takes the lowest round that none of its conflicting prefixes holds.
    """
    if len(rows) != len(prefills):
        raise ValueError(f"{len(rows)} rows but {len(prefills)} prefill lengths")
    order = sorted(range(len(rows)), key=lambda i: (rows[i], prefills[i]))
    assigned = [0] * len(rows)
    chain: list[int] = []  # indices of the rows that are prefixes of the current row, shortest first
    for i in order:
        while chain and not _starts_with(rows[i], rows[chain[-1]]):
            chain.pop()
        taken = {assigned[j] for j in chain if prefills[j] != prefills[i]}
        assigned[i] = next(r for r in range(len(taken) + 1) if r not in taken)
        chain.append(i)
    return assigned


class RowIndex:
    """The prefill lengths of the rows of one round (`rounds`), looked up from right-padded batch rows.

    `prefill_of(batch_row)` returns the prefill of a registered row that `batch_row` starts with, or None when it
    starts with none (rows lm-eval makes up itself, such as its batch-size probe). Within a round every registered
    row that a batch row starts with has the same prefill, so the padding never decides the answer.
    """

    def __init__(self, prefills: dict[Row, int]):
        self._rows = sorted(prefills)
        self._prefills = [prefills[row] for row in self._rows]
        # the longest registered proper prefix of each row (its parent in the trie of the rows), or -1
        self._parent = [-1] * len(self._rows)
        chain: list[int] = []
        for i, row in enumerate(self._rows):
            while chain and not _starts_with(row, self._rows[chain[-1]]):
                chain.pop()
            self._parent[i] = chain[-1] if chain else -1
            chain.append(i)

    def __len__(self) -> int:
        return len(self._rows)

    def prefill_of(self, batch_row: Sequence[int]) -> int | None:
        """Prefill length of the request whose row `batch_row` starts with (None if it starts with no row).

        The registered row just below `batch_row` in lexicographic order either is a prefix of it or extends the
        longest registered prefix of it; walking up its chain of registered prefixes finds that one.
        """
        key = tuple(batch_row)
        i = bisect.bisect_right(self._rows, key) - 1
        while i >= 0 and not _starts_with(key, self._rows[i]):
            i = self._parent[i]
        return self._prefills[i] if i >= 0 else None
