"""A small greedy all-pairs generator: cases (one level of each factor) such that every pair of levels
of two factors appears in some case, steered away from cases a predicate rejects."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from itertools import combinations
from typing import Any

Pair = tuple[tuple[str, int], tuple[str, int]]


def pairs_of(case: Mapping[str, int]) -> set[Pair]:
    """The level pairs ``case`` (factor -> level index) covers, factors in sorted order."""
    items = sorted(case.items())
    return {(a, b) for a, b in combinations(items, 2)}


def all_pairs(
    factors: Mapping[str, Sequence[Any]],
    accepted: Callable[[dict[str, Any]], bool],
    seed: int = 0,
    tries: int = 40,
    fill: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], set[Pair]]:
    """Cases covering every pair of levels with cases that ``accepted`` takes, and the pairs that no
    accepted case could hold (each then gets one case of its own, which ``accepted`` rejects).
    ``accepted`` is also asked of partial cases, the factors not chosen yet at their first level,
    then given to ``fill`` (which may change those: a level that needs another)."""
    names = sorted(factors)
    uncovered = {
        ((a, i), (b, j))
        for a, b in combinations(names, 2)
        for i in range(len(factors[a]))
        for j in range(len(factors[b]))
    }
    rng = random.Random(seed)
    cases: list[dict[str, int]] = []
    lone: set[Pair] = set()
    while uncovered:
        start = sorted(uncovered)[0]
        best: dict[str, int] | None = None
        best_gain = 0

        def ok(case: dict[str, int]) -> bool:
            full = {k: factors[k][case.get(k, 0)] for k in names}
            chosen = {k: full[k] for k in case}
            return accepted({**full, **(fill(full) if fill else {}), **chosen})

        for _ in range(tries if ok(dict(start)) else 0):
            case = _complete(dict(start), names, factors, uncovered, rng, ok)
            gain = len(pairs_of(case) & uncovered)
            if gain > best_gain:
                best, best_gain = case, gain
        if best is None:  # no accepted case holds this pair: it is tried alone
            lone.add(start)
            best = {**{k: 0 for k in names}, **dict(start)}
            uncovered.discard(start)
        else:
            uncovered -= pairs_of(best)
        cases.append(best)
    held = set().union(*(pairs_of(c) for c in cases if ok(c)))  # an accepted case found it after all
    return [{k: factors[k][v] for k, v in case.items()} for case in cases], lone - held


def _complete(
    case: dict[str, int],
    names: list[str],
    factors: Mapping[str, Sequence[Any]],
    uncovered: set[Pair],
    rng: random.Random,
    ok: Callable[[dict[str, int]], bool],
) -> dict[str, int]:
    """``case`` with a level for every other factor, each the one covering most uncovered pairs with
    the levels chosen so far (ties broken at random) among those ``ok`` takes."""
    for name in rng.sample(names, len(names)):
        if name in case:
            continue

        def gain(level: int, name: str = name) -> tuple[int, float]:
            new = {tuple(sorted(((other, chosen), (name, level)))) for other, chosen in case.items()}
            return len(new & uncovered), rng.random()

        for level in sorted(range(len(factors[name])), key=gain, reverse=True):
            if ok({**case, name: level}):
                case[name] = level
                break
    return case
