"""The GPU validation script's CPU fallback runs end to end (the GPU run itself is
done on a lent accelerator; see docs/gpu.md)."""
import json
import os
import subprocess
import sys

from megatron_mm_balance.cost.model import load_cost_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
