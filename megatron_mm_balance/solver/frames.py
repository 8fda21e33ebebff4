"""Which rank encodes which frame, planned from where the frames are.

A Qwen-VL vision tower attends inside each frame (temporal patch) only, so the frames of
one micro-step may be encoded on any data-parallel rank and their embeddings returned to
the rank that computes the pack. :func:`plan_frames` decides where, on the same
all-gathered integers on every rank.

**Load model.** Rank ``r``'s load is the cost of the units it encodes plus the transfer
time of the units it receives: moving unit ``i`` from ``s`` to ``r`` takes ``cost[i]``
off ``s`` and puts ``cost[i] + transfer[i]`` on ``r`` (the receiver waits for the
unit; the sender's send is asynchronous). The micro-step's vision time is the largest
load.

**Target.** No placement ends below the lower bound ``LB = max(ceil(total / D), max
cost)``, but with whole units (and transfers, and the patch cap) ``LB`` is often out of
reach: with ``D * LB - total < D`` of slack the receivers can only take units that fill
them exactly, and a rank whose excess is smaller than its lightest unit must still move
a whole one. The plan uses the *reachable level*: the smallest ``T`` in ``[LB, max
before]`` at which the level plan below brings every rank to ``T`` or under, found by
bisection to within ``max(1, T / 1024)`` (0.1%). ``T = LB`` when that holds; ``LB + max
cost`` is tried before bisecting (it always holds without cap and transfers, so the
plan's max is then within the LPT bound); ``T = max before`` and nothing moves when
nothing lower holds. The least cost any plan reaching ``T`` must move is at least the
excess ``sum_r max(0, load_r - T)`` (``FramePlan.min_moved_cost``) and, with whole
units, at least ``FramePlan.min_cover_cost``: per rank above ``T``, the least sum of a
subset of its units that can move at all covering its excess (exact subset sums,
:func:`cover_lower_bound`). That minimum is certified but not always reachable at ``T``
(the receivers' slack and patch room may not hold the ranks' cheapest covers together);
:mod:`.frames_exact` gives the exact least cost on small instances.

**The level plan at T**, from where the units are:

* *donors* (load above ``T``) each choose units covering their excess ``e = load - T``
  with the least cost they can: the smaller of the smallest single unit ``>= e`` and the
  greedy cover (repeatedly the largest unit that still fits in what is left of ``e``,
  then the smallest unit covering the rest, then dropping any unit the cover does not
  need and trading a unit for a lighter one that still covers). Zero-cost units never
  move;
* the chosen units go to *receivers* (load below ``T``): each to the receiver with the
  least slack that still holds ``cost + transfer`` within ``T`` and whose patches stay
  within ``patch_cap`` (best fit; ties by rank), all donors' units together heaviest
  first (best fit decreasing), or, if that leaves a donor above ``T``, donor by donor,
  heaviest donor first;
* a donor whose unit fits nowhere covers the rest of its excess with other units, and
  only what no receiver takes as it is goes to the receiver with the most slack after
  that receiver has sent some of its own units to others (it *makes room*): the units
  covering its shortfall of slack and of patch room most cheaply (the least cost per
  patch first while patches are short, then a cheap cover of the slack still short);
* a donor that still cannot cover its excess fails the level (the search goes higher).

The search runs these plain level plans. At the level found the plain plan is often at
the edge of what it can do: a donor whose cheap cover fits nowhere covers its excess again
with whatever fits, which may cost far more than a cover a rank can make room for; and
the greedy cover itself may overshoot (it takes the largest unit that fits first). So the
plan kept is the cheapest of the search's and two *weighed* level plans at the same ``T``
(together and donor by donor; and the plain one donor by donor when the search's placed
the covers together and one did not fit as chosen). A weighed plan's donors cover with
the cheapest of the greedy cover and the greedy covers without one of the
``COVER_SKIPS`` largest units (:func:`_cheap_cover`). A donor whose unit fits nowhere
tries each way and keeps the cheapest (each tried, then undone): covering again without
the units that fit nowhere; placing them where a rank makes room first (the cheapest of
the ``ROOM_TRIES`` ranks with the most slack); covering again without its ``1 ..
LEAVE_OUT`` heaviest units too (medium units a rank can make room for cheaply may beat a
cheap cover whose large unit needs a lot of room). And a donor that has shed more than
its excess takes units too, within what it shed beyond it (so a rank making room may
send a unit back to the rank whose unit it takes: a swap). The level stays the plain
plan's (where donors never take units): the weighed plans change what moves, not the
level every rank is brought to.

Finally every move whose sender no longer needs it (taking it back keeps the sender at
``T`` or under, and a sender that receives within the patch cap) is taken back, heaviest
first. So every rank ends at ``T`` or under, transfers included; every move is needed
(taking it back would put its sender above ``T``, or a sender that receives above the
patch cap) and lowers the larger of its two ranks' loads, or serves, through a receiver
that made room, a move from a rank above ``T``: no move costs more than it saves. The
largest load never rises, a balanced micro-step moves nothing, and no receiving rank
ends above the patch cap.

Integer arithmetic, stable orders and ties by rank and unit index: the same plan for the
same input, on every rank. ``FramePlan.greedy_moved_cost`` / ``greedy_max`` give a plain
greedy least-loaded assignment from scratch (every unit, heaviest first, to the least
loaded rank, wherever it started; VeOmni's scheme) as a reference, computed on first
access, as is ``min_cover_cost``. Cost: a few level plans of ``O(moves log D)`` Python
steps (the search's, and two or three more at the level found); measured by
``benchmarks/bench_frame_plan.py`` (docs/notes/2026-12-02-frame-planner.md).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass, field
from functools import cached_property, cmp_to_key
import heapq
from itertools import islice

import numpy as np

#: The level search stops when its bracket is this fraction of the level (or 1).
LEVEL_RESOLUTION = 1024
#: Rounds of the cover's one-for-one trades (each trade only lowers its overshoot).
SWAP_ROUNDS = 2
#: The largest units a weighed plan's cover is also tried without (:func:`_cheap_cover`).
COVER_SKIPS = 3


@dataclass(frozen=True, eq=False)
class FramePlan:
    """The encoder rank of every unit and what the plan costs and reaches.

    Loads include the transfer time of received units (module docstring)."""

    encoder: np.ndarray           # int64, the rank that encodes unit i
    target: int                   # the level every rank was brought to (or under)
    lower_bound: int              # max(ceil(total / D), max cost): no plan ends below it
    max_before: int
    max_after: int
    moved_units: int
    moved_patches: int
    moved_cost: int               # sum of cost over moved units (transfers excluded)
    moved_transfer: int           # sum of transfer over moved units
    min_moved_cost: int           # sum over ranks of max(0, load - target)
    _inputs: tuple = field(default=(), repr=False, compare=False)

    @property
    def moved_over_min(self) -> float:
        """Moved cost over the minimum needed (1.0 when nothing had to move)."""
        return self.moved_cost / self.min_moved_cost if self.min_moved_cost else 1.0

    @cached_property
    def min_cover_cost(self) -> int:
        """A certified lower bound on the cost any plan reaching ``target`` moves with whole
        units: per rank above the target, the least a subset of its movable units covering
        its excess costs (:func:`cover_lower_bound`). Computed on first access."""
        owner, cost, transfer, D, patches, cap = self._inputs
        return cover_lower_bound(owner, cost, D, self.target, transfer=transfer, patches=patches,
                                 patch_cap=cap)

    @property
    def moved_over_cover(self) -> float:
        """Moved cost over :attr:`min_cover_cost` (1.0 when nothing had to move)."""
        return self.moved_cost / self.min_cover_cost if self.min_cover_cost else 1.0

    @cached_property
    def _greedy(self) -> tuple[int, int]:
        owner, cost, transfer, D = self._inputs[:4]
        enc = greedy_assignment(cost, D)
        moved = enc != owner
        load = _rank_sums(enc, cost + np.where(moved, transfer, 0), D)
        return int(cost[moved].sum()), int(load.max()) if D else 0

    @property
    def greedy_moved_cost(self) -> int:
        """Cost a from-scratch greedy least-loaded assignment moves (reference)."""
        return self._greedy[0]

    @property
    def greedy_max(self) -> int:
        """The largest load of that greedy assignment, transfers of its moves included."""
        return self._greedy[1]

    def metrics(self) -> dict:
        """The plan's figures as plain ints and floats (reports, logs)."""
        return {"target": self.target, "lower_bound": self.lower_bound,
                "max_before": self.max_before, "max_after": self.max_after,
                "moved_units": self.moved_units, "moved_patches": self.moved_patches,
                "moved_cost": self.moved_cost, "moved_transfer": self.moved_transfer,
                "min_moved_cost": self.min_moved_cost, "moved_over_min": self.moved_over_min,
                "min_cover_cost": self.min_cover_cost, "moved_over_cover": self.moved_over_cover,
                "greedy_moved_cost": self.greedy_moved_cost, "greedy_max": self.greedy_max}


