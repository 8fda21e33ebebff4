"""The planning of gpu_check's Bridge context-parallel check (the runs need 2 GPUs): the two
launcher commands, count vs cost, and the launcher's dry run of each."""
import json
import os
import subprocess
import sys

import pytest

import bridge_util as bu

SCRIPT = bu.REPO / "scripts" / "gpu_check.py"


def _gpu_check():
    sys.path.insert(0, str(bu.REPO / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


def test_plan_is_count_then_cost_on_context_parallel_2(tmp_path):
    plan = _gpu_check().bridge_cp_split_plan(repo=str(bu.REPO), bridge_dir="/b", data_path="/d",
                                             out=str(tmp_path), python="/py")
    assert [r["name"] for r in plan] == ["count", "cost"]
    for run in plan:
        assert run["env"]["CP"] == "2" and run["env"]["NPROC_PER_NODE"] == "2" and run["env"]["MM_BALANCE"] == "1"
        assert run["env"]["PRECISION"] == "fp32" and run["env"]["OUTPUT_DIR"].endswith(run["name"])
        assert run["argv"][-2:] == ["model.vision_dp_when_cp=true", f"mm_balance.cp_split={run['name']}"]
    assert plan[0]["env"]["OUTPUT_DIR"] != plan[1]["env"]["OUTPUT_DIR"]
    with pytest.raises(ValueError, match="even number of GPUs"):
        _gpu_check().bridge_cp_split_plan(repo=str(bu.REPO), bridge_dir="/b", data_path="/d", out="/o", gpus=3)


def test_plan_commands_through_the_launcher_dry_run(tmp_path):
    env = dict(os.environ, MEGATRON_BRIDGE_DIR="/b", DATA_PATH="/d")
    r = subprocess.run([sys.executable, str(SCRIPT), "--bridge-cp-split", "--plan-only", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    for run in plan:
        denv = {k: v for k, v in os.environ.items() if k != "MEGATRON_BRIDGE_DIR"}
        denv.update({k: v for k, v in run["env"].items() if k != "MEGATRON_BRIDGE_DIR"}, DRY_RUN="1")
        d = subprocess.run(run["argv"], env=denv, capture_output=True, text=True, timeout=60)
        assert d.returncode == 0, d.stderr
        cmd = d.stdout.splitlines()
        assert "model.context_parallel_size=2" in cmd and "mm_balance.enabled=true" in cmd
        assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and "model.expert_model_parallel_size=1" in cmd
        assert cmd[-1] == f"mm_balance.cp_split={run['name']}" and "model.vision_dp_when_cp=true" in cmd
    missing = subprocess.run([sys.executable, str(SCRIPT), "--bridge-cp-split"],
                             env={k: v for k, v in env.items() if k not in ("MEGATRON_BRIDGE_DIR", "DATA_PATH")},
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "MEGATRON_BRIDGE_DIR" in missing.stderr
