"""PNG plots of a simulation (matplotlib, Agg backend, small files).

* ``wait_share_vs_dp.png``: share of time spent waiting vs DP size, one line per
  strategy (one per budget);
* ``throughput_vs_dp.png``: throughput relative to 1D greedy packing vs DP;
* ``heatmap.png``: per-rank x micro-step load (ms) of one global batch before
  balancing, after local reordering and after redistribution, same colour scale.
"""
from __future__ import annotations

import os

import numpy as np

STYLE = {
    "none": dict(color="black", marker="o"),
    "local": dict(color="tab:orange", marker="s"),
    "redistribute-sync": dict(color="tab:blue", marker="^"),
    "redistribute-overlap": dict(color="tab:green", marker="v"),
    # the bounds (report rows with "bound": true): what no placement of whole units beats
    "perfect": dict(color="gray", linestyle=":"),
    "floor-packs": dict(color="gray", linestyle="--"),
    "floor-frames": dict(color="gray", linestyle="-."),
}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _series(runs, key):
    out: dict[str, list] = {}
    for r in runs:
        name = r["strategy"] + (f"@{r['budget']}" if r.get("budget") else "")
        if r.get("llm_params_b") is not None and len({x.get("llm_params_b") for x in runs}) > 1:
            name += f" ({r['llm_params_b']:g}B)"
        out.setdefault(name, []).append((r["dp"], r[key]))
    return out


def _line_plot(runs, key, ylabel, title, path, percent):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=80)
    budgets = sorted({r["budget"] for r in runs if r.get("budget")})
    cmap = plt.get_cmap("Purples")
    for name, pts in _series(runs, key).items():
        pts.sort()
        xs, ys = [p[0] for p in pts], [p[1] * (100 if percent else 1) for p in pts]
        base = name.split("@")[0].split(" ")[0]
        st = dict(STYLE.get(base, {}))
        if base == "budget":
            b = int(name.split("@")[1].split(" ")[0])
            st = dict(color=cmap(0.4 + 0.6 * budgets.index(b) / max(1, len(budgets) - 1)),
                      marker=".", linestyle="--")
        ax.plot(xs, ys, label=name, **st)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("data-parallel ranks (DP)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_all(out_dir: str, runs: list[dict], heat: dict | None, *, title: str = "",
             heatmap_ranks: int = 64) -> list[str]:
    strategies = [r for r in runs if not r.get("bound")]
    paths = [
        _line_plot(strategies, "wait_share", "time spent waiting (%)", f"Waiting share vs DP {title}",
                   os.path.join(out_dir, "wait_share_vs_dp.png"), True),
        _line_plot(runs, "throughput_rel", "throughput / 1D greedy",
                   f"Throughput vs DP {title}", os.path.join(out_dir, "throughput_vs_dp.png"),
                   False),
    ]
    if heat:
        paths.append(plot_heatmap(os.path.join(out_dir, "heatmap.png"), heat,
                                  ranks=heatmap_ranks, title=title))
    return paths


def plot_heatmap(path: str, heat: dict, *, ranks: int = 64, title: str = "") -> str:
    """Heat maps of the first ``ranks`` ranks; titles give the all-rank critical path."""
    plt = _plt()
    names = [n for n in ("none", "local", "redistribute") if n in heat]
    full = [np.asarray(heat[n]) for n in names]
    mats = [m[:ranks] for m in full]
    vmin = min(float(m.min()) for m in mats)
    vmax = max(float(m.max()) for m in mats)
    fig, axes = plt.subplots(1, len(mats), figsize=(3.0 * len(mats) + 1.2, 4.2), dpi=80,
                             squeeze=False, constrained_layout=True)
    im = None
    for ax, n, m, f in zip(axes[0], names, mats, full):
        im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="magma",
                       vmin=vmin, vmax=vmax)
        ax.set_title(f"{n}\nsum of micro-step max\n(all {f.shape[0]} ranks): "
                     f"{f.max(axis=0).sum() / 1000:.1f} s", fontsize=8)
        ax.set_xlabel("micro-step")
    axes[0][0].set_ylabel(f"rank (first {mats[0].shape[0]} of {full[0].shape[0]})")
    fig.colorbar(im, ax=axes[0].tolist(), label="pack time (ms)")
    fig.suptitle(f"Per-rank x micro-step load, one global batch\n{title}", fontsize=9)
    fig.savefig(path)
    plt.close(fig)
    return path
