"""The frame planning call of ``mm_balance.vision=images`` (runtime/frames.py): the per-rank
patch cap, the micro-step figures and their interval sums. Pure, fast."""
import numpy as np
import pytest

from megatron_mm_balance.runtime.frames import (FrameTransfer, FrameWindow, default_patch_cap, frame_figures,
                                                plan_frame_encoders, within_patch_cap)


def _native_res_step(rng, ranks):
    """A micro-step of native-resolution-like frames: a few large, many small, some empty ranks."""
    owner, patches = [], []
    for r in range(ranks):
        for _ in range(rng.integers(0, 6)):
            owner.append(r)
            patches.append(int(rng.choice([16, 64, 256, 1024, 4096])))
    patches = np.array(patches, dtype=np.int64)
    return np.array(owner, dtype=np.int64), patches * (patches + 256), patches


def test_the_cap_is_never_exceeded_by_a_receiving_rank_and_keeps_every_frame_somewhere():
    """The call is ``plan_frames`` with the default cap, then ``lower_by_swaps``: no receiving
    rank ends above the cap, the largest rank cost never rises (and never ends above the
    planner's), and on these steps the cap binds sometimes and the swaps lower it sometimes."""
    from megatron_mm_balance.solver.frame_swaps import lower_by_swaps
    from megatron_mm_balance.solver.frames import plan_frames
    rng = np.random.default_rng(0)
    bound = lowered = swapped = 0
    for _ in range(300):
        ranks = int(rng.integers(2, 9))
        owner, cost, patches = _native_res_step(rng, ranks)
        for cap in (None, int(rng.integers(1, 6000))):
            enc = plan_frame_encoders(owner, cost, ranks, patches=patches, patch_cap=cap)
            limit = default_patch_cap(owner, patches, ranks) if cap is None else cap
            assert enc.shape == owner.shape and ((enc >= 0) & (enc < ranks)).all()
            after = np.bincount(enc, weights=patches, minlength=ranks)
            receives = np.bincount(enc[enc != owner], minlength=ranks) > 0
            assert (after[receives] <= limit).all()
            load_before = np.bincount(owner, weights=cost, minlength=ranks).max() if len(owner) else 0
            load_after = np.bincount(enc, weights=cost, minlength=ranks).max() if len(owner) else 0
            assert load_after <= load_before
            lowered += int(load_after < load_before)
            planned = plan_frames(owner, cost, ranks, patches=patches, patch_cap=limit).encoder
            assert enc.tolist() == lower_by_swaps(owner, planned, cost, ranks, patches=patches,
                                                  patch_cap=limit).tolist()
            load_planned = np.bincount(planned, weights=cost, minlength=ranks).max() if len(owner) else 0
            assert load_after <= load_planned
            swapped += int(load_after < load_planned)
            uncapped = plan_frames(owner, cost, ranks, patches=patches).encoder
            bound += int(not np.array_equal(uncapped, enc))
    assert bound > 0, "the cap never bound"
    assert lowered > 100, lowered
    assert swapped > 0, "the swaps never lowered a plan"


def test_a_transfer_time_counts_on_the_receiver():
    """Two frames of cost 10 on rank 0, nothing on rank 1: without a transfer time one moves;
    with a transfer of 12 (moving costs the receiver more than keeping it) none does."""
    owner, cost, patches = np.array([0, 0]), np.array([10, 10]), np.array([4, 4])
    assert plan_frame_encoders(owner, cost, 2, patches=patches).tolist() in ([0, 1], [1, 0])
    assert plan_frame_encoders(owner, cost, 2, patches=patches, transfer=[12, 12]).tolist() == [0, 0]


def test_a_frames_transfer_cost_is_its_bytes_over_the_link_in_units_of_compute():
    """1,000 patches of 10 kB over 25 GB/s: 400 us; a unit of cost taking 1 ns of compute:
    400,000 units. Rounded up (never charged less than it costs); an infinite link is free."""
    t = FrameTransfer(bytes_per_patch=10_000.0, link_gbps=25.0, unit_seconds=1e-9)
    assert t.cost([1000, 1, 0]).tolist() == [400_000, 400, 0]
    assert FrameTransfer(3.0, 1.0, 1.0).cost([1]).tolist() == [1]          # 3 ns: rounds up to 1 unit
    assert FrameTransfer(1.0, float("inf"), 1.0).cost([5, 7]).tolist() == [0, 0]
    for bad in (dict(bytes_per_patch=0.0), dict(link_gbps=-1.0), dict(unit_seconds=float("nan"))):
        values = dict(bytes_per_patch=1.0, link_gbps=1.0, unit_seconds=1.0)
        values.update(bad)
        with pytest.raises(ValueError, match=f"FrameTransfer.{next(iter(bad))} must be positive"):
            FrameTransfer(**values)


