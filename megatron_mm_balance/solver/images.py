"""Which rank encodes which image: image-level vision balancing of one micro-step.

Per-image encoders (CLIP/SigLIP/InternViT tiles, Qwen-VL images) compute every
image on its own, so the images of one micro-step may be encoded on any
data-parallel rank and their embeddings returned to the rank that computes the
pack (:mod:`megatron_mm_balance.runtime.image_exchange` moves them; the simulator's
``redistribute-images`` strategy times it). Pure: every rank runs this on the same
all-gathered image costs and gets the same assignment.
"""
from __future__ import annotations

import heapq

import numpy as np


def balance_images(owner, cost, num_ranks: int) -> np.ndarray:
    """Encoder rank of each image of one micro-step.

    ``owner[i]``: the rank that holds image ``i`` (computes its pack); ``cost[i]``:
    its encoder cost, a non-negative integer (e.g. microseconds). The target load is
    ``T = max(ceil(total / D), heaviest image)``; every rank keeps its own images,
    heaviest first, while its load stays within ``T``; the rest go, heaviest first,
    to the rank with the least load at that moment (longest processing time first;
    ties by rank). So a balanced micro-step moves nothing, and no rank ends above
    ``T`` plus one image. Integer arithmetic, stable orders, ties by image index:
    the same assignment on every rank. O(n log n + surplus x log D)."""
    owner = np.asarray(owner, dtype=np.int64)
    cost = np.asarray(cost)
    if cost.dtype.kind not in "iub" or np.any(cost < 0):
        raise ValueError("image costs must be non-negative integers")
    cost = cost.astype(np.int64)
    D = int(num_ranks)
    n = len(cost)
    if len(owner) != n or (n and (owner.min() < 0 or owner.max() >= D)):
        raise ValueError(f"owners must be one rank in [0, {D}) per image")
    enc = owner.copy()
    if n == 0 or D == 1:
        return enc
    total = int(cost.sum())
    target = max(-(-total // D), int(cost.max()))
    # each rank's own images heaviest first; keep the prefix that fits the target
    order = np.lexsort((np.arange(n), -cost, owner))
    csum = np.cumsum(cost[order])
    start = np.searchsorted(owner[order], np.arange(D))
    base = np.concatenate([[0], csum])[start][owner[order]]
    keep = (csum - base) <= target
    surplus = order[~keep]
    if len(surplus) == 0:
        return enc
    load = np.bincount(owner[order[keep]], weights=cost[order[keep]], minlength=D).astype(np.int64)
    surplus = surplus[np.lexsort((surplus, -cost[surplus]))]
    heap = [(int(x), r) for r, x in enumerate(load)]
    heapq.heapify(heap)
    for i in surplus.tolist():                   # heaviest first to the lightest rank (LPT)
        x, r = heapq.heappop(heap)
        enc[i] = r
        heapq.heappush(heap, (x + int(cost[i]), r))
    return enc
