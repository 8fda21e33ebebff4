"""Placement of one global batch's packs onto (rank, micro-step) slots.

The one entry point is :func:`plan_placement` (``costs``, and a
:class:`SolverOptions` or its keywords): it dispatches to the strategy for the
cost kind and sync mode (private: micro-step, step, and two-phase in
:mod:`.two_phase`), orders the micro-steps as the runtime delivers them and
checks the result.

Input: an integer cost matrix ``costs[r, i]``: the cost of the ``i``-th pack that
data-parallel rank ``r`` drew for this global batch (D ranks x G micro-steps).
Output: a :class:`Placement` saying, for every destination slot ``(rank, step)``,
which ``(source rank, source index)`` pack it computes.

Stage 1, balance (ignoring origins):

* ``sync="microstep"`` (ranks meet at every micro-step: MoE expert parallelism)
  minimises ``sum_m max_r cost[r, m]``. Sorting all packs by cost and cutting the
  list into consecutive groups of D is optimal, and the maxima of those groups,
  the *levels* ``L_0 >= L_1 >= ...``, are all that the optimum depends on: any
  assignment that puts D packs into micro-step ``k``, each costing at most
  ``L_k``, is equally optimal. That freedom is what stage 2 spends.
* ``sync="step"`` (ranks meet only at the gradient all-reduce) evens each rank's
  total; any micro-step may hold any pack. With nodes, node totals are evened
  first (few large swaps cross the network), then the ranks inside each node.

Stage 2, move little: micro-steps are filled heaviest level first. In each, every
rank proposes its own heaviest unplaced pack, which would stay at home; packs
whose last eligible micro-step this is are forced in; proposals are dropped or
filler packs pulled in (earliest deadline first) so that later micro-steps stay
feasible. A proposal is then accepted only if the rank's running total stays
within a band around the running mean: ``STAGE2_BAND_FACTOR`` times
``balance_tolerance`` (the knob), at least ``STAGE2_MIN_BAND``, of the final mean
rank total, widened by how much the later, lighter micro-steps can still correct. Packs not accepted move,
heaviest to the lightest free rank. Changing a pack's micro-step on its own rank
is free; only a change of rank is a move.

Stage 3, even the rank totals (:mod:`.rank_balance`): swaps that keep every pack
within its micro-step's level (so the objective stays optimal), also across
micro-steps, bring every rank total within ``balance_tolerance`` of the mean (or
to the integer floor of tile-quantised costs), preferring swaps that re-route
packs already moving; then move chains are shortened (a pack away from home
swaps with a foreign pack on its home rank) without breaking that limit.

With step groups (``step_groups``: ranks meet per micro-step only inside their group, the
expert-parallel group, and all of them once per iteration), the objective is the slowest
group's sum of its per-micro-step maxima; :mod:`.group_placement` plans it (packs evened
between groups with few swaps, then each group on its own), never worse than the plan
below. One group of all ranks is the plan below unchanged; every rank its own group is
``step`` mode.

With nodes (``ranks_per_node``), moves prefer node-mates (:mod:`.topology`) and
the result is never worse than the flat placement of the same batch: the grouping is
computed once, the slots, stage 3 and chain shortening run with and without the
nodes, and the node-aware plan is kept unless its balance is worse or, at an equal
balance, more packs cross nodes (:mod:`.node_choice`).

The result is deterministic (integer arithmetic, stable sorts, explicit tie
breaks), total (every pack in exactly one slot) and, in ``microstep`` mode,
exactly optimal for the micro-step objective.

Complexity: O(G * D * G) element operations vectorised over the D x G matrix
(one pass per micro-step), O(G * D log D) for the per-step sorts.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

import numpy as np

from .group_placement import place_in_groups
from .node_choice import no_worse_than_flat
from .rank_balance import SwapRules, balance_node_totals, balance_rank_totals, send_home
from .sorting import lex_argsort, stable_argsort
from .step_groups import check_step_groups, group_objective, inter_group_packs, step_group_ids
from .topology import check_ranks_per_node, node_ids, node_of_each_rank, pair_within_nodes
from .two_phase import as_cost_pairs, two_phase_groups, two_phase_slots

__all__ = ["DEFAULT_BALANCE_TOLERANCE", "SYNC_MODES", "Placement", "PlanStats", "SolverOptions",
           "as_cost_matrix", "check_placement", "control_placement", "evaluate", "microstep_objective", "order_steps",
           "plan_placement", "reordered_packs", "sorted_grouping_optimum", "step_imbalance"]

SYNC_MODES = ("microstep", "step")
#: The one default of ``balance_tolerance`` (the runtime, the Megatron flags and the
#: simulator read it from here).
DEFAULT_BALANCE_TOLERANCE = 0.001
# Stage 2 keeps a rank's own packs while its running total stays within this many
# tolerances of the running mean, and never less than STAGE2_MIN_BAND of the mean
# rank total; the final pass then evens totals to one tolerance with swaps that
# mostly re-route packs already moving (see rank_balance). The floor keeps tight
# tolerances from costing moves in stage 2 (the frontier:
# docs/notes/2026-12-01-placement-performance-v3.md).
STAGE2_BAND_FACTOR = 5.0
STAGE2_MIN_BAND = 0.03
# step mode: stage-3 swaps between packs at most this many micro-steps apart.
STEP_MODE_WINDOW = 2
# step mode: rounds of chain shortening (per level: nodes, then ranks).
STEP_MODE_SHORTEN_ROUNDS = 4
# Share of the later micro-steps' correcting power the band may count on.
DEFAULT_FUTURE_SLACK = 0.5


@dataclass(frozen=True)
class SolverOptions:
    """How :func:`plan_placement` places a batch; validated once, when built.

    ``sync``: where ranks meet (``microstep``: every micro-step, as under MoE
    expert parallelism; ``step``: only at the gradient all-reduce).
    ``balance_tolerance``: how far above the mean a rank's total may end, as a
    fraction of the mean rank total (never tighter than integer costs allow, see
    :func:`~megatron_mm_balance.solver.rank_balance.rank_limit`); stage 2 lets a
    rank's running total drift ``STAGE2_BAND_FACTOR`` times as far while it keeps
    its own packs (never less than ``STAGE2_MIN_BAND``). Larger keeps more packs at
    home; smaller evens rank totals harder.
    ``ranks_per_node``: ranks ``r // ranks_per_node`` share a node, or a sequence of
    each rank's node id (None: flat); moves then stay inside a node wherever the
    balance allows (:mod:`.topology`). ``future_slack``: the share of the later,
    lighter micro-steps' correcting power stage 2's band may count on.
    ``step_groups`` (``microstep`` mode): None, every rank meets every micro-step (the
    whole data-parallel group in lockstep); or one label per rank (row of the cost
    matrix) naming its per-micro-step meeting group, the expert-parallel group within
    the data-parallel group (:mod:`.step_groups`): the plan then minimises the group
    objective. In ``step`` mode nobody meets within an iteration and the labels change
    nothing.
    """

    sync: str = "microstep"
    balance_tolerance: float = DEFAULT_BALANCE_TOLERANCE
    ranks_per_node: int | tuple[int, ...] | None = None
    future_slack: float = DEFAULT_FUTURE_SLACK
    step_groups: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {self.sync!r}")
        for name in ("balance_tolerance", "future_slack"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        rpn = check_ranks_per_node(self.ranks_per_node)
        if isinstance(rpn, np.ndarray):
            rpn = tuple(int(x) for x in rpn)
        object.__setattr__(self, "ranks_per_node", rpn)
        object.__setattr__(self, "step_groups", check_step_groups(self.step_groups))

    def nodes(self, num_ranks: int) -> np.ndarray | None:
        """Each rank's node (dense ids), or None when node awareness is off."""
        rpn = self.ranks_per_node
        return node_ids(num_ranks, np.asarray(rpn, dtype=np.int64) if isinstance(rpn, tuple) else rpn)

    def groups(self, num_ranks: int) -> np.ndarray | None:
        """Each rank's step group (dense ids), or None when all ranks meet every micro-step
        (no labels, or one label for all)."""
        ids = step_group_ids(num_ranks, self.step_groups)
        return None if ids is None or ids.max() == 0 else ids


