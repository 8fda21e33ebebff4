"""Strategies as gather orders, exchange accounting, pools and draws."""
import numpy as np

from megatron_mm_balance.data.packing import Pack
from megatron_mm_balance.solver.placement import sorted_grouping_optimum
from megatron_mm_balance.sim.pool import draw_indices, pool_from_packs
from megatron_mm_balance.sim.strategies import (exchange_times, identity_order, local_order,
                                                redistribute_order)
from megatron_mm_balance.data.traces import Sample


def test_local_order_sorts_each_rank_heaviest_first():
    costs = np.array([[[1, 5, 3], [4, 4, 9]]])
    order = local_order(costs)
    assert order.tolist() == [[[1, 2, 0], [5, 3, 4]]]      # ties keep draw order
    flat = costs.reshape(1, -1)
    assert np.take_along_axis(flat, order.reshape(1, -1), 1).reshape(costs.shape).tolist() == \
        [[[5, 3, 1], [9, 4, 4]]]


def test_redistribute_is_an_optimal_permutation():
    rng = np.random.default_rng(1)
    c = rng.integers(0, 1000, size=(8, 4))
    order = redistribute_order(c, sync="microstep")
    assert sorted(order.ravel().tolist()) == list(range(32))
    placed = c.ravel()[order]
    assert placed.max(axis=0).sum() == sorted_grouping_optimum(c)


def test_exchange_times_by_hand():
    # 2 ranks x 2 steps; rank 1's slot (1, 0) computes rank 0's pack 1 and rank 0's
    # slot (0, 1) computes rank 1's pack 0: two moves, both in their own micro-step.
    order = np.array([[[0, 2], [1, 3]]])
    nbytes = np.array([[100.0, 2e6, 4e6, 50.0]])
    x, b_in = exchange_times(order, nbytes, link_gbps=1.0, latency_ms=0.5)
    assert b_in.tolist() == [[[0.0, 4e6], [2e6, 0.0]]]
    # step 0: rank 0 sends 2 MB, rank 1 receives it: 0.5 + 2 ms each
    # step 1: rank 1 sends 4 MB, rank 0 receives it: 0.5 + 4 ms each
    assert np.allclose(x, [[[2.5, 4.5], [2.5, 4.5]]])
    x0, b0 = exchange_times(identity_order(1, 2, 2), nbytes, link_gbps=1.0, latency_ms=0.5)
    assert not x0.any() and not b0.any()


def test_pool_features_and_draws():
    samples = [Sample(10, (3, 4)), Sample(5, ()), Sample(8, (8,))]
    packs = [Pack((0, 1), 15, (3, 4)), Pack((2,), 8, (8,))]
    pool = pool_from_packs(packs, samples, seq_len=16)
    assert pool.image_tokens.tolist() == [7, 8]
    assert pool.image_sq.tolist() == [25, 64]
    assert pool.sample_len_sq.tolist() == [125, 64]
    assert pool.text_tokens.tolist() == [8, 0]
    assert abs(pool.efficiency - 23 / 32) < 1e-12
    a = draw_indices(2, 3, 4, 5, seed=7)
    assert a.shape == (3, 4, 5) and np.array_equal(a, draw_indices(2, 3, 4, 5, seed=7))
    c = draw_indices(10, 2, 3, 4, seed=0, mode="contiguous")
    assert np.all((np.diff(c, axis=2) % 10) == 1)


def test_two_phase_is_the_default_when_the_timing_model_has_both_phases():
    from megatron_mm_balance.sim.engine import resolve_balance_cost
    from megatron_mm_balance.sim.timing import TimingModel, load_timing
    assert resolve_balance_cost("auto", load_timing("vlm_30b_moe")) == "two-phase"
    assert resolve_balance_cost("auto", TimingModel(vision_ms_per_token=1.0)) == "time"
    assert resolve_balance_cost("image-tokens", load_timing("vlm_30b_moe")) == "image-tokens"


def test_inter_node_mask_follows_ranks_per_node():
    import numpy as np
    from megatron_mm_balance.sim.strategies import inter_node_mask
    G = 2
    # 4 ranks; slot (1, 0) takes rank 0's pack (same node of 2), (2, 1) takes rank 1's
    order = (np.arange(4)[:, None] * G + np.arange(G)[None, :])[None].copy()
    order[0, 1, 0] = 0 * G + 1
    order[0, 0, 1] = 1 * G + 0
    order[0, 2, 1] = 1 * G + 1
    order[0, 1, 1] = 2 * G + 1
    m = inter_node_mask(order, 2)
    assert m.sum() == 2 and m[0, 2, 1] and m[0, 1, 1]
    assert inter_node_mask(order, None).sum() == 4


def test_simulator_models_the_runtimes_order():
    from megatron_mm_balance.solver.placement import plan_placement
    rng = np.random.default_rng(3)
    for sync in ("microstep", "step"):
        c = rng.integers(0, 1000, size=(8, 6))
        pl = plan_placement(c, sync=sync)
        assert np.array_equal(redistribute_order(c, sync=sync), pl.src_rank * 6 + pl.src_index)
        moved = pl.moved().sum(axis=0)
        assert moved[0] == moved.min()


def test_prefetch_changes_only_the_overlapped_run():
    from megatron_mm_balance.data.mixtures import make_mixture
    from megatron_mm_balance.sim.engine import SimConfig, simulate_dp
    from megatron_mm_balance.sim.pool import build_pool
    from megatron_mm_balance.sim.timing import load_timing
    pool = build_pool(make_mixture("heldout-real", n=4000, seed=1), 8192,
                      cache_key="prefetch-heldout-real-4000")
    timing = load_timing("vlm_30b_moe")
    out = {}
    for prefetch in (False, True):
        cfg = SimConfig(dps=[32], ga=8, seq_len=8192, batches=3, prefetch=prefetch,
                        strategies=("none", "redistribute-sync", "redistribute-overlap"))
        runs, _ = simulate_dp(cfg, 32, timing, pool, {})
        out[prefetch] = {r["strategy"]: r for r in runs}
        assert all(r["prefetch"] is prefetch for r in runs)
    for name in ("none", "redistribute-sync"):
        assert out[True][name]["time_per_batch_ms"] == out[False][name]["time_per_batch_ms"]
    off, on = out[False]["redistribute-overlap"], out[True]["redistribute-overlap"]
    assert off["exchange_share"] > 0          # micro-step 0's exchange is exposed ...
    assert on["exchange_share"] < off["exchange_share"]   # ... and hides with prefetch
    assert on["time_per_batch_ms"] < off["time_per_batch_ms"]
    assert on["bytes_moved_per_step"] == off["bytes_moved_per_step"]
