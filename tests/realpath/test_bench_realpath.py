"""``mm-balance bench-realpath`` in a smoke setting: one round of off / sync / overlap / auto
through the user's launcher (``configs/megatron/vision_heavy_cpu.sh`` with a 2-layer CLIP and
4 micro-batches per step), its JSON report, the per-pack timing files, and equal losses.

About 2.5 minutes on 2 cores (four launcher runs of 5 iterations).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import realpath_util as rp

#: extended: the Bridge native-resolution benchmark's smoke test (tests/bridge) runs the same
#: benchmark code (bench/realpath.py) through the other framework in CI
pytestmark = [pytest.mark.realpath, pytest.mark.extended, pytest.mark.timeout(1800)]

ITERS, WARMUP, G = 3, 2, 4


def test_bench_realpath_smoke(megatron_lm, runs_dir):
    out = runs_dir / "bench-realpath"
    env = dict(os.environ, PYTHONPATH=f"{rp.REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "megatron_mm_balance.cli", "bench-realpath", "--megatron-lm", str(megatron_lm),
           "--rounds", "1", "--iters", str(ITERS), "--warmup", str(WARMUP), "--calibration-iters", "2",
           "--set", f"GBS={2 * G}", "--set", "MM_BALANCE_CPU_VIT=2,64,4,128", "--samples", "128",
           "--out", str(out), "--json", str(out / "report.json")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500, cwd=str(rp.REPO))
    print(r.stdout[-3000:])
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rep = json.loads((out / "report.json").read_text())

    assert list(rep["modes"]) == ["off", "sync", "overlap", "auto"]
    for mode, m in rep["modes"].items():
        it = m["iteration_ms"]
        assert it["n"] == (ITERS if mode != "auto" else 2) and 0 < it["min"] <= it["median"] <= it["max"], mode
        run = m["runs"][0]
        # every rank timed every micro-batch of every iteration
        timing = [json.loads(line) for k in (0, 1)
                  for line in open(os.path.join(run["out_dir"], "timing", f"timing-rank{k:05d}.jsonl"))]
        assert len(timing) == 2 * G * (ITERS + WARMUP), mode
        assert {t["iteration"] for t in timing} == set(range(1, ITERS + WARMUP + 1))
        if mode == "off":
            assert m["consumer_wait_ms_per_iteration"]["n"] == 0          # no balancer, no telemetry
        else:
            for key in ("consumer_wait_ms_per_iteration", "exchange_ms_per_iteration",
                        "exchange_cpu_ms_per_iteration"):
                assert m[key]["n"] > 0 and m[key]["median"] >= 0, (mode, key)
            assert m["gain_vs_off"] is not None
    # the auto run decided at iteration 4 (a model chosen, or image tokens kept with the reason)
    fit = rep["modes"]["auto"]["runs"][0]["fit"]
    assert ("from iteration 4" in fit) or ("fit refused" in fit) or ("kept image tokens" in fit), fit
    assert (out / "round1-auto" / "checkpoints" / "mm_balance_cost_fit.json").is_file()

    assert len(rep["losses"]) == 3 and all(x["equal"] and x["iterations"] == ITERS + WARMUP
                                           for x in rep["losses"]), rep["losses"]
    p = rep["predicted"]
    for key in ("unbalanced_ms", "perfect_ms", "perfect_gain", "vision_share_at_mean_pack",
                "overlap_placement_ms", "sync_placement_ms"):
        assert key in p and p[key] is not None, key
    assert p["perfect_ms"] <= p["unbalanced_ms"]
    s = rep["simulated"]
    for mode in ("off", "sync", "overlap"):
        assert s[mode]["simulated_ms"] > 0 and s[mode]["measured_ms"] > 0
    assert "losses equal off vs on in every run: yes" in r.stdout