def _int_array(values, name: str, n: int | None) -> np.ndarray:
    a = np.asarray(values)
    if a.ndim != 1:
        raise ValueError(f"plan_frames: {name} must be a 1-D sequence, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise ValueError(f"plan_frames: {name} must be integers, got dtype {a.dtype}")
    if n is not None and len(a) != n:
        raise ValueError(f"plan_frames: {name} has {len(a)} entries for {n} units")
    a = a.astype(np.int64)
    if a.size and a.min() < 0:
        raise ValueError(f"plan_frames: {name} must be >= 0, got {int(a.min())} "
                         f"at unit {int(np.argmin(a))}")
    return a


def _validate(owner, cost, num_ranks, patches, patch_cap, transfer):
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"plan_frames: num_ranks must be an integer >= 1, got {num_ranks!r}")
    D = int(num_ranks)
    cost = _int_array(cost, "cost", None)
    n = len(cost)
    owner = _int_array(owner, "owner", n)
    if n and owner.max() >= D:
        raise ValueError(f"plan_frames: owner {int(owner.max())} of unit {int(np.argmax(owner))} "
                         f"is not a rank in [0, {D})")
    patches = np.ones(n, dtype=np.int64) if patches is None else _int_array(patches, "patches", n)
    transfer = np.zeros(n, dtype=np.int64) if transfer is None else _int_array(transfer, "transfer", n)
    if patch_cap is not None:
        if isinstance(patch_cap, bool) or not isinstance(patch_cap, (int, np.integer)) or patch_cap < 0:
            raise ValueError(f"plan_frames: patch_cap must be an integer >= 0 or None, got {patch_cap!r}")
        patch_cap = int(patch_cap)
    return D, owner, cost, patches, patch_cap, transfer


