"""Which packs each step group computes: few swaps between groups that even the groups' best
micro-step objectives.

Step groups (:mod:`.step_groups`) wait for each other only once per iteration, so a group's
iteration time depends only on the packs it holds: placed as well as possible inside the
group, ``S`` ranks per micro-step, its objective is at least its *profile*

    ``P_g = sum over phases of X*_S(g)``,

``X*_S`` the sorted-grouping optimum of the phase's costs over the group's ``S * G`` packs
(sort descending, cut into runs of ``S``, add the runs' maxima). With one phase the
placement inside the group reaches it exactly; with two (vision, language) it is each
phase's own bound, which the two-phase grouping approaches (:mod:`.two_phase`). The
iteration ends with the slowest group, so the packs the groups hold should even out their
profiles, while moving few packs between groups (those moves are the ones that cross the
network when a group is a node).

Starting from every group's own packs, rounds of swaps: each group whose profile is above
``(1 + tolerance)`` times the mean profile is paired with a distinct group below the mean
(heaviest with lightest; a pair without a useful swap walks on to the next light group in
the following round) and applies, per pair, the best swap of one of its packs ``x`` with
one of the partner's packs ``y``:

1. a swap that lands both groups at or under the limit, and among those the one adding the
   fewest inter-group moves (a pack going back to its own group saves one), then the one
   nearest the pair's midpoint;
2. otherwise the swap that lowers the pair's larger profile the most (fewest added moves on
   ties); none that does not lower it.

A swap's effect on a profile is exact and O(1) from the group's sorted costs (replacing the
element at sorted position ``p`` by a value landing at position ``t`` shifts the run maxima
between them by one element: prefix sums of those one-element steps, plus the value
itself if it lands on a run's first position). Candidates per pair, in the order of the
packs' total cost: for ``x`` the first pack of every run of ``S`` and the group's last
(``G + 1``), for ``y`` the last pack of every run (``G``). With one phase the change of
the heavy group depends on ``x`` only through its run and that of the light group grows
with ``x``'s value (and the same for ``y`` the other way), so the best swap of any pair of
runs is among these; with two phases they are a sample by the total. Every applied swap
lowers its pair's larger profile; at most ``max_rounds`` rounds.

Vectorised over the pairs of a round; only the groups a round changed are sorted again.
Deterministic (integer arithmetic, stable orders, ties by group and position). Cost per
round: O(changed groups * S * G log) for the sorts, O(pairs * G^2) for the candidates.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .pairing import pair_heavy_with_light
from .sorting import lex_argsort

#: composite keys (group, cost) and the swap keys need every profile below this.
_SPAN = 1 << 40


def exchangeable(costs: np.ndarray) -> bool:
    """Whether :func:`exchange_between_groups` takes ``costs`` ``[D, G, P]``: every profile
    (at most ``G * P`` times the largest cost) below ``2**40`` (microseconds: a pack of
    hours)."""
    D, G, P = costs.shape
    return int(costs.max(initial=0)) * G * P < _SPAN


@dataclass
class GroupHoldings:
    """Which packs each rank holds after the exchange between groups (in place of its own):
    ``held[r, i]`` the flat index (``src_rank * G + src_index``) of the pack in rank ``r``'s
    ``i``-th position; ``swaps``: how many swaps between groups were applied."""

    held: np.ndarray
    swaps: int


def _steps(srt: np.ndarray, S: int):
    """Prefix sums of the run maxima's one-element steps, per group and phase:
    ``down[e, j, p] = sum_{k<j} (a[kS+1] - a[kS])`` (maxima moving one element later) and
    ``up[e, j, p] = sum_{1<=k<j} (a[kS-1] - a[kS])`` (one element earlier); ``[E, R+1, P]``."""
    E, N, P = srt.shape
    R = N // S
    lvl = srt[:, ::S, :]                                   # a[kS], k < R
    nxt = np.concatenate([srt[:, 1:, :], np.zeros((E, 1, P), srt.dtype)], axis=1)[:, ::S, :]
    prv = np.concatenate([np.zeros((E, 1, P), srt.dtype), srt[:, :-1, :]], axis=1)[:, ::S, :]
    d = nxt - lvl
    u = prv - lvl
    u[:, 0, :] = 0
    z = np.zeros((E, 1, P), dtype=np.int64)
    return (np.concatenate([z, np.cumsum(d, axis=1)], axis=1),
            np.concatenate([z, np.cumsum(u, axis=1)], axis=1))


def _removal_terms(down, up, e, p, S):
    """What removing group ``e``'s element at sorted position ``p`` contributes to a
    replacement's change of the run-maxima sum (one phase): ``(below, above)`` for a new
    value below and above the removed one (see :func:`_insertion_terms`)."""
    return down[e, -(-p // S)], up[e, p // S + 1]


def _insertion_terms(srt, down, up, e, y, above, S):
    """What inserting value ``y`` into group ``e`` contributes (one phase); ``above``: how
    many of the group's elements exceed ``y``. Replacing the element ``x`` at position ``p``
    by ``y`` changes the run-maxima sum by ``ins_below - rem_below`` when ``y < x`` (``y``
    lands at ``t = above - 1``; the maxima in ``[p, t)`` step one element down) and by
    ``rem_above - ins_above`` when ``y > x`` (``y`` lands at ``t = above``; the maxima in
    ``(t, p]`` step one element up); in both cases plus ``y - a[t]`` if ``t`` starts a run,
    folded in here."""
    N = srt.shape[1]
    t_lo = np.clip(above - 1, 0, N - 1)
    below = down[e, -(-t_lo // S)] + np.where(t_lo % S == 0, y - srt[e, t_lo], 0)
    t_hi = np.clip(above, 0, N - 1)
    over = up[e, t_hi // S + 1] - np.where(t_hi % S == 0, y - srt[e, t_hi], 0)
    return below, over


def _replace_deltas(srt, down, up, e, p, x, y, above, S):
    """``[Q, Cx, Cy]`` changes of group ``e[q]``'s run-maxima sum (one phase) when its
    element ``x[q, i]`` at sorted position ``p[q, i]`` is replaced by ``y[q, j]`` (``above[q,
    j]`` of the group's elements exceed it)."""
    rem_lo, rem_hi = _removal_terms(down, up, e[:, None], p, S)
    ins_lo, ins_hi = _insertion_terms(srt, down, up, e[:, None], y, above, S)
    xv, yv = x[:, :, None], y[:, None, :]
    return np.where(yv < xv, ins_lo[:, None, :] - rem_lo[:, :, None],
                    np.where(yv > xv, rem_hi[:, :, None] - ins_hi[:, None, :], 0))


class _Groups:
    """The exchange's state: the packs each group holds (``members[e]``: flat pack ids) and,
    refreshed for the groups a round changed, per phase their costs sorted descending
    ``srt [E, N, P]``, the run maxima's step sums ``down``/``up``, composite ascending keys
    (group, cost) ``comp[q]`` for counting, the profiles ``prof`` and the candidate columns
    ``cand`` (:func:`_candidates`)."""

    def __init__(self, flat: np.ndarray, members: np.ndarray, S: int):
        self.flat, self.members, self.S = flat, members, S
        E, N = members.shape
        P = flat.shape[1]
        self.weight = flat.sum(axis=1)
        self.srt = np.zeros((E, N, P), dtype=np.int64)
        self.down = np.zeros((E, N // S + 1, P), dtype=np.int64)
        self.up = np.zeros_like(self.down)
        self.comp = np.zeros((P, E, N), dtype=np.int64)
        self.prof = np.zeros(E, dtype=np.int64)
        runs = np.arange(0, N, S)
        self.x_pos = np.unique(np.append(runs, N - 1))          # each run's first, the last
        self.y_pos = runs + S - 1                               # each run's last
        self.xc = np.zeros((E, len(self.x_pos)), dtype=np.int64)
        self.yc = np.zeros((E, len(self.y_pos)), dtype=np.int64)
        self.refresh(np.arange(E))

    def refresh(self, rows: np.ndarray) -> None:
        mem = self.members[rows]
        srt = -np.sort(-self.flat[mem], axis=1)
        self.srt[rows] = srt
        self.prof[rows] = srt[:, ::self.S, :].sum(axis=(1, 2))
        self.down[rows], self.up[rows] = _steps(srt, self.S)
        self.comp[:, rows, :] = (rows[:, None] * _SPAN + srt[:, ::-1, :].transpose(2, 0, 1))
        order = np.argsort(-self.weight[mem], axis=1, kind="stable")
        self.xc[rows] = order[:, self.x_pos]
        self.yc[rows] = order[:, self.y_pos]

    def above(self, q: int, e: np.ndarray, v: np.ndarray) -> np.ndarray:
        """How many of group ``e``'s phase-``q`` costs exceed ``v`` (broadcast)."""
        N = self.members.shape[1]
        return (e + 1) * N - np.searchsorted(self.comp[q].ravel(), e * _SPAN + v, side="right")


def exchange_between_groups(costs: np.ndarray, group: np.ndarray, *, tolerance: float,
                            max_rounds: int = 64) -> GroupHoldings:
    """Swap packs between step groups until every group's profile is within
    ``(1 + tolerance)`` of the mean profile or no swap lowers a pair's larger profile (the
    module docstring). ``costs``: ``[D, G]`` or ``[D, G, P]`` non-negative integers;
    ``group``: dense group ids ``[D]``, every group the same size. Returns the holdings."""
    c = costs if costs.ndim == 3 else costs[:, :, None]
    D, G, P = c.shape
    E = int(group.max()) + 1
    size = np.bincount(group, minlength=E)
    if np.any(size != size[0]):
        raise ValueError("exchange_between_groups needs step groups of equal size")
    S = int(size[0])
    N = S * G
    flat = c.reshape(D * G, P).astype(np.int64)
    if not exchangeable(c):
        raise ValueError(f"costs must stay below {_SPAN // (G * P)} for the exchange between groups")
    # members[e]: the flat ids of the packs group e holds, in rank-major order of its ranks.
    ranks_of = np.argsort(group, kind="stable").reshape(E, S)
    slots = (ranks_of[:, :, None] * G + np.arange(G)[None, None, :]).reshape(E, N)
    state = _Groups(flat, slots.copy(), S)
    home = np.repeat(group, G)                             # each pack's own group
    attempt = np.zeros(E, dtype=np.int64)
    swaps = 0
    rows = np.arange(E)
    for _ in range(max_rounds):
        prof = state.prof
        total = int(prof.sum())
        limit = int(np.floor(total / E * (1.0 + tolerance)))
        heavy = np.flatnonzero(prof > limit)
        if len(heavy) == 0:
            break
        heavy = heavy[lex_argsort((heavy, -prof[heavy]))]
        pool = lex_argsort((rows, prof))
        pool = pool[E * prof[pool] < total]
        if len(pool) == 0:
            break
        pairs = pair_heavy_with_light(heavy, pool, attempt)
        if pairs is None:
            break
        h, l = pairs
        px, py = _best_swaps(state, h, l, limit, home)
        ok = px >= 0
        attempt[h[~ok]] += 1
        if not ok.any():
            continue
        attempt[h[ok]] = 0
        h, l, px, py = h[ok], l[ok], px[ok], py[ok]
        m = state.members
        m[h, px], m[l, py] = m[l, py], m[h, px].copy()
        state.refresh(np.concatenate([h, l]))
        swaps += len(h)
    held = np.empty(D * G, dtype=np.int64)
    held[slots.ravel()] = state.members.ravel()
    return GroupHoldings(held.reshape(D, G), swaps)


def _best_swaps(st: _Groups, h, l, limit, home):
    """The best swap per pair (``h[i]`` heavy, ``l[i]`` light): columns of ``st.members``
    of ``x`` (in ``h``) and ``y`` (in ``l``), -1 where no swap lowers the pair's larger
    profile. See the module docstring for the order of preference."""
    P = st.flat.shape[1]
    xs, ys = st.xc[h], st.yc[l]                            # [Q, Cx], [Q, Cy]
    Q, Cx = xs.shape
    Cy = ys.shape[1]
    xid, yid = st.members[h[:, None], xs], st.members[l[:, None], ys]
    dh = np.zeros((Q, Cx, Cy), dtype=np.int64)
    dl = np.zeros((Q, Cx, Cy), dtype=np.int64)
    hh, ll = h[:, None], l[:, None]
    for q in range(P):
        s_q, dn, u_q = st.srt[:, :, q], st.down[:, :, q], st.up[:, :, q]
        xv, yv = st.flat[xid, q], st.flat[yid, q]          # [Q, C]
        # sorted position of x in h: the first of its value (the run maxima do not depend
        # on which of equal values is replaced), i.e. how many exceed it
        dh += _replace_deltas(s_q, dn, u_q, h, st.above(q, hh, xv), xv, yv,
                              st.above(q, hh, yv), st.S)
        dl += np.swapaxes(_replace_deltas(s_q, dn, u_q, l, st.above(q, ll, yv), yv, xv,
                                          st.above(q, ll, xv), st.S), 1, 2)
    prof = st.prof
    ph = prof[h][:, None, None] + dh
    pl = prof[l][:, None, None] + dl
    worst = np.maximum(ph, pl)
    useful = worst < prof[h][:, None, None]
    # inter-group moves added: x leaves h (or goes back home to l), y likewise
    xh, yh = home[xid], home[yid]
    added = ((xh != ll).astype(np.int64) - (xh != hh))[:, :, None] \
        + ((yh != hh).astype(np.int64) - (yh != ll))[:, None, :]
    spread = np.abs(ph - pl)
    window = useful & (ph <= limit) & (pl <= limit)
    big = np.iinfo(np.int64).max
    key = np.where(useful, (1 << 61) + (worst - prof[h][:, None, None] + (1 << 40)) * 8
                   + added + 2, big)
    np.copyto(key, (added + 2) * (1 << 50) + spread, where=window)
    key = key.reshape(Q, Cx * Cy)
    k = np.argmin(key, axis=1)
    ok = key[np.arange(Q), k] < big
    bx = np.where(ok, xs[np.arange(Q), k // Cy], -1)
    by = np.where(ok, ys[np.arange(Q), k % Cy], -1)
    return bx, by