def test_the_figures_count_the_moved_frames_transfer():
    owner, encoder = np.array([0, 0, 1]), np.array([0, 1, 1])
    cost, patches, transfer = np.array([6, 6, 0]), np.array([4, 4, 1]), np.array([3, 5, 7])
    f = frame_figures(owner, encoder, cost, patches, 2, transfer)
    assert f.transfer_moved == 5 and frame_figures(owner, encoder, cost, patches, 2).transfer_moved == 0
    window = FrameWindow()
    window.add(f)
    window.add(f)
    assert window.summary()["transfer_moved"] == 10


def test_the_figures_carry_the_rates_used_and_measured():
    owner, encoder = np.array([0, 0, 1]), np.array([0, 1, 1])
    cost, patches = np.array([6, 6, 0]), np.array([4, 4, 1])
    f = frame_figures(owner, encoder, cost, patches, 2, rates=(2.0, 0.05), measured=(1.5, 0.0))
    assert (f.link_gbps, f.tower_tflops, f.link_gbps_measured, f.tower_tflops_measured) == (2.0, 0.05, 1.5, 0.0)
    window = FrameWindow()
    window.add(f)
    window.add(None)                                   # no frame: no rate in the mean
    window.add(frame_figures(owner, encoder, cost, patches, 2, rates=(4.0, 0.15), measured=(2.5, 0.1)))
    s = window.summary()
    assert s["link_gbps"] == pytest.approx(3.0) and s["tower_tflops"] == pytest.approx(0.1)
    # measured: the mean over the micro-steps that had a measurement (the tower's first had none)
    assert s["link_gbps_measured"] == pytest.approx(2.0) and s["tower_tflops_measured"] == pytest.approx(0.1)
    assert FrameWindow().summary()["link_gbps"] == 0.0


def test_the_default_cap_is_the_most_any_rank_held():
    owner, patches = np.array([0, 0, 1, 2]), np.array([10, 5, 12, 1])
    assert default_patch_cap(owner, patches, 3) == 15
    assert default_patch_cap(np.zeros(0, np.int64), np.zeros(0, np.int64), 2) == 0


def test_within_patch_cap_undoes_moves_heaviest_first():
    owner = np.array([0, 0, 0, 1])
    encoder = np.array([0, 1, 1, 1])                  # two frames of rank 0 go to rank 1
    cost, patches = np.array([9, 5, 7, 1]), np.array([4, 3, 3, 2])
    # rank 1 held 2 patches: room for one 3-patch frame under cap 5; the costlier (frame 2) goes
    assert within_patch_cap(owner, encoder, cost, patches, 5, 2).tolist() == [0, 0, 1, 1]
    assert within_patch_cap(owner, encoder, cost, patches, 8, 2).tolist() == encoder.tolist()
    assert within_patch_cap(owner, encoder, cost, patches, 2, 2).tolist() == owner.tolist()


def test_figures_of_a_plan():
    owner = np.array([0, 0, 0, 1, 2])
    encoder = np.array([0, 1, 2, 1, 2])
    cost, patches = np.array([8, 4, 4, 2, 0]), np.array([8, 4, 4, 2, 1])
    f = frame_figures(owner, encoder, cost, patches, 3)
    assert (f.frames, f.patches, f.frames_moved, f.patches_moved, f.cost_moved) == (5, 19, 2, 8, 8)
    # target max(ceil(18 / 3), 8) = 8: rank 0 (16) is 8 above it, nobody else
    assert f.cost_moved_min == 8 and (f.cost_max_before, f.cost_max_after) == (16, 8)
    assert f.cost_mean == 6.0 and (f.patches_max_before, f.patches_max_after) == (16, 8)
    window = FrameWindow()
    window.add(f)
    window.add(None)                                   # a micro-step with no frame anywhere
    window.add(f)
    s = window.summary()
    assert s["micro_steps"] == 3 and s["frames"] == 10 and s["frames_moved"] == 4
    assert s["imbalance_before"] == pytest.approx(32 / 12) and s["imbalance_after"] == pytest.approx(16 / 12)
    assert s["vision_max_before"] == pytest.approx(32 / 3)
