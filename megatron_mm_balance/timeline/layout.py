"""One global batch as a timeline per rank: what each rank did at every micro-step, and how
long it waited for the others. Pure numpy: no files, no drawing.

A rank's micro-step is, in the order it runs: the host's work before the micro-batch
(data, the loader, an exposed pack exchange: the gap between two timed micro-batches),
the vision forward (less the frames' exchange, shown apart where the records split it),
the exchange, waiting for the others, the language model (forward and backward) and the
vision backward. Where the ranks meet (``sync``):

* ``microstep`` (expert parallelism: the MoE all-to-alls meet every micro-step): every
  rank's language model starts when the last rank has arrived, and lasts the language
  phase of that rank (it waited least: the compute,
  :func:`~megatron_mm_balance.sim.run_trace.measured_phases`); a rank arrives after its
  previous vision backward, the host's gap and its vision forward. The time between its
  arrival and the last one's is its waiting. This is the simulator's micro-step timeline
  (:func:`~megatron_mm_balance.sim.timeline.simulate_timeline`) on the measured phases:
  the language phases the other ranks measured hold that waiting plus noise;
* ``step`` (data parallelism only): each rank runs its micro-steps back to back, its own
  measured phases; the language phase is all compute.

Every rank then waits for the slowest at the end of the step (the gradient all-reduce):
the step's span is the longest rank's, and each row ends with that wait.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

#: the phases of a micro-step, in the order a rank runs them (the last axis of ``phases``)
PHASES = ("host", "vision forward", "exchange", "waiting", "language model", "vision backward")
HOST, VISION_FORWARD, EXCHANGE, WAITING, LANGUAGE, VISION_BACKWARD = range(len(PHASES))
SYNC_MODES = ("microstep", "step")


@dataclass(frozen=True)
class BatchTimeline:
    """One global batch, as drawn: per row (a rank, or a node's mean rank) and micro-step the
    milliseconds of each of :data:`PHASES`, and the wait at the step's end."""

    title: str                      #: e.g. ``off, iteration 7``
    iteration: int
    labels: Tuple[str, ...]         #: one per row, top to bottom
    phases: np.ndarray              #: ``[rows, micro-steps, len(PHASES)]`` ms
    final_wait: np.ndarray          #: ``[rows]`` ms, waiting for the slowest at the step's end
    step_ms: float                  #: the longest rank's span (every rank's, not only the rows')
    waiting_share: float            #: waiting over all ranks' time in the step
    ranks: int                      #: the ranks of the global batch
    unit: str = "rank"              #: what a row is: ``rank`` or ``node``

    def busy_ms(self) -> np.ndarray:
        """``[rows]``: each row's time not spent waiting."""
        return busy_ms(self.phases)


def phase_durations(vf, lf, lb, vb, gap, lm_compute, exchange=None, *, sync: str = "microstep") -> np.ndarray:
    """``[..., D, G, len(PHASES)]`` ms from the records' arrays ``[..., D, G]``: vision forward
    ``vf``, language forward ``lf`` and backward ``lb``, vision backward ``vb``, the host gap
    before each micro-batch ``gap``, the language model's compute ``lm_compute`` (the same for
    every rank of a micro-step under ``microstep``) and the frames' exchange inside the
    vision forward ``exchange`` (zeros when None); laid out as the module docstring says."""
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {', '.join(SYNC_MODES)}, got {sync!r}")
    vf, lf, lb, vb, gap, lm_compute = (np.asarray(a, dtype=np.float64) for a in (vf, lf, lb, vb, gap, lm_compute))
    exchange = np.zeros_like(vf) if exchange is None else np.clip(np.asarray(exchange, dtype=np.float64), 0.0, vf)
    out = np.zeros(vf.shape + (len(PHASES),))
    out[..., HOST] = np.maximum(gap, 0.0)
    out[..., VISION_FORWARD] = vf - exchange
    out[..., EXCHANGE] = exchange
    out[..., VISION_BACKWARD] = vb
    if sync == "step":
        out[..., LANGUAGE] = lf + lb
        return out
    lm = np.broadcast_to(lm_compute, vf.shape)
    out[..., LANGUAGE] = lm
    clock = np.zeros(vf.shape[:-1])                                   # [..., D]: each rank's time
    for g in range(vf.shape[-1]):
        arrival = clock + out[..., g, HOST] + vf[..., g]
        start = arrival.max(axis=-1, keepdims=True)                   # the last rank's arrival
        out[..., g, WAITING] = start - arrival
        clock = start + lm[..., g] + vb[..., g]
    return out


def busy_ms(phases: np.ndarray) -> np.ndarray:
    """Time not spent waiting, summed over micro-steps: ``[..., D]`` of ``[..., D, G, P]``."""
    return phases.sum(axis=(-1, -2)) - phases[..., WAITING].sum(axis=-1)


def spans_ms(phases: np.ndarray) -> np.ndarray:
    """Each rank's end of compute, waiting inside the micro-steps included: ``[..., D]``."""
    return phases.sum(axis=(-1, -2))


def waiting_shares(phases: np.ndarray) -> np.ndarray:
    """Per global batch (``[I, D, G, P]`` -> ``[I]``): waiting (inside the micro-steps and at
    the step's end) over all ranks' time in the step, ``D x`` the longest span."""
    span = spans_ms(phases)
    total = span.shape[-1] * span.max(axis=-1)
    waiting = phases[..., WAITING].sum(axis=(-1, -2)) + (span.max(axis=-1, keepdims=True) - span).sum(axis=-1)
    return np.divide(waiting, total, out=np.zeros_like(total), where=total > 0)


def worst_batch(phases: np.ndarray) -> int:
    """Index of the global batch (``[I, D, G, P]``) whose ranks waited the largest share."""
    return int(np.argmax(waiting_shares(phases)))


def chosen_rows(phases: np.ndarray, slowest: int) -> list:
    """``[(row index, role)]`` of one batch (``[D, G, P]``): the ``slowest`` ranks by busy time,
    slowest first, then the median rank; every rank, slowest first, when that is all of them."""
    busy = busy_ms(phases)
    order = sorted(range(len(busy)), key=lambda d: (-busy[d], d))
    if slowest + 1 >= len(order):
        return [(d, "slowest" if k == 0 else "") for k, d in enumerate(order)]
    median = order[len(order) // 2]
    rows = [(d, "slowest" if k == 0 else f"#{k + 1} slowest") for k, d in enumerate(order[:slowest])]
    return rows + [(median, "median")]


def node_means(phases: np.ndarray, nodes: Sequence) -> Tuple[np.ndarray, list]:
    """``([N, G, P], node names)``: each node's mean rank (``phases`` ``[D, G, P]``, ``nodes``
    the node of each rank), nodes in order of first appearance."""
    names = list(dict.fromkeys(nodes))
    members = [[d for d, n in enumerate(nodes) if n == name] for name in names]
    return np.stack([phases[m].mean(axis=0) for m in members]), names


def batch_timeline(phases: np.ndarray, *, iteration: int, title: str, slowest: int = 3,
                   rank_names: Optional[Sequence] = None, nodes: Optional[Sequence] = None) -> BatchTimeline:
    """The rows of one global batch (``phases`` ``[D, G, P]``, :func:`phase_durations`): the
    ``slowest`` ranks and the median rank (:func:`chosen_rows`), or with ``nodes`` (the node
    of each rank) the slowest nodes' and the median node's mean ranks. ``rank_names``: the
    global rank of each row of ``phases`` (default its index). The step's span and waiting
    share are every rank's."""
    span = spans_ms(phases)
    step = float(span.max()) if span.size else 0.0
    share = float(waiting_shares(phases[None])[0])
    names = list(rank_names) if rank_names is not None else list(range(len(phases)))
    unit, rows = "rank", phases
    if nodes is not None:
        rows, names = node_means(phases, nodes)
        unit = "node"
    picked = chosen_rows(rows, slowest)
    chosen = rows[[d for d, _ in picked]]
    labels = tuple(f"{unit} {names[d]}" + (f" ({role})" if role else "") for d, role in picked)
    if unit == "node":
        size = {name: sum(1 for n in nodes if n == name) for name in names}
        labels = tuple(f"{lab}, mean of {size[names[d]]}" for lab, (d, _) in zip(labels, picked))
    return BatchTimeline(title=title, iteration=int(iteration), labels=labels, phases=chosen,
                         final_wait=step - spans_ms(chosen), step_ms=step, waiting_share=share,
                         ranks=len(phases), unit=unit)