@dataclass(frozen=True)
class Placement:
    """``src_rank[r, m], src_index[r, m]``: the pack destination slot (r, m) computes."""

    src_rank: np.ndarray
    src_index: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.src_rank.shape

    def slots(self) -> np.ndarray:
        """``[[dst_rank, dst_step, src_rank, src_index], ...]``, D*G rows, dst-major."""
        D, G = self.shape
        dr, ds = np.meshgrid(np.arange(D), np.arange(G), indexing="ij")
        return np.stack([dr.ravel(), ds.ravel(), self.src_rank.ravel(),
                         self.src_index.ravel()], axis=1)

    def moved(self) -> np.ndarray:
        """Boolean [D, G]: destination slot receives a pack from another rank."""
        return self.src_rank != np.arange(self.shape[0])[:, None]

    def apply(self, costs: np.ndarray) -> np.ndarray:
        """Costs as computed after placement: ``out[r, m] = costs[src(r, m)]``."""
        return np.asarray(costs)[self.src_rank, self.src_index]

    @staticmethod
    def identity(num_ranks: int, num_steps: int) -> "Placement":
        r, m = np.meshgrid(np.arange(num_ranks), np.arange(num_steps), indexing="ij")
        return Placement(r.astype(np.int64), m.astype(np.int64))


