"""The cost ranks mixed-size micro-batches of the CPU toy tower as measured: Bridge's own
Qwen3-VL vision tower (configs/bridge/qwen3_vl_moe_tiny_cpu.py, under the CPU harness, whose
packed attention computes each frame alone) timed forward + backward on micro-batches that the
patch count mostly ties (one large frame, many small ones, a video, a few medium ones); the
FLOP-derived model (cost/flops.py, ``cost=model`` without a cost file) orders them as measured,
by Spearman rank correlation, better than the patch count does. The timing script is
tests/bridge/toy_tower_timing.py (best of 2 in turn, one thread).

Realpath: a Bridge environment start-up plus about 3 s of tower steps per repetition.
"""
from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

import bridge_util as bu

pytestmark = [pytest.mark.realpath, pytest.mark.timeout(900)]

#: the least rank correlation the FLOP model must reach (0.97 measured on a loaded machine)
FLOOR = 0.7


def spearman(a, b) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    def ranks(x):
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def test_spearman_takes_mean_ranks_of_ties():
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2, 2], [1, 2, 3, 4]) == pytest.approx(0.894427, abs=1e-6)


def test_the_flops_model_ranks_the_toy_towers_micro_batches_as_measured(bridge_python, bridge_trees):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(bu.REPO), str(bridge_trees["bridge"] / "src"), str(bridge_trees["mlm"])]), OMP_NUM_THREADS="1")
    r = subprocess.run([bridge_python, str(bu.REPO / "tests" / "bridge" / "toy_tower_timing.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["preset_is_this_tower"], "mm-balance replay's qwen3-vl-tiny-cpu preset is not the toy tower"
    flops = spearman(got["flops"], got["measured_ms"])
    patches = spearman(got["patches"], got["measured_ms"])
    rows = "\n".join(f"  {len(g):>2} x {tuple(g[0])}: {p:>5} patches, {m:7.1f} ms, {f / 1e9:6.2f} GFLOP"
                     for g, p, m, f in zip(got["grids"], got["patches"], got["measured_ms"], got["flops"]))
    print(f"\ntoy tower, best of 2: Spearman FLOP model {flops:.3f}, patch count {patches:.3f}\n{rows}")
    assert flops > patches and flops >= FLOOR, rows
