"""The FLOP-derived Qwen-VL cost ranks micro-batches as the CPU toy Qwen3-VL tower measures them.

tests/bridge/toy_tower_timing.py builds the toy config's vision tower with Bridge's own provider
(CPU harness) and times forward + backward on micro-batches of mixed frame sizes (equal patch
totals split into few large or many small frames, a video, other totals). The FLOP model's
ranking must follow the measured one (Spearman rank correlation), and more closely than the
patch count, which cannot tell the equal totals apart. Slow: ``-m realpath``.
"""
from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

import bridge_util as bu

pytestmark = [pytest.mark.realpath, pytest.mark.timeout(900)]


def spearman(a, b) -> float:
    """Rank correlation with tied values given their mean rank."""
    def ranks(x):
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def test_spearman_helper():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(spearman([1, 2, 3], [5, 5, 5]))


def test_flop_cost_ranks_the_toy_tower_as_measured(bridge_python, bridge_trees):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(bu.REPO), str(bridge_trees["bridge"] / "src"),
                                           str(bridge_trees["mlm"])]))
    res = subprocess.run([bridge_python, str(bu.REPO / "tests" / "bridge" / "toy_tower_timing.py")],
                         env=env, capture_output=True, text=True, timeout=600, cwd=str(bu.REPO))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    measured, flops, patches = out["measured_ms"], out["flops"], out["patches"]
    print("\n grids                              measured ms   FLOP model (GFLOP)   patches")
    for g, m, f, p in zip(out["grids"], measured, flops, patches):
        print(f" {str(g[:2]) + ('...' if len(g) > 2 else ''):<36} {m:10.1f} {f / 1e9:14.3f} {p:12d}")
    rho_flops, rho_patches = spearman(flops, measured), spearman(patches, measured)
    print(f" Spearman vs measured: FLOP model {rho_flops:.3f}, patch count {rho_patches:.3f}")
    assert rho_flops >= 0.9 and rho_flops > rho_patches, (rho_flops, rho_patches)
