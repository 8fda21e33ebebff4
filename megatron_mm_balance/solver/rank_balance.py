"""Even out rank totals of a placement by swaps that keep the micro-step objective.

After stage 2 of :func:`megatron_mm_balance.solver.placement.plan_placement` every pack
sits in a micro-step whose *level* (the sorted-grouping maximum of that step)
admits it. Any swap of two packs that keeps each pack at or below the level of
the micro-step it lands in keeps the micro-step objective at the optimum, so this
pass may swap across micro-steps, not only inside one. In ``step`` mode there are
no levels: any two packs may swap.

Each round pairs every rank above the upper limit ``U`` with a distinct light
rank and applies, per pair, the best swap of all ``G x G`` candidates:

1. a swap whose cost difference lands both ranks at or below ``U`` (the
   *window*), and among those the one adding the fewest moves: re-moving a pack
   that already moves is free, sending a pack home saves a move; then the one
   nearest the pair's midpoint;
2. otherwise the swap that brings the pair closest to its midpoint (a strict
   improvement of the pair's spread), fewest added moves on ties.

A heavy rank that found no improving swap with its partner is paired with the
next light rank in the following round. The sum of squared totals falls with
every applied swap, so the pass ends; it stops when no rank is above ``U``, no
pair improves, or after ``max_rounds``.

With step groups (``SwapRules.unit``: the per-micro-step meeting groups of
:mod:`.group_placement`) a rank swaps only with ranks of its own group, against that
group's levels, and its limit is its group's mean; without units nothing changes.

What every pass of one solve must respect (the costs checked against the levels,
the scalar whose rank totals are evened, the levels, the nodes) travels as one
:class:`SwapRules`; the placement being improved as its two ``[D, G]`` arrays
``src_rank``, ``src_index``, changed in place.

Deterministic: integer costs, stable orderings, ties broken by rank and slot.
Cost per round: O(P * G^2) vectorised for P heavy ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .pairing import pair_heavy_with_light
from .sorting import lex_argsort, stable_argsort
from .topology import INTER_NODE_WEIGHT

# Chain shortening across nodes looks this many micro-steps away (two in step mode;
# with two-phase boxes only the same micro-step, which needs no box check).
NODE_STEP_WINDOW = 1


def rank_limit(total: int, num_ranks: int, tolerance: float, grain: int = 1) -> int:
    """The largest rank total allowed: ``mean * (1 + tolerance)`` rounded down, but
    never below the integer floor: when every cost is a multiple of ``grain`` (tile-
    quantised image tokens: 256), so is every rank total, and no placement puts the
    heaviest rank below the mean rounded up to a multiple of ``grain``."""
    mean = total / num_ranks
    grain = max(int(grain), 1)
    floor = -(-total // num_ranks)
    floor = -(-floor // grain) * grain
    return max(int(np.floor(mean * (1.0 + tolerance))), floor)


def cost_grain(values: np.ndarray) -> int:
    """The greatest common divisor of the costs (1 if all are zero)."""
    g = int(np.gcd.reduce(np.asarray(values, dtype=np.int64).ravel()))
    return g if g > 0 else 1


@dataclass(frozen=True)
class SwapRules:
    """What every swap of one solve respects, the same through all its passes.

    ``costs`` ``[D, G]`` (or ``[D, G, 2]``: vision, language) are checked against
    ``levels``: ``levels[k]`` (``microstep`` mode) is the most a pack in micro-step
    ``k`` may cost, with two-phase costs a box ``(vision, language)`` a pack must fit
    in both; None (``step`` mode): any two packs may swap. ``weights`` ``[D, G]``:
    the scalar whose rank totals are evened, if not ``costs`` itself. ``node``
    ``[D]``: each rank's node (None: flat); a pack crossing nodes then counts
    ``1 + INTER_NODE_WEIGHT`` moves when swaps of equal balance are compared.
    ``unit`` ``[D]`` (dense ids; None: one unit of all ranks): ranks swap only with ranks
    of their own unit (a step group, :mod:`.step_groups`), each unit has its own levels
    (``levels[u]``: unit ``u``'s ``[G]`` levels or ``[G, 2]`` boxes) and its own limit
    (its mean rank total, :meth:`limit`).
    """

    costs: np.ndarray
    weights: np.ndarray | None = None
    levels: np.ndarray | None = None
    node: np.ndarray | None = None
    unit: np.ndarray | None = None

    @property
    def balanced(self) -> np.ndarray:
        """The ``[D, G]`` scalar whose rank totals are evened."""
        return self.costs if self.weights is None else self.weights

    @property
    def boxes(self) -> bool:
        """The levels are two-phase boxes (``(vision, language)`` per micro-step)."""
        return self.levels is not None and self.levels.ndim - (self.unit is not None) == 2

    def limit(self, tolerance: float):
        """:func:`rank_limit` of the balanced scalar at ``tolerance``: an int, or with units
        each rank's limit ``[D]`` (its unit's)."""
        bal = self.balanced
        grain = cost_grain(bal)
        if self.unit is None:
            return rank_limit(int(bal.sum()), bal.shape[0], tolerance, grain)
        num = int(self.unit.max()) + 1
        totals = np.bincount(self.unit, weights=None, minlength=num)
        sums = np.zeros(num, dtype=np.int64)
        np.add.at(sums, self.unit, bal.sum(axis=1))
        per_unit = np.array([rank_limit(int(sums[u]), int(totals[u]), tolerance, grain)
                             for u in range(num)], dtype=np.int64)
        return per_unit[self.unit]

    def unit_levels(self, ranks: np.ndarray) -> np.ndarray:
        """The levels that bind ranks ``ranks`` (broadcast over them without units)."""
        if self.unit is None:
            return np.broadcast_to(self.levels, ranks.shape + self.levels.shape)
        return self.levels[self.unit[ranks]]


def _at(limit, ranks):
    """A limit (an int, or per rank) at ``ranks``."""
    return limit if np.ndim(limit) == 0 else limit[ranks]


PARTNERS = ("any", "mates-first", "mates-only")


def balance_rank_totals(rules: SwapRules, src_rank: np.ndarray, src_index: np.ndarray, *,
                        tolerance: float, partners: str = "any", step_window: int | None = 2,
                        max_rounds: int = 256) -> int:
    """Swap packs in place (``src_rank``/``src_index`` ``[D, G]``) until no rank total
    exceeds :func:`rank_limit` at ``tolerance``, every swap within ``rules``.
    Returns the number of swaps applied.

    ``partners`` (with nodes): ``any``, the global walk; ``mates-first``, a heavy rank
    tries its node-mates before the global walk; ``mates-only``, only them (no pack
    crosses a node). ``step_window``: a pack swaps only with packs at most this many
    micro-steps away (None: any), which keeps a round at O(P * G * (2W + 1)).
    """
    if partners not in PARTNERS:
        raise ValueError(f"partners must be one of {PARTNERS}, got {partners!r}")
    c, levels, node = rules.costs, rules.levels, rules.node
    bal = rules.balanced
    D, G = c.shape[:2]
    home = np.arange(D)
    a = bal[src_rank, src_index]                       # balanced quantity at each slot
    lv = c[src_rank, src_index]                        # level-checked cost at each slot
    totals = a.sum(axis=1)
    grain = cost_grain(bal)
    U = rules.limit(tolerance)
    attempt = np.zeros(D, dtype=np.int64)
    applied = 0
    # Light slots a heavy slot i may swap with: micro-steps i - W .. i + W (all when
    # step_window is None); swaps across steps further apart are rarely the best.
    W = G if step_window is None else int(step_window)
    off = np.arange(-min(W, G - 1), min(W, G - 1) + 1)
    jj = np.arange(G)[:, None] + off[None, :]
    jok = (jj >= 0) & (jj < G)
    jj = np.clip(jj, 0, G - 1)
    # With units a rank's partners are its unit's ranks (node-mates or not); else node-mates
    # as ``partners`` says.
    mate_key = node if rules.unit is None else rules.unit
    mates_only = (partners == "mates-only" and node is not None) or rules.unit is not None
    mates_first = (partners != "any" and node is not None) or rules.unit is not None
    if mates_first:
        members = _members(mate_key)
    for _ in range(max_rounds):
        heavy = np.flatnonzero(totals > U)
        if len(heavy) == 0:
            break
        heavy = heavy[np.lexsort((heavy, -totals[heavy]))]
        pool = np.lexsort((home, totals))
        pool = pool[totals[pool] < _at(U, pool)]
        if len(pool) == 0:
            break
        P = len(heavy)
        # A partner helps only if lighter by more than one grain. Heavy rank i (in
        # order) starts at the i-th lightest and walks on past partners that failed;
        # with nodes, it first walks its node-mates, lightest first.
        n_elig = np.searchsorted(totals[pool], totals[heavy] - grain, side="left")
        k = np.zeros(P, dtype=np.int64)
        if mates_first:
            mates = members[mate_key[heavy]]                    # [P, R], -1 padded
            mt = np.where(mates >= 0, totals[mates], np.iinfo(np.int64).max)
            order = np.lexsort((mates, mt), axis=1)
            mates = np.take_along_axis(mates, order, axis=1)
            mt = np.take_along_axis(mt, order, axis=1)
            k = ((mt < (totals[heavy] - grain)[:, None]) & (mt < _at(U, mates))).sum(axis=1)
        live = attempt[heavy] < (k if mates_only else n_elig + k)
        if not live.any():
            break
        heavy, n_elig, k = heavy[live], n_elig[live], k[live]
        P = len(heavy)
        att = attempt[heavy]
        light = pool[(np.arange(P) + att - k) % np.maximum(n_elig, 1)]
        if mates_first:
            mates = mates[live]
            near = att < k
            light[near] = mates[np.flatnonzero(near), att[near]]
        _, first = np.unique(light, return_index=True)
        keep = np.zeros(P, dtype=bool)
        keep[first] = True
        attempt[heavy[~keep]] += 1
        h, l = heavy[keep], light[keep]
        ah, al = a[h], a[l][:, jj]                      # [P, G], [P, G, K]
        delta = ah[:, :, None] - al                     # [P, G(heavy slot), K(light slot)]
        gap = (totals[h] - totals[l])[:, None, None]
        valid = (delta > 0) & (delta < gap) & jok[None]
        if levels is not None and rules.unit is None:
            ch, cl = lv[h], lv[l][:, jj]
            if levels.ndim == 1:
                valid &= (ch[:, :, None] <= levels[jj][None])         # heavy pack -> light's step
                valid &= (cl <= levels[:, None][None])                # light pack -> heavy's step
            else:                                                     # boxes: every component
                valid &= (ch[:, :, None, :] <= levels[jj][None]).all(axis=-1)
                valid &= (cl <= levels[:, None][None]).all(axis=-1)
        elif levels is not None:                                      # the pair's unit's levels
            ch, cl = lv[h], lv[l][:, jj]
            lev = rules.unit_levels(h)                                # [P, G] or [P, G, 2]
            if not rules.boxes:
                valid &= (ch[:, :, None] <= lev[:, jj])
                valid &= (cl <= lev[:, :, None])
            else:
                valid &= (ch[:, :, None, :] <= lev[:, jj]).all(axis=-1)
                valid &= (cl <= lev[:, :, None]).all(axis=-1)
        lo = (totals[h] - _at(U, h))[:, None, None]
        hi = (_at(U, l) - totals[l])[:, None, None]
        window = valid & (delta >= lo) & (delta <= hi)
        sh, sl = src_rank[h], src_rank[l]
        hh, ll = h[:, None], l[:, None]
        # Moves added by the swap: heavy's pack goes to l, light's pack goes to h.
        add_h = move_weight(sh, ll, node) - move_weight(sh, hh, node)     # [P, G]
        add_l = move_weight(sl, hh, node) - move_weight(sl, ll, node)
        added = add_h[:, :, None] + add_l[:, jj] + 2 * (1 + INTER_NODE_WEIGHT)
        spread = np.abs(2 * delta - gap)
        big = np.iinfo(np.int64).max
        # window first (by added moves, then spread), else best spread then moves: a window
        # key (added <= 4 * (1 + INTER_NODE_WEIGHT) < 1000, spread < 2^40) is below any other.
        key = np.where(valid, (1 << 50) + spread * 8 + added, big)
        np.copyto(key, added * (1 << 40) + spread, where=window)
        K = jj.shape[1]
        key = key.reshape(len(h), G * K)
        best = np.argmin(key, axis=1)
        ok = key[np.arange(len(h)), best] < big
        attempt[h[~ok]] += 1
        if not ok.any():
            continue
        h, l, best = h[ok], l[ok], best[ok]
        i, j = best // K, jj[best // K, best % K]
        d = a[h, i] - a[l, j]
        for arr in (src_rank, src_index, a, lv):
            arr[h, i], arr[l, j] = arr[l, j], arr[h, i].copy()
        totals[h] -= d
        totals[l] += d
        applied += len(h)
    return applied


def balance_node_totals(rules: SwapRules, src_rank: np.ndarray, src_index: np.ndarray, *,
                        limit: int, max_rounds: int = 64) -> int:
    """Even the nodes' totals first, with few large swaps across nodes (``step`` mode,
    where no level binds a pack to a micro-step: ``rules.levels`` is ignored; ``rules.node``
    must be set). Returns the swaps applied.

    Only a node's surplus has to cross the network; evening the ranks of one node is
    then NVLink traffic (:func:`balance_rank_totals` with ``mates_only``). Each round
    pairs every node above its limit (heaviest first) with a distinct node below its
    mean (lightest first; a pair without a useful swap walks on to the next light node
    in the following round, a pair that swapped starts from the lightest again) and swaps one pack of the heavy node's heaviest rank with
    one of the light node's lightest rank: the swap whose cost difference comes closest
    to what the pair needs (the heavy node's surplus over its mean, capped by the light
    node's deficit), strictly narrowing the pair's gap. A node's limit is its mean plus
    half of its ranks' headroom ``size * (limit - mean) / 2``, so the ranks inside can
    still end under ``limit``. Integer arithmetic (means scaled by the number of ranks),
    ties by slot order: deterministic. O(pairs x G^2) per round."""
    node = rules.node
    if node is None:
        raise ValueError("balance_node_totals needs the ranks' nodes (rules.node)")
    bal = rules.balanced
    D, G = bal.shape[:2]
    a = bal[src_rank, src_index]
    totals = a.sum(axis=1)
    num = int(node.max()) + 1
    size = np.bincount(node, minlength=num).astype(np.int64)
    total = int(totals.sum())
    members = _members(node)
    rows_all = np.arange(num)
    # Scaled by D: node n's mean is size*total/D; above the limit iff
    # 2*D*nt > 2*size*total + size*(D*limit - total).
    mean_d = size * total
    over_d2 = 2 * mean_d + size * (D * int(limit) - total)
    attempt = np.zeros(num, dtype=np.int64)
    applied = 0
    big = np.iinfo(np.int64).max
    for _ in range(max_rounds):
        nt = np.zeros(num, dtype=np.int64)
        np.add.at(nt, node, totals)
        heavy = np.flatnonzero(2 * D * nt > over_d2)
        if len(heavy) == 0:
            break
        heavy = heavy[np.lexsort((heavy, -nt[heavy]))]
        pool = np.lexsort((rows_all, nt * D - mean_d))
        pool = pool[D * nt[pool] < mean_d[pool]]
        if len(pool) == 0:
            break
        pairs = pair_heavy_with_light(heavy, pool, attempt)
        if pairs is None:
            break
        h, l = pairs
        P = len(h)
        mh, ml = members[h], members[l]
        sr = np.take_along_axis(mh, np.argmax(np.where(mh >= 0, totals[mh], -1), axis=1)[:, None],
                                axis=1)[:, 0]
        rr = np.take_along_axis(ml, np.argmin(np.where(ml >= 0, totals[ml], big), axis=1)[:, None],
                                axis=1)[:, 0]
        delta = a[sr][:, :, None] - a[rr][:, None, :]           # [P, G (heavy), G (light)]
        gap = (nt[h] - nt[l])[:, None, None]
        want = np.minimum(D * nt[h] - mean_d[h], mean_d[l] - D * nt[l])[:, None, None]
        valid = (delta > 0) & (delta < gap)
        key = np.where(valid, np.abs(D * delta - want), big).reshape(P, G * G)
        best = np.argmin(key, axis=1)
        ok = key[np.arange(P), best] < big
        attempt[h[~ok]] += 1
        if not ok.any():
            continue
        attempt[h[ok]] = 0                                      # next time: lightest first
        sr, rr, best = sr[ok], rr[ok], best[ok]
        i, j = best // G, best % G
        d = a[sr, i] - a[rr, j]
        for arr in (src_rank, src_index, a):
            arr[sr, i], arr[rr, j] = arr[rr, j], arr[sr, i].copy()
        totals[sr] -= d
        totals[rr] += d
        applied += len(sr)
    return applied


def move_weight(origin, location, node: np.ndarray | None) -> np.ndarray:
    """What a pack from rank ``origin`` computed on rank ``location`` costs in moves:
    0 at home, 1 on another rank, ``1 + INTER_NODE_WEIGHT`` on another node."""
    w = (np.asarray(origin) != location).astype(np.int64)
    if node is not None:
        w = w + INTER_NODE_WEIGHT * (node[origin] != node[location])
    return w


def send_home(rules: SwapRules, src_rank: np.ndarray, src_index: np.ndarray, *,
              limit: int, max_rounds: int = 2) -> int:
    """Shorten move chains in place: swap a pack ``x`` sitting away from its home
    rank ``h`` with a foreign pack ``y`` sitting on ``h``. ``x`` goes home (one move
    less; two if ``y``'s home is where ``x`` sat) and no rank total rises above
    ``limit`` (nor above its current value if already above). Levels are kept as
    in :func:`balance_rank_totals`. Returns the moves saved (weighted by
    :func:`move_weight` when ``node`` is given).

    With ``node``, a first pass does the same one level up: a pack away from its
    home node swaps with a pack on any rank of that node that came from another
    node, so both end nearer home (inter-node moves weigh ``1 + INTER_NODE_WEIGHT``).

    Candidates: each pack away from home against the packs away from home that sit
    on its home rank (node) in the micro-steps of the window, found through buckets
    by (unit, micro-step): O(away packs x (2W + 1) x away packs per bucket) per
    round, no dense scan of the unit's ranks.
    Per round, each slot takes part in one swap; a swap that changes totals also
    claims its two ranks, so the limit holds however many swaps run in parallel."""
    levels, node = rules.levels, rules.node
    D = rules.costs.shape[0]
    saved = 0
    # (group, rounds, micro-step window): across nodes first, one round also between
    # neighbouring micro-steps (scalar levels only: boxes would need checks too), then
    # in the same micro-step; inside a node the same micro-step. Step mode: two away.
    passes = []
    if node is not None:
        if levels is None:
            passes.append((node, max_rounds, 2))
        else:
            scalar = not rules.boxes
            if scalar:
                passes.append((node, 1, NODE_STEP_WINDOW))
            passes.append((node, max_rounds - scalar, 0))
    passes.append((np.arange(D), max_rounds, 2 if levels is None else 0))
    for group, rounds, window in passes:
        saved += _shorten(rules, src_rank, src_index, limit=limit, group=group,
                          step_window=window, max_rounds=rounds)
    return saved


def _shorten(rules: SwapRules, src_rank, src_index, *, limit: int, group: np.ndarray,
             step_window: int, max_rounds: int) -> int:
    """One level of :func:`send_home`: ``group[r]`` is rank r's home unit (rank or
    node). A pack ``x`` away from its home unit may swap with a pack ``y`` that sits
    on a rank of x's home unit, at most ``step_window`` micro-steps from x (0: the
    same micro-step, where levels hold trivially; otherwise both packs must fit the
    level or box of the step they land in), and is itself away from home.

    Candidates are generated sparsely: the packs away from home are bucketed by
    (unit they sit on, micro-step), and each ``x`` meets only the buckets of its
    home unit within the window, so a round costs O(away packs x (2W + 1) x away
    packs per bucket) rather than O(away packs x ranks per unit x (2W + 1)); when every
    rank is its own unit and the window is 0, x's one candidate is read directly from
    the slot (home rank, micro-step), without buckets. Each
    ``x`` takes its best partner: largest gain, then smallest total change, then
    the lowest (rank position in its unit, micro-step offset), as a dense scan of
    the unit's ranks in order would."""
    c, levels, node = rules.costs, rules.levels, rules.node
    bal = rules.balanced
    D, G = c.shape[:2]
    a = bal[src_rank, src_index]
    lv = c[src_rank, src_index]
    totals = a.sum(axis=1)
    cap = np.maximum(totals, limit)
    num_units = int(group.max()) + 1
    usize = np.bincount(group, minlength=num_units)
    uorder = np.argsort(group, kind="stable")
    ustart = np.concatenate([[0], np.cumsum(usize)])[:-1]
    mpos = np.empty(D, dtype=np.int64)                      # rank's position in its unit
    mpos[uorder] = np.arange(D) - ustart[group[uorder]]
    W = min(int(step_window), G - 1)
    off = np.arange(-W, W + 1)
    K = len(off)
    check_levels = levels is not None and W > 0
    if check_levels:
        lf = lv.reshape(D * G, -1)
        # each rank's levels, [D, G, 1 or 2] (the same for every rank without units)
        lvl = rules.unit_levels(np.arange(D)).reshape(D, G, -1)
    a_fl = a.ravel()
    big = np.iinfo(np.int64).max
    saved = 0
    for _ in range(max_rounds):
        sr_fl = src_rank.ravel()
        fx = np.flatnonzero(group[sr_fl] != np.repeat(group, G))   # away packs, row-major
        F = len(fx)
        if F == 0:
            break
        xr, xi = fx // G, fx % G
        xo = sr_fl[fx]
        single = num_units == D and W == 0
        if single:
            # Every rank its own unit, the same micro-step: x's one candidate is the slot
            # (x's home rank, x's micro-step), if the pack there is away from home too.
            where = np.full(D * G, -1, dtype=np.int64)
            where[fx] = np.arange(F)
            at_home_slot = where[xo * G + xi]
            cnt = (at_home_slot >= 0).astype(np.int64)
            px = np.flatnonzero(cnt)
            py = at_home_slot[px]                           # y as an index into fx
            if len(px) == 0:
                break
        else:
            # Buckets of away packs by (unit they sit on, micro-step); row-major order
            # keeps each bucket in rank order.
            bkey = group[xr] * G + xi
            border = stable_argsort(bkey)
            bcount = np.bincount(bkey, minlength=num_units * G)
            bstart = np.concatenate([[0], np.cumsum(bcount)])[:-1]
            ys = xi[:, None] + off[None, :]                 # [F, K]
            inside = (ys >= 0) & (ys < G)
            b = group[xo][:, None] * G + np.clip(ys, 0, G - 1)
            cnt = np.where(inside, bcount[b], 0).ravel()
            n = int(cnt.sum())
            if n == 0:
                break
            first = np.cumsum(cnt) - cnt
            pos = np.repeat(bstart[b].ravel() - first, cnt) + np.arange(n)
            py = border[pos]                                # y as an index into fx
            px = np.repeat(np.arange(F), cnt.reshape(F, K).sum(axis=1))
        x_fl, y_fl = fx[px], fx[py]
        pxr, pyr, pxi, pyi = xr[px], xr[py], xi[px], xi[py]
        pxo, pyo = xo[px], xo[py]
        d = a_fl[y_fl] - a_fl[x_fl]                         # x's rank gains y, loses x
        valid = (totals[pxr] + d <= cap[pxr]) & (totals[pyr] - d <= cap[pyr])
        if rules.unit is not None:                          # swaps stay inside a unit
            valid &= rules.unit[pxr] == rules.unit[pyr]
        if check_levels:                                    # x into y's step, y into x's
            valid &= (lf[x_fl] <= lvl[pyr, pyi]).all(axis=-1)
            valid &= (lf[y_fl] <= lvl[pxr, pxi]).all(axis=-1)
        gain = ((pxo != pxr).astype(np.int64) - (pxo != pyr) + (pyo != pyr) - (pyo != pxr))
        if node is not None:                                # move_weight, gathered once
            nxo, nxr, nyr, nyo = node[pxo], node[pxr], node[pyr], node[pyo]
            gain += INTER_NODE_WEIGHT * ((nxo != nxr).astype(np.int64) - (nxo != nyr)
                                         + (nyo != nyr) - (nyo != nxr))
        valid &= gain > 0
        if not valid.any():
            break
        key = np.where(valid, -gain * (1 << 40) + np.abs(d), big)
        if single:                                          # one candidate per x: its own
            pick = np.flatnonzero(valid)
            cand, kb = px[pick], key[pick]
        else:
            col = mpos[pyr] * K + (pyi - pxi + W)           # the dense scan's column
            has = np.flatnonzero(cnt.reshape(F, K).sum(axis=1))
            seg = (np.cumsum(cnt) - cnt).reshape(F, K)[has, 0]
            kmin = np.full(F, big, dtype=np.int64)
            kmin[has] = np.minimum.reduceat(key, seg)
            tie = key == kmin[px]
            cmin = np.full(F, big, dtype=np.int64)
            cmin[has] = np.minimum.reduceat(np.where(tie, col, big), seg)
            pick = np.flatnonzero(tie & (col == cmin[px]) & valid)   # one pair per x, x order
            cand = px[pick]
            kb = kmin[cand]
        o = lex_argsort((cand, kb))
        pick, cand = pick[o], cand[o]
        x, y = x_fl[pick], y_fl[pick]
        ycol, dd = pyr[pick], d[pick]
        # Each slot in one swap; swaps that change totals also claim both ranks.
        keep = _first_touch(x, y, D * G)
        pick, x, y, ycol, dd = pick[keep], x[keep], y[keep], ycol[keep], dd[keep]
        moves = dd != 0
        claim = _first_touch(pxr[pick[moves]], ycol[moves], D)
        keep = ~moves
        keep[np.flatnonzero(moves)[claim]] = True
        pick, x, y, ycol, dd = pick[keep], x[keep], y[keep], ycol[keep], dd[keep]
        if len(x) == 0:
            break
        saved += int(gain[pick].sum())
        for arr in (src_rank, src_index, a, lv):
            fl = arr.reshape(D * G, *arr.shape[2:])
            fl[x], fl[y] = fl[y], fl[x].copy()
        np.add.at(totals, pxr[pick], dd)
        np.subtract.at(totals, ycol, dd)
    return saved


def _first_touch(r: np.ndarray, h: np.ndarray, num_ranks: int) -> np.ndarray:
    """Mask of the swaps (in priority order, each touching items ``r[k]`` and
    ``h[k]`` out of ``num_ranks``) that are the first to touch both their items."""
    n = len(r)
    first = np.full(num_ranks, n, dtype=np.int64)
    k = np.arange(n)
    np.minimum.at(first, r, k)
    np.minimum.at(first, h, k)
    return (first[r] == k) & (first[h] == k)


def _members(node: np.ndarray) -> np.ndarray:
    """``[num_nodes, max ranks per node]``: the ranks of each node, -1 padded."""
    num = int(node.max()) + 1
    size = np.bincount(node, minlength=num)
    out = np.full((num, int(size.max())), -1, dtype=np.int64)
    order = np.argsort(node, kind="stable")
    start = np.concatenate([[0], np.cumsum(size)])[:-1]
    out[node[order], np.arange(len(node)) - start[node[order]]] = order
    return out