def _rank_sums(rank: np.ndarray, values: np.ndarray, D: int) -> np.ndarray:
    """Exact int64 per-rank sums (``bincount`` would go through float64)."""
    out = np.zeros(D, dtype=np.int64)
    np.add.at(out, rank, values)
    return out


def default_patch_cap(owner, patches, num_ranks: int) -> int:
    """The glue's default cap: the most patches any rank held before balancing."""
    owner = np.asarray(owner, dtype=np.int64)
    patches = np.asarray(patches, dtype=np.int64)
    return int(_rank_sums(owner, patches, int(num_ranks)).max()) if len(owner) else 0


def cover_lower_bound(owner, cost, num_ranks: int, target: int, *, transfer=None, patches=None,
                      patch_cap=None) -> int:
    """Least cost any plan that brings every rank to ``target`` or under must move, as a
    certified lower bound (:attr:`FramePlan.min_cover_cost`): the sum over ranks above
    the target of the least cost a subset of their units that can move at all adds up to
    while covering the excess ``e`` (a unit moves only if ``cost + transfer <=
    target`` and, under a patch cap, its patches fit the cap), exact by subset sums
    (:func:`min_cover`); for a rank whose subset sums outgrow ``COVER_STATES``, the
    weaker bound: ``e``, or its lightest unit of at least ``e`` when its lighter units
    add up to less (any cover then holds one)."""
    owner = np.asarray(owner, dtype=np.int64)
    cost = np.asarray(cost, dtype=np.int64)
    D, target = int(num_ranks), int(target)
    excess = np.maximum(_rank_sums(owner, cost, D) - target, 0)
    movable = cost + (0 if transfer is None else np.asarray(transfer, dtype=np.int64)) <= target
    if patch_cap is not None:
        movable &= (np.ones_like(cost) if patches is None else np.asarray(patches)) <= int(patch_cap)
    total = 0
    for r in np.flatnonzero(excess).tolist():
        e = int(excess[r])
        units = np.sort(cost[(owner == r) & movable])
        exact = min_cover(units, e)
        if exact is not None:
            total += exact
            continue
        k = int(np.searchsorted(units, e))                      # first unit >= e
        total += e if int(units[:k].sum()) >= e or k == len(units) else int(units[k])
    return total


#: Subset sums :func:`min_cover` keeps before it gives up (the bound then falls back).
COVER_STATES = 1 << 15


def min_cover(costs, need: int) -> int | None:
    """The least sum ``>= need`` of a subset of ``costs`` (integers >= 0), exactly: the
    subset sums below ``need`` that can still reach it, heaviest unit first; ``None`` if
    they outgrow :data:`COVER_STATES` or no subset reaches ``need``."""
    c = np.sort(np.asarray(costs, dtype=np.int64))[::-1]
    rest = np.concatenate([np.cumsum(c[::-1])[::-1], [0]])      # rest[i]: sum of c[i:]
    if need <= 0:
        return 0
    if rest[0] < need:
        return None
    best, states = int(rest[0]), np.zeros(1, dtype=np.int64)
    for i, ci in enumerate(c.tolist()):
        new = states + ci
        hit = new >= need
        if hit.any():
            best = min(best, int(new[hit].min()))
        states = np.union1d(states, new[~hit])
        states = states[states + rest[i + 1] >= need]           # those that can still cover
        if len(states) > COVER_STATES:
            return None
        if best == need or not len(states):
            break
    return best