def control_placement(solved: Placement) -> Placement:
    """The control of ``solved``: every rank keeps exactly its own packs, reordered across
    micro-steps about as much as balancing regroups them.

    Rank ``r``'s pack ``i`` is computed, in ``solved``, at some micro-step ``s(r, i)`` (on
    whichever rank). The control sorts rank ``r``'s own packs by ``(s(r, i), i)`` (the
    micro-step order balancing gives them) and then rotates that order by ``r`` positions
    (rank ``r``'s ``m``-th micro-step trains the ``(m + r) mod G``-th of them). The rotation
    is what makes it comparable to balancing: ranks that meet at a micro-step (an
    expert-parallel all-to-all, a gradient bucket) then meet other partners than in the
    unbalanced order at most micro-steps, as they do under balancing; the sort alone
    leaves a rank whose packs balancing keeps at home in its own order (measured on
    Megatron-Bridge's DP=4, G=2 layout: 2 of 24 slots reordered,
    docs/notes/2026-12-02-control-band.md).

    Nothing crosses ranks, so a run in this order shows the arithmetic-order band of a job
    (the loss differences that only summation order makes) against which balancing's own
    difference is judged. A pure function of ``solved``: identical on every rank.
    """
    D, G = solved.shape
    step_of = np.empty((D, G), dtype=np.int64)
    step_of[solved.src_rank, solved.src_index] = np.arange(G)[None, :]
    order = np.lexsort((np.broadcast_to(np.arange(G), (D, G)), step_of), axis=1)
    rotated = np.stack([np.roll(order[r], -(r % G)) for r in range(D)])
    return Placement(np.repeat(np.arange(D, dtype=np.int64)[:, None], G, axis=1),
                     rotated.astype(np.int64))


def reordered_packs(placement: Placement) -> int:
    """Slots that compute a pack at another micro-step than the one it was drawn for."""
    return int((placement.src_index != np.arange(placement.shape[1])[None, :]).sum())


def as_cost_matrix(costs) -> np.ndarray:
    """Validate costs: a 2-D matrix of non-negative integers (floats must be integral)."""
    c = np.asarray(costs)
    if c.ndim != 2 or c.shape[0] < 1 or c.shape[1] < 1:
        raise ValueError(f"costs must be a non-empty [ranks, micro-steps] matrix, got shape {c.shape}")
    if c.dtype.kind == "f":
        if not np.all(np.isfinite(c)) or np.any(c != np.rint(c)):
            raise ValueError("costs must be integers (quantise float costs before placing)")
        c = c.astype(np.int64)
    elif c.dtype.kind in "iub":
        c = c.astype(np.int64)
    else:
        raise ValueError(f"costs must be numeric, got dtype {c.dtype}")
    if np.any(c < 0):
        raise ValueError("costs must be >= 0")
    return c


def microstep_objective(assigned: np.ndarray) -> int:
    """Sum over micro-steps of the slowest rank's cost (``assigned[r, m]``)."""
    return int(np.asarray(assigned).max(axis=0).sum())


def sorted_grouping_optimum(costs) -> int:
    """The minimum of :func:`microstep_objective` over all placements."""
    c = as_cost_matrix(costs)
    D = c.shape[0]
    return int(np.sort(c.ravel())[::-1][::D].sum())


def _solve(costs, opts: SolverOptions) -> Placement:
    """Dispatch one global batch to its strategy (before :func:`order_steps`).

    Each strategy is split into what does not depend on the nodes (the grouping of
    packs into micro-steps) and the slots, rank balance and chain shortening that
    do. With nodes, both completions run on the same grouping and
    :func:`~.node_choice.no_worse_than_flat` keeps the node-aware one unless it is
    worse than the flat one (balance first, then packs crossing nodes)."""
    tol = opts.balance_tolerance
    if np.ndim(costs) == 3:
        pairs = as_cost_pairs(costs)
        both = bool(pairs[:, :, 0].any() and pairs[:, :, 1].any())
        if opts.sync == "microstep" and both:
            D, G, _ = pairs.shape
            if D == 1 or G == 1:
                return Placement.identity(D, G)
            groups = two_phase_groups(pairs)
            return _node_aware_or_flat(
                lambda node: Placement(*two_phase_slots(pairs, groups, tol, node)),
                opts.nodes(D), SwapRules(pairs, weights=groups.weights, levels=groups.boxes), tol)
        # step mode counts only rank totals; one phase alone: the scalar optimum
        costs = pairs.sum(axis=2)
    c = as_cost_matrix(costs)
    D, G = c.shape
    if D == 1 or G == 1:
        # One rank: nothing to exchange. One micro-step: the slowest pack sets both
        # objectives whoever computes it, so moving anything only costs bandwidth.
        return Placement.identity(D, G)
    if opts.sync == "step":
        return _node_aware_or_flat(lambda node: _step_placement(c, tol, node), opts.nodes(D),
                                   SwapRules(c), tol, shorten_rounds=STEP_MODE_SHORTEN_ROUNDS)
    groups = _microstep_grouping(c)
    return _node_aware_or_flat(lambda node: _microstep_slots(c, groups, opts, node), opts.nodes(D),
                               SwapRules(c, levels=groups.levels), tol)


