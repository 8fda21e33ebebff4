"""The balancing strategies, each as "which pack does slot (rank, micro-step) run".

* ``none``: 1D greedy packs in the order each rank drew them.
* ``budget``: the same, on packs built by the 2D image-budget packer (the
  strategy lives in the pool; the order is untouched).
* ``local``: each rank sorts only its own packs, heaviest first. A rank cannot
  see the others, but every rank applying the same rule lines heavy packs up
  with heavy packs: micro-step 0 holds each rank's heaviest pack, the last one
  each rank's lightest, so the per-micro-step maxima fall. The rule cannot change
  a rank's total, so it does nothing when ranks meet only at the step's end.
* ``redistribute-sync`` / ``redistribute-overlap``: the placement the runtime
  delivers, :func:`megatron_mm_balance.solver.placement.plan_placement` (same placement;
  the two differ only in how the exchange is timed, see :mod:`.timeline`).
* ``redistribute-groups``: ``redistribute-overlap`` with the group placement
  (``plan_placement(..., step_groups=)``: ranks meet per micro-step in groups of ``--ep``
  consecutive ranks, data parallelism once per iteration; without ``--ep`` it is
  ``redistribute-overlap``).
* ``redistribute-images``: packs placed for the language phase only, then every
  micro-step's images spread over the ranks for the encoder and the embeddings
  sent back (:mod:`.vision_balance`), overlapped pack exchange.
* ``redistribute-frames``: the same with the frame planner
  (:func:`megatron_mm_balance.solver.frames.plan_frames`: planned from where the frames
  are, the embeddings' transfer in the plan, a patch cap); on a native-resolution
  mixture (``native-res``) every frame of a video is its own unit.

Each function returns a flat gather index ``[.., D, G]`` into the rank-major
``D * G`` packs of a global batch (``src_rank * G + src_index``).
"""
from __future__ import annotations

import numpy as np

from ..solver.placement import plan_placement

STRATEGIES = ("none", "budget", "local", "redistribute-sync", "redistribute-overlap",
              "redistribute-groups", "redistribute-images", "redistribute-frames")
# What ``--strategies`` runs when not given: the group placement and image balancing are
# opt-in (the first is ``redistribute-overlap`` itself without ``--ep``; for the second
# see :mod:`.vision_balance`).
DEFAULT_STRATEGIES = STRATEGIES[:5]


def identity_order(B: int, D: int, G: int) -> np.ndarray:
    base = (np.arange(D)[:, None] * G + np.arange(G)[None, :]).astype(np.int64)
    return np.broadcast_to(base, (B, D, G)).copy()


def local_order(costs: np.ndarray) -> np.ndarray:
    """Heaviest-first order within each rank, ``costs`` ``[B, D, G]``; ties keep draw order."""
    costs = np.asarray(costs)
    B, D, G = costs.shape
    order = np.argsort(-costs, axis=2, kind="stable")
    return order + (np.arange(D)[None, :, None] * G)


def redistribute_order(costs: np.ndarray, *, sync: str, ranks_per_node=None,
                       step_groups=None) -> np.ndarray:
    """The runtime's placement of one batch's ``[D, G]`` integer costs (``[D, G, 2]``:
    two-phase), as a gather index; ``step_groups``: each rank's per-micro-step meeting
    group (None: all ranks meet every micro-step).

    :func:`megatron_mm_balance.solver.placement.plan_placement`: the solver and then the
    runtime's micro-step order (the step that moves the fewest packs first, so the
    one exchange that cannot hide behind compute is the smallest).
    """
    pl = plan_placement(costs, sync=sync, ranks_per_node=ranks_per_node, step_groups=step_groups)
    G = costs.shape[1]
    return pl.src_rank * G + pl.src_index


def inter_node_mask(order: np.ndarray, ranks_per_node) -> np.ndarray:
    """``[B, D, G]``: the slot's pack comes from a rank on another node (rank ``r``
    on node ``r // ranks_per_node``; None: every rank its own node)."""
    B, D, G = order.shape
    src = order // G
    dst = np.arange(D)[None, :, None]
    if not ranks_per_node or ranks_per_node <= 1:
        return src != dst
    return (src // ranks_per_node) != (dst // ranks_per_node)


def exchange_times(order: np.ndarray, nbytes: np.ndarray, *, link_gbps: float,
                   latency_ms: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank exchange time (ms) and bytes received, for gather index ``order``.

    ``order`` ``[B, D, G]`` as returned above; ``nbytes`` ``[B, D*G]`` bytes of
    each pack in source (rank-major) order. A slot whose pack comes from another
    rank receives it; its source rank sends it in the destination's micro-step.
    A rank's time per micro-step is ``latency + max(bytes in, bytes out) / link``.
    """
    B, D, G = order.shape
    src_rank = order // G
    moved = src_rank != np.arange(D)[None, :, None]
    pack_bytes = np.take_along_axis(nbytes, order.reshape(B, -1), axis=1).reshape(B, D, G)
    b_in = np.where(moved, pack_bytes, 0.0)
    step = np.broadcast_to(np.arange(G), (B, D, G))
    batch = np.broadcast_to(np.arange(B)[:, None, None], (B, D, G))
    flat = ((batch * D + src_rank) * G + step)[moved]
    b_out = np.bincount(flat, weights=pack_bytes[moved], minlength=B * D * G).reshape(B, D, G)
    busiest = np.maximum(b_in, b_out)
    x = np.where(busiest > 0, latency_ms + busiest / (link_gbps * 1e6), 0.0)
    return x, b_in
