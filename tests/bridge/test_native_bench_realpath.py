"""``mm-balance bench-realpath --bridge`` in a smoke setting: one round of off and packs through
the user's launcher (``configs/bridge/qwen3_vl_moe_native_res_cpu.sh``, 2 micro-batches per
rank), the hold-out round on another data seed, the JSON report, the per-pack timing files
(every micro-batch of every rank, with its grids) and equal losses.

Four launcher runs of 4 iterations on a 48-sample native-res data set.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import bridge_util as bu

pytestmark = [pytest.mark.realpath, pytest.mark.timeout(1800)]

ITERS, WARMUP, G = 2, 2, 2      # 2 measured: a global batch is reported when the next one starts


def test_bridge_bench_realpath_smoke(bridge_python, bridge_trees, bridge_runs_dir):
    out = bridge_runs_dir / "bench-native"
    env = dict(os.environ, PYTHONPATH=f"{bu.REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "megatron_mm_balance.cli", "bench-realpath", "--bridge", str(bridge_trees["bridge"]),
           "--megatron-lm", str(bridge_trees["mlm"]), "--python", bridge_python, "--modes", "off,packs",
           "--rounds", "1", "--iters", str(ITERS), "--warmup", str(WARMUP), "--samples", "48",
           "--holdout-seed", "1", "--set", f"GBS={2 * G}", "--out", str(out), "--json", str(out / "report.json")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1700, cwd=str(bu.REPO))
    print(r.stdout[-4000:])
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rep = json.loads((out / "report.json").read_text())

    assert rep["meta"]["framework"] == "bridge" and list(rep["modes"]) == ["off", "packs"]
    # --host gpu-node (the default): every rank's batches drawn and its heap grown before its first iteration
    assert rep["meta"]["host"] == "gpu-node" and "host gpu-node" in r.stdout
    for d in ("round1-off", "round1-packs", "holdout-off", "holdout-packs"):
        log = (out / d / "train.log").read_text(errors="replace")
        assert f"drew {(ITERS + WARMUP) * G} micro-batches before the first iteration" in log, d
        assert "grew each rank's heap by" in log, d
    for mode, m in rep["modes"].items():
        it = m["iteration_ms"]
        assert it["n"] == ITERS and 0 < it["min"] <= it["median"] <= it["max"], mode
        timing = bu.timing_records(os.path.join(m["runs"][0]["out_dir"], "timing"))
        assert sorted(timing) == [0, 1] and all(len(v) == G * (ITERS + WARMUP) for v in timing.values()), mode
        assert all("grids" in rec for v in timing.values() for rec in v)
        assert any(len(rec["grids"]) > 0 for v in timing.values() for rec in v)
    assert rep["modes"]["packs"]["packs_moved_per_iteration"]["n"] > 0
    assert len(rep["losses"]) == 1 and all(x["equal"] and x["iterations"] == ITERS + WARMUP
                                           for x in rep["losses"]), rep["losses"]
    p = rep["predicted"]
    for key in ("unbalanced_ms", "perfect_ms", "perfect_gain", "placement_ms", "vision_share_at_mean_pack",
                "packs_placement_ms"):
        assert p.get(key) is not None, key
    assert p["perfect_ms"] <= p["unbalanced_ms"] and 0 < p["vision_share_at_mean_pack"] < 1
    # the placement objective on the off run's packs, from the FLOP cost the run wrote
    o = {k: v["ms"] for k, v in p["objective"].items()}
    assert o["perfect"] <= o["floor_frames"] + 1e-6 and o["floor_frames"] <= o["floor_packs"] + 1e-6
    assert o["floor_packs"] <= min(o["image_tokens"], o["flop_cost"], o["measured"], o["unbalanced"]) + 1e-6
    assert "the placement objective on the same packs" in r.stdout
    assert rep["simulated"]["off"]["simulated_ms"] > 0 and rep["simulated"]["packs"]["simulated_ms"] > 0
    h = rep["holdout"]
    assert h["seed"] == 1 and [x["mode"] for x in h["runs"]] == ["off", "packs"]
    for mode in ("off", "packs"):
        assert h[mode]["simulated_ms"] > 0 and h[mode]["measured_ms"] > 0 and h[mode]["rel_error"] is not None
    assert (out / "data-seed1" / "processor").is_dir()
    assert "hold-out data set (seed 1)" in r.stdout and "losses equal off vs on in every run: yes" in r.stdout