def _node_aware_or_flat(complete, node: np.ndarray | None, rules: SwapRules, tolerance: float,
                        shorten_rounds: int = 2) -> Placement:
    """``complete(node)``: the strategy's placement for the ranks' nodes (None: flat).
    Without nodes, the flat placement; with nodes, the node-aware one unless it is worse
    than the flat one, then the flat one shortened across nodes
    (:func:`~.node_choice.no_worse_than_flat`, whose guarantee this is)."""
    flat = complete(None)
    if node is None:
        return flat
    aware = complete(node)
    node_rules = replace(rules, node=node)
    src_rank, src_index = no_worse_than_flat(
        node_rules, (aware.src_rank, aware.src_index), (flat.src_rank, flat.src_index),
        limit=node_rules.limit(tolerance), shorten_rounds=shorten_rounds)
    return Placement(src_rank, src_index)


def _step_placement(c: np.ndarray, tolerance: float, node: np.ndarray | None) -> Placement:
    """Only rank totals count: keep every pack home and swap pairs between the
    heaviest and lightest ranks until the totals are even."""
    D, G = c.shape
    pl = Placement.identity(D, G)
    rules = SwapRules(c, node=node)
    limit = rules.limit(tolerance)
    if node is not None:
        # Nodes first (few large swaps cross the network), then ranks inside
        # each node (NVLink), then whatever is left over the limit, anywhere.
        balance_node_totals(rules, pl.src_rank, pl.src_index, limit=limit)
        balance_rank_totals(rules, pl.src_rank, pl.src_index, tolerance=tolerance,
                            partners="mates-only", step_window=STEP_MODE_WINDOW)
    balance_rank_totals(rules, pl.src_rank, pl.src_index, tolerance=tolerance,
                        partners="mates-first", step_window=STEP_MODE_WINDOW)
    if node is not None:
        send_home(rules, pl.src_rank, pl.src_index, limit=limit, max_rounds=STEP_MODE_SHORTEN_ROUNDS)
    return pl


@dataclass(frozen=True)
class _Grouping:
    """Stage 1 and stage 2's choice of which packs share each micro-step, for scalar
    costs in ``microstep`` mode; it does not depend on the nodes. ``order[r]``: rank
    r's own pack indices, heaviest first; ``cs``: their costs in that order;
    ``levels``: ``L_k``; ``steps[k]``: the packs of micro-step ``k`` as flat indices
    into ``cs`` (row-major: in origin order)."""

    order: np.ndarray
    cs: np.ndarray
    levels: np.ndarray
    steps: tuple


def _microstep_grouping(c: np.ndarray) -> _Grouping:
    """Stage 1 (levels) and the grouping half of stage 2 (:class:`_Stage2`)."""
    D, G = c.shape
    # own packs, heaviest first (ties by position): one stable sort of (rank, -cost)
    order = (lex_argsort((-c.ravel(), np.repeat(np.arange(D), G))) % G).reshape(D, G)
    cs = np.take_along_axis(c, order, axis=1)             # [D, G] sorted costs
    levels = np.sort(c.ravel())[::-1][::D]                 # L_k, non-increasing
    fill = _Stage2(cs, levels)
    placed = np.zeros((D, G), dtype=bool)
    steps = []
    for k in range(G):
        chosen = fill.choose(~placed, k)
        fl = np.flatnonzero(chosen)                          # row-major: origin order
        steps.append(fl)
        placed |= chosen
        fill.placed(fl)
    return _Grouping(order, cs, levels, tuple(steps))


