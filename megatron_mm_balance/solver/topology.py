"""Which data-parallel ranks share a node, and what a placement sends between nodes.

Ranks on one node exchange packs over NVLink; ranks on different nodes over the
network, an order of magnitude slower. The topology is either an explicit node id
per rank (any labels, in any arrangement: ``[0, 1, 0, 1]`` for cyclic placement,
``[7, 3, 7, 3]`` alike; the runtime finds them, ``runtime.groups``) or, as a
shorthand, ``ranks_per_node`` R: rank ``r`` on node ``r // R``. Labels are
renumbered by first appearance in rank order (:func:`dense_node_ids`), so the
plan depends only on which ranks share a node, never on the labels' values.

The placement uses this to prefer intra-node moves wherever the balance does not
care (:func:`pair_within_nodes`, the move weights of :mod:`.rank_balance`, and in
``step`` mode node totals evened before rank totals:
:func:`~megatron_mm_balance.solver.rank_balance.balance_node_totals`), and reports
inter-node packs and bytes (:func:`traffic`). Those preferences are greedy; the
plan they give is kept only where it is no worse than the flat plan
(:mod:`.node_choice`).
"""
from __future__ import annotations

import os

import numpy as np

from .sorting import stable_argsort

DEFAULT_RANKS_PER_NODE = 8
# An inter-node move counts as this many intra-node moves when the solver chooses
# between swaps of equal balance (a network hop is ~10x slower than NVLink).
INTER_NODE_WEIGHT = 4


def ranks_per_node_from_env(default: int | None = DEFAULT_RANKS_PER_NODE) -> int | None:
    """``LOCAL_WORLD_SIZE`` (set by torchrun) or ``default``; one-line error if bad."""
    text = os.environ.get("LOCAL_WORLD_SIZE")
    if text is None or not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be >= 1, got {value}")
    return value


def check_ranks_per_node(ranks_per_node):
    """Validate the solver argument: None (flat: every rank its own node), an
    integer >= 1 (rank ``r`` on node ``r // ranks_per_node``), or a sequence with
    each rank's node id (integers >= 0, any values and arrangement: data-parallel
    ranks need not be contiguous on a node; with tensor parallelism inner, a node
    holds every TP-th global rank; with cyclic placement, every other rank)."""
    if ranks_per_node is None:
        return None
    if isinstance(ranks_per_node, (list, tuple, np.ndarray)):
        ids = np.asarray(ranks_per_node)
        if ids.ndim != 1 or (len(ids) and (ids.dtype.kind not in "iu" or ids.min() < 0)):
            raise ValueError("ranks_per_node as node ids must be a 1-D sequence of integers >= 0")
        return ids.astype(np.int64)
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, (int, np.integer)):
        raise ValueError(f"ranks_per_node must be a positive integer or None, got {ranks_per_node!r}")
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    return int(ranks_per_node)


def dense_node_ids(labels) -> np.ndarray:
    """Each rank's node as 0, 1, ... numbered by first appearance in rank order (rank 0's
    node is 0), from any hashable labels (node ids, host names): equal labels, equal ids,
    and the same ids for any relabelling of the same partition."""
    first: dict = {}
    return np.array([first.setdefault(x.item() if isinstance(x, np.generic) else x, len(first))
                     for x in labels], dtype=np.int64)


def node_of_each_rank(num_ranks: int, ranks_per_node) -> np.ndarray | None:
    """Node of each rank (dense, :func:`dense_node_ids`) for a checked
    :func:`check_ranks_per_node` value, one node included; None only for None."""
    if ranks_per_node is None:
        return None
    if isinstance(ranks_per_node, np.ndarray):
        if len(ranks_per_node) != num_ranks:
            raise ValueError(f"node ids: {len(ranks_per_node)} given for {num_ranks} ranks")
        return dense_node_ids(ranks_per_node)
    return np.arange(num_ranks, dtype=np.int64) // ranks_per_node


def node_ids(num_ranks: int, ranks_per_node) -> np.ndarray | None:
    """Node of each rank (0-based, dense) as the solver uses it, or None when node
    awareness changes nothing (None, 1, one node, or every rank on its own node)."""
    node = node_of_each_rank(num_ranks, ranks_per_node)
    if node is None or num_ranks == 0:
        return None
    num = int(node.max()) + 1
    return None if num <= 1 or num == num_ranks else node


def pair_within_nodes(movers_origin: np.ndarray, free: np.ndarray,
                      node: np.ndarray | None) -> np.ndarray:
    """Destinations for movers (in priority order, e.g. heaviest first) among free
    ranks (in preference order, e.g. lightest first): ``free`` in order when
    ``node`` is None; otherwise each node's movers first take that node's free
    ranks (both in their given orders), and the rest pair up in order."""
    n = len(movers_origin)
    if node is None or n == 0:
        return free[:n].copy()
    mn = node[movers_origin]
    fn = node[free]
    num_nodes = int(node.max()) + 1
    # position of each mover / free rank within its node's group, orders kept
    m_ord = stable_argsort(mn)
    f_ord = stable_argsort(fn)
    m_cnt = np.bincount(mn, minlength=num_nodes)
    f_cnt = np.bincount(fn, minlength=num_nodes)
    m_start = np.concatenate([[0], np.cumsum(m_cnt)])[:-1]
    f_start = np.concatenate([[0], np.cumsum(f_cnt)])[:-1]
    m_pos = np.empty(n, dtype=np.int64)
    m_pos[m_ord] = np.arange(n) - m_start[mn[m_ord]]
    dest = np.full(n, -1, dtype=np.int64)
    local = m_pos < f_cnt[mn]
    dest[local] = free[f_ord[f_start[mn[local]] + m_pos[local]]]
    used = np.zeros(len(free), dtype=bool)
    f_pos = np.empty(len(free), dtype=np.int64)
    f_pos[f_ord] = np.arange(len(free)) - f_start[fn[f_ord]]
    used[f_pos < m_cnt[fn]] = True
    rest = ~local
    dest[rest] = free[~used][: int(rest.sum())]
    return dest


def traffic(src_rank: np.ndarray, ranks_per_node,
            nbytes: np.ndarray | None = None) -> dict:
    """Packs (and bytes, given ``nbytes[src_rank, src_index]``-aligned per-slot sizes)
    that change rank, and those that change node, for a placement's ``src_rank``.
    ``ranks_per_node``: as :func:`check_ranks_per_node` (node ids or R); on one node
    nothing crosses; None counts every rank as its own node (every move crosses)."""
    D = src_rank.shape[0]
    dst = np.arange(D)[:, None]
    moved = src_rank != dst
    node = node_of_each_rank(D, check_ranks_per_node(ranks_per_node))
    inter = moved if node is None else (node[src_rank] != node[dst])
    out = {"moved_packs": int(moved.sum()), "inter_node_packs": int(inter.sum())}
    if nbytes is not None:
        out["moved_bytes"] = float(np.asarray(nbytes)[moved].sum())
        out["inter_node_bytes"] = float(np.asarray(nbytes)[inter].sum())
    return out
