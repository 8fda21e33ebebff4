"""``mm-balance timeline``: where a run's time went in one global batch, rank by rank.

    mm-balance timeline OFF_TIMING_DIR [ON_TIMING_DIR] [--iteration N] [--slowest K]
        [--per-node] [--ranks-per-node N] [--sync microstep|step] [--labels off,on]
        [--title TEXT] --out PATH

Reads the per-pack timings a run wrote (``--mm-balance-timing-dir``; per rank or per node
files, every iteration or sampled) and draws one global batch as ``PATH.png`` and
``PATH.svg``: the ``--slowest`` ranks and the median rank (``--per-node``: nodes' mean
ranks), each micro-step's vision forward, language model, vision backward, the waiting,
and the frames' exchange where the records have it. The batch is the one whose ranks
waited the largest share of the step (of the first run), or ``--iteration``. A second
timing directory (the same job with balancing on) is drawn below it at the same
iteration, on the same time axis. Prints what it drew.
"""
from __future__ import annotations

import argparse

from ..sim.run_trace import RunTraceError
from .draw import draw, panel_title
from .layout import SYNC_MODES, WAITING, BatchTimeline, batch_timeline, worst_batch
from .records import read_run


class TimelineError(ValueError):
    """Bad input to ``mm-balance timeline``: one line."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="TIMING_DIR",
                   help="a run's --mm-balance-timing-dir (or mm_balance.timing_dir); a second one, the same "
                        "job with balancing on, is drawn below the first at the same iteration")
    p.add_argument("--iteration", type=int, default=None,
                   help="the global batch to draw (default: the first run's batch whose ranks waited "
                        "the largest share of the step)")
    p.add_argument("--slowest", type=int, default=3,
                   help="the slowest ranks (nodes) drawn, with the median one (default %(default)s)")
    p.add_argument("--per-node", action="store_true",
                   help="one row per node: the mean of its ranks (nodes from the records, or "
                        "--ranks-per-node)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="rank r on node r // N (default: the node each record names)")
    p.add_argument("--sync", choices=SYNC_MODES, default="microstep",
                   help="where the run's ranks met: microstep (expert parallel: waiting inside the "
                        "language model) or step (data parallel only: at the step's end); default "
                        "%(default)s")
    p.add_argument("--skip-iterations", type=int, default=2,
                   help="first iterations left out: start-up (default %(default)s)")
    p.add_argument("--labels", default="off,--mm-balance",
                   help="the runs' names in the figure, comma separated (default %(default)s)")
    p.add_argument("--title", default="", help="the figure's title")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="write PATH.png and PATH.svg (a trailing .png or .svg is dropped)")


def _checked(a) -> list:
    if len(a.runs) > 2:
        raise TimelineError(f"at most two timing directories (off, then on), got {len(a.runs)}")
    if a.slowest < 1:
        raise TimelineError(f"--slowest must be >= 1, got {a.slowest}")
    if a.ranks_per_node is not None and a.ranks_per_node < 1:
        raise TimelineError(f"--ranks-per-node must be >= 1, got {a.ranks_per_node}")
    if a.skip_iterations < 0:
        raise TimelineError(f"--skip-iterations must be >= 0, got {a.skip_iterations}")
    labels = [s.strip() for s in a.labels.split(",")]
    if len(labels) < len(a.runs) or not all(labels[:len(a.runs)]):
        raise TimelineError(f"--labels: one name per timing directory, got {a.labels!r}")
    return labels[:len(a.runs)]


def panels_of(runs: list, labels: list, *, iteration=None, slowest: int = 3,
              per_node: bool = False) -> list:
    """One :class:`BatchTimeline` per run (:class:`~.records.RunPhases`) at ``iteration``, default the
    first run's worst batch; every run must have that batch."""
    first = runs[0]
    if iteration is None:
        iteration = first.iterations[worst_batch(first.phases)]
    panels = []
    for run, label in zip(runs, labels):
        nodes = None
        if per_node:
            if run.nodes is None:
                raise TimelineError(f"{run.directory}: the records name no node: pass --ranks-per-node N")
            nodes = run.nodes
        panels.append(batch_timeline(run.phases[run.index(iteration)], iteration=iteration,
                                     title=f"{label}, iteration {iteration}", slowest=slowest,
                                     rank_names=run.ranks, nodes=nodes))
    return panels


def describe(panel: BatchTimeline, reference: BatchTimeline) -> list:
    """The lines printed for a panel: its title, and each row's busy and waiting time."""
    lines = [panel_title(panel, reference)]
    waits = panel.phases[:, :, WAITING].sum(axis=1) + panel.final_wait
    for label, busy, wait in zip(panel.labels, panel.busy_ms(), waits):
        lines.append(f"  {label:<28} busy {busy:10,.1f} ms   waiting {wait:10,.1f} ms")
    return lines


def cmd(a) -> int:
    labels = _checked(a)
    stem = a.out[:-4] if a.out.endswith((".png", ".svg")) else a.out
    try:
        runs = [read_run(d, sync=a.sync, skip_iterations=a.skip_iterations, ranks_per_node=a.ranks_per_node)
                for d in a.runs]
        panels = panels_of(runs, labels, iteration=a.iteration, slowest=a.slowest, per_node=a.per_node)
    except RunTraceError as exc:
        raise TimelineError(str(exc)) from None
    for panel in panels:
        print("\n".join(describe(panel, panels[0])))
    for path in draw(panels, stem, title=a.title):
        print(f"wrote {path}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("timeline", help="draw one global batch of a run's per-pack timings, rank by "
                              "rank (the slowest ranks and the median one; off above on)")
    add_arguments(p)
    p.set_defaults(func=cmd)