def _microstep_slots(c: np.ndarray, groups: _Grouping, opts: SolverOptions,
                     node: np.ndarray | None) -> Placement:
    """The slots half of stage 2 (which chosen packs stay home, where the others go),
    then stage 3, for scalar costs, ``sync="microstep"``."""
    D, G = c.shape
    cs, levels = groups.cs, groups.levels
    floor = int(levels[-1])
    future = np.append(levels[1:], floor).astype(np.float64) - floor   # correcting power left
    band0 = _stage2_band(opts.balance_tolerance) * float(c.sum()) / D

    rows = np.arange(D)
    dst_rank = np.zeros((D, G), dtype=np.int64)            # in sorted coordinates
    dst_step = np.zeros((D, G), dtype=np.int64)
    totals = np.zeros(D, dtype=np.int64)

    for k, fl in enumerate(groups.steps):
        # Which chosen packs stay at home, and where the others go.
        r_idx = fl // G
        cost = cs.ravel()[fl]
        mean_after = (totals.sum() + cost.sum()) / D
        band = band0 + opts.future_slack * future[k]
        # Each rank's stay candidate: its heaviest chosen pack (first in row order).
        is_first = np.ones(len(r_idx), dtype=bool)
        is_first[1:] = r_idx[1:] != r_idx[:-1]
        cand_rank = r_idx[is_first]
        cand_cost = cost[is_first]
        after = totals[cand_rank] + cand_cost
        ok = (after <= mean_after + band) & (after >= mean_after - band)
        stay = np.zeros(len(r_idx), dtype=bool)
        stay[np.flatnonzero(is_first)[ok]] = True

        dest = np.full(len(r_idx), -1, dtype=np.int64)
        dest[stay] = r_idx[stay]
        taken = np.zeros(D, dtype=bool)
        taken[r_idx[stay]] = True
        movers = np.flatnonzero(~stay)
        free = np.flatnonzero(~taken)
        # Heaviest mover to the lightest free rank; ties by origin then position / rank id.
        # (movers and free ranks are in (origin, position) / rank order already)
        mv = movers[stable_argsort(-cost[movers])]
        fr = free[stable_argsort(totals[free])]
        dest[mv] = pair_within_nodes(r_idx[mv], fr, node)
        dst_rank.ravel()[fl] = dest
        dst_step.ravel()[fl] = k
        totals[dest] += cost                                 # dest: every rank once

    src_rank = np.empty((D, G), dtype=np.int64)
    src_index = np.empty((D, G), dtype=np.int64)
    src_rank[dst_rank, dst_step] = np.repeat(rows, G).reshape(D, G)
    src_index[dst_rank, dst_step] = groups.order
    rules = SwapRules(c, levels=levels, node=node)
    balance_rank_totals(rules, src_rank, src_index, tolerance=opts.balance_tolerance)
    send_home(rules, src_rank, src_index, limit=rules.limit(opts.balance_tolerance))
    return Placement(src_rank, src_index)


def _stage2_band(tolerance: float) -> float:
    """Stage 2's band around the running mean, as a fraction of the mean rank total."""
    return max(STAGE2_BAND_FACTOR * tolerance, STAGE2_MIN_BAND)


