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


def test_disabled_issues_no_collectives():
    res = harness.launch(2, "disabled", hard_timeout=60)
    assert res[0].get("same_objects") is True, res[0]
    assert res[0]["threads_delta"] == 0 and res[0]["stats"] == 0
