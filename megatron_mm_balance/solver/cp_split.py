"""Split a micro-batch's vision frames across context-parallel ranks by cost.

Under context parallelism Megatron-Bridge's Qwen3-VL (``vision_dp_when_cp``) gives each
context-parallel rank a contiguous range of the micro-batch's frames (every image, and
every temporal patch of a video, is one frame), runs the vision tower on its range only,
and all-gathers the embeddings back in rank order. Bridge sizes the ranges by frame
*count*; a rank that gets the large frames then holds the others up. This module sizes
them by frame *cost* instead, still contiguous, so the gathered embeddings keep their
order and the communication is the one the split already does.

:func:`cost_split` is the linear-partition problem: the split of a sequence of
non-negative costs into ``parts`` contiguous (possibly empty) ranges whose largest range
cost is smallest. It is exact (no heuristic): a dynamic programme over the ranges, with
a binary search per boundary (``O(parts * n log n)``), using only comparisons and
differences of prefix sums, so integer costs are exact and float costs are compared
consistently. Among the splits that reach the optimum it returns the one closest to
:func:`equal_count_split` (the least total displacement of the range boundaries from
Bridge's), so when Bridge's split is already optimal it is returned unchanged.

The cost of a frame of ``p = h*w`` patches is a callable (or the costs are given as a
sequence): :func:`default_frame_cost` is ``p * (p + alpha)``, per full-attention layer
of the tower up to a constant: the attention scores and values are quadratic in ``p``,
the projections and MLP linear with a ratio ``alpha = 2*hidden + ffn`` to the quadratic
term (:func:`tower_alpha`). A calibrated per-frame model replaces it by being passed as
the ``frame_cost`` callable (one place: the caller's choice of callable).

Pure Python: nothing here knows torch or torch.distributed.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, List, Optional, Sequence

#: A frame's cost from its patch count ``p = h * w``.
FrameCost = Callable[[int], float]


def tower_alpha(hidden_size: int, ffn_hidden_size: int) -> int:
    """The linear-to-quadratic cost ratio of a vision transformer layer: ``2*hidden + ffn``."""
    if hidden_size <= 0 or ffn_hidden_size <= 0:
        raise ValueError(f"tower sizes must be positive, got hidden {hidden_size} and ffn {ffn_hidden_size}")
    return 2 * int(hidden_size) + int(ffn_hidden_size)


def default_frame_cost(alpha: int) -> FrameCost:
    """``p -> p * (p + alpha)``: a frame of ``p`` patches (integer for integer ``alpha``)."""
    if alpha < 0:
        raise ValueError(f"alpha must be non-negative, got {alpha}")
    return lambda p: p * (p + alpha)


def frame_patches(grid_thw: Iterable[Sequence[int]]) -> List[int]:
    """The patch count of every frame of ``(t, h, w)`` grids, videos expanded frame by frame
    (a grid of ``t`` temporal patches is ``t`` frames of ``h*w``, as Bridge's ``expand_thw``)."""
    out: List[int] = []
    for row in grid_thw:
        if len(row) != 3:
            raise ValueError(f"grid rows must be (t, h, w) triples, got {list(row)}")
        t, h, w = (int(v) for v in row)
        if t <= 0 or h <= 0 or w <= 0:
            raise ValueError(f"grid entries must be positive, got (t, h, w) = ({t}, {h}, {w})")
        out.extend([h * w] * t)
    return out


def frame_costs(grid_thw: Iterable[Sequence[int]], frame_cost: FrameCost) -> List[float]:
    """Per-frame costs of ``(t, h, w)`` grids under ``frame_cost`` (see :func:`frame_patches`)."""
    return [frame_cost(p) for p in frame_patches(grid_thw)]


def equal_count_split(num_frames: int, parts: int) -> List[int]:
    """Bridge's split by count: ``num_frames // parts`` each, one more for the first ranks."""
    _check_parts(parts)
    if num_frames < 0:
        raise ValueError(f"the number of frames must be non-negative, got {num_frames}")
    base, extra = divmod(num_frames, parts)
    return [base + (1 if k < extra else 0) for k in range(parts)]


def range_costs(costs: Sequence[float], counts: Sequence[int]) -> List[float]:
    """The summed cost of each contiguous range of ``counts`` frames."""
    if sum(counts) != len(costs) or any(c < 0 for c in counts):
        raise ValueError(f"range counts {list(counts)} do not cover the {len(costs)} frames")
    out, start = [], 0
    for c in counts:
        out.append(sum(costs[start:start + c]))
        start += c
    return out


def cost_split(costs: Sequence[float], parts: int) -> List[int]:
    """Frames per rank of the contiguous split of ``costs`` into ``parts`` ranges with the
    smallest maximum range cost, closest to :func:`equal_count_split` among the optimal ones.

    Every frame is in exactly one range, in order; ranges may be empty (fewer frames than
    ranks, or a single frame costing more than all the others). Deterministic: the same
    costs give the same split on every rank.
    """
    _check_parts(parts)
    costs = _checked_costs(costs)
    n = len(costs)
    if parts == 1 or n == 0:
        return equal_count_split(n, parts)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = _optimal_max_cost(prefix, parts)
    bounds = _closest_optimal_bounds(prefix, parts, best, _equal_count_bounds(n, parts))
    return [bounds[k + 1] - bounds[k] for k in range(parts)]


# --------------------------------------------------------------------------- internals

def _check_parts(parts: int) -> None:
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"the number of context-parallel ranks must be a positive integer, got {parts!r}")


