"""Placement when ranks meet per micro-step in several step groups (expert parallelism
inside data parallelism).

The iteration time is the slowest step group's sum over micro-steps of its slowest rank
(:func:`~.step_groups.group_objective`; two-phase costs: the vision and the language
maxima of each micro-step), and the data-parallel group meets at the end. Step groups do
not wait for each other within an iteration, so micro-step ``k`` of one group has nothing
to do with micro-step ``k`` of another. The plan:

1. **Which packs each group computes** (:func:`~.group_exchange.exchange_between_groups`):
   every group starts with its own packs; few swaps between groups even out the groups'
   best objectives, preferring packs that go back to their own group. Only these packs
   cross between groups (where a group is a node: the network).
2. **Micro-steps inside each group**: the group's packs are cut into runs of ``S`` (its
   ranks) by an order, the runs become the group's micro-steps, heaviest first. One phase:
   the packs sorted by cost, the group's exact optimum (the sorted grouping). Two phases:
   each group's own bands along language, every band cut by vision or by language (the
   band program of :func:`~.two_phase._band_program` run in every group at once on its own
   packs, :func:`_own_banded_runs`; its choices include the bands the program picks for
   the whole batch and one band by either phase); groups of unequal size take the best of
   the batch's bands and the packs sorted by vision, by language and by their sum. On a
   small batch the swap descent follows (:mod:`.two_phase`).
3. **Slots**, micro-step by micro-step for all groups at once: a rank keeps its heaviest
   pack of the micro-step; the others go to the ranks of the same group left without one,
   heaviest to the lightest running total, to a rank on the pack's own node first.
4. **Rank totals and movement inside each group** (:mod:`.rank_balance` with the groups as
   units): swaps between ranks of one group that keep every pack within its micro-step's
   level (box) in that group, until every rank total is within the tolerance of its group's
   mean; then move chains are shortened, never across groups.

The result is kept only if it is no worse than today's placement of the same batch in
each of: the group objective (up to the balance tolerance's share of the mean rank total,
the same trade of balance for packs kept home that the tolerance makes for rank totals;
exactly no worse at tolerance 0), the packs crossing groups, and the weighted moves (a
pack on another rank 1, on another node ``1 + INTER_NODE_WEIGHT``,
:func:`~.rank_balance.move_weight`); otherwise today's placement is returned. Per batch the
two plans' objectives differ by a few tenths of a percent either way (the two-phase
grouping of a group's own packs against the batch's), on average by nothing, while the
group plan sends about a tenth as many packs between groups; the tolerance lets it keep
that on most batches. One group of all ranks is today's placement
(the caller dispatches it there unchanged); every rank its own group is ``step`` mode.
Groups of unequal size (or costs beyond ``2**40`` over a profile) skip part 1: each
keeps its own packs.

Vectorised over groups (the only Python loops run over micro-steps and swap rounds), so
a thousand ranks in groups of eight cost about what one group of a thousand does.
Deterministic: integer costs, stable orders, explicit tie breaks.
"""
from __future__ import annotations

import numpy as np

from .group_exchange import exchange_between_groups, exchangeable
from .rank_balance import SwapRules, balance_rank_totals, move_weight, send_home
from .sorting import lex_argsort, stable_argsort
from .step_groups import group_objective, inter_group_packs
from .two_phase import BAND_SAMPLE, SWAP_DESCENT_MAX_PACKS, _band_program, _swap_descent


#: each group's band program cuts on a grid of ``G / OWN_BAND_UNITS`` micro-steps (finer
#: than the batch's 8: a group's few packs gain from it, measured 0.1-0.4% of the slowest
#: group's objective on heldout, heldout-real, mixed and native-res at 1024 x 32, EP 8)
OWN_BAND_UNITS = 16
#: the exchange between groups evens their profiles to this share of the tolerance (the
#: groups' objectives are what the iteration waits for; rank totals inside a group get the
#: whole tolerance)
EXCHANGE_TOLERANCE_SHARE = 0.5


