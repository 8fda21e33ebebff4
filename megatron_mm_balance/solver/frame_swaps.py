"""Single moves and pairwise swaps that lower a frame plan's largest load.

:func:`~.frames.plan_frames` brings every rank to a level from where the frames are, and its
level search plans with a rank above the level never receiving. Under a patch cap that is
often what stops it: a light rank that already holds many small frames has no patch room
for the one large frame that would even the micro-step, and the placements that do better
are swaps (the heavy rank sends its large frame and takes small ones back). On the Bridge
benchmark's micro-steps after pack placement, the exact lowest level under the default cap
is 1.203 of the mean where the planner alone ends at 1.239
(``benchmarks/bench_frame_plan.py --timing``).

:func:`lower_by_swaps` starts from a plan and, while it can, takes the rank with the largest
load and makes the one change with one partner that lowers the larger of the two loads the
most: one of its frames moves to the partner, or one of its frames and one of the
partner's (or two of them) trade places. Partners are the ``partners`` least-loaded ranks. The load model is
the planner's: a frame encoded away from its owner weighs its cost plus its transfer, a
rank that receives ends within the patch cap, zero-cost frames stay. Every change lowers
the largest load of the two ranks it touches below the current largest load, so the
largest load never rises and a move never costs more than it saves; among equal levels
the change moving the least cost wins, then the lowest partner, frame and frame indices.
Integer arithmetic and those ties: the same result on every rank. Pure numpy.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

#: the least-loaded ranks the heaviest rank tries moves and swaps with, per round
PARTNERS = 8
#: the most candidate changes weighed per micro-step (summed over rounds): a bound on the
#: pass's time, about 10 ms of numpy at this size
WORK = 1 << 15


def lower_by_swaps(owner, encoder, cost, num_ranks: int, *, patches=None, patch_cap: Optional[int] = None,
                   transfer=None, partners: int = PARTNERS, work: int = WORK) -> np.ndarray:
    """``encoder`` with moves and swaps that lower its largest load (module docstring); stops
    when no change lowers the heaviest rank, or once ``work`` candidate changes have been
    weighed. Returns the plan as it was when the largest load last fell, if it fell by at least
    the planner's own tolerance (1/1024 of where it started, :mod:`.frames`); else
    ``encoder`` itself: changes that only lowered one of several ranks at the largest load, or
    lowered it by less, would move frames for nothing."""
    owner = np.asarray(owner, dtype=np.int64)
    enc = np.asarray(encoder, dtype=np.int64).copy()
    cost = np.asarray(cost, dtype=np.int64)
    n, D = cost.size, int(num_ranks)
    patches = np.ones(n, dtype=np.int64) if patches is None else np.asarray(patches, dtype=np.int64)
    transfer = np.zeros(n, dtype=np.int64) if transfer is None else np.asarray(transfer, dtype=np.int64)
    if not (owner.shape == enc.shape == cost.shape == patches.shape == transfer.shape == (n,)):
        raise ValueError("lower_by_swaps: owner, encoder, cost, patches and transfer need one entry per frame")
    if n == 0 or D < 2:
        return enc
    cap = None if patch_cap is None else int(patch_cap)
    budget = [int(work)]
    start = int(_loads(owner, enc, cost, patches, transfer, D)[0].max())
    best, best_max = enc.copy(), start
    while budget[0] > 0:
        change = _best_change(owner, enc, cost, patches, transfer, cap, D, partners, budget)
        if change is None:
            break
        a, l, back = change
        h = int(enc[a])
        enc[a] = l
        for b in back:
            if b >= 0:
                enc[b] = h
        now = int(_loads(owner, enc, cost, patches, transfer, D)[0].max())
        if now < best_max:
            best, best_max = enc.copy(), now
    return best if start - best_max >= max(1, start // 1024) else np.asarray(encoder, dtype=np.int64).copy()


def _loads(owner, enc, cost, patches, transfer, D):
    away = enc != owner
    load = np.bincount(enc, weights=cost + np.where(away, transfer, 0), minlength=D).astype(np.int64)
    held = np.bincount(enc, weights=patches, minlength=D).astype(np.int64)
    received = np.bincount(enc, weights=away.astype(np.int64), minlength=D).astype(np.int64)
    return load, held, received


def _partner_sets(units: np.ndarray, pairs: bool) -> np.ndarray:
    """``[k, 2]`` sets of a partner's frames it may send back (-1: none): nothing, each frame,
    and with ``pairs`` each two of them."""
    sets = [np.array([[-1, -1]], dtype=np.int64), np.column_stack([units, np.full(units.size, -1)])]
    if pairs and units.size >= 2:
        i, j = np.triu_indices(units.size, k=1)
        sets.append(np.column_stack([units[i], units[j]]))
    return np.concatenate(sets).astype(np.int64)


def _best_change(owner, enc, cost, patches, transfer, cap, D, partners, budget):
    """``(frame a of the heaviest rank, partner l, frames of l sent back)`` lowering the
    pair's larger load the most below the largest load, or None; ``budget[0]``: candidate
    changes still allowed, lowered by those weighed (pairs sent back only while it lasts)."""
    load, held, received = _loads(owner, enc, cost, patches, transfer, D)
    h = int(np.lexsort((np.arange(D), -load))[0])
    top = int(load[h])
    mine = np.flatnonzero((enc == h) & (cost > 0))
    if mine.size == 0:
        return None
    others = [r for r in np.lexsort((np.arange(D), load)).tolist() if r != h][:max(1, int(partners))]
    best = None

    def weigh(u, r):
        """What frames ``u`` weigh on rank ``r``: their cost, plus their transfer away from their owner."""
        return cost[u] + np.where(owner[u] != r, transfer[u], 0)

    for l in others:
        if budget[0] <= 0:
            break
        theirs = np.flatnonzero((enc == l) & (cost > 0))
        pairs = mine.size * theirs.size * (theirs.size - 1) // 2 <= budget[0]
        back = _partner_sets(theirs, pairs)
        budget[0] -= mine.size * len(back)
        ia, ib = np.meshgrid(np.arange(mine.size), np.arange(len(back)), indexing="ij")
        a, bs = mine[ia.ravel()], back[ib.ravel()]
        has = bs >= 0                                            # [k, 2]
        bb = np.where(has, bs, 0)

        def back_sum(values):
            return np.where(has, values, 0).sum(axis=1)

        new_h = load[h] - weigh(a, h) + back_sum(weigh(bb, h))
        new_l = load[l] + weigh(a, l) - back_sum(weigh(bb, l))
        level = np.maximum(new_h, new_l)
        ok = level < top
        if cap is not None:
            recv_h = received[h] - (owner[a] != h) + back_sum(owner[bb] != h)
            recv_l = received[l] + (owner[a] != l) - back_sum(owner[bb] != l)
            held_h = held[h] - patches[a] + back_sum(patches[bb])
            held_l = held[l] + patches[a] - back_sum(patches[bb])
            ok &= ((recv_h == 0) | (held_h <= cap)) & ((recv_l == 0) | (held_l <= cap))
        if not ok.any():
            continue
        moved = (cost[a] * ((owner[a] != l).astype(np.int64) - (owner[a] != h))
                 + back_sum(cost[bb] * ((owner[bb] != h).astype(np.int64) - (owner[bb] != l))))
        idx = np.flatnonzero(ok)
        pick = idx[np.lexsort((bs[idx, 1], bs[idx, 0], a[idx], moved[idx], level[idx]))[0]]
        key = (int(level[pick]), int(moved[pick]), l, int(a[pick]), int(bs[pick, 0]), int(bs[pick, 1]))
        if best is None or key < best:
            best = key
    return None if best is None else (best[3], best[2], (best[4], best[5]))
