"""Short soak and the pass-through check across real processes (the 5,000-batch
soak is benchmarks/soak_runtime.py)."""
import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "rt_harness", os.path.join(os.path.dirname(__file__), "rt_harness.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


def test_short_soak_no_thread_growth_bounded_rss():
    res = harness.launch(2, "soak", hard_timeout=150, batches=300, warmup=50)
    for r, x in enumerate(res):
        assert "threads_end" in x, f"rank {r}: {x.get('error') or x}\n{x.get('log', '')}"
        assert x["threads_end"] == x["threads_warm"], x
        assert x["os_threads_end"] <= x["os_threads_warm"], x
        assert x["exchange_threads_closed"] == 0
        assert x["rss_end"] - x["rss_warm"] <= max(8.0, 0.05 * x["rss_warm"]), x
        assert x["moved"] > 0
        # MM_BALANCE_PROBE's samples (what the Megatron soak records): after warm-up the
        # threads, the open descriptors and the exchange's queues hold still
        after = [p for p in x["probe"] if p["global_batch"] >= 50]
        assert [p["global_batch"] for p in x["probe"]] == list(range(0, 300, 25))
        for key in ("threads", "os_threads", "fds", "requests"):
            assert len({p[key] for p in after}) == 1, (key, [p[key] for p in after])
        assert all(p["ready"] <= 1 and p["stats"] <= 1024 for p in x["probe"])


def test_disabled_issues_no_collectives():
    res = harness.launch(2, "disabled", hard_timeout=60)
    assert res[0].get("same_objects") is True, res[0]
    assert res[0]["threads_delta"] == 0 and res[0]["stats"] == 0


def test_bench_runtime_cli_smoke():
    """``mm-balance bench-runtime`` end to end, tiny: the table has every mode, and the
    savable-source mode checked its save_state against the consumed position."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "megatron_mm_balance.cli", "bench-runtime", "--world", "2",
           "--microbatches", "2", "--batches", "1", "--warmup", "0", "--rounds", "1",
           "--lm-ms", "1", "--vision-us-per-token", "0.1", "--bytes-per-image-token", "4",
           "--hard-timeout", "100"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=harness.ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    for mode in ("| off |", "| sync |", "| overlap |", "| overlap-callable |", "| overlap-save-state |",
                 "| ideal |", "exposed wait", "save_state() equal to the consumed position"):
        assert mode in out.stdout, out.stdout
    bad = subprocess.run(cmd[:4] + ["--world", "1"], capture_output=True, text=True, timeout=60,
                         cwd=harness.ROOT)
    assert bad.returncode == 2 and "--world" in bad.stderr


def test_shadow_measures_the_plan_and_moves_nothing():
    """Shadow mode on real gloo ranks: each rank gets its own packs in draw order, no bytes
    travel, and the statistics are the plan's (what balancing would have given)."""
    import numpy as np
    from megatron_mm_balance.solver.placement import PlanStats, plan_placement
    G, batches, world = 4, 3, 3
    res = harness.launch(world, "shadow", hard_timeout=90, G=G, batches=batches)
    for r, x in enumerate(res):
        assert "delivered" in x, f"rank {r}: {x.get('error') or x}"
        assert x["delivered"] == x["pulled"]                      # own packs, own order
        assert len(x["stats"]) == batches
    for gb in range(batches):
        costs = np.array([x["costs"][gb * G:(gb + 1) * G] for x in res])
        want = PlanStats.of(costs, plan_placement(costs))
        for x in res:
            st = x["stats"][gb]
            assert st["shadow"] is True and st["packs_sent"] == st["packs_received"] == 0
            assert st["bytes_sent"] == st["bytes_received"] == 0
            assert st["packs_moved"] == 0                         # delivered: nothing moved
            assert st["packs_would_move"] == want.packs_moved     # the plan's figure
            assert st["microstep_cost_after"] == want.microstep_cost_after
            assert st["predicted_gain"] == want.predicted_gain
    assert any(x["stats"][0]["packs_would_move"] for x in res)         # there was something to gain
