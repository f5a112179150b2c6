"""Grouping conversations into rows of a fixed capacity, for `data_prep.collate.PackingCollator` (`data.pack`)."""

from __future__ import annotations

from typing import Sequence


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices of `lengths` grouped into as few rows of `capacity` as the
    heuristic finds (longest first, each into the first row with room; ties in index order), each
    row's indices sorted. Deterministic."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, room in enumerate(free) if room >= lengths[i]), None)
        if row is None:
            rows.append([])
            free.append(capacity)
            row = len(rows) - 1
        rows[row].append(i)
        free[row] -= lengths[i]
    return [sorted(row) for row in rows]
