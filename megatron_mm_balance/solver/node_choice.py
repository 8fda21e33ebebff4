"""A node-aware plan is never worse than the flat plan of the same batch.

Node awareness changes how a plan is built: stage 2 sends each mover to a free rank
of its own node first, stage 3 weighs an inter-node move as ``1 + INTER_NODE_WEIGHT``
moves, chain shortening runs per node first (:mod:`.topology`, :mod:`.rank_balance`).
Those are greedy choices, and on some batches they lose to the flat plan. The typical
case (4 ranks, nodes ``[0, 0, 1, 1]``, 2 micro-steps): stage 2 keeps every mover on its
node, so no pack crosses, but node 0 ends a few hundred tokens heavier than node 1;
stage 3 then relieves node 0's two heavy ranks one by one, each with its own swap
across the network (4 packs cross), where the flat plan spread the load while placing
and crossed twice. The same happens with step mode's node totals and with two-phase
costs; no local rule removes every such case.

So with nodes, the solver completes both plans from the same grouping (the part of
the solve that does not depend on the nodes runs once) and keeps the node-aware one
unless its quality is worse. The quality of a plan, compared lexicographically:

1. the balance objective: ``sum_m max_r`` of the placed costs (micro-step modes; with
   two-phase costs both phases' maxima), 0 in ``step`` mode;
2. the excess of the heaviest rank total over the limit
   (:func:`~.rank_balance.rank_limit`): every plan at or under it is balanced;
3. the packs that cross nodes.

**Guarantee** (:func:`no_worse_than_flat`): the plan returned is no worse than the flat
plan and no worse than the node-aware candidate in this order: never a worse balance
than either, and at an equal balance never more packs across nodes than either. When
the flat plan wins, it is first shortened across nodes (:func:`~.rank_balance.send_home`
with the nodes); every swap there lowers the weighted move count, which with
``INTER_NODE_WEIGHT >= 2`` never raises the inter-node count, keeps each rank under
``max(limit, its total)`` and each pack within its level or box (the same micro-step
for two-phase boxes), so it never worsens 1-3.

Cost: one more completion (slots, rank balance and chain shortening, without the
grouping) per node-aware solve and an ``O(D * G)`` comparison. Deterministic: integer
arithmetic and a fixed order of comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .rank_balance import SwapRules, send_home
from .topology import INTER_NODE_WEIGHT

if INTER_NODE_WEIGHT < 2:   # the monotonicity argument of the module docstring needs it
    raise AssertionError("INTER_NODE_WEIGHT must be >= 2")


def inter_node_packs(src_rank: np.ndarray, node: np.ndarray) -> int:
    """Slots that compute a pack drawn on another node."""
    return int(np.count_nonzero(node[src_rank] != node[:, None]))


@dataclass(frozen=True, order=True)
class PlanQuality:
    """What :func:`no_worse_than_flat` compares, in this order (lower is better)."""

    objective: int       #: sum over micro-steps of the placed maxima (0 in step mode)
    excess: int          #: heaviest rank total above the limit (0 when at or under it)
    inter_node: int      #: packs computed on another node than the one they were drawn on

    @classmethod
    def of(cls, rules: SwapRules, src_rank: np.ndarray, src_index: np.ndarray, *,
           limit: int) -> "PlanQuality":
        """The quality of a placement under ``rules`` (``rules.node`` set; ``rules.levels``
        None: step mode, no objective)."""
        D, G = src_rank.shape
        slot = (src_rank * G + src_index).ravel()            # one gather per array, by row
        objective = 0
        if rules.levels is not None:
            placed = np.take(rules.costs.reshape(D * G, -1), slot, axis=0).reshape(D, G, -1)
            objective = int(placed.max(axis=0).sum())
        heaviest = int(rules.balanced.ravel()[slot].reshape(D, G).sum(axis=1).max())
        return cls(objective, max(heaviest - int(limit), 0), inter_node_packs(src_rank, rules.node))


def no_worse_than_flat(rules: SwapRules, aware, flat, *, limit: int, shorten_rounds: int = 2):
    """``(src_rank, src_index)`` of the node-aware candidate ``aware`` unless its
    :class:`PlanQuality` is worse than the flat plan ``flat``'s; then ``flat`` shortened
    across nodes (changed in place). ``rules`` (with ``rules.node``) and ``limit`` are
    those both candidates were balanced under; ``shorten_rounds``: as
    :func:`~.rank_balance.send_home`'s ``max_rounds``. See the module docstring."""
    if rules.node is None:
        raise ValueError("no_worse_than_flat needs the ranks' nodes (rules.node)")
    if PlanQuality.of(rules, *aware, limit=limit) <= PlanQuality.of(rules, *flat, limit=limit):
        return aware
    send_home(rules, *flat, limit=limit, max_rounds=shorten_rounds)
    return flat