def greedy_assignment(cost, num_ranks: int) -> np.ndarray:
    """A plain greedy from scratch (the reference): units by cost descending (ties by
    index), each to the least-loaded rank (ties by rank), wherever it started."""
    cost = np.asarray(cost, dtype=np.int64)
    enc = np.zeros(len(cost), dtype=np.int64)
    heap = [(0, r) for r in range(int(num_ranks))]
    for i in np.lexsort((np.arange(len(cost)), -cost)).tolist():
        load, r = heap[0]
        enc[i] = r
        heapq.heapreplace(heap, (load + int(cost[i]), r))
    return enc


def _cover(costs: list, need: int) -> list:
    """Positions in ``costs`` (ascending) of a cheap subset whose sum is at least ``need``,
    in descending order (see the module docstring); [] if the whole list is short of it."""
    n = len(costs)
    picks, rem, hi = [], need, n
    while rem > 0:                               # the largest unit that fits what is left
        j = bisect_right(costs, rem, 0, hi) - 1
        if j < 0:
            break
        picks.append(j)
        rem -= costs[j]
        hi = j
    if rem > 0:                                  # the smallest unit covering the rest
        taken, rest = set(picks), 0
        while rest < n and rest in taken:
            rest += 1
        if rest == n:
            return []
        picks.append(rest)
        picks.sort(reverse=True)
    total = sum(costs[j] for j in picks)
    for j in list(picks):                        # drop what the cover does not need
        if total - costs[j] >= need:
            picks.remove(j)
            total -= costs[j]
    for _ in range(SWAP_ROUNDS):                 # trade one unit for a lighter one that still covers
        over, best, taken = total - need, None, set(picks)
        for j in picks:
            k = bisect_left(costs, costs[j] - over)
            while k < j and k in taken:
                k += 1
            if k < j and costs[k] < costs[j] and (best is None or costs[j] - costs[k] > best[0]):
                best = (costs[j] - costs[k], j, k)
        if best is None:
            break
        picks[picks.index(best[1])] = best[2]
        picks.sort(reverse=True)
        total -= best[0]
    single = bisect_left(costs, need)
    if single < n and costs[single] <= total:
        return [single]
    return picks


def _cheap_cover(costs: list, need: int) -> list:
    """The cheapest of :func:`_cover` and its covers without one of the ``COVER_SKIPS``
    largest units within ``need`` (the greedy takes the largest unit that fits first,
    which may leave a rest only a large unit covers: 66.9M + 42.6M for 91.7M, where
    46.6M + 42.6M + 1.6M + 1.0M covers it exactly)."""
    best = _cover(costs, need)
    if not best:
        return best
    total = sum(costs[j] for j in best)
    top = bisect_right(costs, need)
    for j in range(top - 1, max(-1, top - 1 - COVER_SKIPS), -1):
        if total == need:
            break
        rest = costs[:j] + costs[j + 1:]
        picks = _cover(rest, need)
        t = sum(rest[k] for k in picks)
        if picks and t < total:
            best, total = [k if k < j else k + 1 for k in picks], t
    return sorted(best, reverse=True)


class _Receivers:
    """Every rank's slack (``T - load``, negative above the level) and patch room; those
    with slack by slack: the best fit for a unit, the patch cap respected; charges can be
    given back (the plan's undo)."""

    def __init__(self, ranks, slack, room, closed=frozenset()):
        self.slack = dict(zip(ranks, slack))
        self.room = room                        # patches each rank may still take (None: no cap)
        self.closed = closed                    # ranks that never receive
        self.free = sorted((x, r) for r, x in self.slack.items() if x > 0 and r not in closed)

    def hold(self, r: int) -> None:
        """Take ``r`` out of the choice (it is making room)."""
        if self.slack[r] > 0 and r not in self.closed:
            del self.free[bisect_left(self.free, (self.slack[r], r))]

    def release(self, r: int) -> None:
        """Put ``r`` back into the choice, at its current slack."""
        if self.slack[r] > 0 and r not in self.closed:
            insort(self.free, (self.slack[r], r))

    def charge(self, r: int, size: int, patches: int) -> None:
        """Rank ``r`` takes ``size`` of load and ``patches`` (negative: gives them back)."""
        self.hold(r)
        self.slack[r] -= size
        if self.room is not None:
            self.room[r] -= patches
        self.release(r)

    def room_for(self, r: int, patches: int) -> bool:
        return self.room is None or self.room[r] >= patches

    def take(self, size: int, patches: int):
        """The rank with the least slack >= ``size`` and room for ``patches``, charged; or None."""
        free = self.free
        i = bisect_left(free, (size, -1))
        while i < len(free):
            r = free[i][1]
            if self.room_for(r, patches):
                self.charge(r, size, patches)
                return r
            i += 1
        return None