def place_in_groups(c: np.ndarray, groups: np.ndarray, node: np.ndarray | None,
                    tolerance: float, today) -> tuple[np.ndarray, np.ndarray]:
    """``(src_rank, src_index)`` of validated costs ``c`` (``[D, G]`` or ``[D, G, 2]``) for
    dense step group ids ``groups`` (several groups, not every rank alone), the ranks'
    dense node ids ``node`` (None: flat) and the balance tolerance: the group plan
    (:func:`group_plan`) unless it loses to ``today`` (today's placement of the batch, with
    ``src_rank`` and ``src_index``) on any figure of the module docstring (the objective
    beyond ``tolerance`` times the mean rank total)."""
    if c.shape[1] == 1:
        return today.src_rank, today.src_index
    planned = group_plan(c, groups, node, tolerance)
    mine = _quality(c, *planned, groups, node)
    theirs = _quality(c, today.src_rank, today.src_index, groups, node)
    slack = int(np.floor(tolerance * int(c.sum()) / c.shape[0]))
    allowed = (theirs[0] + slack,) + theirs[1:]
    return planned if all(a <= b for a, b in zip(mine, allowed)) else (today.src_rank,
                                                                         today.src_index)


def _quality(c, src_rank, src_index, groups, node) -> tuple:
    """What :func:`place_in_groups` compares, each lower is better: the group objective, the
    packs crossing groups, the weighted moves."""
    D = c.shape[0]
    moves = int(move_weight(src_rank, np.arange(D)[:, None], node).sum())
    return (group_objective(c[src_rank, src_index], groups),
            inter_group_packs(src_rank, groups), moves)


