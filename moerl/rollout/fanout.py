"""A call fanned out over N engines: the requests split into N contiguous slices balanced by samples (the split
does not depend on where the engines run, so a seeded run gives the same rollouts wherever they are), and the
answers gathered in order with the first error raised once every engine has answered."""

from __future__ import annotations

from moerl.engine import Request


def split(requests: list[Request], n: int) -> list[slice]:
    """``n`` contiguous slices of ``requests`` with about equal numbers of samples (some may be empty)."""
    weights = [r.params.n for r in requests]
    total, bounds, acc, k = sum(weights), [0], 0, 1
    for i, w in enumerate(weights):
        acc += w
        while k < n and acc >= total * k / n:
            bounds.append(i + 1)
            k += 1
    bounds += [len(requests)] * (n + 1 - len(bounds))
    return [slice(bounds[j], bounds[j + 1]) for j in range(n)]


def gather(calls: list) -> list:
    """Every call's result, in order; the first exception is raised once all have answered, so no engine is left
    with an unread reply."""
    results, first = [], None
    for call in calls:
        try:
            results.append(call())
        except Exception as e:  # noqa: BLE001 - re-raised below
            first = first or e
    if first is not None:
        raise first
    return results
