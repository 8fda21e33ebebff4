"""Per-micro-step meeting groups: who waits for whom inside an iteration.

Under expert parallelism only the ranks of one expert-parallel group run each
micro-step in lockstep (every MoE layer's all-to-all spans that group); the whole
data-parallel group meets once per iteration, at the gradient reduction. The solver
takes that layout as *step-group labels*: ``labels[r]`` is the per-micro-step
meeting group of data-parallel rank ``r`` (row ``r`` of the cost matrix). Labels are
any non-negative integers; only which ranks share one matters (they are renumbered
by first appearance, :func:`step_group_ids`). ``None`` means one group of all ranks:
every rank meets every micro-step.

The *group objective* of placed costs (:func:`group_objective`) is the iteration
time this layout gives: every group runs its micro-steps at its slowest rank's pace,
``sum_m max_{r in g} cost[r, m]`` (two-phase costs: the vision and the language
maxima of each micro-step, ``sum_m (max V + max L)``), and the iteration ends with
the slowest group. One group of all ranks: today's micro-step objective; every rank
its own group: the heaviest rank total.

Pure numpy; no state.
"""
from __future__ import annotations

import numbers

import numpy as np

from .topology import dense_node_ids


def check_step_groups(labels) -> tuple[int, ...] | None:
    """Validate step-group labels once: None, or a 1-D sequence of integers >= 0 (one per
    data-parallel rank; the count is checked against the costs when placing). Returns a
    tuple of ints; a clear one-line ``ValueError`` names what is wrong."""
    if labels is None:
        return None
    if isinstance(labels, (str, bytes)) or not hasattr(labels, "__len__"):
        raise ValueError(f"step_groups must be None or a sequence of integer labels, one per "
                         f"data-parallel rank, got {labels!r}")
    arr = np.asarray(labels, dtype=object) if not isinstance(labels, np.ndarray) else labels
    if arr.ndim != 1 or len(arr) == 0:
        raise ValueError(f"step_groups must be a non-empty 1-D sequence of labels, got shape "
                         f"{np.shape(arr)}")
    out = []
    for i, x in enumerate(arr.tolist()):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise ValueError(f"step_groups[{i}] must be an integer label, got {x!r}")
        if x < 0:
            raise ValueError(f"step_groups[{i}] must be >= 0, got {x}")
        out.append(int(x))
    return tuple(out)


def step_group_ids(num_ranks: int, labels) -> np.ndarray | None:
    """Each rank's step group as 0, 1, ... by first appearance in rank order, or None for
    None (one group of all ranks). Raises when the count does not match ``num_ranks``."""
    labels = check_step_groups(labels)
    if labels is None:
        return None
    if len(labels) != num_ranks:
        raise ValueError(f"step_groups has {len(labels)} labels for {num_ranks} data-parallel "
                         f"ranks (one per row of the cost matrix)")
    return dense_node_ids(labels)


def group_objective(placed, groups: np.ndarray | None) -> int:
    """The group objective (module docstring) of placed costs ``placed[r, m]`` (``[D, G]``,
    or ``[D, G, 2]`` vision and language) for dense group ids ``groups`` (None: one group)."""
    a = np.asarray(placed, dtype=np.int64)
    if a.ndim == 2:
        a = a[:, :, None]
    if groups is None:
        return int(a.max(axis=0).sum())
    order = np.argsort(groups, kind="stable")
    g = groups[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    per = np.maximum.reduceat(a[order], starts, axis=0)   # [E, G, P]: each group's maxima
    return int(per.sum(axis=(1, 2)).max())


def inter_group_packs(src_rank: np.ndarray, groups: np.ndarray | None) -> int:
    """Slots that compute a pack drawn in another step group (0 for one group)."""
    if groups is None:
        return 0
    return int(np.count_nonzero(groups[src_rank] != groups[:, None]))
