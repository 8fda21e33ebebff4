"""Qwen-VL grids as the cost model's features: one attention unit per frame.

A Qwen2/2.5/3-VL vision tower sees each image or video at its own size, a ``t x h x w``
grid of patches, and attends inside each *frame* only (``cu_seqlens`` repeats ``h*w``
once per temporal patch). A frame of ``p = h*w`` patches costs about ``a*p^2 + b*p`` per
full-attention layer, so the features of a micro-batch are its frames' patch counts:
``sum(p)``, ``sum(p^2)`` and the number of frames (the units of
:class:`~megatron_mm_balance.cost.model.PackFeatures`), with the number of images
(a video is one) and the language side's per-sample lengths. Squaring a whole video's
``t*h*w`` would overstate its quadratic term ``t``-fold.

Pure: no torch; what a replay or a timing hook records (a list of ``(t, h, w)``) is
enough.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

from .model import FeatureArrays, PackFeatures


def check_grid(grid, where: str = "grid") -> tuple[int, int, int]:
    """``(t, h, w)`` as three ints >= 0; a one-line error otherwise."""
    try:
        vals = [float(v) for v in grid]
    except (TypeError, ValueError):
        vals = []
    if len(vals) != 3 or any(v != int(v) for v in vals):
        raise ValueError(f"{where} must be a (t, h, w) triple of ints, got {grid!r}")
    t, h, w = (int(v) for v in vals)
    if min(t, h, w) < 0:
        raise ValueError(f"{where} must be a (t, h, w) triple of ints >= 0, got {grid!r}")
    return t, h, w


def grid_frames(grids: Iterable) -> tuple[int, ...]:
    """The patches of every frame: an image or video of grid ``(t, h, w)`` is ``t`` frames
    of ``h*w`` patches."""
    out = []
    for i, g in enumerate(grids):
        t, h, w = check_grid(g, f"grid {i}")
        out.extend([h * w] * t)
    return tuple(out)


def grid_pack_features(grids: Sequence, lengths: Sequence[int] = (),
                       positions: Optional[int] = None) -> PackFeatures:
    """The features of one micro-batch from its grids (images and videos, any order) and
    its per-sample lengths (``positions``: the tokens the language model computes, when
    padding makes it more than their sum)."""
    grids = list(grids)
    return PackFeatures(grid_frames(grids), tuple(int(n) for n in lengths), positions,
                        num_images=len(grids))


def grid_feature_arrays(batches: Sequence[Sequence], lengths: Optional[Sequence[Sequence[int]]] = None,
                        positions: Optional[Sequence[Optional[int]]] = None) -> FeatureArrays:
    """:class:`FeatureArrays` of many micro-batches, each given as its list of ``(t, h, w)``
    (``lengths`` / ``positions``: one entry per micro-batch, default none)."""
    n = len(batches)
    lengths = [()] * n if lengths is None else list(lengths)
    positions = [None] * n if positions is None else list(positions)
    if len(lengths) != n or len(positions) != n:
        raise ValueError(f"grid_feature_arrays: {n} micro-batches but {len(lengths)} lengths "
                         f"and {len(positions)} positions")
    return FeatureArrays.of([grid_pack_features(g, ln, pos)
                             for g, ln, pos in zip(batches, lengths, positions)])