def _checked_costs(costs: Sequence[float]) -> List[float]:
    out = list(costs)
    for i, c in enumerate(out):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"frame costs must be finite non-negative numbers, got {c!r} at frame {i}")
    return out


def _equal_count_bounds(n: int, parts: int) -> List[int]:
    bounds = [0]
    for c in equal_count_split(n, parts):
        bounds.append(bounds[-1] + c)
    return bounds


def _first_index(lo: int, hi: int, pred: Callable[[int], bool]) -> int:
    """The smallest ``i`` in ``[lo, hi]`` with ``pred(i)`` true (``pred`` monotone: false then true);
    ``hi + 1`` when there is none."""
    hi += 1
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _optimal_max_cost(prefix: List[float], parts: int) -> float:
    """The smallest achievable largest range cost.

    ``best[j]`` (``k`` ranges over the first ``j`` frames) is non-decreasing in ``j`` and the
    last range's cost ``prefix[j] - prefix[i]`` non-increasing in its start ``i``, so the
    optimal start is where they cross: a binary search, then the better of its two sides.
    """
    n = len(prefix) - 1
    best = list(prefix)                       # one range: everything so far
    for _ in range(2, parts + 1):
        prev, best = best, [0] * (n + 1)
        for j in range(n + 1):
            i = _first_index(0, j, lambda i: prev[i] >= prefix[j] - prefix[i])
            cands = [max(prev[m], prefix[j] - prefix[m]) for m in (i - 1, i) if 0 <= m <= j]
            best[j] = min(cands)
    return best[n]


def _closest_optimal_bounds(prefix: List[float], parts: int, limit: float, target: List[int]) -> List[int]:
    """Range boundaries, every range costing at most ``limit``, with the least
    ``sum_k |bound_k - target_k|``; among equals, the earliest boundaries."""
    n = len(prefix) - 1
    inf = float("inf")
    dev = [0] + [inf] * n                     # boundary 0 at frame 0
    choice: List[List[int]] = []
    for k in range(1, parts + 1):
        new, back = [inf] * (n + 1), [-1] * (n + 1)
        window: List[int] = []                # candidate starts, increasing index, increasing dev
        head, nxt = 0, 0
        for j in range(n + 1):
            while nxt <= j:                   # admit start nxt into the window
                while len(window) > head and dev[window[-1]] > dev[nxt]:
                    window.pop()
                window.append(nxt)
                nxt += 1
            lo = _first_index(0, j, lambda i: prefix[j] - prefix[i] <= limit)
            while head < len(window) and window[head] < lo:
                head += 1
            if head < len(window) and dev[window[head]] < inf and (k < parts or j == n):
                new[j] = dev[window[head]] + abs(j - target[k])
                back[j] = window[head]
        choice.append(back)
        dev = new
    if dev[n] == inf:                         # cannot happen: limit is achievable
        raise AssertionError("no split within the optimal cost")
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(choice[k - 1][bounds[-1]])
    return bounds[::-1]


def imbalance(values: Sequence[float]) -> Optional[float]:
    """``max / mean`` of per-rank values (None when they are all zero)."""
    vals = list(values)
    mean = sum(vals) / len(vals) if vals else 0.0
    return None if mean == 0 else max(vals) / mean
