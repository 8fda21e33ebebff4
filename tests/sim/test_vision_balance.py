"""Image-level vision balancing: the image assignment, its timeline, and the strategy."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_mm_balance.sim.cli import main
from megatron_mm_balance.sim.report import check_report
from megatron_mm_balance.solver.images import balance_images
from megatron_mm_balance.sim.vision_balance import (all_to_all_ms,
                                                    micro_step_images, simulate_images_timeline)
from megatron_mm_balance.sim.timing import TimingModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from determinism import placement_digests  # noqa: E402


@pytest.mark.parametrize("seed", range(8))
def test_every_image_lands_on_one_rank_within_the_lpt_bound(seed):
    rng = np.random.default_rng(seed)
    D = int(rng.choice([2, 5, 16, 64]))
    n = int(rng.integers(1, 6 * D))
    owner = np.sort(rng.integers(0, D, size=n))
    cost = (rng.choice([64, 256, 576, 1024], size=n) * rng.random(n)).astype(np.int64)
    enc = balance_images(owner, cost, D)
    assert enc.shape == owner.shape and enc.min() >= 0 and enc.max() < D
    load = np.bincount(enc, weights=cost, minlength=D)
    assert np.isclose(load.sum(), cost.sum())
    # keep-home prefix within the target, then longest-first: within one image of it
    target = max(-(-cost.sum() // D), cost.max())
    assert load.max() <= target + cost.max()
    assert load.max() <= np.bincount(owner, weights=cost, minlength=D).max()
    assert np.array_equal(enc, balance_images(owner, cost, D))


def test_balanced_images_stay_home():
    owner = np.array([0, 0, 1, 1, 2])
    cost = np.array([3, 2, 4, 1, 5])              # every rank at 5: nothing moves
    assert balance_images(owner, cost, 3).tolist() == owner.tolist()
    # one rank holds everything: its heaviest image stays, the rest spread out (5 is optimal)
    enc = balance_images(np.zeros(4, dtype=np.int64), np.array([4, 3, 3, 2]), 3)
    assert enc[0] == 0 and sorted(np.bincount(enc, weights=[4, 3, 3, 2], minlength=3)) == [3, 4, 5]


def test_bad_image_costs_are_one_clear_error():
    with pytest.raises(ValueError, match="non-negative integers"):
        balance_images(np.array([0]), np.array([1.5]), 2)
    with pytest.raises(ValueError, match="owners"):
        balance_images(np.array([2]), np.array([1]), 2)


def test_micro_step_images_follow_the_packs():
    class P:
        image_offsets = np.array([0, 2, 2, 5])
    owner, img = micro_step_images(P, np.array([2, 1, 0]))
    assert owner.tolist() == [0, 0, 0, 2, 2] and img.tolist() == [2, 3, 4, 0, 1]


def test_timeline_by_hand():
    # 2 ranks, 1 micro-step: balanced vision 5 ms each, LM 20 / 30 ms in lockstep,
    # vision backward 10 ms; all-to-alls 2 ms (embeddings) and 3 ms (gradients).
    vf = np.array([[[5.0], [5.0]]])
    lm = np.array([[[20.0], [30.0]]])
    vb = np.array([[[10.0], [10.0]]])
    res = simulate_images_timeline(vf, lm, vb, x=np.zeros_like(vf), a2a_fwd=np.array([[2.0]]),
                                   a2a_bwd=np.array([[3.0]]), overhead=1.0)
    # 5 (encode) + 2 + 30 (slowest LM) + 3 + 10 = 50, plus 1 overhead
    assert res["time"].tolist() == [51.0]
    assert res["exchange"].tolist() == [[5.0, 5.0]]
    assert res["wait"].tolist() == [[10.0, 0.0]]
    step = simulate_images_timeline(vf, lm, vb, x=np.zeros_like(vf), a2a_fwd=np.array([[2.0]]),
                                    a2a_bwd=np.array([[3.0]]), sync="step")
    assert step["time"].tolist() == [50.0]                  # the gradient all-to-all meets


def test_all_to_all_is_the_slowest_rank():
    t = TimingModel(link_gbps=1.0, latency_ms=0.5)
    out = np.array([[[1000.0], [0.0]]])
    inn = np.array([[[0.0], [1000.0]]])
    assert np.allclose(all_to_all_ms(out, inn, 2000.0, t), [[0.5 + 2.0]])
    assert all_to_all_ms(np.zeros((1, 2, 1)), np.zeros((1, 2, 1)), 2000.0, t).tolist() == [[0.0]]


def test_strategy_runs_in_the_simulator(tmp_path):
    out = tmp_path / "out"
    rc = main(["simulate", "heldout-real", "--dp", "16", "--ga", "4", "--batches", "2",
               "--pool-samples", "3000", "--no-progress", "--no-plots", "--timing", "vlm_30b_moe",
               "--timing-set", "exchange.link_gbps=25", "--timing-set", "exchange.latency_ms=1",
               "--strategies", "none,redistribute-overlap,redistribute-images", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    check_report(report)
    runs = {r["strategy"]: r for r in report["runs"]}
    img = runs["redistribute-images"]
    assert img["bytes_moved_per_step"] > runs["redistribute-overlap"]["bytes_moved_per_step"] * 0.5
    assert img["wait_share"] < runs["none"]["wait_share"]
    assert img["exchange_share"] > 0                        # the all-to-alls are exposed
    assert img["throughput_rel"] > 1.0


IMAGES = """
import types
import numpy as np
from megatron_mm_balance.solver.images import balance_images
rng = np.random.default_rng(3)
owner = np.sort(rng.integers(0, 256, size=2000))
cost = rng.choice([64, 256, 576], size=2000)
enc = balance_images(owner, cost, 256)
placements = [types.SimpleNamespace(src_rank=enc, src_index=owner)]
"""


def test_image_assignment_identical_across_processes():
    assert len(placement_digests(IMAGES, ("0", "4242"))) == 1


def test_a_frames_time_comes_from_the_cost_estimator():
    # one model of a frame's cost: the simulator's per-image times are the cost model's
    from megatron_mm_balance.sim.pool import build_pool
    from megatron_mm_balance.sim.timing import load_timing
    from megatron_mm_balance.sim.vision_balance import image_costs
    from megatron_mm_balance.data.mixtures import make_mixture
    t = load_timing("vlm_30b_moe")
    pool = build_pool(make_mixture("native-res", n=300, seed=3), 8192)
    n = pool.image_sizes.astype(np.float64)
    assert np.array_equal(image_costs(pool, t), t.cost_model().unit_forward_ms(pool.image_sizes))
    assert np.allclose(image_costs(pool, t), t.vision_ms_per_token * n + t.vision_ms_per_token_sq * n * n)
