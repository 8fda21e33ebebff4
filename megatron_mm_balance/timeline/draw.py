"""Drawing :class:`~.layout.BatchTimeline` panels as the seed's Figures 5 and 8 show a step:
one bar per rank along time, each micro-step's vision forward, language model and vision
backward in turn, and the waiting in between and at the end; a run without balancing
above, with balancing below, on one time axis. PNG and SVG (matplotlib, Agg). Pure
drawing: it reads no records.
"""
from __future__ import annotations

import os
from typing import List, Sequence

import numpy as np

from .layout import PHASES, WAITING, BatchTimeline

#: colour and hatch of each phase (:data:`~.layout.PHASES`), and of the wait at the step's end
STYLE = {
    "host": dict(facecolor="#bdbdbd"),
    "vision forward": dict(facecolor="#f28e2b"),
    "exchange": dict(facecolor="#59a14f"),
    "waiting": dict(facecolor="#fbe3e3", hatch="////", edgecolor="#d62728"),
    "language model": dict(facecolor="#4e79a7"),
    "vision backward": dict(facecolor="#b5531b"),
}
LEGEND = {"host": "host (data, loader, exposed pack exchange)", "exchange": "frames' exchange",
          "waiting": "waiting for other ranks"}
ROW_INCHES, PANEL_INCHES, WIDTH_INCHES = 0.42, 0.95, 11.0


def _unit(step_ms: float) -> tuple:
    return (1000.0, "s") if step_ms >= 2000 else (1.0, "ms")


def row_segments(phases: np.ndarray, final_wait: float) -> dict:
    """``{phase: [(start, width), ...]}`` of one row (``phases`` ``[G, P]``, ms), the final
    wait counted as waiting; zero-width segments left out."""
    widths = np.append(phases.reshape(-1), max(float(final_wait), 0.0))
    kinds = [PHASES[k] for _ in range(phases.shape[0]) for k in range(len(PHASES))] + [PHASES[WAITING]]
    starts = np.concatenate([[0.0], np.cumsum(widths)[:-1]])
    out: dict = {name: [] for name in PHASES}
    for kind, start, width in zip(kinds, starts, widths):
        if width > 0:
            out[kind].append((float(start), float(width)))
    return out


def _duration(ms: float) -> str:
    return f"{ms / 1000:,.2f} s" if ms >= 1000 else f"{ms:,.0f} ms"


def panel_title(panel: BatchTimeline, reference: BatchTimeline | None) -> str:
    vs = ""
    if reference is not None and reference.step_ms > 0 and panel is not reference:
        vs = f" ({panel.step_ms / reference.step_ms - 1:+.1%} vs {reference.title.split(',')[0]})"
    shown = f"{len(panel.labels)} of {panel.ranks} ranks" if panel.unit == "rank" else \
        f"{len(panel.labels)} nodes' mean ranks"
    return (f"{panel.title}: step {_duration(panel.step_ms)}{vs}; ranks waited "
            f"{panel.waiting_share:.0%} of it; {shown}")


def draw(panels: Sequence[BatchTimeline], stem: str, *, title: str = "") -> List[str]:
    """``stem.png`` and ``stem.svg`` with one panel per timeline, top to bottom, on one time
    axis; returns the paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not panels:
        raise ValueError("nothing to draw: no global batch")
    longest = max(p.step_ms for p in panels)
    scale, unit = _unit(longest)
    heights = [max(len(p.labels), 1) for p in panels]
    fig_h = 1.1 + sum(h * ROW_INCHES + PANEL_INCHES for h in heights)
    fig, axes = plt.subplots(len(panels), 1, figsize=(WIDTH_INCHES, fig_h), dpi=100, sharex=True,
                             gridspec_kw={"height_ratios": [h + 1.6 for h in heights]}, squeeze=False)
    used = set()
    for ax, panel in zip(axes[:, 0], panels):
        for y, (label, phases, wait) in enumerate(zip(panel.labels, panel.phases, panel.final_wait)):
            for kind, segs in row_segments(phases, wait).items():
                if segs:
                    used.add(kind)
                    style = dict(STYLE[kind])
                    edge = style.pop("edgecolor", "white")
                    ax.broken_barh([(s / scale, w / scale) for s, w in segs], (y - 0.36, 0.72),
                                   edgecolor=edge, linewidth=0.4, **style)
        ax.set_yticks(range(len(panel.labels)))
        ax.set_yticklabels(panel.labels, fontsize=8)
        ax.set_ylim(len(panel.labels) - 0.5, -0.5)
        ax.axvline(panel.step_ms / scale, color="#d62728", linewidth=0.8, linestyle="--")
        ax.set_title(panel_title(panel, panels[0]), fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlim(0, longest / scale * 1.02)
    axes[-1, 0].set_xlabel(f"time from the start of the global batch ({unit}); "
                           f"each bar: one rank's micro-steps in turn", fontsize=8)
    handles = [Patch(label=LEGEND.get(k, k), **{a: v for a, v in STYLE[k].items()})
               for k in PHASES if k in used]
    top = 0.3 if title else 0.05                                     # inches above the legend
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1.0 - top / fig_h))
    if title:
        fig.suptitle(title, fontsize=10, y=1.0 - 0.06 / fig_h, va="top")
    fig.tight_layout(rect=(0, 0, 1, 1.0 - (top + 0.25) / fig_h), pad=0.4, h_pad=1.2)
    paths = []
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    for ext in ("png", "svg"):
        path = f"{stem}.{ext}"
        fig.savefig(path)
        paths.append(path)
    plt.close(fig)
    return paths
