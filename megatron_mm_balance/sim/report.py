"""The stdout table and ``report.json`` of a simulation.

``report.json`` is ``{"runs": [...], "meta": {...}}``; every run carries at least
``dp``, ``ep`` (the per-micro-step group size; ``dp`` when every rank meets every
micro-step), ``strategy`` (``none``, ``budget``, ``local``, ``redistribute-sync``,
``redistribute-overlap``, ``redistribute-groups``, ...), ``efficiency``, ``wait_share``, ``throughput_rel`` and
``bytes_moved_per_step``; ``budget`` runs name their image budget. Rows with
``"bound": true`` (``perfect``, ``floor-packs``, ``floor-frames``) are not strategies but
what no placement beats on the same global batches (:mod:`megatron_mm_balance.solver.floors`):
their step time and throughput are the bound's, their waiting, exchange and movement
``null``. Strategy runs carry ``objective_over_perfect``: their placement's objective
(``sum_m (max_r V + max_r L)``, or the largest rank total under ``sync="step"``) over the
perfectly even one, the quantity the floors bound (the bound rows carry theirs);
``perfect_share``: throughput over the ``perfect`` row's. ``redistribute-images`` and
``redistribute-frames`` also carry ``vision_moved_share`` (vision time encoded away from
its pack's rank over all of it) and ``vision_max_over_floor`` (each micro-step's largest
encoder load over ``max(mean, heaviest image)``, summed).
"""
from __future__ import annotations

import json
import math
import os

REQUIRED_KEYS = ("dp", "strategy", "efficiency", "wait_share", "throughput_rel",
                 "bytes_moved_per_step")

def _pct(key, digits=1):
    return lambda r: "-" if r.get(key) is None else f"{round(r[key] * 100, digits) + 0.0:.{digits}f}%"


COLUMNS = [
    ("llm_b", 6, lambda r: "-" if r.get("llm_params_b") is None else f"{r['llm_params_b']:g}"),
    ("dp", 5, lambda r: str(r["dp"])),
    ("strategy", 20, lambda r: r["strategy"] + (f"@{r['budget']}" if r.get("budget") else "")),
    ("pack_eff", 8, lambda r: f"{r['efficiency'] * 100:.1f}%"),
    ("step_s", 8, lambda r: f"{r['time_per_batch_ms'] / 1000:.2f}"),
    ("wait", 6, _pct("wait_share")),
    ("exch", 6, _pct("exchange_share")),
    ("slowdown", 8, _pct("slowdown")),
    ("thru_rel", 8, lambda r: f"{r['throughput_rel']:.3f}"),
    ("of_perf", 7, lambda r: f"{r['perfect_share'] * 100:.1f}%" if r.get("perfect_share") else "-"),
    ("obj/perf", 8, lambda r: "-" if r.get("objective_over_perfect") is None
     else f"{r['objective_over_perfect']:.4f}"),
    ("moved", 6, _pct("moved_fraction", 0)),
    ("GB/step", 8, lambda r: "-" if r.get("bytes_moved_per_step") is None
     else f"{r['bytes_moved_per_step'] / 1e9:.2f}"),
    ("inter GB", 8, lambda r: "-" if r.get("bound")
     else f"{r.get('inter_node_bytes_per_step', 0.0) / 1e9:.2f}"),
]


#: with step groups (``--ep`` below DP): the expert-parallel size after ``dp``, and the
#: packs computed in another step group at the end
EP_COLUMN = ("ep", 5, lambda r: str(r.get("ep", r["dp"])))
INTER_GROUP_COLUMN = ("inter grp", 9, lambda r: "-" if r.get("bound")
                      else _pct("inter_group_moved_fraction")(r))


def format_table(runs: list[dict]) -> str:
    cols = COLUMNS
    if any(r.get("ep", r["dp"]) != r["dp"] for r in runs):
        cols = COLUMNS[:2] + [EP_COLUMN] + COLUMNS[2:] + [INTER_GROUP_COLUMN]
    head = "  ".join(name.rjust(w) if i else name.ljust(w)
                     for i, (name, w, _) in enumerate(cols))
    lines = [head, "-" * len(head)]
    for r in runs:
        lines.append("  ".join(f(r).rjust(w) if i else f(r).ljust(w)
                               for i, (_, w, f) in enumerate(cols)))
    return "\n".join(lines)


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if hasattr(v, "item"):          # numpy scalars
        return _clean(v.item())
    return v


def write_report(out_dir: str, runs: list[dict], meta: dict) -> str:
    path = os.path.join(out_dir, "report.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_clean({"runs": runs, "meta": meta}), f, indent=1)
        f.write("\n")
    return path


def check_report(report: dict) -> None:
    """Raise ``ValueError`` if ``report`` breaks the CLI contract."""
    if not isinstance(report, dict) or not isinstance(report.get("runs"), list):
        raise ValueError("report must be an object with a 'runs' list")
    for i, r in enumerate(report["runs"]):
        for k in REQUIRED_KEYS:
            if k not in r:
                raise ValueError(f"run {i} lacks '{k}'")
        if r["strategy"] == "budget" and not r.get("budget"):
            raise ValueError(f"run {i}: a budget run must name its budget")
