"""Ranked assignments: every one-to-one assignment of a value table, best first, and the best one
not yet rejected (what the advice shows and the advised and asking players propose).

Small tables are enumerated; larger ones are ranked lazily by Murty's k-best partition, one
Hungarian solve per child.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from itertools import permutations

import numpy as np

Pairs = list[tuple[int, int]]  # (reviewer index, paper index)


# Up to this size every assignment is enumerated (5! = 120); above it, Murty's k-best.
ENUMERATE_UP_TO = 5


def ranked_assignments(estimate: np.ndarray) -> Iterator[tuple[float, Pairs]]:
    """Every one-to-one assignment of ``estimate`` as (value, sorted pairs), best value first.

    Up to ``ENUMERATE_UP_TO`` all n! assignments are enumerated and sorted (ties: pairs in
    lexicographic order); above it they come lazily from Murty's partition of the solution space,
    one Hungarian solve per child, so asking for the k best costs about k * n solves.
    """
    arr = np.asarray(estimate, dtype=float)
    n = arr.shape[0]
    if n <= ENUMERATE_UP_TO:
        perms = np.array(list(permutations(range(n))), dtype=np.int64)  # perms[k][r] = paper
        values = arr[np.arange(n), perms].sum(axis=1)
        for k in np.lexsort((np.arange(len(perms)), -values)):  # stable: ties in perm order
            yield float(values[k]), [(r, int(p)) for r, p in enumerate(perms[k])]
        return
    yield from murty_ranking(arr)


def _constrained_best(
    arr: np.ndarray, forced: frozenset, forbidden: frozenset
) -> tuple[float, Pairs] | None:
    """The best assignment that uses every ``forced`` pair and no ``forbidden`` one, or None."""
    from scipy.optimize import linear_sum_assignment

    cost = -arr.copy()
    for r, p in forced:
        keep = cost[r, p]
        cost[r, :] = np.inf
        cost[:, p] = np.inf
        cost[r, p] = keep
    for r, p in forbidden:
        cost[r, p] = np.inf
    try:
        rows, cols = linear_sum_assignment(cost)
    except ValueError:  # no assignment avoids every forbidden pair
        return None
    pairs = sorted((int(r), int(c)) for r, c in zip(rows, cols))
    return float(arr[rows, cols].sum()), pairs


def murty_ranking(arr: np.ndarray) -> Iterator[tuple[float, Pairs]]:
    """Murty's k-best assignments: each popped solution's space minus itself is split into
    disjoint children (its i-th free pair forbidden, the ones before it forced)."""
    first = _constrained_best(arr, frozenset(), frozenset())
    if first is None:
        return
    count = 0
    heap = [(-first[0], first[1], count, frozenset(), frozenset())]
    while heap:
        neg, pairs, _, forced, forbidden = heapq.heappop(heap)
        yield -neg, pairs
        free = [pair for pair in pairs if pair not in forced]
        for i, pair in enumerate(free):
            child_forced = forced | frozenset(free[:i])
            child_forbidden = forbidden | {pair}
            found = _constrained_best(arr, child_forced, child_forbidden)
            if found is not None:
                count += 1
                heapq.heappush(heap, (-found[0], found[1], count, child_forced, child_forbidden))


def best_untried(estimate: np.ndarray, rejected: list[Pairs]) -> Pairs | None:
    """The best assignment of ``estimate`` that is none of the ``rejected`` ones (exact: the
    assignments in ``ranked_assignments`` order, the first not rejected); None once every
    assignment was rejected."""
    seen = {tuple(sorted(map(tuple, pairs))) for pairs in rejected}
    for _, pairs in ranked_assignments(estimate):
        if tuple(pairs) not in seen:
            return pairs
    return None
