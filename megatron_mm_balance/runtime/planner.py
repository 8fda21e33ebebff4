"""The planner: one global batch's placement from its cost metadata alone.

:func:`plan_batch` is what every balancing mode runs once per global batch, on
every rank, from the same integer costs (so every rank reaches the same plan):
the tensor exchange and shadow mode (:mod:`.engine`, on the all-gathered
costs), sampler mode (on the costs the dataset reports by index) and the
simulator. It sees no pack, no process group and no device: only the
``[ranks, micro-steps]`` cost matrix and the settings. Moving the data the plan
describes is the coordinators' business (:mod:`.engine` for the exchange,
``megatron.sampler`` for index reassignment).

Imports neither torch nor anything of a training framework.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from ..solver.placement import Placement, PlanStats, plan_placement
from .config import BalancerConfig


def node_of_ranks(ranks: Optional[Sequence[int]], ranks_per_node: Optional[int],
                  found: Optional[Sequence[int]] = None):
    """The node of each data-parallel rank as the planner sees it: with ``ranks_per_node``
    (the override) from its global rank, rank ``r`` on node ``r // ranks_per_node``; else
    ``found``, each rank's node id as found at exchange-group creation (in the group's rank
    order, :func:`~.groups.gather_node_ids`); else None (flat)."""
    if ranks is not None and ranks_per_node:
        return tuple(int(r) // int(ranks_per_node) for r in ranks)
    if found is not None:
        return tuple(int(n) for n in found)
    return None


def plan_batch(costs, config: BalancerConfig, *, ranks: Optional[Sequence[int]] = None,
               nodes: Optional[Sequence[int]] = None,
               step_groups: Optional[Sequence[int]] = None) -> Tuple[Placement, PlanStats]:
    """The placement of one global batch and what it does.

    ``costs``: integer costs, ``[D, G]`` (one per pack) or ``[D, G, 2]`` (vision,
    language): row ``r`` holds the packs data-parallel rank ``r`` drew, in order.
    ``config``: the balancer's settings; the planner reads ``sync``,
    ``balance_tolerance`` and ``ranks_per_node``. ``ranks``: the global ranks of the
    D data-parallel ranks, which place them on nodes (``ranks_per_node``); None when
    nothing travels between ranks (sampler mode, the simulator), so the plan is flat.
    ``nodes``: the node id of each of the D ranks instead (any labels; the exchange passes
    :func:`node_of_ranks`'s, the found ids unless ``ranks_per_node`` overrides them).
    ``step_groups``: each of the D ranks' per-micro-step meeting group (the expert-parallel
    group within the data-parallel group, ``MeetingGroups.labels()``); None: all D ranks
    meet every micro-step. ``microstep`` mode then minimises the slowest group's sum of its
    per-micro-step maxima (:mod:`~megatron_mm_balance.solver.step_groups`).

    Returns the solved placement (checked to be a bijection of the packs onto the
    slots, its micro-steps ordered so the first moves least) and its
    :class:`~megatron_mm_balance.solver.placement.PlanStats` on the scalar costs
    (two-phase costs summed), with the group objective, the inter-group and (nodes known)
    the inter-node moves. Shadow mode calls this too and then delivers the
    identity instead: the stats are then what balancing would have done.
    """
    c = np.asarray(costs)
    if nodes is None:
        nodes = node_of_ranks(ranks, config.ranks_per_node)
    placement = plan_placement(c, sync=config.sync, balance_tolerance=config.balance_tolerance,
                               ranks_per_node=None if nodes is None else list(nodes),
                               step_groups=step_groups)
    scalar = c.sum(axis=2) if c.ndim == 3 else c
    return placement, PlanStats.of(scalar, placement, step_groups=step_groups, nodes=nodes)
