"""Two-phase placement: balance the vision and the language phase of every micro-step.

Under expert parallelism ranks meet twice per micro-step: the language model's
first all-to-all waits for the slowest vision forward, and the language phase
runs in lockstep. A micro-step therefore costs about
``max_r vision[r, m] + max_r language[r, m]``, and a scalar cost (vision +
language time) cannot even out both: an image-heavy pack and a pack of long
text documents cost the same scalar time but load different phases.

Input: ``costs[r, i, :] = (vision, language)``, non-negative integers (e.g.
microseconds of forward + backward), rank ``r``'s ``i``-th pack. Objective:
``sum_m (max_r V[r, m] + max_r L[r, m])`` over the placed packs.

1. **Grouping** (which packs share a micro-step). The best of several candidate
   groupings into ``G`` groups of ``D`` by the two-phase objective:

   * sorted grouping by vision, by language, and by their sum (one-dimensional
     keys; when one phase is zero everywhere, the key of the other is the exact
     optimum, as in the scalar solver);
   * *bands*: cut the packs by language cost into bands (a
     multiple of D each) and group each band by sorted vision cost (or sorted
     language cost). Otherwise every vision-sorted micro-step holds some
     long-text pack and pays nearly the global language maximum. The bands come
     from a dynamic program over boundaries on a grid of ``G / 8`` groups;
   * on small batches (at most ``SWAP_DESCENT_MAX_PACKS`` packs), the best of
     those then descends by swaps of two packs between groups while the
     objective falls (measured against the exact optimum of :mod:`.exact`).

2. **Slots** (which rank computes which pack). Each group becomes a micro-step;
   a rank keeps its heaviest pack of that group, the others move to the ranks
   left without one, heaviest to the lightest running total (node-mates first).

3. **Rank totals and movement**: the swaps of :mod:`.rank_balance`, where a pack
   may enter micro-step ``m`` only if both its costs fit that micro-step's maxima
   (the *box*), so the objective never changes; rank totals of vision + language
   end within the tolerance; move chains are shortened.

The lower bound (:func:`two_phase_lower_bound`) is each phase at its own
sorted-grouping optimum; :func:`evaluate_two_phase` reports the gap to it.
Deterministic: integer costs, stable sorts, explicit tie breaks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sorting import lex_argsort, stable_argsort
from .rank_balance import SwapRules, balance_rank_totals, send_home
from .topology import pair_within_nodes


def as_cost_pairs(costs) -> np.ndarray:
    """Validate two-phase costs: ``[D, G, 2]`` non-negative integers."""
    c = np.asarray(costs)
    if c.ndim != 3 or c.shape[2] != 2 or c.shape[0] < 1 or c.shape[1] < 1:
        raise ValueError(f"two-phase costs must be a [ranks, micro-steps, 2] array, got shape {c.shape}")
    if c.dtype.kind == "f":
        if not np.all(np.isfinite(c)) or np.any(c != np.rint(c)):
            raise ValueError("costs must be integers (quantise float costs before placing)")
    elif c.dtype.kind not in "iub":
        raise ValueError(f"costs must be numeric, got dtype {c.dtype}")
    c = c.astype(np.int64)
    if np.any(c < 0):
        raise ValueError("costs must be >= 0")
    return c


def _sgo(x: np.ndarray, D: int) -> int:
    return int(np.sort(x.ravel())[::-1][::D].sum())


def two_phase_objective(assigned: np.ndarray) -> int:
    """``sum_m (max_r V + max_r L)`` of placed ``[D, G, 2]`` costs."""
    a = np.asarray(assigned)
    return int(a[:, :, 0].max(axis=0).sum() + a[:, :, 1].max(axis=0).sum())


def two_phase_lower_bound(costs) -> int:
    """Each phase at its own sorted-grouping optimum: no placement does better."""
    c = as_cost_pairs(costs)
    D = c.shape[0]
    return _sgo(c[:, :, 0], D) + _sgo(c[:, :, 1], D)


def _grouping_objective(v, l, group, G):
    vm = np.zeros(G, dtype=np.int64)
    lm = np.zeros(G, dtype=np.int64)
    np.maximum.at(vm, group, v)
    np.maximum.at(lm, group, l)
    return int(vm.sum() + lm.sum())


def _order_objective(v, l, order, D):
    """Objective of the grouping that cuts ``order`` (pack indices) into runs of D."""
    starts = np.arange(0, len(order), D)
    return int(np.maximum.reduceat(v[order], starts).sum() + np.maximum.reduceat(l[order], starts).sum())


def _desc_order(key, tie):
    """Pack indices by ``key`` descending, ties by ``tie`` descending, then index."""
    return lex_argsort((-tie, -key))


def _sorted_groups(key, tie, D):
    order = _desc_order(key, tie)
    group = np.empty(len(key), dtype=np.int64)
    group[order] = np.arange(len(key)) // D
    return group


# Above this many packs the band program runs on an evenly strided sample (the
# packs of a global batch are exchangeable draws), and only the chosen bands are
# built on all packs: the program's cost stops growing with D.
BAND_SAMPLE = 8192


def _band_program(p, q, D, G, units):
    """Best bands ``[(s, e, by_p), ...]`` (group ranges along q, highest first)."""
    N = len(p)
    idx = np.arange(N)
    q_order = _desc_order(q, p)
    p_order = _desc_order(p, q)
    q_pos = np.empty(N, dtype=np.int64)
    q_pos[q_order] = idx
    qp = q_pos[p_order]                         # q-rank of each pack, in p order
    step = max(1, G // units)
    cuts = sorted(set(list(range(0, G, step)) + [G]))

    def band(s, e):
        lo, hi = s * D, e * D
        starts = np.arange(0, hi - lo, D)
        mem = q_order[lo:hi]                                   # by q: q-sorted grouping
        cost_q = int(q[mem[::D]].sum()) + int(np.maximum.reduceat(p[mem], starts).sum())
        byp = p_order[(qp >= lo) & (qp < hi)]                  # by p: p-sorted grouping
        cost_p = int(p[byp[::D]].sum()) + int(np.maximum.reduceat(q[byp], starts).sum())
        return (cost_p, True) if cost_p <= cost_q else (cost_q, False)

    cost = {}
    best = {0: (0, None)}
    for j, e in enumerate(cuts[1:], start=1):
        opts = []
        for s in cuts[:j]:
            cost[(s, e)] = band(s, e)
            opts.append((best[s][0] + cost[(s, e)][0], s))
        best[e] = min(opts)
    bands = []
    e = G
    while e > 0:
        s = best[e][1]
        bands.append((s, e, cost[(s, e)][1]))
        e = s
    return bands[::-1]


def _banded_groups(p, q, D, G, units: int = 8):
    """Bands along ``q`` (highest first), each band's packs grouped by sorted ``p``
    (or by sorted ``q`` if cheaper): long-text packs stop setting the language
    maximum of every vision-sorted micro-step, and vice versa. Band boundaries
    fall on multiples of ``G // units`` groups; the best bands come from a dynamic
    program over those boundaries (each band's cost O(N) from the global orders,
    on a strided sample of at most ``BAND_SAMPLE`` packs).
    Returns (pack order, group-major, and its objective)."""
    N = len(p)
    stride = -(-N // BAND_SAMPLE)
    if stride > 1 and D // stride >= 1:
        Ds = D // stride
        sample = np.arange(0, N, stride)[: G * Ds]
        bands = _band_program(p[sample], q[sample], Ds, G, units)
    else:
        bands = _band_program(p, q, D, G, units)
    q_order = _desc_order(q, p)
    q_pos = np.empty(N, dtype=np.int64)
    q_pos[q_order] = np.arange(N)
    p_order = None
    parts = []
    for s, e, by_p in bands:
        lo, hi = s * D, e * D
        if by_p:
            if p_order is None:
                p_order = _desc_order(p, q)
                qp = q_pos[p_order]
            parts.append(p_order[(qp >= lo) & (qp < hi)])
        else:
            parts.append(q_order[lo:hi])
    order = np.concatenate(parts)
    return order, _order_objective(p, q, order, D)


# Small batches (at most this many packs) finish with a descent of pack swaps
# between groups; the exact reference (solver/exact.py) showed the gap it closes.
SWAP_DESCENT_MAX_PACKS = 256


def group_two_phase(v: np.ndarray, l: np.ndarray, D: int, G: int) -> np.ndarray:
    """Group id (micro-step) of each of the ``D * G`` packs; see the module docstring."""
    both = bool(v.any() and l.any())
    if not both:                                  # one phase: its sorted grouping is optimal
        order = _desc_order(v, l) if v.any() else _desc_order(l, v)
    else:
        # The band program includes the single bands [0, G) grouped by vision or by
        # language alone, so it is never worse than either one-dimensional sort.
        order, obj = _banded_groups(v, l, D, G)
        by_sum = _desc_order(v + l, v)
        if _order_objective(v, l, by_sum, D) < obj:
            order = by_sum
    group = np.empty(len(v), dtype=np.int64)
    group[order] = np.arange(len(v)) // D
    if both and G > 1 and len(v) <= SWAP_DESCENT_MAX_PACKS:
        _swap_descent(v.astype(np.int64), l.astype(np.int64), group, G)
    return group


def _max_without(x: np.ndarray, group: np.ndarray, G: int) -> np.ndarray:
    """Per pack: the maximum of ``x`` over the other packs of its group (0 if none)."""
    top = np.zeros(G, dtype=np.int64)
    np.maximum.at(top, group, x)
    is_top = x == top[group]
    count = np.bincount(group, weights=is_top, minlength=G)
    second = np.zeros(G, dtype=np.int64)
    np.maximum.at(second, group, np.where(is_top, 0, x))
    alone = is_top & (count[group] == 1)
    return np.where(alone, second[group], top[group])


def _swap_descent(v: np.ndarray, l: np.ndarray, group: np.ndarray, G: int,
                  max_rounds: int = 1024) -> int:
    """Swap packs between groups in place while a swap lowers the two-phase objective:
    each round applies the best swap of all pairs (ties: the first in row-major pair
    order), O(N^2) per round. Returns the objective saved."""
    N = len(v)
    saved = 0
    for _ in range(max_rounds):
        vm = np.zeros(G, dtype=np.int64)
        lm = np.zeros(G, dtype=np.int64)
        np.maximum.at(vm, group, v)
        np.maximum.at(lm, group, l)
        wv, wl = _max_without(v, group, G), _max_without(l, group, G)
        ga, gb = group[:, None], group[None, :]
        # pack i (row) goes to j's group, pack j (column) to i's
        after = (np.maximum(wv[:, None], v[None, :]) + np.maximum(wv[None, :], v[:, None])
                 + np.maximum(wl[:, None], l[None, :]) + np.maximum(wl[None, :], l[:, None]))
        delta = after - (vm[ga] + vm[gb] + lm[ga] + lm[gb])
        delta[ga == gb] = 0
        k = int(np.argmin(delta))
        if delta.flat[k] >= 0:
            break
        i, j = divmod(k, N)
        group[i], group[j] = group[j], group[i]
        saved -= int(delta.flat[k])
    return saved


@dataclass(frozen=True)
class TwoPhaseGroups:
    """Step 1 of the module docstring, which does not depend on the nodes: ``weights``
    ``[D, G]`` (vision + language, the rank totals evened), ``boxes[m]`` micro-step m's
    (vision, language) maxima (micro-steps in decreasing order of their sum), and ``order`` with
    ``bounds``: the packs (flat indices) of micro-step m, heaviest first (ties by
    origin then index), are ``order[bounds[m]:bounds[m + 1]]``."""

    weights: np.ndarray
    boxes: np.ndarray
    order: np.ndarray
    bounds: np.ndarray


def two_phase_groups(c: np.ndarray) -> TwoPhaseGroups:
    """Group validated ``[D, G, 2]`` costs into micro-steps (``microstep`` mode, both
    phases present, D and G above 1): :func:`group_two_phase`, then the boxes."""
    D, G, _ = c.shape
    v, l = c[:, :, 0].ravel(), c[:, :, 1].ravel()
    w = (v + l).reshape(D, G)                                # rank totals: vision + language
    group = group_two_phase(v, l, D, G).reshape(D, G)

    # Boxes: each group's maxima, in decreasing order of total (the micro-step order).
    vm = np.zeros(G, dtype=np.int64)
    lm = np.zeros(G, dtype=np.int64)
    np.maximum.at(vm, group.ravel(), v)
    np.maximum.at(lm, group.ravel(), l)
    step_of_group = np.empty(G, dtype=np.int64)
    step_of_group[np.lexsort((np.arange(G), -(vm + lm)))] = np.arange(G)
    step = step_of_group[group]
    boxes = np.empty((G, 2), dtype=np.int64)
    boxes[step_of_group, 0] = vm
    boxes[step_of_group, 1] = lm
    wf, sf = w.ravel(), step.ravel()
    # Packs of each step, heaviest first, ties by origin then index (row-major).
    top = int(wf.max()) + 1
    order = lex_argsort((top - 1 - wf, sf))
    bounds = np.searchsorted(sf[order], np.arange(G + 1))
    return TwoPhaseGroups(w, boxes, order, bounds)


def two_phase_slots(c: np.ndarray, groups: TwoPhaseGroups, tolerance: float,
                    node: np.ndarray | None):
    """Steps 2 and 3 of the module docstring on ``groups``: ``(src_rank, src_index)``,
    each ``[D, G]``, for the ranks' nodes (None: flat)."""
    D, G, _ = c.shape
    w, order, bounds = groups.weights, groups.order, groups.bounds
    src_rank = np.full((D, G), -1, dtype=np.int64)
    src_index = np.full((D, G), -1, dtype=np.int64)
    totals = np.zeros(D, dtype=np.int64)
    rows = np.repeat(np.arange(D), G)
    cols = np.tile(np.arange(G), D)
    for m in range(G):
        sel = order[bounds[m]:bounds[m + 1]]
        r, i = rows[sel], cols[sel]
        first = np.ones(len(sel), dtype=bool)
        # a rank keeps its heaviest pack of this step (first in order among its own)
        o = stable_argsort(r)
        dup = np.zeros(len(sel), dtype=bool)
        dup[o[1:]] = r[o[1:]] == r[o[:-1]]
        first &= ~dup
        src_rank[r[first], m] = r[first]
        src_index[r[first], m] = i[first]
        movers = np.flatnonzero(~first)                      # heaviest first already
        free = np.flatnonzero(src_rank[:, m] < 0)
        free = free[stable_argsort(totals[free])]              # free: ascending ranks
        dest = pair_within_nodes(r[movers], free, node)
        src_rank[dest, m] = r[movers]
        src_index[dest, m] = i[movers]
        totals += w[src_rank[:, m], src_index[:, m]]             # every rank once

    rules = SwapRules(c, weights=w, levels=groups.boxes, node=node)
    balance_rank_totals(rules, src_rank, src_index, tolerance=tolerance)
    send_home(rules, src_rank, src_index, limit=rules.limit(tolerance))
    return src_rank, src_index


def evaluate_two_phase(costs, placement) -> dict:
    """Two-phase objective against its lower bound and the unbalanced baseline, and
    rank balance / movement of a placement."""
    c = as_cost_pairs(costs)
    D, G, _ = c.shape
    after = c[placement.src_rank, placement.src_index]
    lb = two_phase_lower_bound(c)
    total = c.sum(axis=2)
    ideal = (c[:, :, 0].sum() + c[:, :, 1].sum()) / D
    rt = after.sum(axis=2).sum(axis=1)
    moved = placement.moved()
    return {
        "two_phase_objective": two_phase_objective(after),
        "lower_bound": lb,
        "gap": two_phase_objective(after) / lb if lb else 1.0,
        "baseline_gap": two_phase_objective(c) / lb if lb else 1.0,
        "vs_ideal": two_phase_objective(after) / ideal if ideal else 1.0,
        "rank_ratio": float(rt.max() / rt.mean()) if rt.mean() else 1.0,
        "baseline_rank_ratio": float(total.sum(axis=1).max() / total.sum(axis=1).mean())
        if total.sum() else 1.0,
        "moved_fraction": float(moved.mean()),
    }