@dataclass(frozen=True)
class _Units:
    """Every rank's movable units (cost > 0), cost ascending, as Python lists for the
    level plans: ``ids[starts[r]:starts[r + 1]]`` and their ``costs``; ``owner`` and
    ``cost`` by unit index."""

    ids: list
    costs: list
    starts: list
    owner: list
    cost: list
    transfer: list | None        # None: no unit has a transfer time
    patches: list | None         # None: no patch cap

    def size(self, u: int) -> int:
        """What unit ``u`` weighs on the rank that receives it."""
        return self.cost[u] + (self.transfer[u] if self.transfer else 0)

    def pat(self, u: int) -> int:
        return self.patches[u] if self.patches else 0


#: Ranks tried for making room per placement (the most slack first).
ROOM_TRIES = 4
#: The most heaviest units a weighed plan's donor leaves out when it covers its excess again.
LEAVE_OUT = 2


class _LevelPlan:
    """The moves that bring every rank to ``T`` or under (module docstring)."""

    def __init__(self, T: int, load: np.ndarray, units: _Units, room0, *, rich: bool = False):
        self.T, self.load, self.units, self.rich = T, load, units, rich
        self.recv = _Receivers(range(len(load)), (T - load).tolist(),
                               None if room0 is None else room0.tolist(),
                               frozenset() if rich else frozenset(np.flatnonzero(load > T).tolist()))
        self.moves = {}                              # unit -> rank that encodes it
        self.got = [0] * len(load)                   # units each rank receives
        self.cost = 0                                # cost of every move
        self.short = False                           # a donor's cover did not fit as chosen
        self.log = []                                # (unit, rank, put): what trials undo

    # -- bookkeeping ------------------------------------------------------------------
    def _record(self, u: int, r: int) -> None:
        """Unit ``u``, charged to ``r``, leaves its rank."""
        u_ = self.units
        self.moves[u] = r
        self.got[r] += 1
        self.recv.charge(u_.owner[u], -u_.cost[u], -u_.pat(u))
        self.cost += u_.cost[u]
        self.log.append((u, r, True))

    def place(self, u: int) -> bool:
        """Unit ``u`` to the best-fitting receiver, as it is."""
        r = self.recv.take(self.units.size(u), self.units.pat(u))
        if r is None:
            return False
        self._record(u, r)
        return True

    def put(self, u: int, r: int) -> None:
        """Unit ``u`` to receiver ``r`` (the caller checked that it fits)."""
        self.recv.charge(r, self.units.size(u), self.units.pat(u))
        self._record(u, r)

    def take_back(self, u: int, *, log: bool = True) -> None:
        u_ = self.units
        r = self.moves.pop(u)
        self.got[r] -= 1
        self.recv.charge(r, -u_.size(u), -u_.pat(u))
        self.recv.charge(u_.owner[u], u_.cost[u], u_.pat(u))
        self.cost -= u_.cost[u]
        if log:
            self.log.append((u, r, False))

    def _rollback(self, mark: int) -> None:
        """Undo every move and take-back since ``mark`` (a length of the log)."""
        while len(self.log) > mark:
            u, r, was_put = self.log.pop()
            if was_put:
                self.take_back(u, log=False)
            else:
                self.put(u, r)
                self.log.pop()

    def cover(self, costs: list, need: int) -> list:
        """A cheap cover of ``need`` (:func:`_cover`; :func:`_cheap_cover` when ``rich``)."""
        return _cheap_cover(costs, need) if self.rich else _cover(costs, need)

    def need(self, s: int) -> int:
        """What rank ``s`` still has to shed to reach ``T`` (negative: its slack)."""
        return -self.recv.slack[s]

    def home(self, s: int, skip=()) -> tuple[list, list]:
        """Donor ``s``'s units still at home (not in ``skip``), cost ascending."""
        u_ = self.units
        a, b = u_.starts[s], u_.starts[s + 1]
        pairs = [(u, c) for u, c in zip(u_.ids[a:b], u_.costs[a:b])
                 if u not in self.moves and u not in skip]
        return [u for u, _ in pairs], [c for _, c in pairs]

    def trim(self, s: int) -> None:
        """Take back, heaviest first, what donor ``s`` sends beyond its excess (within the
        patch cap if it receives)."""
        u_, recv = self.units, self.recv
        a, b = u_.starts[s], u_.starts[s + 1]
        for u in sorted((u for u in u_.ids[a:b] if u in self.moves), key=lambda u: (-u_.cost[u], u)):
            if u_.cost[u] <= recv.slack[s] and (not self.got[s] or recv.room_for(s, u_.pat(u))):
                self.take_back(u)

    # -- the plan ---------------------------------------------------------------------
    def run(self, donors: list, *, together: bool) -> bool:
        """Every donor (load above ``T``) sheds a cheap cover of its excess; False if one
        cannot. ``together``: the covers are placed together, heaviest unit first (best
        fit decreasing: large units take the large holes before small units split them);
        else donor by donor, heaviest donor first. A donor whose unit fits nowhere then
        covers the rest of its excess (:meth:`finish`)."""
        u_, T = self.units, self.T
        self.together = together
        donors = [s for s in donors if self.load[s] > T]
        covers = {}
        for s in donors:
            a, b = u_.starts[s], u_.starts[s + 1]
            covers[s] = [u_.ids[a + j] for j in self.cover(u_.costs[a:b], self.need(s))]
        short = {}
        if together:
            for u in sorted((u for s in donors for u in covers[s]), key=lambda u: (-u_.size(u), u)):
                if not self.place(u):
                    short.setdefault(u_.owner[u], []).append(u)
            return all(self.finish(s, short[s]) for s in donors if s in short)
        for s in donors:
            for u in covers[s]:
                if not self.place(u):
                    if not self.finish(s, [u]):
                        return False
                    break
        return True

    def finish(self, s: int, stuck: list) -> bool:
        """Donor ``s``, some of whose cover fit nowhere, covers the rest of its excess: by
        covering it again without the units that fit nowhere (a plain plan), or the
        cheapest of that, placing those units where a rank makes room first, and covering
        it again without its ``k <= LEAVE_OUT`` heaviest units (``rich``,
        :meth:`_complete`; each tried, then undone)."""
        self.short = True
        if not self.rich:
            return self._complete(s, stuck, 0)
        mark, cost0, best = len(self.log), self.cost, None
        for way in range(-1, LEAVE_OUT + 1):
            if self._complete(s, stuck, way) and (best is None or self.cost - cost0 < best[0]):
                best = (self.cost - cost0, way)
            self._rollback(mark)
        return best is not None and self._complete(s, stuck, best[1])

    def _complete(self, s: int, stuck: list, way: int) -> bool:
        """One way of :meth:`finish`. ``way`` -1: the units that fit nowhere are placed
        first, each where a rank makes room, then the rest of the excess is covered with
        units that fit as they are, else with a rank making room; 0: covered again
        without the units that fit nowhere, else with a rank making room for any unit;
        ``k > 0``: both without them and without the ``k`` heaviest units at home."""
        if way < 0:
            for u in sorted(stuck, key=lambda u: (-self.units.cost[u], u)):
                if self.need(s) > 0 and not self.make_room(u):
                    return False
            need = self._shed(*self.home(s), self.need(s), room=False)
            left = ()
        else:
            left = set(stuck)
            if way:
                ids = self.home(s)[0]
                left.update(ids[max(0, len(ids) - way):])
            need = self._shed(*self.home(s, left), self.need(s), room=False)
            left = left if way else ()
        if need > 0:
            need = self._shed(*self.home(s, left), need, room=True)
        if need > 0:
            return False
        self.trim(s)                  # a later round may have covered what an earlier unit was moved for
        return True

    def _shed(self, ids: list, costs: list, need: int, *, room: bool) -> int:
        """Cover rounds over ``ids`` (cost ascending; both lists shrink in place as units
        move or fit nowhere), each unit placed as it is or, ``room``, where a receiver
        makes room: the need left."""
        while need > 0:
            picks = self.cover(costs, need)
            if not picks:
                break
            placed = 0
            for j in picks:                                   # heaviest first
                u = ids[j]
                if not (self.place(u) or (room and self.make_room(u))):
                    break
                need -= costs[j]
                placed += 1
            gone = set(picks[:placed + 1])                    # placed, and the one that fits nowhere
            ids[:] = [u for j, u in enumerate(ids) if j not in gone]
            costs[:] = [c for j, c in enumerate(costs) if j not in gone]
        return need

    def make_room(self, u: int) -> bool:
        """Place unit ``u``, which no rank takes as it is, on a rank after that rank sends
        some of its own units to the others (best fit; the rank ``u`` leaves among them):
        the units that cover its shortfall of slack and of patch room most cheaply
        (:func:`_room_cover`). Ranks are tried most slack first (``ROOM_TRIES`` of them;
        the first only in a plain plan), and the cheapest that works is kept; nothing
        changes if none does."""
        recv, u_ = self.recv, self.units
        s = u_.owner[u]
        tries = ROOM_TRIES if self.rich else 1
        ranks = list(islice((r for _, r in reversed(recv.free) if r != s), tries))
        best, mark = None, len(self.log)
        for r in ranks:
            if best is not None and best[0] == 0:
                break
            cost0 = self.cost
            if self._room_on(r, u):
                if best is None or self.cost - cost0 < best[0]:
                    best = (self.cost - cost0, r)
                self._rollback(mark)
        return best is not None and self._room_on(best[1], u)

    def _room_on(self, r: int, u: int) -> bool:
        """Rank ``r`` sends units covering what it lacks of slack and of patch room for
        unit ``u`` to the others, then takes ``u``; False (nothing changed) if they do
        not all fit."""
        recv, u_ = self.recv, self.units
        size, pat, s = u_.size(u), u_.pat(u), u_.owner[u]
        home, costs = self.home(r)
        lack = 0 if recv.room is None else max(0, pat - recv.room[r])
        picks = _room_cover(costs, [u_.pat(v) for v in home], size - recv.slack[r], lack)
        if not picks:
            return False
        recv.hold(r)
        recv.charge(s, -u_.cost[u], -pat)        # u leaves s first: s may take r's units
        targets = []
        for j in picks:                          # heaviest first, best fit among the others
            r2 = recv.take(u_.size(home[j]), u_.pat(home[j]))
            if r2 is None:
                break
            targets.append((home[j], r2))
        for v, r2 in targets:
            recv.charge(r2, -u_.size(v), -u_.pat(v))
        recv.charge(s, u_.cost[u], pat)
        recv.release(r)
        if len(targets) < len(picks):
            return False
        for v, r2 in targets:
            self.put(v, r2)                      # credits r with v's cost and patches
        self.put(u, r)
        return True


