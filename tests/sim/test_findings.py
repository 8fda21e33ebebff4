"""The seed's qualitative findings, reproduced on the mixed trace at small DP.

Each test states the finding it checks; the numbers at production scale are in
docs/simulator.md. Pools are packed once per process (8,000 samples of the
shuffled ``mixed`` trace; the packer's efficiency uses the whole trace).
"""
import pytest

from megatron_mm_balance.data.mixtures import mixed
from megatron_mm_balance.data.packing import pack_greedy
from megatron_mm_balance.sim.engine import SimConfig, simulate_dp
from megatron_mm_balance.sim.pool import build_pool, pool_stats
from megatron_mm_balance.sim.timing import load_timing

ALL = ("none", "local", "redistribute-sync", "redistribute-overlap")


@pytest.fixture(scope="module")
def samples():
    return mixed(0)[:8000]


@pytest.fixture(scope="module")
def pool(samples):
    return build_pool(samples, 8192, cache_key="findings-mixed-8000")


def run(pool, D, timing, *, sync="microstep", ga=8, batches=4, strategies=ALL):
    cfg = SimConfig(dps=[D], ga=ga, seq_len=8192, sync=sync, batches=batches,
                    strategies=strategies)
    runs, _ = simulate_dp(cfg, D, timing, pool, {})
    return {r["strategy"]: r for r in runs}


def test_greedy_1d_packing_is_over_99_percent_at_8k():
    assert pack_greedy(mixed(0), 8192).efficiency >= 0.99


def test_budget_packing_collapses_then_approaches_1d(samples, pool):
    eff, cv = {}, {}
    for b in (2048, 3072, 4096, 6144):
        st = pool_stats(build_pool(samples, 8192, budget=b, cache_key="findings-mixed-8000"))
        eff[b], cv[b] = st["efficiency"], st["image_tokens_cv"]
    # Budgets that balance (image tokens per pack spread halved) leave sequences ~1/3 empty.
    assert cv[3072] < 0.6 * pool_stats(pool)["image_tokens_cv"]
    assert eff[3072] < 0.75
    # The dial: efficiency rises with the budget and returns to 1D greedy.
    assert eff[2048] < eff[3072] < eff[4096] < eff[6144]
    assert eff[6144] >= pool.efficiency - 0.01


def test_waiting_share_grows_with_dp(pool):
    t = load_timing("default")
    waits = [run(pool, D, t, strategies=("none",))["none"]["wait_share"] for D in (8, 64, 512)]
    assert waits[0] < waits[1] < waits[2]
    assert waits[2] > 0.3


def test_balancing_gain_shrinks_as_the_llm_grows(pool):
    t = load_timing("default")
    gains = [run(pool, 64, t.with_llm_params(n))["redistribute-overlap"]["throughput_rel"] - 1
             for n in (2, 8, 32, 128)]
    assert all(a > b for a, b in zip(gains, gains[1:])), gains
    assert gains[-1] > 0


def test_local_reordering_helps_less_as_dp_grows(pool):
    t = load_timing("default")

    def share(D):   # share of the redistribution gain that local reordering gets
        r = run(pool, D, t)
        gain = {k: r[k]["throughput_rel"] - 1 for k in ("local", "redistribute-overlap")}
        return gain["local"] / gain["redistribute-overlap"]
    small, large = share(8), share(512)
    assert 0 < large < small


def test_local_reordering_does_nothing_without_per_microstep_meetings(pool):
    r = run(pool, 64, load_timing("default"), sync="step", strategies=("none", "local"))
    assert r["local"]["throughput_rel"] == pytest.approx(1.0)


def test_overlap_recovers_most_and_sync_much_less(pool):
    r = run(pool, 64, load_timing("vlm_30b_moe"))
    sync_gain = r["redistribute-sync"]["throughput_rel"] - 1
    overlap_gain = r["redistribute-overlap"]["throughput_rel"] - 1
    assert overlap_gain > 0.05
    assert overlap_gain > 2 * sync_gain
    exposed = {k: r[k]["exchange_share"] for k in ("redistribute-sync", "redistribute-overlap")}
    assert exposed["redistribute-overlap"] < 0.1 * exposed["redistribute-sync"]
    # With a GPU-direct link the synchronous exchange is cheap (what remains is the
    # extra meeting it adds between vision backward and the next vision forward).
    fast = run(pool, 64, load_timing("vlm_30b_moe", ["exchange.link_gbps=25",
                                                     "exchange.latency_ms=1"]))
    fast_sync = fast["redistribute-sync"]["throughput_rel"] - 1
    assert fast_sync > 0.8 * (fast["redistribute-overlap"]["throughput_rel"] - 1)


def test_redistribution_removes_most_of_the_waiting_in_the_seeds_framing(pool):
    # The seed's framing: LM time depends on pack length only (no attention term).
    t = load_timing("default")
    r = run(pool, 256, t)
    none, ov = r["none"], r["redistribute-overlap"]
    assert ov["wait_share"] < 0.35 * none["wait_share"]
    assert ov["throughput_rel"] > r["local"]["throughput_rel"] > 1.0
