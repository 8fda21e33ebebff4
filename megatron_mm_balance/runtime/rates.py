"""Rates a run measures for itself: the data-parallel link's bytes per second and the vision
tower's FLOPs per second, agreed on by every rank of a group.

Image-level balancing charges a moved frame's transfer to the rank that receives it, in
frame-cost units, from two rates (``runtime/frames.py::FrameTransfer``). A nominal figure is
right only on the machine it was read on, so where a rate is not set the run measures it:

- every rank times its own work (:class:`RateMeter`): the bytes it sent and received over
  the seconds of the exchange that moved them, the FLOPs of the frames it encoded over the
  seconds of the tower's forward; it keeps the median of its last few samples
  (:class:`RateWindow`), so one slow micro-step does not swing the plan;
- it reports that median as an integer in the micro-step's first collective (the unit
  table's header, :func:`header_value`), so every rank reads every rank's figure;
- every rank takes the same value from the same integers (:func:`agreed_rate`: the median
  of the ranks that have one, else the prior, the setting or the device's nominal figure).

The same numbers on every rank, so the same plan. On a GPU a stretch is timed with CUDA
events, read once the work has completed (never a synchronisation), so its sample may arrive
a micro-step later. Knows nothing of Megatron.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Optional, Sequence

import numpy as np

#: the header's integer units: link rates in MB/s, tower rates in MFLOP/s
LINK_UNIT = 1e6
TOWER_UNIT = 1e6


class RateWindow:
    """The median of the last ``size`` samples of ``amount / seconds``; samples of less than
    ``min_amount`` are left out (a tiny transfer times its latency, not the link)."""

    def __init__(self, size: int = 8, min_amount: float = 0.0):
        self.samples: deque = deque(maxlen=max(1, int(size)))
        self.min_amount = float(min_amount)

    def add(self, amount: float, seconds: float) -> None:
        if seconds > 0 and amount > 0 and amount >= self.min_amount:
            self.samples.append(amount / seconds)

    def rate(self) -> Optional[float]:
        return float(np.median(self.samples)) if self.samples else None


def header_value(rate: Optional[float], unit: float) -> int:
    """``rate`` as the header's integer (in ``unit``; at least 1 for any positive rate); 0:
    none measured."""
    if rate is None or not rate > 0:
        return 0
    return max(1, int(round(rate / unit)))


def agreed_rate(values: Sequence[int], unit: float, prior: float) -> float:
    """The rate every rank uses: the median of the ranks' positive header integers, in
    ``unit``; ``prior`` when no rank has one. Identical on every rank given the same values."""
    measured = [int(v) for v in values if int(v) > 0]
    if not measured:
        return float(prior)
    return float(np.median(np.asarray(measured, dtype=np.float64))) * unit


class RateMeter:
    """Times stretches of work on one device and feeds their rates to :class:`RateWindow`\\ s.

    ``start()`` before the work, ``stop(token, amount, window)`` after it. On CPU the
    sample is the wall time, added at once; on CUDA two events on the current stream, added
    by :meth:`poll` once the second has completed."""

    def __init__(self, device_type: str = "cpu"):
        self.cuda = device_type == "cuda"
        self._pending: list = []

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        import torch
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, token, amount: float, window: RateWindow) -> None:
        if not self.cuda:
            window.add(amount, time.perf_counter() - token)
            return
        import torch
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((token, end, amount, window))

    def poll(self) -> None:
        """Adds the samples of every CUDA stretch that has completed (CPU: nothing pending)."""
        waiting = []
        for start, end, amount, window in self._pending:
            if end.query():
                window.add(amount, start.elapsed_time(end) / 1e3)
            else:
                waiting.append((start, end, amount, window))
        self._pending = waiting