def _room_cover(costs: list, pats: list, short: int, lack: int) -> list:
    """Positions (descending) of units with costs summing to at least ``short`` and
    patches to at least ``lack``, cheaply: the fewest-cost-per-patch units until the
    patches are covered, then a cheap cover (:func:`_cover`) of the cost still short,
    then dropping, heaviest first, what neither sum needs; [] if the units fall short."""
    n = len(costs)
    picks = set()
    if lack > 0:
        got = 0
        per_patch = cmp_to_key(lambda i, j: costs[i] * pats[j] - costs[j] * pats[i] or i - j)
        for j in sorted((j for j in range(n) if pats[j] > 0), key=per_patch):
            if got >= lack:
                break
            picks.add(j)
            got += pats[j]
        if got < lack:
            return []
    rest = short - sum(costs[j] for j in picks)
    if rest > 0:
        others = [j for j in range(n) if j not in picks]
        more = _cover([costs[j] for j in others], rest)
        if not more:
            return []
        picks.update(others[k] for k in more)
    c, q = sum(costs[j] for j in picks), sum(pats[j] for j in picks)
    for j in sorted(picks, reverse=True):
        if c - costs[j] >= short and q - pats[j] >= lack:
            picks.discard(j)
            c -= costs[j]
            q -= pats[j]
    return sorted(picks, reverse=True)