def group_plan(c: np.ndarray, groups: np.ndarray, node: np.ndarray | None,
               tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """Parts 1-4 of the module docstring: ``(src_rank, src_index)``, each ``[D, G]``."""
    D, G = c.shape[:2]
    ph = c if c.ndim == 3 else c[:, :, None]               # [D, G, P]
    sizes = np.bincount(groups)
    if np.all(sizes == sizes[0]) and exchangeable(ph):
        held = exchange_between_groups(ph, groups,
                                       tolerance=tolerance * EXCHANGE_TOLERANCE_SHARE).held
    else:
        held = np.arange(D * G, dtype=np.int64).reshape(D, G)
    vc = ph.reshape(D * G, -1).astype(np.int64)[held]      # [D, G, P]: what each rank holds
    step, boxes = _group_steps(vc, groups, sizes)
    origin_node = None if node is None else node[held // G]
    src = _slots(vc.sum(axis=2), step, groups, node, origin_node)   # positions into held
    ids = held.ravel()[src]
    src_rank, src_index = ids // G, ids % G
    levels = boxes[:, :, 0] if ph.shape[2] == 1 else boxes
    rules = SwapRules(c, weights=None if c.ndim == 2 else c.sum(axis=2), levels=levels,
                      node=node, unit=groups)
    balance_rank_totals(rules, src_rank, src_index, tolerance=tolerance)
    send_home(rules, src_rank, src_index, limit=rules.limit(tolerance))
    return src_rank, src_index


def _positions(key_cols, groups_of: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Each pack's position inside its group in the order of ``key_cols`` (``lex_argsort``
    keys, last primary; the group is the primary key before them)."""
    order = lex_argsort((*key_cols, groups_of))
    pos = np.empty(len(order), dtype=np.int64)
    pos[order] = np.arange(len(order)) - start[groups_of[order]]
    return pos


def _group_steps(vc: np.ndarray, groups: np.ndarray, sizes: np.ndarray):
    """Part 2 of the module docstring on the held costs ``vc`` ``[D, G, P]``: each held
    pack's micro-step in its group ``[D, G]`` and each group's per-step maxima ``[E, G, P]``
    (steps heaviest first)."""
    D, G, P = vc.shape
    E = len(sizes)
    g_of = np.repeat(groups, G)                             # group of each held pack (flat)
    S = sizes[g_of]
    start = np.concatenate([[0], np.cumsum(sizes * G)])[:-1]
    idx = np.arange(D * G)
    v = vc[:, :, 0].ravel()
    if P == 1:
        run = _positions((idx, -v), g_of, start) // S
    else:
        l = vc[:, :, 1].ravel()
        if np.all(sizes == sizes[0]):
            # each group's own bands: the band program on the same grid in every group,
            # whose choices include the batch's bands and single bands by either phase
            candidates = [_own_banded_runs(v, l, groups, int(sizes[0]), G)]
        else:
            candidates = [
                _positions((idx, -v, -(v + l)), g_of, start) // S,        # by the sum
                _banded_runs(v, l, g_of, S, start, D, G),                 # the batch's bands
                _positions((idx, -l, -v), g_of, start) // S,              # by vision
                _positions((idx, -v, -l), g_of, start) // S]              # by language
        if len(candidates) == 1:
            run = candidates[0]
        else:
            scores = np.stack([_run_objective(v, l, g_of * G + r, E, G) for r in candidates])
            best = np.argmin(scores, axis=0)                # first of the best per group
            run = np.choose(best[g_of], candidates)
        if D * G <= SWAP_DESCENT_MAX_PACKS and G > 1:
            for e in range(E):
                mine = np.flatnonzero(g_of == e)
                r = run[mine].copy()
                _swap_descent(v[mine], l[mine], r, G)
                run[mine] = r
    maxima = _segment_max(vc.reshape(D * G, P), g_of * G + run).reshape(E, G, P)
    # the group's steps heaviest first (ties: run order)
    rank_of_run = np.empty((E, G), dtype=np.int64)
    order = np.lexsort((np.broadcast_to(np.arange(G), (E, G)), -maxima.sum(axis=2)), axis=1)
    np.put_along_axis(rank_of_run, order, np.arange(G)[None, :], axis=1)
    step = rank_of_run[g_of, run]
    boxes = np.take_along_axis(maxima, order[:, :, None], axis=1)
    return step.reshape(D, G), boxes


def _segment_max(values: np.ndarray, key: np.ndarray) -> np.ndarray:
    """``values`` ``[N, P]``: the maximum over the rows of each key ``0 .. K-1`` (every key
    present), ``[K, P]``."""
    order = stable_argsort(key)
    starts = np.flatnonzero(np.r_[True, key[order][1:] != key[order][:-1]])
    return np.maximum.reduceat(values[order], starts, axis=0)


def _run_objective(v, l, key, E, G) -> np.ndarray:
    """Per group: the sum over its runs of (max vision + max language)."""
    m = _segment_max(np.stack([v, l], axis=1), key)
    return m.sum(axis=1).reshape(E, G).sum(axis=1)


def _banded_runs(v, l, g_of, S, start, D, G, units: int = 8) -> np.ndarray:
    """The runs of the bands along language that the whole batch's band program chooses
    (``[(s, e, by_vision)]``, ranges of runs): in every group, the packs whose language
    position falls in ``[s*S, e*S)`` form that band's runs, cut by vision or by language."""
    N = len(v)
    stride = -(-N // BAND_SAMPLE)
    if stride > 1 and D // stride >= 1:
        Ds = D // stride
        sample = np.arange(0, N, stride)[: G * Ds]
        bands = _band_program(v[sample], l[sample], Ds, G, units)
    else:
        bands = _band_program(v, l, D, G, units)
    idx = np.arange(N)
    qpos = _positions((idx, -v, -l), g_of, start)           # language position in the group
    vpos = _positions((idx, -l, -v), g_of, start)           # vision position in the group
    band = np.zeros(N, dtype=np.int64)
    by_v = np.zeros(N, dtype=bool)
    for b, (s, e, by_p) in enumerate(bands):
        inside = (qpos >= s * S) & (qpos < e * S)
        band[inside] = b
        by_v[inside] = by_p
    within = np.where(by_v, vpos, qpos)
    # by band, then the band's own order: band b fills the group's positions [s*S, e*S)
    return _positions((idx, within, band), g_of, start) // S


def _own_banded_runs(v, l, groups, S, G, units: int = OWN_BAND_UNITS) -> np.ndarray:
    """The band program of :mod:`.two_phase` run in every group on its own packs at once
    (groups of equal size ``S``): bands along language on a grid of ``G / units`` runs, each
    band cut by vision or by language, whichever is cheaper in that group; a dynamic program
    per group over the band boundaries. Returns each held pack's run (flat, rank-major)."""
    E = int(groups.max()) + 1
    N = S * G
    D = len(groups)
    members = (np.argsort(groups, kind="stable").reshape(E, S)[:, :, None] * G
               + np.arange(G)[None, None, :]).reshape(E, N)          # flat ids per group
    pv, pl = v[members], l[members]
    q_ord = np.lexsort((-pv, -pl), axis=1)                              # language, then vision
    p_ord = np.lexsort((-pl, -pv), axis=1)
    qpos = np.empty((E, N), dtype=np.int64)
    np.put_along_axis(qpos, q_ord, np.arange(N)[None, :], axis=1)
    ppos = np.empty((E, N), dtype=np.int64)
    np.put_along_axis(ppos, p_ord, np.arange(N)[None, :], axis=1)
    vq, lq = np.take_along_axis(pv, q_ord, 1), np.take_along_axis(pl, q_ord, 1)
    vp, lp = np.take_along_axis(pv, p_ord, 1), np.take_along_axis(pl, p_ord, 1)
    qp = np.take_along_axis(qpos, p_ord, 1)                             # q-rank, in p order
    # cut by language, runs of S in q order are fixed: the band's cost is a difference of
    # prefix sums of the runs' (first language + largest vision)
    by_q = np.concatenate([np.zeros((E, 1), dtype=np.int64),
                           np.cumsum(lq[:, ::S] + vq.reshape(E, G, S).max(axis=2), axis=1)], axis=1)
    step = max(1, G // units)
    cuts = sorted(set(list(range(0, G, step)) + [G]))
    # every band (s, e) between cuts, its cost cut by vision, all bands of one length at once
    cost_p = {}
    for length in sorted({e - s for i, s in enumerate(cuts) for e in cuts[i + 1:]}):
        starts = np.array([s for s in cuts if s + length in cuts], dtype=np.int64)
        lo = (starts * S)[:, None, None]
        sel = (qp[None] >= lo) & (qp[None] < lo + length * S)             # [k, E, N]
        n = length * S
        bv = np.broadcast_to(vp, sel.shape)[sel].reshape(len(starts), E, n)
        bl = np.broadcast_to(lp, sel.shape)[sel].reshape(len(starts), E, length, S)
        costs = bv[:, :, ::S].sum(axis=2) + bl.max(axis=3).sum(axis=2)    # [k, E]
        for s, cost in zip(starts.tolist(), costs):
            cost_p[(s, s + length)] = cost
    best = {0: np.zeros(E, dtype=np.int64)}
    back, by_p = {}, {}
    for j, e in enumerate(cuts[1:], start=1):
        cands, froms, flags = [], [], []
        for s in cuts[:j]:
            cost_q = by_q[:, e] - by_q[:, s]
            cands.append(best[s] + np.minimum(cost_p[(s, e)], cost_q))
            flags.append(cost_p[(s, e)] <= cost_q)
            froms.append(s)
        stack = np.stack(cands)
        k = np.argmin(stack, axis=0)                                      # first of the best
        best[e] = stack[k, np.arange(E)]
        back[e] = np.asarray(froms)[k]
        by_p[e] = np.stack(flags)[k, np.arange(E)]
    # each group's bands, walked back from G: a pack's band start and whether by vision
    first = np.zeros((E, N), dtype=np.int64)
    vis = np.zeros((E, N), dtype=bool)
    end = np.full(E, G, dtype=np.int64)
    while np.any(end > 0):
        live = end > 0
        s_of = np.zeros(E, dtype=np.int64)
        flag = np.zeros(E, dtype=bool)
        for e in np.unique(end[live]):
            at = live & (end == e)
            s_of[at] = back[int(e)][at]
            flag[at] = by_p[int(e)][at]
        inside = live[:, None] & (qpos >= (s_of * S)[:, None]) & (qpos < (end * S)[:, None])
        first[inside] = np.broadcast_to(s_of[:, None], (E, N))[inside]
        vis[inside] = np.broadcast_to(flag[:, None], (E, N))[inside]
        end = np.where(live, s_of, end)
    within = np.where(vis, ppos, qpos)
    order = np.lexsort((within, first), axis=1)                         # by band, its order
    run = np.empty((E, N), dtype=np.int64)
    np.put_along_axis(run, order, (np.arange(N) // S)[None, :], axis=1)
    out = np.empty(D * G, dtype=np.int64)
    out[members.ravel()] = run.ravel()
    return out


def _slots(weight: np.ndarray, step: np.ndarray, groups: np.ndarray, node, origin_node):
    """Part 3 of the module docstring: ``out[r, m]``, the flat position (into the held
    packs, ``rank * G + index``) of the pack rank ``r`` computes at micro-step ``m``."""
    D, G = weight.shape
    w, st = weight.ravel(), step.ravel()
    idx = np.arange(D * G)
    order = lex_argsort((idx, -w, st))                      # by step, heaviest first
    bounds = np.searchsorted(st[order], np.arange(G + 1))
    out = np.full((D, G), -1, dtype=np.int64)
    totals = np.zeros(D, dtype=np.int64)
    holder = idx // G
    for m in range(G):
        sel = order[bounds[m]:bounds[m + 1]]
        r = holder[sel]
        o = stable_argsort(r)
        dup = np.zeros(len(sel), dtype=bool)
        dup[o[1:]] = r[o[1:]] == r[o[:-1]]
        keep = ~dup                                          # each rank's heaviest of the step
        out[r[keep], m] = sel[keep]
        movers = sel[dup]                                    # heaviest first already
        free = np.flatnonzero(out[:, m] < 0)
        free = free[stable_argsort(totals[free])]
        dest = _pair_in_groups(holder[movers], free, groups, node,
                               None if origin_node is None else origin_node.ravel()[movers])
        out[dest, m] = movers
        totals += w[out[:, m]]
    return out


def _match(mkey: np.ndarray, fkey: np.ndarray):
    """Movers (keys ``mkey``, in priority order) to free slots (``fkey``, in preference
    order) of the same key, in order: each mover's index into the free slots or -1."""
    n = len(mkey)
    dest = np.full(n, -1, dtype=np.int64)
    if n == 0 or len(fkey) == 0:
        return dest
    keys = np.unique(np.concatenate([mkey, fkey]))
    mk, fk = np.searchsorted(keys, mkey), np.searchsorted(keys, fkey)
    m_ord, f_ord = stable_argsort(mk), stable_argsort(fk)
    m_cnt, f_cnt = np.bincount(mk, minlength=len(keys)), np.bincount(fk, minlength=len(keys))
    m_start = np.concatenate([[0], np.cumsum(m_cnt)])[:-1]
    f_start = np.concatenate([[0], np.cumsum(f_cnt)])[:-1]
    m_pos = np.empty(n, dtype=np.int64)
    m_pos[m_ord] = np.arange(n) - m_start[mk[m_ord]]
    ok = m_pos < f_cnt[mk]
    dest[ok] = f_ord[f_start[mk[ok]] + m_pos[ok]]
    return dest


def _pair_in_groups(holders: np.ndarray, free: np.ndarray, groups: np.ndarray, node,
                    origin_node) -> np.ndarray:
    """Destination ranks for movers held by ``holders`` (heaviest first) among the ``free``
    ranks (lightest first), always in the mover's group: first a free rank on the mover's
    own node (its origin's), then the group's other free ranks, in order."""
    n = len(holders)
    dest = np.full(n, -1, dtype=np.int64)
    used = np.zeros(len(free), dtype=bool)
    gm, gf = groups[holders], groups[free]
    if node is not None:
        span = int(node.max()) + 1
        first = _match(gm * span + origin_node, gf * span + node[free])
        hit = first >= 0
        dest[hit] = first[hit]
        used[first[hit]] = True
    rest = np.flatnonzero(dest < 0)
    left = np.flatnonzero(~used)
    second = _match(gm[rest], gf[left])
    dest[rest] = left[second]
    if np.any(second < 0):                     # cannot happen: a group's slots fit its packs
        raise AssertionError("step group placement: a mover found no free rank in its group")
    return free[dest]
