"""Which rank encodes which frame, every micro-step: the one planning call and its figures.

Image-level vision balancing of native-resolution encoders (Qwen-VL: a frame of
``h x w`` patches is encoded on its own) moves whole frames between the ranks of a
per-micro-step meeting group. Every rank knows the global batch's frames (their owners,
integer costs and patch counts, gathered once at the batch's meeting,
:mod:`~.frame_ahead`) and calls :func:`plan_frame_encoders` on the same numbers: the same
assignment everywhere. :func:`within_receive_budget` then bounds the rows each rank
receives ahead of a micro-step.

:func:`plan_frame_encoders` is the single place the planner is called:
``solver/frames.py::plan_frames``, which plans from where the frames are: it lowers the
largest rank cost to the lowest level it reaches while moving the least cost it finds,
no receiving rank ends above the patch cap, and a frame's transfer time (when given)
counts on the rank that receives it; then ``solver/frame_swaps.py::lower_by_swaps`` lowers
the largest rank cost further with single moves and swaps (a frame for one or two of
another rank's), which the planner's level search does not consider and which the patch cap
often calls for. :func:`within_patch_cap` remains for planners that
do not know the cap (``solver/images.py::balance_images``, kept as the reference).

:func:`frame_figures` are the micro-step's figures (moved frames, patches and cost, the
least cost that bringing every rank down to the target moves, the largest and mean rank
cost before and after), computed from the assignment alone, whatever planner made it (so
they stay comparable when the planner changes); :class:`FrameWindow` sums them over a log
interval. Pure numpy: knows nothing of torch or Megatron.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Dict, Optional

import numpy as np

from ..solver.frame_swaps import lower_by_swaps
from ..solver.frames import default_patch_cap, plan_frames   # default_patch_cap: re-exported for the glue


def plan_frame_encoders(owner, cost, num_ranks: int, *, patches, patch_cap: Optional[int] = None,
                        transfer=None) -> np.ndarray:
    """The encoder rank of every frame (see the module docstring). ``patch_cap``: no rank
    that receives frames ends above it (None: ``default_patch_cap``, the most patches any rank held before); ``transfer[i]``:
    the time moving frame ``i`` costs its receiver, in the unit of ``cost`` (None: 0)."""
    patch_cap = default_patch_cap(owner, patches, num_ranks) if patch_cap is None else int(patch_cap)
    encoder = plan_frames(owner, cost, num_ranks, patches=patches, patch_cap=patch_cap, transfer=transfer).encoder
    return lower_by_swaps(owner, encoder, cost, num_ranks, patches=patches, patch_cap=patch_cap, transfer=transfer)


@dataclass(frozen=True)
class FrameTransfer:
    """What moving a frame costs the rank that receives it, in the frame cost's unit.

    A moved frame's pixel rows travel to its encoder, its embeddings (main and deepstack)
    back, and in backward their gradients to the encoder again (and the pixels' gradients
    back when the pixels need them): ``bytes_per_patch`` per patch of the frame. Over a link
    of ``link_gbps`` GB/s that takes ``patches * bytes_per_patch / link`` seconds, which is
    ``/ unit_seconds`` units of cost (the seconds of compute one unit of the frame cost
    takes). Rounded up, so a move is never charged less than it costs. Pure arithmetic on
    numbers every rank holds alike: the same integers on every rank. ``link_gbps`` infinite:
    moves are free (0)."""

    bytes_per_patch: float
    link_gbps: float
    unit_seconds: float

    def __post_init__(self):
        for name in ("bytes_per_patch", "link_gbps", "unit_seconds"):
            value = getattr(self, name)
            if not value > 0 or math.isnan(value):
                raise ValueError(f"FrameTransfer.{name} must be positive, got {value!r}")

    def cost(self, patches) -> np.ndarray:
        """The integer transfer cost of frames of ``patches`` patches each."""
        patches = np.asarray(patches, dtype=np.float64)
        if math.isinf(self.link_gbps):
            return np.zeros(patches.shape, dtype=np.int64)
        seconds = patches * self.bytes_per_patch / (self.link_gbps * 1e9)
        return np.ceil(seconds / self.unit_seconds).astype(np.int64)


def within_patch_cap(owner, encoder, cost, patches, cap: int, num_ranks: int) -> np.ndarray:
    """``encoder`` with the moves that would take a receiving rank above ``cap`` patches
    undone (those frames stay with their owner).

    A rank's budget counts all the frames it held before as staying (whichever of them
    leave), so the cap holds however the accepted moves combine: a rank that receives
    ends with at most ``cap`` patches. Moves are accepted heaviest cost first (ties by
    frame index), each while its receiver's budget allows. Deterministic."""
    owner = np.asarray(owner, dtype=np.int64)
    encoder = np.asarray(encoder, dtype=np.int64).copy()
    cost = np.asarray(cost, dtype=np.int64)
    patches = np.asarray(patches, dtype=np.int64)
    moved = np.flatnonzero(owner != encoder)
    if moved.size == 0:
        return encoder
    room = cap - np.bincount(owner, weights=patches, minlength=num_ranks).astype(np.int64)
    for i in moved[np.lexsort((moved, -cost[moved]))].tolist():
        r = int(encoder[i])
        if patches[i] <= room[r]:
            room[r] -= patches[i]
        else:
            encoder[i] = owner[i]
    return encoder