class _Stage2:
    """Stage 2's choice of the D packs of each micro-step (heaviest level first).

    Holds, in sorted coordinates (each rank's packs heaviest first), the costs
    ``cs``, each pack's ``deadline`` (the last micro-step whose level admits it)
    and the unplaced packs per deadline, kept across micro-steps so that the
    feasibility repair counts only the D chosen packs."""

    def __init__(self, cs: np.ndarray, levels: np.ndarray):
        self.cs = cs
        self.D, self.G = cs.shape
        self.deadline = np.searchsorted(-levels, -cs, side="right") - 1
        self.rank = np.repeat(np.arange(self.D), self.G).reshape(self.D, self.G)
        self.due_unplaced = np.bincount(self.deadline.ravel(), minlength=self.G)

    def choose(self, unplaced: np.ndarray, k: int) -> np.ndarray:
        """The D packs of micro-step ``k``: every rank proposes its heaviest unplaced
        pack, packs due now are forced in, then drop / fill / repair."""
        D, G = self.D, self.G
        rows = np.arange(D)
        chosen = np.zeros((D, G), dtype=bool)
        first = np.argmax(unplaced, axis=1)                 # 0 when a row has none left
        has = unplaced[rows, first]
        chosen[rows[has], first[has]] = True                # proposals
        forced = unplaced & (self.deadline <= k)
        chosen |= forced
        n = int(np.count_nonzero(chosen))
        if n > D:
            self._drop(chosen, forced, n - D)
        elif n < D:
            self._fill(chosen, unplaced, D - n, G - k)
        if k + 1 < G:
            self._repair(chosen, forced, unplaced, k)
        return chosen

    def placed(self, flat: np.ndarray) -> None:
        """Packs ``flat`` (flat indices) were placed."""
        self.due_unplaced -= np.bincount(self.deadline.ravel()[flat], minlength=self.G)

    def _heaviest_first(self, mask: np.ndarray) -> np.ndarray:
        """Indices (flat) of ``mask`` ordered heaviest first, ties by rank then position."""
        idx = np.flatnonzero(mask)                   # row-major: by rank, then position
        return idx[stable_argsort(-self.cs.ravel()[idx])]

    def _least_urgent_first(self, chosen: np.ndarray, forced: np.ndarray) -> np.ndarray:
        """Indices (flat) of the chosen, non-forced packs: latest deadline, then lightest,
        then highest rank first: the ones a micro-step can give up at least cost."""
        idx = np.flatnonzero(chosen & ~forced)
        return idx[lex_argsort((-self.rank.ravel()[idx], self.cs.ravel()[idx],
                                -self.deadline.ravel()[idx]))]

    def _drop(self, chosen, forced, count: int) -> None:
        """Drop the ``count`` least urgent non-forced chosen packs."""
        chosen.ravel()[self._least_urgent_first(chosen, forced)[:count]] = False

    def _fill(self, chosen, unplaced, count: int, slots_left: int) -> None:
        """Pull in ``count`` unplaced packs not yet chosen: first from ranks holding more
        packs than they have slots left (they must export anyway), then the heaviest
        (earliest deadline). Each such rank offers only as many packs as its surplus."""
        rest = unplaced & ~chosen
        surplus = unplaced.sum(axis=1) - slots_left
        exportable = rest & (np.cumsum(rest, axis=1) <= surplus[:, None])
        idx = self._heaviest_first(exportable)[:count]
        if len(idx) < count:
            more = self._heaviest_first(rest & ~exportable)
            idx = np.concatenate([idx, more[: count - len(idx)]])
        chosen.ravel()[idx] = True

    def _repair(self, chosen, forced, unplaced, k: int) -> None:
        """Keep later micro-steps feasible: no more packs due by step k' than slots left."""
        D, G = self.D, self.G
        while True:
            due_chosen = np.bincount(self.deadline.ravel()[np.flatnonzero(chosen)], minlength=G)
            due = np.cumsum(self.due_unplaced - due_chosen)[k + 1:]
            excess = int((due - D * np.arange(1, G - k)).max())
            if excess <= 0:
                return
            rest = unplaced & ~chosen
            out = self._least_urgent_first(chosen, forced)
            if len(out) < excess:   # cannot happen: stage-1 levels guarantee feasibility
                raise AssertionError("placement infeasible: inconsistent levels")
            inn = self._heaviest_first(rest)[:excess]
            chosen.ravel()[out[:excess]] = False
            chosen.ravel()[inn] = True


def evaluate(costs, placement: Placement) -> dict:
    """Balance and movement metrics of a placement (and of the unbalanced baseline)."""
    return PlanStats.of(costs, placement).metrics()


def check_placement(placement: Placement, num_ranks: int, num_steps: int) -> None:
    """Raise if ``placement`` is not a bijection of the D x G packs onto the slots."""
    sr, si = placement.src_rank, placement.src_index
    if sr.shape != (num_ranks, num_steps) or si.shape != (num_ranks, num_steps):
        raise ValueError(f"placement shape {sr.shape} != {(num_ranks, num_steps)}")
    if sr.min() < 0 or sr.max() >= num_ranks or si.min() < 0 or si.max() >= num_steps:
        raise ValueError("placement refers to a pack outside the global batch")
    flat = np.sort(sr.ravel() * num_steps + si.ravel())
    if not np.array_equal(flat, np.arange(num_ranks * num_steps)):
        raise ValueError("placement is not a permutation: some pack is duplicated or lost")


def order_steps(placement: Placement) -> Placement:
    """Put the micro-step that moves the fewest packs first (ties: earliest).

    Every later micro-step's exchange hides behind the previous step's compute;
    the first one of a global batch cannot, so it should move as little as
    possible. Permuting micro-steps changes neither objective.
    """
    moved = placement.moved().sum(axis=0)
    first = int(np.argmin(moved))
    if first == 0:
        return placement
    G = placement.shape[1]
    cols = [first] + [c for c in range(G) if c != first]
    return Placement(placement.src_rank[:, cols], placement.src_index[:, cols])


