"""Qwen3-VL's context-parallel frame split by cost against Bridge's equal-count split, on 2 real
gloo processes: the toy vision tower of configs/bridge/qwen3_vl_moe_tiny_cpu.py through Bridge's
own split / slice / all-gather functions (tests/bridge/cp_split_rank.py), native-resolution-like
micro-batches. Outputs and gradients must agree; the vision phase's max/mean across the two
context-parallel ranks is printed per micro-step for both splits (no time is asserted)."""
from pathlib import Path

import pytest

from megatron_mm_balance.testing.ranks import run_rank_script

RANK_SCRIPT = str(Path(__file__).with_name("cp_split_rank.py"))


@pytest.mark.realpath
def test_cost_split_equals_count_split_on_two_cp_ranks(bridge_python, bridge_trees):
    results = run_rank_script(RANK_SCRIPT, 2, timeout=600, python=bridge_python,
                              pythonpath=(bridge_trees["mlm"], bridge_trees["bridge"] / "src"))
    for r in results:
        assert "error" not in r, r.get("error")
    # Differences relative to each tensor's largest entry. Not bit-identical in fp32: the ranks
    # hold other frames, so the CPU GEMMs get other row counts (their kernels and summation
    # order depend on it) and each parameter gradient is summed over frames in another grouping
    # before the CP sum. With the tower cast to fp64 the differences fall by orders of magnitude
    # (measured 4.3e-10 for the embeddings of step 0, against 1.6e-7 in fp32), not to fp64's
    # 1e-16 (7.7e-8 for a layer-norm weight gradient): some of the tower's arithmetic, the norms
    # among it, stays below fp64 after the cast (not located further).
    for step, d in results[0]["diffs64"].items():
        assert len(d["names"]) > 4, (step, d)
        for name, rel in zip(d["names"], d["max_rel"]):
            assert rel <= (1e-6 if name.startswith("grad:") else 1e-8), (step, name, rel)
    for step, d in results[0]["diffs"].items():
        for name, rel in zip(d["names"], d["max_rel"]):
            assert rel <= (5e-6 if name.startswith("grad:") else 1e-6), (step, name, rel)
    rows = results[0]["rows"]
    assert [r["counts"] for r in rows] == [r["counts"] for r in results[1]["rows"]]   # every rank: one plan
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], {})[r["split"]] = r
    assert any(s["cost"]["predicted"] < s["count"]["predicted"] for s in by_step.values())
    assert all(s["cost"]["predicted"] <= s["count"]["predicted"] for s in by_step.values())
    print("\nvision phase (tower forward + backward) max/mean across the 2 CP ranks, per micro-step")
    print(f"{'step':>4} {'frames/rank count':>18} {'cost':>10} {'predicted count':>16} {'cost':>6}"
          f" {'measured count':>15} {'cost':>6}")
    for step, s in sorted(by_step.items()):
        c, k = s["count"], s["cost"]
        print(f"{step:>4} {str(c['counts']):>18} {str(k['counts']):>10} {c['predicted']:>16.3f} {k['predicted']:>6.3f}"
              f" {c['measured']:>15.3f} {k['measured']:>6.3f}")
    for label, key in (("fp32", "diffs"), ("fp64", "diffs64")):
        ds = results[0][key].values()
        out = max(r for d in ds for n, r in zip(d["names"], d["max_rel"]) if not n.startswith("grad:"))
        par = max(r for d in ds for n, r in zip(d["names"], d["max_rel"]) if n.startswith("grad:"))
        print(f"{label}: cost vs count, largest difference / largest entry: outputs and pixel "
              f"gradients {out:.2e}, parameter gradients {par:.2e}")
