"""The simulator's bounds (perfect balance, the floors of whole packs and of whole frames)
and native-resolution frames (``native-res``, ``redistribute-frames``)."""
import json

import numpy as np
import pytest

from megatron_mm_balance.data.mixtures import make_mixture
from megatron_mm_balance.data.traces import Sample
from megatron_mm_balance.sim.cli import main
from megatron_mm_balance.sim.pool import build_pool
from megatron_mm_balance.sim.report import check_report
from megatron_mm_balance.sim.timing import load_timing
from megatron_mm_balance.sim.vision_balance import balanced_vision

GPU_DIRECT = ["--timing-set", "exchange.link_gbps=25", "--timing-set", "exchange.latency_ms=1"]
ALL = "none,local,redistribute-overlap,redistribute-images,redistribute-frames"


def run(tmp_path, *extra):
    out = tmp_path / "out"
    rc = main(["simulate", "native-res", "--samples", "4000", "--dp", "8,16", "--ga", "4",
               "--batches", "2", "--timing", "vlm_30b_moe", "--no-progress", "--no-plots",
               "--strategies", ALL, *GPU_DIRECT, "--out", str(out), *extra])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    check_report(report)
    return report["runs"]


@pytest.mark.parametrize("sync", ["microstep", "step"])
def test_no_strategy_beats_the_floors(tmp_path, sync):
    runs = run(tmp_path, "--sync", sync)
    for D in (8, 16):
        at = {r["strategy"]: r for r in runs if r["dp"] == D}
        perfect, packs, frames = at["perfect"], at["floor-packs"], at["floor-frames"]
        assert perfect["perfect_share"] == pytest.approx(1.0)
        eps = 1e-9
        assert perfect["throughput_rel"] >= frames["throughput_rel"] - eps
        assert frames["throughput_rel"] >= packs["throughput_rel"] - eps
        assert 1.0 - eps <= frames["objective_over_perfect"] <= packs["objective_over_perfect"] + eps
        for name in ("none", "local", "redistribute-overlap"):
            assert at[name]["objective_over_perfect"] >= packs["objective_over_perfect"] - eps
        for name in ("redistribute-images", "redistribute-frames"):
            assert at[name]["objective_over_perfect"] >= frames["objective_over_perfect"] - eps
            assert at[name]["vision_max_over_floor"] >= 1.0
            assert 0 < at[name]["vision_moved_share"] < 1
        for name in ("none", "local", "redistribute-overlap", "redistribute-images",
                     "redistribute-frames"):
            assert at[name]["perfect_share"] <= 1.0 + eps
        if sync == "microstep":
            # balancing frames beats placing whole packs here (GPU-direct exchange)
            assert at["redistribute-frames"]["throughput_rel"] > at["redistribute-overlap"]["throughput_rel"]


def test_bounds_can_be_left_out(tmp_path):
    runs = run(tmp_path, "--no-floors")
    assert not any(r.get("bound") for r in runs)
    assert all("perfect_share" not in r for r in runs)


def test_a_video_is_spread_frame_by_frame():
    # rank 0 holds a pack with one video of 16 equal frames, ranks 1-3 text-only packs: the
    # video's frames are encoded on every rank, each a unit of its own
    video = next(s for s in make_mixture("native-res", n=3000, seed=2)
                 if len(s.images) >= 16 and len(set(s.images)) == 1 and s.tokens > 400)
    pool = build_pool([video] + [Sample(8000)] * 3, 8192)
    first = int(np.flatnonzero(pool.num_images)[0])
    text = np.flatnonzero(pool.num_images == 0)[:3]
    placed = np.array([first, *text]).reshape(1, 4, 1)
    t = load_timing("vlm_30b_moe")
    for planner in ("images", "frames"):
        vf, img_out, img_in, stats = balanced_vision(pool, t, placed, planner)
        assert (vf[0, :, 0] > 0).all(), planner             # every rank encodes some frames
        assert stats["max_ms"] <= stats["floor_ms"] * 1.3
        assert img_in[0, 1:, 0].sum() == img_out[0, 0, 0] > 0
