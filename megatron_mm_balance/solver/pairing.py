"""Pairing over-full rows with light ones for a round of swaps, shared by the rank balance
(:mod:`.rank_balance`) and the step groups' balance (:mod:`.group_exchange`).

Each heavy row tries the light rows in the pool's order, starting ``attempt[row]`` places
along, so a heavy row whose last try found no improving swap tries the next light row the
next round. A light row is paired with at most one heavy row per round (the first in the
heavy order); the heavy rows left without a partner this round move one place along. Pure
numpy: the same pairs on every rank for the same arrays.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np


def pair_heavy_with_light(heavy: np.ndarray, pool: np.ndarray,
                          attempt: np.ndarray) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """``(h, l)``: this round's heavy rows and their light partners, or None when every heavy
    row has tried the whole pool. ``heavy`` in priority order, ``pool`` lightest first;
    ``attempt`` (per row, updated in place) counts the tries each row has had."""
    heavy = heavy[attempt[heavy] < len(pool)]
    if len(heavy) == 0:
        return None
    light = pool[(np.arange(len(heavy)) + attempt[heavy]) % len(pool)]
    _, first = np.unique(light, return_index=True)
    keep = np.zeros(len(heavy), dtype=bool)
    keep[first] = True
    attempt[heavy[~keep]] += 1
    return heavy[keep], light[keep]
