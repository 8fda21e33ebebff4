"""A run's timing directory as :mod:`.layout`'s arrays: every complete global batch's phases
per rank and micro-step, the ranks and their nodes.

Reads what ``--mm-balance-timing-dir`` (Bridge: ``mm_balance.timing_dir``) wrote, per rank or
per node files, every iteration or sampled (:mod:`megatron_mm_balance.cost.timing_files`),
through :func:`~megatron_mm_balance.sim.run_trace.load_run`. On CPU the records are
``perf_counter`` spans; on GPU CUDA-event spans (the timing hooks' clock).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from ..sim.run_trace import RunTrace, RunTraceError, load_run, measured_phases
from .layout import phase_durations

#: the figure of the frames' exchange inside the vision forward (``mm_balance.vision=images``)
#: that is not the tower's own compute: gathers, planning, transfers, waits and copies
EXCHANGE_TOTAL, EXCHANGE_TOWER = "vision_exchange_ms", "vision_tower_ms"


@dataclass(frozen=True)
class RunPhases:
    """A run's complete global batches, as the timeline draws them."""

    directory: str
    iterations: Tuple[int, ...]
    ranks: Tuple[int, ...]
    nodes: Optional[Tuple[str, ...]]     #: each rank's node, where the records name it
    phases: np.ndarray                   #: ``[I, D, G, len(PHASES)]`` ms

    def index(self, iteration: int) -> int:
        if iteration not in self.iterations:
            raise RunTraceError(f"{self.directory}: no complete global batch at iteration {iteration} "
                                f"(complete: {_ranges(self.iterations)})")
        return self.iterations.index(iteration)


def exchange_ms(trace: RunTrace) -> np.ndarray:
    """``[I, D, G]``: the frames' exchange inside each vision forward (its records'
    ``details``, less the tower's compute); zeros without them."""
    def of(rec):
        details = rec.get("details") or {}
        return max(float(details.get(EXCHANGE_TOTAL, 0.0)) - float(details.get(EXCHANGE_TOWER, 0.0)), 0.0)
    return trace._map(of)


def rank_nodes(trace: RunTrace, ranks_per_node: Optional[int] = None) -> Optional[Tuple[str, ...]]:
    """Each rank's node: ``rank // ranks_per_node`` when given, else the ``node`` the records
    carry (every written line names it), else None."""
    if ranks_per_node:
        return tuple(str(r // ranks_per_node) for r in trace.ranks)
    first = [trace.records[0][d][0].get("node") for d in range(len(trace.ranks))]
    return tuple(str(n) for n in first) if all(n is not None for n in first) else None


def read_run(directory: str, *, sync: str = "microstep", skip_iterations: int = 2,
             ranks_per_node: Optional[int] = None) -> RunPhases:
    """The complete global batches after the first ``skip_iterations`` (warm-up) of the run
    in ``directory``, as :func:`~.layout.phase_durations` lays them out."""
    trace = load_run(directory, skip_iterations=skip_iterations)
    measured = measured_phases(trace)
    phases = phase_durations(trace.vf, trace.lf, trace.lb, trace.vb, measured.gap, measured.lm,
                             exchange_ms(trace), sync=sync)
    return RunPhases(directory, tuple(trace.iterations), tuple(trace.ranks), rank_nodes(trace, ranks_per_node),
                     phases)


def _ranges(values) -> str:
    """``1-5, 8, 10-12``: a sorted list of integers, shortly."""
    out, start, prev = [], None, None
    for v in sorted(values):
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ", ".join(out)