def plan_placement(costs, options: SolverOptions | None = None, *, sync: str | None = None,
                   balance_tolerance: float | None = None, ranks_per_node=None,
                   step_groups=None) -> Placement:
    """Place one global batch: the placement the runtime delivers for an all-gathered
    cost matrix, and the solver's one public entry.

    ``costs``: ``[D, G]`` non-negative integers (rank ``r``'s ``i``-th pack), or
    ``[D, G, 2]`` (vision, language) per pack: ``microstep`` mode then minimises the
    sum over micro-steps of both phases' maxima (:mod:`.two_phase`), ``step`` mode
    balances their sum. ``options``: a :class:`SolverOptions`; or the keywords
    ``sync`` (default ``microstep``), ``balance_tolerance`` (None: the default),
    ``ranks_per_node`` and ``step_groups`` (one per-micro-step meeting group label per
    rank, :class:`SolverOptions`), not both. The strategy for the costs, sync mode and
    groups, then :func:`order_steps`; the result is checked (:func:`check_placement`,
    O(D*G log(D*G))) before it is returned, so a solver bug surfaces here, the
    same on every rank, instead of as a lost pack.
    """
    if options is None:
        options = SolverOptions(
            sync="microstep" if sync is None else sync,
            balance_tolerance=DEFAULT_BALANCE_TOLERANCE if balance_tolerance is None
            else balance_tolerance,
            ranks_per_node=ranks_per_node, step_groups=step_groups)
    elif (sync is not None or balance_tolerance is not None or ranks_per_node is not None
          or step_groups is not None):
        raise ValueError("plan_placement takes options or the keywords sync, balance_tolerance, "
                         "ranks_per_node, step_groups, not both")
    c = as_cost_pairs(costs) if np.ndim(costs) == 3 else as_cost_matrix(costs)
    D = c.shape[0]
    groups = options.groups(D)                    # checks the labels against D
    if options.sync == "step" or groups is None:
        solved = _solve(c, replace(options, step_groups=None))
    elif int(groups.max()) + 1 == D:
        # Every rank its own group: nobody waits within an iteration, only rank totals count.
        solved = _solve(c, replace(options, sync="step", step_groups=None))
    else:
        solved = _solve_groups(c, options, groups)
    placement = order_steps(solved)
    check_placement(placement, *c.shape[:2])
    return placement


def _solve_groups(c: np.ndarray, opts: SolverOptions, groups: np.ndarray) -> Placement:
    """Several step groups of several ranks (:mod:`.group_placement`): which packs each group
    computes (few swaps between groups, :mod:`.group_exchange`), then each group's own
    micro-steps, slots and rank totals; never worse than today's placement of the batch
    under the group objective."""
    today = _solve(c, replace(opts, step_groups=None))
    return Placement(*place_in_groups(c, groups, opts.nodes(c.shape[0]), opts.balance_tolerance,
                                      today))


def _ratio(num, den) -> float:
    return float(num / den) if den else 1.0


