"""Synthetic Qwen-VL timing records with a known per-frame cost, for the replay's and the
calibration's tests: micro-batches of native-resolution grids (one large image, many small
ones, a video of several frames, a few medium images) at similar patch counts, whose vision
time is a given function of their frames' patch counts. Pure numpy.
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import numpy as np

#: a frame of p patches, per full-attention layer: about a*p + b*p^2 (b/a = 2,000 patches here)
PER_PATCH_MS, PER_PATCH_SQ_MS = 4e-3, 2e-6


def per_frame_quadratic(frames: Sequence[int]) -> float:
    """Vision forward milliseconds of a micro-batch whose frames have these patch counts."""
    return float(sum(PER_PATCH_MS * p + PER_PATCH_SQ_MS * p * p for p in frames))


def _even(rng, lo: int, hi: int) -> int:
    return 2 * int(rng.integers(lo, hi + 1))


def native_grids(rng) -> List[List[int]]:
    """One micro-batch's ``(t, h, w)`` grids (2 x 2-mergeable sides), one of four kinds."""
    kind = int(rng.integers(0, 4))
    if kind == 0:                                            # one large image: 1,024-4,096 patches
        return [[1, _even(rng, 16, 32), _even(rng, 16, 32)]]
    if kind == 1:                                            # many small images
        return [[1, _even(rng, 4, 8), _even(rng, 4, 8)] for _ in range(int(rng.integers(6, 25)))]
    if kind == 2:                                            # a video: several frames of one size
        return [[int(rng.integers(2, 7)), _even(rng, 8, 14), _even(rng, 8, 14)]]
    return [[1, _even(rng, 10, 20), _even(rng, 10, 20)] for _ in range(int(rng.integers(2, 4)))]


def frame_records(vision_ms: Callable[[Sequence[int]], float] = per_frame_quadratic, *,
                  iterations: Sequence[int] = range(1, 9), ranks: int = 4, G: int = 8, seed: int = 0,
                  noise: float = 0.0, language_ms: float = 50.0) -> List[dict]:
    """Timing records in the Bridge hooks' format (``grids``, ``images`` = ``t*h*w`` per grid,
    ``lengths`` = the padded sequence): vision forward ``vision_ms(frames)`` times
    ``1 + noise * N(0, 1)``, backward 2x; a constant language phase (every pack padded alike)."""
    from ..cost.frames import grid_frames
    rng = np.random.default_rng(seed)
    out = []
    for it in iterations:
        for r in range(ranks):
            for m in range(G):
                grids = native_grids(rng)
                v = vision_ms(grid_frames(grids)) * (1.0 + noise * float(rng.standard_normal()))
                out.append(dict(iteration=it, microbatch=m, rank=r, grids=grids,
                                images=[t * h * w for t, h, w in grids], lengths=[1024],
                                vision_forward_ms=max(v, 0.0), vision_backward_ms=2 * max(v, 0.0),
                                lm_forward_ms=language_ms, lm_backward_ms=2 * language_ms,
                                start_s=0.0, end_s=0.0))
    return out