def _drop_unneeded(moves: dict, T: int, owner, cost, patches, transfer, cap, D: int) -> dict:
    """Take back, heaviest first, every move its sender no longer needs: a receiver that
    made room may have got slack back when a donor took back a unit it had covered
    twice. Every rank stays at ``T`` or under and within the patch cap."""
    enc = owner.copy()
    units = np.fromiter(moves.keys(), dtype=np.int64, count=len(moves))
    enc[units] = np.fromiter(moves.values(), dtype=np.int64, count=len(moves))
    moved = enc != owner
    load = _rank_sums(enc, cost + np.where(moved, transfer, 0), D).tolist()
    pat = _rank_sums(enc, patches, D).tolist()
    received = np.bincount(enc[moved], minlength=D).tolist()
    changed = True
    while changed:
        changed = False
        for u in sorted(moves, key=lambda u: (-int(cost[u]), u)):
            s, r, c = int(owner[u]), moves[u], int(cost[u])
            if load[s] + c > T or (cap is not None and received[s] and pat[s] + int(patches[u]) > cap):
                continue
            del moves[u]
            load[s] += c
            load[r] -= c + int(transfer[u])
            pat[s] += int(patches[u])
            pat[r] -= int(patches[u])
            received[r] -= 1
            changed = True
    return moves


def _by_rank_then_cost(owner: np.ndarray, cost: np.ndarray, D: int) -> np.ndarray:
    """Unit indices by rank, then cost ascending, then index: a stable sort of one int64
    key when it fits (fast when the units come grouped by rank, as gathered), else
    ``lexsort``; the same permutation either way."""
    width = int(cost.max()) + 1 if len(cost) else 1
    if width * D < 1 << 62:
        return np.argsort(owner * width + cost, kind="stable")
    return np.lexsort((cost, owner))


def _level_plan(T: int, load: np.ndarray, donors: list, units: _Units, room0):
    """The plain level plan that brings every rank to ``T`` or under (together, else
    donor by donor), or None."""
    for together in (True, False):
        plan = _LevelPlan(T, load, units, room0)
        if plan.run(donors, together=together):
            return plan
    return None