def within_receive_budget(owner, encoder, cost, rows, budget: int) -> np.ndarray:
    """``encoder`` with the moves that would take a rank above ``budget`` rows received from
    other ranks undone (those units stay with their owner).

    The rows a rank encodes for others are sent to it ahead of their micro-step and held
    until that micro-step's backward; ``budget`` bounds them per rank and micro-step. Moves
    are accepted heaviest cost first (ties by unit index), each while its receiver's budget
    allows; undoing a move never adds rows to another rank. Deterministic."""
    owner = np.asarray(owner, dtype=np.int64)
    encoder = np.asarray(encoder, dtype=np.int64).copy()
    cost = np.asarray(cost, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    moved = np.flatnonzero(owner != encoder)
    if moved.size == 0 or int(rows[moved].sum()) <= 0:
        return encoder
    room: Dict[int, int] = {}
    for i in moved[np.lexsort((moved, -cost[moved]))].tolist():
        r = int(encoder[i])
        left = room.get(r, int(budget))
        if rows[i] <= left:
            room[r] = left - int(rows[i])
        else:
            encoder[i] = owner[i]
    return encoder


@dataclass(frozen=True)
class FrameFigures:
    """One micro-step's frames and what the assignment did with them (identical on every
    rank of the group). Costs in the cost function's unit."""

    frames: int
    patches: int
    frames_moved: int
    patches_moved: int
    cost_moved: int
    #: the least cost a plan must move to bring every rank down to the target
    #: ``max(ceil(total / ranks), costliest frame)``: the sum of each rank's excess over it
    #: (whole frames may not reach the target; a plan that stops above it moves less)
    cost_moved_min: int
    cost_max_before: int
    cost_max_after: int
    cost_mean: float
    patches_max_before: int
    patches_max_after: int
    #: the moved frames' transfer cost (:class:`FrameTransfer`; 0 when none was charged)
    transfer_moved: int = 0
    #: the link GB/s and tower TFLOP/s the transfer cost was computed from (0: none)
    link_gbps: float = 0.0
    tower_tflops: float = 0.0
    #: the rates the group measured (``runtime/rates.py``; 0: none measured yet)
    link_gbps_measured: float = 0.0
    tower_tflops_measured: float = 0.0


def frame_figures(owner, encoder, cost, patches, num_ranks: int, transfer=None, rates=None,
                  measured=None) -> FrameFigures:
    """The figures of one micro-step's assignment (see :class:`FrameFigures`);
    ``transfer[i]``: what moving frame ``i`` costs (None: nothing); ``rates``: the ``(link
    GB/s, tower TFLOP/s)`` it was computed from (None: none); ``measured``: those the group
    measured (None or 0: none)."""
    rates, measured = rates or (0.0, 0.0), measured or (0.0, 0.0)
    owner, encoder = np.asarray(owner, dtype=np.int64), np.asarray(encoder, dtype=np.int64)
    cost, patches = np.asarray(cost, dtype=np.int64), np.asarray(patches, dtype=np.int64)
    transfer = np.zeros_like(cost) if transfer is None else np.asarray(transfer, dtype=np.int64)
    load = lambda where, what: np.bincount(where, weights=what, minlength=num_ranks).astype(np.int64)  # noqa: E731
    before, after = load(owner, cost), load(encoder, cost)
    total = int(cost.sum())
    target = max(-(-total // num_ranks), int(cost.max()) if cost.size else 0)
    moved = owner != encoder
    return FrameFigures(
        frames=int(cost.size), patches=int(patches.sum()), frames_moved=int(moved.sum()),
        patches_moved=int(patches[moved].sum()), cost_moved=int(cost[moved].sum()),
        cost_moved_min=int(np.maximum(before - target, 0).sum()),
        cost_max_before=int(before.max()), cost_max_after=int(after.max()),
        cost_mean=total / num_ranks,
        patches_max_before=int(load(owner, patches).max()), patches_max_after=int(load(encoder, patches).max()),
        transfer_moved=int(transfer[moved].sum()),
        link_gbps=float(rates[0]), tower_tflops=float(rates[1]),
        link_gbps_measured=float(measured[0] or 0.0), tower_tflops_measured=float(measured[1] or 0.0))


@dataclass
class FrameWindow:
    """Sums of :class:`FrameFigures` over the micro-steps of a log interval (micro-steps
    with no frame anywhere count in ``micro_steps`` only; ``planned``: those with frames)."""

    micro_steps: int = 0
    planned: int = 0
    frames: int = 0
    patches: int = 0
    frames_moved: int = 0
    patches_moved: int = 0
    cost_moved: int = 0
    cost_moved_min: int = 0
    cost_max_before: int = 0
    cost_max_after: int = 0
    cost_mean: float = 0.0
    patches_max_before: int = 0
    patches_max_after: int = 0
    transfer_moved: int = 0
    link_gbps: float = 0.0
    tower_tflops: float = 0.0
    link_gbps_measured: float = 0.0
    tower_tflops_measured: float = 0.0
    #: micro-steps whose figures carry a measured link / tower rate
    link_measured_steps: int = 0
    tower_measured_steps: int = 0

    def add(self, figures: Optional[FrameFigures]) -> None:
        self.micro_steps += 1
        if figures is None:
            return
        self.planned += 1
        self.link_measured_steps += int(figures.link_gbps_measured > 0)
        self.tower_measured_steps += int(figures.tower_tflops_measured > 0)
        for f in fields(FrameFigures):
            setattr(self, f.name, getattr(self, f.name) + getattr(figures, f.name))

    def summary(self) -> Dict[str, float]:
        """The interval's figures: totals of frames, patches and moves; per micro-step means
        of the largest rank's cost (and patches) before and after; ``imbalance_*``: the
        largest rank's cost over the mean, as ratios of the interval's sums; ``link_gbps``,
        ``tower_tflops``: the mean rates the plans charged moves at (0: none), ``*_measured``:
        the mean of what the group measured, over the micro-steps that had a measurement (0:
        none yet)."""
        n, planned = max(1, self.micro_steps), max(1, self.planned)
        ratio = (lambda a: a / self.cost_mean if self.cost_mean else 1.0)  # noqa: E731
        return {
            "micro_steps": float(self.micro_steps), "frames": float(self.frames),
            "patches": float(self.patches), "frames_moved": float(self.frames_moved),
            "patches_moved": float(self.patches_moved), "cost_moved": float(self.cost_moved),
            "cost_moved_min": float(self.cost_moved_min), "transfer_moved": float(self.transfer_moved),
            "vision_max_before": self.cost_max_before / n, "vision_max_after": self.cost_max_after / n,
            "vision_mean": self.cost_mean / n,
            "imbalance_before": ratio(self.cost_max_before), "imbalance_after": ratio(self.cost_max_after),
            "patches_max_before": self.patches_max_before / n, "patches_max_after": self.patches_max_after / n,
            "link_gbps": self.link_gbps / planned, "tower_tflops": self.tower_tflops / planned,
            "link_gbps_measured": self.link_gbps_measured / max(1, self.link_measured_steps),
            "tower_tflops_measured": self.tower_tflops_measured / max(1, self.tower_measured_steps),
        }
