"""The GPU validation script's CPU fallback runs end to end (the GPU run itself is
done on a lent accelerator; see docs/gpu.md)."""
import json
import os
import subprocess
import sys

import pytest

from megatron_mm_balance.cost.model import load_cost_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.realpath             # slow (about 40 s): the whole script on CPU
def test_gpu_check_cpu_fallback_writes_results(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--cpu"],
                          env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "delivered tensors bit-identical                        True" in proc.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["overlap"]["sync"]["bit_identical"] and report["overlap"]["overlap"]["bit_identical"]
    model = load_cost_file(str(tmp_path / "cost_model.json"))
    assert model.vision_ms_per_token > 0 or model.vision_ms_per_token_sq > 0
    records = json.loads((tmp_path / "calibration.json").read_text())["records"]
    assert len(records) >= 5 and records[0]["images"] == []
    # part 3: the timing hooks timed every micro-batch of the LLaVA-shaped model, and the online
    # fit was decided (accepted, or refused with its reason: CPU timings of a tiny encoder are noisy)
    timing = report["timing"]
    assert timing["records"] == timing["expected"] == 18 and timing["with_vision"] > 0
    assert len((tmp_path / "timing-rank00000.jsonl").read_text().splitlines()) == 18
    from megatron_mm_balance.cost.calibration import read_fit
    fit = read_fit(str(tmp_path / "online_fit.json"))
    assert fit.records == 12 and (fit.ok or fit.reason)
    assert "micro-batches timed by the hooks / run" in proc.stdout


def test_gpu_check_functions_in_process():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    src = gpu_check.PackSource(3, 0.01)
    assert len(set(src.digests)) == 3
    assert gpu_check.digest(src.packs[0]) == src.digests[0]


# -- part 5 (Megatron-Bridge's Qwen3-VL toy): its plan per machine, its log reading, its skips.
# The run itself: tests/bridge/test_bridge_installed.py (realpath, through the CPU harness).
def _dry_run(gpus, **env):
    e = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM_DIR", "MEGATRON_BRIDGE_DIR")}
    e.update(GPU_COUNT=str(gpus), OUT="/tmp/gpu-out", **env)
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry-run"],
                          env=e, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    head, _, rest = proc.stdout.partition("its launcher runs:\n")
    plan, six, tail = rest.partition("== 6.")         # part 5's JSON plan, then part 6's line
    return head + six + tail, (json.loads(plan) if plan else None)


def test_gpu_check_dry_run_plans_each_machine():
    head, plan = _dry_run(0)
    assert "the CPU configuration" in head and "4. off/on in Megatron-LM's own loop: skipped (0 GPU" in head
    assert "5. Megatron-Bridge Qwen3-VL toy: skipped (no GPU visible" in head and plan is None
    head, plan = _dry_run(1)
    assert "the GPU configuration" in head and "skipped (1 GPU visible; needs 2)" in head
    assert [(r["name"], r["env"]["NPROC_PER_NODE"], r["env"]["MM_BALANCE"]) for r in plan] == [("1gpu-on", "1", "1")]
    head, plan = _dry_run(2)
    assert "skipped (set MEGATRON_LM_DIR" in head
    assert [(r["name"], r["env"]["NPROC_PER_NODE"], r["env"]["EP"], r["env"]["MM_BALANCE"]) for r in plan] == \
        [("dp2-off", "2", "1", "0"), ("dp2-on", "2", "1", "1")]
    assert plan[1]["argv"][1].endswith("scripts/pretrain_bridge_vlm.sh") and plan[1]["argv"][2] == "--config"
    assert plan[1]["env"]["OUTPUT_DIR"] == "/tmp/gpu-out/bridge/dp2-on"
    head, plan = _dry_run(4, MEGATRON_LM_DIR="/m")
    assert "bench-realpath --megatron-lm /m --out /tmp/gpu-out/bench-realpath" in head
    assert [(r["name"], r["env"]["NPROC_PER_NODE"], r["env"]["EP"]) for r in plan] == \
        [("dp2-ep2-off", "4", "2"), ("dp2-ep2-on", "4", "2")]
    assert "6. Bridge CP=2 frame split: skipped (needs 2 GPUs, MEGATRON_BRIDGE_DIR" in head
    head, _ = _dry_run(2, MEGATRON_BRIDGE_DIR="/b", DATA_PATH="/d")
    assert "6. Bridge Qwen3-VL CP=2 frame split, count vs cost: timeout 1900" in head and "--bridge-cp-split" in head


#: Two iterations as Bridge's training_log prints them, and our telemetry line.
BRIDGE_LOG = """\
 [2026-12-02 05:00:00] iteration        1/       3 | consumed samples:            8 | elapsed time per iteration (ms): 2714.5 | learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 6.542763E+00 | loss scale: 1.0 |
[mm-balance] iteration 1 | imbalance_before: 1.4 | imbalance_after: 1.1 | packs_moved: 2 | solver_ms: 0.3
 [2026-12-02 05:00:03] iteration        2/       3 | consumed samples:           16 | elapsed time per iteration (ms): 812.0 | learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 6.533825E+00 | loss scale: 1.0 |
"""


def test_gpu_check_reads_bridge_logs():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    res = gpu_check.parse_bridge_log(BRIDGE_LOG)
    assert res == {"elapsed_ms": {1: 2714.5, 2: 812.0}, "losses": {1: 6.542763, 2: 6.533825},
                   "packs_moved": {1: 2}}
    assert gpu_check.median_after_warmup({1: 9.0, 2: 5.0, 3: 1.0, 4: 2.0, 5: 3.0}) == 2.0
    assert gpu_check.median_after_warmup({1: 9.0}) == 9.0 and gpu_check.median_after_warmup({}) is None


def test_gpu_check_bridge_part_skips_without_bridge(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_BRIDGE_DIR", "PYTHON", "DRY_RUN")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--out", str(tmp_path),
                           "--bridge-only", "--bridge-ranks", "2"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "5. Megatron-Bridge Qwen3-VL toy: skipped (no Megatron-Bridge" in proc.stdout
    assert json.loads((tmp_path / "bridge_check.json").read_text())["skipped"].startswith("no Megatron-Bridge")
    missing = tmp_path / "nowhere"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--out", str(tmp_path),
                           "--bridge-only", "--bridge-ranks", "1"], env=dict(env, MEGATRON_BRIDGE_DIR=str(missing)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"skipped (pretrain_bridge_vlm: {missing} has no src/megatron/bridge" in proc.stdout