def _cheapest_plan(T: int, load: np.ndarray, donors: list, units: _Units, room0, found, drop) -> dict:
    """The cheapest of the level plans at ``T`` after :func:`_drop_unneeded` (``drop``):
    the search's (``found``), the ``rich`` ones together and donor by donor
    (:class:`_LevelPlan`) and, when some donor's cover did not fit as chosen in
    ``found`` and it placed them together, the plain one donor by donor."""
    best = drop(found.moves)
    best_cost = sum(units.cost[u] for u in best)
    ways = ([(False, False)] if found.short and found.together else []) + [(True, True), (True, False)]
    for rich, together in ways:
        plan = _LevelPlan(T, load, units, room0, rich=rich)
        if plan.run(donors, together=together):
            moves = drop(plan.moves)
            c = sum(units.cost[u] for u in moves)
            if c < best_cost:
                best, best_cost = moves, c
    return best


def _search_level(lb: int, max_before: int, max_cost: int, args: tuple):
    """The reachable level and the plain plan found there (None: nothing moves): ``lb``
    if it holds, else bisection between the last level that fails and the first that
    holds, to within ``max(1, T / LEVEL_RESOLUTION)``; ``lb + max_cost`` is tried first
    (it holds without cap and transfers: the LPT bound)."""
    found = _level_plan(lb, *args)
    if found is not None:
        return lb, found
    lo, hi = lb, max_before                           # lo fails, hi holds (nothing moves)
    if lb + max_cost < max_before:
        found = _level_plan(lb + max_cost, *args)
        if found is None:
            lo = lb + max_cost
        else:
            hi = lb + max_cost
    while hi - lo > max(1, lo // LEVEL_RESOLUTION):
        mid = (lo + hi) // 2
        plan = _level_plan(mid, *args)
        if plan is None:
            lo = mid
        else:
            found, hi = plan, mid
    return hi, found


def plan_frames(owner, cost, num_ranks, *, patches=None, patch_cap=None, transfer=None) -> FramePlan:
    """The encoder rank of every unit (frame) of one micro-step; see the module docstring.

    ``owner[i]``: the rank holding unit ``i``; ``cost[i]``: its compute cost, an integer
    >= 0; ``patches[i]``: its activation-memory proxy (default 1 per unit);
    ``patch_cap``: the most patches a receiving rank may end with (default: no cap; the
    glue passes :func:`default_patch_cap`); ``transfer[i]``: the integer time moving it
    costs the receiver, in the units of ``cost`` (default 0). Bad input raises one
    ``ValueError`` line naming it."""
    D, owner, cost, patches, patch_cap, transfer = _validate(owner, cost, num_ranks, patches,
                                                            patch_cap, transfer)
    n = len(cost)
    load = _rank_sums(owner, cost, D)
    max_before = int(load.max())
    total = int(load.sum())
    lb = max(-(-total // D), int(cost.max()) if n else 0)
    inputs = (owner, cost, transfer, D, patches, patch_cap)
    moves = {}
    target = max_before
    if max_before > lb and D > 1:
        room0 = None if patch_cap is None else patch_cap - _rank_sums(owner, patches, D)
        order = _by_rank_then_cost(owner, cost, D)
        order = order[cost[order] > 0]                            # zero-cost units never move
        units = _Units(order.tolist(), cost[order].tolist(),
                       np.searchsorted(owner[order], np.arange(D + 1)).tolist(),
                       owner.tolist(), cost.tolist(),
                       transfer.tolist() if transfer.any() else None,
                       None if room0 is None else patches.tolist())
        donors = np.lexsort((np.arange(D), -load)).tolist()
        args = (load, donors, units, room0)
        target, found = _search_level(lb, max_before, int(cost.max()), args)
        if found is not None:
            moves = _cheapest_plan(target, *args, found, lambda m: _drop_unneeded(
                m, target, owner, cost, patches, transfer, patch_cap, D))
    enc = owner.copy()
    if moves:
        units = np.fromiter(moves.keys(), dtype=np.int64, count=len(moves))
        enc[units] = np.fromiter(moves.values(), dtype=np.int64, count=len(moves))
    moved = enc != owner
    after = _rank_sums(enc, cost + np.where(moved, transfer, 0), D)
    return FramePlan(
        encoder=enc, target=int(target), lower_bound=int(lb), max_before=max_before,
        max_after=int(after.max()), moved_units=int(moved.sum()),
        moved_patches=int(patches[moved].sum()), moved_cost=int(cost[moved].sum()),
        moved_transfer=int(transfer[moved].sum()),
        min_moved_cost=int(np.maximum(load - target, 0).sum()), _inputs=inputs)
