"""Exact references for the frame planner on small instances (MILP).

:func:`~megatron_mm_balance.solver.frames.plan_frames` brings every rank to a level ``T``
moving little. Two questions about one micro-step need an exact answer to judge it:

* :func:`exact_min_moved`: the least cost any placement that brings every rank to ``T`` or
  under moves (the load model of :mod:`.frames`: a received unit weighs ``cost +
  transfer``, no receiving rank ends above the patch cap, zero-cost units stay);
* :func:`exact_min_level`: the lowest largest load any placement reaches (so the
  planner's level can be set against the best one).

Binaries ``x[u, r]`` (unit ``u`` is encoded on rank ``r``) for every unit of cost > 0 and
every rank, one rank per unit; rank ``r``'s load ``sum_u (cost[u] + transfer[u] * [r is
not u's owner]) x[u, r]`` at most ``T``. Under a patch cap, ``y[r]`` marks a rank that
receives (``x[u, r] <= y[r]`` for units it does not own) and its patches stay within
the cap when it does (``sum_u patches[u] x[u, r] <= cap + M (1 - y[r])``). The moved cost
is ``sum_u cost[u] (1 - x[u, owner[u]])``.

The solver's proven bound (``bound``) is a certified lower bound even when the time
limit cuts the search short; ``optimal`` says whether the best placement found is proven
optimal (within HiGHS' default relative gap of 1e-4). A benchmark and test reference,
not a runtime path: ``units x ranks`` binaries, meant for ``D <= 16`` and a few hundred
units. Needs scipy (``scipy.optimize.milp``), imported only when called.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ExactFrames:
    """``value``: the best placement's moved cost (:func:`exact_min_moved`) or largest
    load (:func:`exact_min_level`), None if none was found in time (or none exists:
    ``infeasible``); ``bound``: the proven lower bound on it; ``encoder``: that placement."""

    value: int | None
    bound: float
    optimal: bool
    infeasible: bool
    encoder: np.ndarray | None


def _arrays(owner, cost, num_ranks, patches, transfer):
    owner = np.asarray(owner, dtype=np.int64)
    cost = np.asarray(cost, dtype=np.int64)
    n = len(cost)
    patches = np.ones(n, dtype=np.int64) if patches is None else np.asarray(patches, dtype=np.int64)
    transfer = np.zeros(n, dtype=np.int64) if transfer is None else np.asarray(transfer, dtype=np.int64)
    if len(owner) != n or len(patches) != n or len(transfer) != n:
        raise ValueError("frames_exact: owner, cost, patches and transfer need one entry per unit")
    return owner, cost, int(num_ranks), patches, transfer


def _solve(owner, cost, D, patches, transfer, cap, target, time_limit, weight=None):
    """Build and solve the program; ``target`` None: minimise the largest load; else the
    moved sum of ``weight`` (default ``cost``)."""
    weight = cost if weight is None else np.asarray(weight, dtype=np.int64)
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError:
        raise RuntimeError("the exact frame reference needs scipy (pip install scipy)") from None
    mov = np.flatnonzero(cost > 0)
    m = len(mov)
    if m == 0:                                         # nothing can move: the loads as they are
        load = np.zeros(D, dtype=np.int64)
        np.add.at(load, owner, cost)
        if target is None:
            return ExactFrames(int(load.max()), float(load.max()), True, False, owner.copy())
        if load.max() > target:
            return ExactFrames(None, float("inf"), False, True, None)
        return ExactFrames(0, 0.0, True, False, owner.copy())
    nx = m * D
    unit, rank = np.repeat(np.arange(m), D), np.tile(np.arange(D), m)
    u = mov[unit]
    home = owner[u] == rank
    size = (cost[u] + np.where(home, 0, transfer[u])).astype(np.float64)
    ny = D if cap is not None else 0
    nt = 1 if target is None else 0                    # the level variable
    n_var = nx + ny + nt
    rows, cols, vals, lo, hi = [], [], [], [], []
    r0 = 0

    def add(rr, cc, vv, lower, upper, n_rows):
        nonlocal r0
        rows.append(np.asarray(rr) + r0)
        cols.append(np.asarray(cc))
        vals.append(np.asarray(vv, dtype=np.float64))
        lo.append(np.broadcast_to(np.asarray(lower, dtype=np.float64), n_rows))
        hi.append(np.broadcast_to(np.asarray(upper, dtype=np.float64), n_rows))
        r0 += n_rows

    add(unit, np.arange(nx), np.ones(nx), 1.0, 1.0, m)                       # one rank per unit
    if target is None:                                                       # load - T <= 0
        add(np.concatenate([rank, np.arange(D)]), np.concatenate([np.arange(nx), np.full(D, n_var - 1)]),
            np.concatenate([size, -np.ones(D)]), -np.inf, 0.0, D)
    else:
        add(rank, np.arange(nx), size, -np.inf, float(target), D)
    if cap is not None:
        fixed = np.zeros(D, dtype=np.int64)
        np.add.at(fixed, owner[cost == 0], patches[cost == 0])
        big = float(patches.sum()) + 1.0
        away = np.flatnonzero(~home)
        k = len(away)
        add(np.concatenate([np.arange(k), np.arange(k)]), np.concatenate([away, nx + rank[away]]),
            np.concatenate([np.ones(k), -np.ones(k)]), -np.inf, 0.0, k)      # x[u, r] <= y[r]
        add(np.concatenate([rank, np.arange(D)]), np.concatenate([np.arange(nx), nx + np.arange(D)]),
            np.concatenate([patches[u].astype(np.float64), np.full(D, big)]),
            -np.inf, cap + big - fixed, D)
    c = np.zeros(n_var)
    if target is None:
        c[-1] = 1.0
    else:
        c[:nx] = -np.where(home, weight[u], 0)
    A = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                   shape=(r0, n_var)).tocsr()
    upper = np.ones(n_var)
    integrality = np.ones(n_var)
    if target is None:
        upper[-1] = np.inf
        integrality[-1] = 0
    res = milp(c, constraints=LinearConstraint(A, np.concatenate(lo), np.concatenate(hi)),
               integrality=integrality, bounds=Bounds(np.zeros(n_var), upper),
               options={"time_limit": float(time_limit), "disp": False})
    const = 0.0 if target is None else float(weight[mov].sum())
    if res.x is None:
        infeasible = res.status == 2
        return ExactFrames(None, float("inf") if infeasible else const, False, infeasible, None)
    enc = owner.copy()
    enc[mov] = np.rint(res.x[:nx]).reshape(m, D).argmax(axis=1)
    moved = enc != owner
    if target is None:
        load = np.zeros(D, dtype=np.int64)
        np.add.at(load, enc, cost + np.where(moved, transfer, 0))
        value = int(load.max())
    else:
        value = int(weight[moved].sum())
    bound = getattr(res, "mip_dual_bound", None)
    bound = float(value) if bound is None else const + float(bound)
    return ExactFrames(value, min(bound, float(value)), res.status == 0, False, enc)


def exact_min_moved(owner, cost, num_ranks, target, *, patches=None, patch_cap=None, transfer=None,
                    moved=None, time_limit: float = 30.0) -> ExactFrames:
    """The least cost moved by any placement bringing every rank to ``target`` or under
    (see the module docstring); ``moved``: per unit, the quantity whose moved sum is
    minimised instead of the cost (e.g. the patches)."""
    owner, cost, D, patches, transfer = _arrays(owner, cost, num_ranks, patches, transfer)
    if moved is not None and len(moved) != len(cost):
        raise ValueError("frames_exact: moved needs one entry per unit")
    return _solve(owner, cost, D, patches, transfer, patch_cap, int(target), time_limit, moved)


def exact_min_level(owner, cost, num_ranks, *, patches=None, patch_cap=None, transfer=None,
                    time_limit: float = 30.0) -> ExactFrames:
    """The lowest largest load any placement reaches (see the module docstring)."""
    owner, cost, D, patches, transfer = _arrays(owner, cost, num_ranks, patches, transfer)
    return _solve(owner, cost, D, patches, transfer, patch_cap, None, time_limit)
