"""Who meets whom in a training iteration: the data-parallel ranks an exchange balances,
and the groups of them that wait for each other every micro-step.

Megatron's data-parallel ranks meet once per iteration, at the gradient reduction. Within
an iteration a rank waits for another only through a collective it runs every micro-step:
under expert parallelism, every MoE layer's all-to-all over the expert-parallel group. So

* the **per-iteration group** is the data-parallel group (the exchange group: one per
  context-parallel rank and per data-holding pipeline stage);
* its **per-micro-step groups** partition it: two of its ranks share one when a chain of
  per-micro-step collectives links their data-parallel positions (Megatron-core carves the
  expert-parallel group out of data x context parallel, so an expert-parallel group may span
  context-parallel ranks: what counts for an exchange group is which data-parallel positions
  it joins). Without expert parallelism every rank is its own step group: nobody waits
  within an iteration.

:class:`MeetingGroups` is the pure description (global ranks only, checked once): the
planner takes :meth:`MeetingGroups.labels` (``plan_batch(..., step_groups=)``), the telemetry
:meth:`MeetingGroups.describe`. :func:`step_groups_from_collectives` turns what the
framework's process groups say into the partition. The glue reads the groups from the
framework (``megatron.groups``, ``bridge.iterator``); nothing here assumes a layout.

Imports neither torch nor anything of a training framework.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Dict, Iterable, Mapping, Optional, Sequence, Tuple


def _ranks(values: Iterable, what: str) -> Tuple[int, ...]:
    out = []
    for v in values:
        try:
            r = operator.index(v)
        except TypeError:
            r = -1
        if isinstance(v, bool) or r < 0:
            raise ValueError(f"{what}: {v!r} is not a global rank")
        out.append(r)
    return tuple(out)


@dataclass(frozen=True)
class MeetingGroups:
    """One exchange group's meetings: who meets once per iteration and who every micro-step.

    ``iteration``: the data-parallel group's global ranks, in canonical (ascending) order,
    which is the order of the exchange's cost-matrix rows. ``steps``: the per-micro-step
    groups, tuples of global ranks, each a non-empty subset of ``iteration``, disjoint and
    covering it; canonical order (members ascending, groups by their first member).
    ``rank``: this rank's global rank (None: a description not tied to a rank).
    ``via``: what makes the step groups meet (``"expert parallel"``; ``""`` when nobody
    meets within an iteration). Build with :meth:`of`, which puts everything in
    canonical order; the constructor checks but does not reorder.
    """

    iteration: Tuple[int, ...]
    steps: Tuple[Tuple[int, ...], ...]
    rank: Optional[int] = None
    via: str = ""

    def __post_init__(self):
        it = _ranks(self.iteration, "meeting groups: per-iteration group")
        if not it:
            raise ValueError("meeting groups: the per-iteration group is empty")
        if list(it) != sorted(set(it)):
            raise ValueError(f"meeting groups: per-iteration group {list(it)} is not in ascending "
                             "order without repeats")
        steps = tuple(_ranks(g, "meeting groups: per-micro-step group") for g in self.steps)
        members: Dict[int, int] = {}
        for index, group in enumerate(steps):
            if not group:
                raise ValueError("meeting groups: an empty per-micro-step group")
            if list(group) != sorted(set(group)):
                raise ValueError(f"meeting groups: per-micro-step group {list(group)} is not in "
                                 "ascending order without repeats")
            for r in group:
                if r not in it:
                    raise ValueError(f"meeting groups: rank {r} of per-micro-step group {list(group)} "
                                     f"is not in the per-iteration group {list(it)}")
                if r in members:
                    raise ValueError(f"meeting groups: rank {r} is in two per-micro-step groups, "
                                     f"{list(steps[members[r]])} and {list(group)}")
                members[r] = index
        missing = [r for r in it if r not in members]
        if missing:
            raise ValueError(f"meeting groups: rank(s) {missing} of the per-iteration group "
                             f"{list(it)} are in no per-micro-step group")
        if [g[0] for g in steps] != sorted(g[0] for g in steps):
            raise ValueError("meeting groups: per-micro-step groups not ordered by their first rank")
        if self.rank is not None and int(self.rank) not in members:
            raise ValueError(f"meeting groups: rank {self.rank} is not in the per-iteration group "
                             f"{list(it)}")
        object.__setattr__(self, "iteration", it)
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "rank", None if self.rank is None else int(self.rank))
        object.__setattr__(self, "via", str(self.via or ""))

    # -- construction ------------------------------------------------------------------
    @classmethod
    def of(cls, iteration: Iterable[int], steps: Optional[Iterable[Iterable[int]]] = None, *,
           rank: Optional[int] = None, via: str = "") -> "MeetingGroups":
        """The groups in canonical order. ``steps`` None: every rank its own step group
        (nobody meets within an iteration)."""
        it = tuple(sorted(_ranks(iteration, "meeting groups: per-iteration group")))
        if steps is None:
            groups = [(r,) for r in it]
        else:
            groups = [tuple(sorted(_ranks(g, "meeting groups: per-micro-step group"))) for g in steps]
        groups.sort(key=lambda g: g[0] if g else -1)
        return cls(it, tuple(groups), rank=rank, via=via if any(len(g) > 1 for g in groups) else "")

    @classmethod
    def everyone_meets(cls, iteration: Iterable[int], *, rank: Optional[int] = None,
                       via: str = "every micro-step") -> "MeetingGroups":
        """All ranks of the iteration group meet every micro-step (today's objective)."""
        it = list(iteration)
        return cls.of(it, [it], rank=rank, via=via)

    # -- what the planner and the telemetry read ------------------------------------------
    @property
    def size(self) -> int:
        """D, the data-parallel ranks of the iteration group."""
        return len(self.iteration)

    @property
    def step_group(self) -> Tuple[int, ...]:
        """This rank's per-micro-step group (needs ``rank``)."""
        if self.rank is None:
            raise ValueError("meeting groups: step_group needs the rank the groups were read on")
        return self.steps[self._index_of_rank()[self.rank]]

    def _index_of_rank(self) -> Dict[int, int]:
        return {r: i for i, g in enumerate(self.steps) for r in g}

    def labels(self) -> Tuple[int, ...]:
        """Each data-parallel rank's step group index, in ``iteration`` order (the rows of the
        exchange's cost matrix): the ``step_groups`` the planner takes."""
        index = self._index_of_rank()
        return tuple(index[r] for r in self.iteration)

    @property
    def meet_within_iteration(self) -> bool:
        """Whether any two ranks wait for each other within an iteration (some step group
        has more than one rank)."""
        return any(len(g) > 1 for g in self.steps)

    @property
    def all_meet_each_step(self) -> bool:
        """Whether the whole iteration group is one step group (expert parallel = data parallel)."""
        return len(self.steps) == 1

    def sync(self) -> str:
        """The planner's sync these groups call for: ``"microstep"`` when some ranks wait for
        each other every micro-step, else ``"step"`` (only rank totals matter)."""
        return "microstep" if self.meet_within_iteration else "step"

    def describe(self) -> str:
        """One line for the log and the telemetry, e.g. ``per iteration: data parallel of 4
        [0, 1, 2, 3]; per micro-step: 2 groups of 2 (expert parallel) [0, 1] [2, 3]``."""
        head = f"per iteration: data parallel of {self.size} {list(self.iteration)}; per micro-step: "
        if not self.meet_within_iteration:
            return head + "none (each rank alone)"
        sizes = sorted({len(g) for g in self.steps})
        shape = (f"{len(self.steps)} group{'s' if len(self.steps) != 1 else ''} of "
                 f"{'/'.join(str(s) for s in sizes)}")
        via = f" ({self.via})" if self.via else ""
        return head + shape + via + " " + " ".join(str(list(g)) for g in self.steps)

    def as_dict(self) -> dict:
        """For JSON records: the groups as lists."""
        return {"iteration": list(self.iteration), "steps": [list(g) for g in self.steps],
                "via": self.via, "sync": self.sync()}


def step_groups_from_collectives(iteration: Sequence[int], position: Mapping[int, int],
                                 collectives: Iterable[Iterable[int]]) -> Tuple[Tuple[int, ...], ...]:
    """The per-micro-step partition of the data-parallel group ``iteration``.

    ``position[r]``: the data-parallel position (index within its data-parallel group) of
    every global rank the collectives name, and of the ranks of ``iteration``;
    ``collectives``: the rank groups that run a collective every micro-step (the
    expert-parallel groups of the world or of the ranks that matter). Two ranks of
    ``iteration`` share a step group when a chain of these collectives links their
    positions: ranks at one position hold the same micro-batch (their tensor-, context- and
    pipeline-parallel peers) and advance together. Pure function; a rank a collective names
    without a position is an error, not silently skipped.
    """
    parent: Dict[int, int] = {}

    def find(p: int) -> int:
        parent.setdefault(p, p)
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    def pos(r: int) -> int:
        try:
            return int(position[int(r)])
        except KeyError:
            raise ValueError(f"meeting groups: rank {int(r)} has no data-parallel position") from None

    for group in collectives:
        ps = [pos(r) for r in group]
        for p in ps[1:]:
            a, b = find(ps[0]), find(p)
            if a != b:
                parent[max(a, b)] = min(a, b)
    positions = [pos(r) for r in iteration]
    if len(set(positions)) != len(positions):
        raise ValueError(f"meeting groups: data-parallel group {list(iteration)} holds one position "
                         f"twice ({positions})")
    by_root: Dict[int, list] = {}
    for r, p in zip(iteration, positions):
        by_root.setdefault(find(p), []).append(int(r))
    return tuple(tuple(sorted(g)) for g in sorted(by_root.values(), key=min))
