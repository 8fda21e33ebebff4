"""Exact reference for the two-phase micro-step objective on small instances (MILP).

The two-phase objective of a grouping of ``N = D * G`` packs into ``G`` micro-steps
of ``D`` packs each is ``sum_m (max V + max L)`` over the groups (which rank
computes which pack does not change it). :mod:`.two_phase` groups heuristically;
this module solves the same problem exactly with a mixed-integer program, so the
heuristic's gap to the true optimum, not only to the lower bound, can be measured.
It is a benchmark and test reference, not a runtime path: the program grows as
``N^2`` and is meant for ``D <= 16``, ``G <= 8``.

Formulation (group *representatives*, no symmetry between groups): sort the packs
by vision cost, descending, ties by language cost then index; the first pack of
each group in that order is its representative and sets the group's vision
maximum. Binaries ``x[p, q]`` (``p <= q`` in that order): pack ``q`` is in the
group represented by ``p``; ``x[p, p]``: ``p`` represents a group. Constraints:
every pack in exactly one group; ``x[p, q] <= x[p, p]``; a representative's group
holds ``D`` packs; ``G`` representatives. Continuous ``lm[p] >= l[q] * x[p, q]``
is the group's language maximum. Objective: ``sum_p v[p] x[p, p] + sum_p lm[p]``.
Every grouping has exactly one encoding, so the branch and bound does not wade
through ``G!`` copies of each solution.

Needs scipy (``scipy.optimize.milp``, HiGHS), an optional dependency of the tests
and benchmarks; imported only when called.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .sorting import lex_argsort


@dataclass(frozen=True)
class ExactResult:
    """``objective``: the best grouping found (optimal when ``optimal``);
    ``bound``: the solver's proven lower bound (= objective when optimal);
    ``group[i]``: the micro-step (0..G-1) of pack ``i``."""

    objective: int
    bound: float
    optimal: bool
    group: np.ndarray


def exact_two_phase_grouping(v, l, D: int, G: int, *, time_limit: float = 60.0) -> ExactResult:
    """The grouping of packs ``(v[i], l[i])`` into ``G`` groups of ``D`` that minimises
    ``sum over groups of (max v + max l)``; see the module docstring."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError:
        raise RuntimeError("the exact reference needs scipy (pip install scipy)") from None
    v = np.asarray(v, dtype=np.int64).ravel()
    l = np.asarray(l, dtype=np.int64).ravel()
    N = len(v)
    if len(l) != N or N != D * G or D < 1 or G < 1:
        raise ValueError(f"need D * G = {D * G} packs with both costs, got {len(v)} and {len(l)}")
    if np.any(v < 0) or np.any(l < 0):
        raise ValueError("costs must be >= 0")
    order = lex_argsort((-l, -v))                # by v descending, ties by l, then index
    vs, ls = v[order].astype(np.float64), l[order].astype(np.float64)
    pp, qq = np.triu_indices(N)                  # pairs p <= q: x[p, q]
    X = len(pp)
    diag = np.flatnonzero(pp == qq)              # x[p, p]
    n_var = X + N                                # then lm[p]
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def add(rr, cc, vv, lower, upper):
        nonlocal r
        rows.append(np.asarray(rr) + r)
        cols.append(np.asarray(cc))
        vals.append(np.asarray(vv, dtype=np.float64))
        n = int(np.max(rr)) + 1
        lo.append(np.broadcast_to(lower, n))
        hi.append(np.broadcast_to(upper, n))
        r += n

    k = np.arange(X)
    add(qq, k, np.ones(X), 1.0, 1.0)                                 # each pack in one group
    off = np.flatnonzero(pp != qq)                                   # x[p, q] - x[p, p] <= 0
    m = np.arange(len(off))
    add(np.concatenate([m, m]), np.concatenate([off, diag[pp[off]]]),
        np.concatenate([np.ones(len(off)), -np.ones(len(off))]), -np.inf, 0.0)
    # sum_q x[p, q] - D x[p, p] = 0 (the diagonal counts once in the sum)
    add(np.concatenate([pp, pp[diag]]), np.concatenate([k, diag]),
        np.concatenate([np.ones(X), -float(D) * np.ones(N)]), 0.0, 0.0)
    add(np.zeros(N, dtype=np.int64), diag, np.ones(N), float(G), float(G))   # G groups
    # l[q] x[p, q] - lm[p] <= 0
    add(np.concatenate([k, k]), np.concatenate([k, X + pp]),
        np.concatenate([ls[qq], -np.ones(X)]), -np.inf, 0.0)
    # Valid cuts that make the relaxation at least the sorted-grouping bound of each
    # phase. Vision: the first k packs (v order) lie in groups represented among them,
    # at least ceil(k / D) of them.
    for kk in range(1, N + 1):
        if kk % D == 1 or D == 1:
            add(np.zeros(kk, dtype=np.int64), diag[:kk], np.ones(kk), float(-(-kk // D)), np.inf)
    # Language: y[p, j] >= x[p, q] for the j * D packs of largest l (T_j), j = 1..G:
    # at least j groups touch T_j, and a group touching T_j has lm >= the l of T_j's last.
    l_rank = np.empty(N, dtype=np.int64)
    l_rank[lex_argsort((np.arange(N), -ls))] = np.arange(N)         # 0 = largest l
    thr = np.sort(ls)[::-1][D - 1::D]                                # t_1 >= ... >= t_G
    n_y = N * G
    y0 = n_var
    n_var += n_y
    for j in range(1, G + 1):
        sel = np.flatnonzero(l_rank[qq] < j * D)                     # x[p, q] with q in T_j
        yk = y0 + pp[sel] * G + (j - 1)
        mm = np.arange(len(sel))
        add(np.concatenate([mm, mm]), np.concatenate([sel, yk]),
            np.concatenate([np.ones(len(sel)), -np.ones(len(sel))]), -np.inf, 0.0)
        add(np.zeros(N, dtype=np.int64), y0 + np.arange(N) * G + (j - 1), np.ones(N), float(j), np.inf)
    step = thr - np.append(thr[1:], 0.0)
    pr = np.repeat(np.arange(N), G)
    add(np.concatenate([pr, np.arange(N)]), np.concatenate([y0 + np.arange(n_y), X + np.arange(N)]),
        np.concatenate([np.tile(step, N), -np.ones(N)]), -np.inf, 0.0)
    A = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                   shape=(r, n_var)).tocsr()
    cons = LinearConstraint(A, np.concatenate(lo), np.concatenate(hi))
    c = np.zeros(n_var)
    c[diag] = vs
    c[X:] = 1.0

    integrality = np.concatenate([np.ones(X), np.zeros(N + n_y)])
    ub = np.concatenate([np.ones(X), np.full(N, float(ls.max()) if N else 0.0), np.ones(n_y)])
    res = milp(c, constraints=cons, integrality=integrality, bounds=Bounds(np.zeros(n_var), ub),
               options={"time_limit": float(time_limit), "disp": False})
    if res.x is None:
        raise RuntimeError(f"the MILP found no grouping within {time_limit} s ({res.message})")
    x = np.rint(res.x[:X]).astype(np.int64)
    reps = np.flatnonzero(x[diag] == 1)
    rep_group = np.full(N, -1, dtype=np.int64)
    rep_group[reps] = np.arange(len(reps))
    group_sorted = np.full(N, -1, dtype=np.int64)
    sel = np.flatnonzero(x == 1)
    group_sorted[qq[sel]] = rep_group[pp[sel]]
    group = np.empty(N, dtype=np.int64)
    group[order] = group_sorted
    obj = _grouping_objective(v, l, group, G)
    bound = float(getattr(res, "mip_dual_bound", None) or obj)
    optimal = res.status == 0
    return ExactResult(objective=obj, bound=min(bound, obj) if not optimal else float(obj),
                       optimal=optimal, group=group)


def _grouping_objective(v, l, group, G) -> int:
    if np.any(group < 0) or np.any(np.bincount(group, minlength=G) != len(v) // G):
        raise RuntimeError("the MILP returned an inconsistent grouping")
    vm = np.zeros(G, dtype=np.int64)
    lm = np.zeros(G, dtype=np.int64)
    np.maximum.at(vm, group, v)
    np.maximum.at(lm, group, l)
    return int(vm.sum() + lm.sum())