@dataclass(frozen=True)
class PlanStats:
    """What one global batch's placement does: baseline and predicted costs, moved packs.

    Computed once, with the plan (:meth:`of`), from the integer cost matrix
    ``costs[r, m]`` (rank r's m-th pack, as drawn) and the placement; every
    consumer (runtime statistics, sampler mode, CLI, simulator, telemetry, the
    CPU demo) reads its figures from here. "before" is the order the packs were
    drawn in (no balancing), "after" the placement.
    """

    microstep_cost_before: int             #: sum over micro-steps of the slowest rank's cost
    microstep_cost_after: int
    microstep_optimum: int                 #: the least micro-step cost any placement reaches
    rank_total_max_before: int             #: the heaviest rank's total
    rank_total_max_after: int
    rank_total_mean: float                 #: mean rank total (the same before and after)
    step_max_before: tuple[int, ...]       #: per micro-step: the heaviest pack across ranks
    step_max_after: tuple[int, ...]
    step_mean_before: tuple[float, ...]    #: per micro-step: the mean pack cost across ranks
    step_mean_after: tuple[float, ...]
    packs_moved: int                       #: slots that compute a pack drawn by another rank
    num_packs: int                         #: D * G
    step_groups: int                       #: per-micro-step meeting groups (1: all ranks meet)
    group_cost_before: int                 #: the group objective (:mod:`.step_groups`)
    group_cost_after: int
    inter_group_moves: int                 #: slots computing a pack drawn in another step group
    inter_node_moves: int | None           #: ... drawn on another node (None: nodes unknown)

    @classmethod
    def of(cls, costs, placement: Placement, *, step_groups=None, nodes=None) -> "PlanStats":
        """The figures of ``placement`` on the scalar costs ``costs[r, m]``. ``step_groups``:
        each rank's per-micro-step meeting group label (None: all ranks meet every
        micro-step); ``nodes``: each rank's node label (None: unknown, no inter-node count)."""
        c = as_cost_matrix(costs)
        after = placement.apply(c)
        D = c.shape[0]
        groups = step_group_ids(D, step_groups)
        node = node_of_each_rank(D, check_ranks_per_node(None if nodes is None else list(nodes)))
        return cls(
            microstep_cost_before=microstep_objective(c),
            microstep_cost_after=microstep_objective(after),
            microstep_optimum=sorted_grouping_optimum(c),
            rank_total_max_before=int(c.sum(axis=1).max()),
            rank_total_max_after=int(after.sum(axis=1).max()),
            rank_total_mean=float(c.sum(axis=1).mean()),
            step_max_before=tuple(int(x) for x in c.max(axis=0)),
            step_max_after=tuple(int(x) for x in after.max(axis=0)),
            step_mean_before=tuple(float(x) for x in c.mean(axis=0)),
            step_mean_after=tuple(float(x) for x in after.mean(axis=0)),
            packs_moved=int(placement.moved().sum()),
            num_packs=int(c.size),
            step_groups=1 if groups is None else int(groups.max()) + 1,
            group_cost_before=group_objective(c, groups),
            group_cost_after=group_objective(after, groups),
            inter_group_moves=inter_group_packs(placement.src_rank, groups),
            inter_node_moves=None if node is None else inter_group_packs(placement.src_rank, node),
        )

    # -- ratios (1.0 = perfect balance) ------------------------------------------
    @property
    def microstep_ratio(self) -> float:
        """Micro-step cost over the mean rank total: the micro-step objective, normalised."""
        return _ratio(self.microstep_cost_after, self.rank_total_mean)

    @property
    def baseline_microstep_ratio(self) -> float:
        return _ratio(self.microstep_cost_before, self.rank_total_mean)

    @property
    def rank_ratio(self) -> float:
        """Heaviest rank total over the mean rank total."""
        return _ratio(self.rank_total_max_after, self.rank_total_mean)

    @property
    def baseline_rank_ratio(self) -> float:
        return _ratio(self.rank_total_max_before, self.rank_total_mean)

    @property
    def microstep_vs_optimum(self) -> float:
        return _ratio(self.microstep_cost_after, self.microstep_optimum)

    @property
    def moved_fraction(self) -> float:
        return _ratio(self.packs_moved, self.num_packs) if self.num_packs else 0.0

    @property
    def group_gain(self) -> float:
        """Group objective saved, as a fraction of the drawn order's (0 when nothing to gain)."""
        return (1.0 - _ratio(self.group_cost_after, self.group_cost_before)
                if self.group_cost_before else 0.0)

    @property
    def imbalance_before(self) -> float:
        """Mean over micro-steps of heaviest pack / mean pack (see :func:`step_imbalance`)."""
        return step_imbalance(self.step_max_before, self.step_mean_before)

    @property
    def imbalance_after(self) -> float:
        return step_imbalance(self.step_max_after, self.step_mean_before)

    @property
    def predicted_gain(self) -> float:
        """Micro-step cost saved, as a fraction of the baseline's (0 when nothing to gain)."""
        return (1.0 - _ratio(self.microstep_cost_after, self.microstep_cost_before)
                if self.microstep_cost_before else 0.0)

    # -- views ---------------------------------------------------------------------
    def metrics(self) -> dict:
        """The ratios :func:`evaluate` reports (the CLI's and the tests' view)."""
        return {
            "microstep_ratio": self.microstep_ratio,
            "rank_ratio": self.rank_ratio,
            "baseline_microstep_ratio": self.baseline_microstep_ratio,
            "baseline_rank_ratio": self.baseline_rank_ratio,
            "microstep_vs_optimum": self.microstep_vs_optimum,
            "moved": self.packs_moved,
            "moved_fraction": self.moved_fraction,
            "group_cost_ratio": _ratio(self.group_cost_after, self.rank_total_mean),
            "baseline_group_cost_ratio": _ratio(self.group_cost_before, self.rank_total_mean),
            "inter_group_moves": self.inter_group_moves,
            "inter_node_moves": self.inter_node_moves,
        }

    def record(self) -> dict:
        """The per-global-batch statistics record (runtime and sampler ``.stats`` entries)."""
        return {
            "microstep_cost_before": self.microstep_cost_before,
            "microstep_cost_after": self.microstep_cost_after,
            "rank_total_max_before": self.rank_total_max_before,
            "rank_total_max_after": self.rank_total_max_after,
            "rank_total_mean": self.rank_total_mean,
            "step_max_before": list(self.step_max_before),
            "step_max_after": list(self.step_max_after),
            "step_mean_before": list(self.step_mean_before),
            "step_mean_after": list(self.step_mean_after),
            "packs_moved": self.packs_moved,
            "step_groups": self.step_groups,
            "group_cost_before": self.group_cost_before,
            "group_cost_after": self.group_cost_after,
            "inter_group_moves": self.inter_group_moves,
            "inter_node_moves": self.inter_node_moves,
        }


def step_imbalance(step_max, step_mean) -> float:
    """Mean over micro-steps of ``step_max[m] / step_mean[m]`` (steps with mean 0 skipped;
    1.0 when none is left): how much the slowest rank exceeds the average, per micro-step."""
    ratios = [m / a for m, a in zip(step_max, step_mean) if a]
    return sum(ratios) / len(ratios) if ratios else 1.0
