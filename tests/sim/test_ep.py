"""``mm-balance simulate --ep``: ranks meet per micro-step in expert-parallel groups, data
parallelism once per step (timeline by hand, the group placement, the images run, bad input)."""
import json

import numpy as np
import pytest

from megatron_mm_balance.sim.cli import main
from megatron_mm_balance.sim.report import check_report
from megatron_mm_balance.sim.timeline import simulate_timeline
from megatron_mm_balance.sim.vision_balance import simulate_images_timeline

# 4 ranks, 2 micro-steps; ranks 0-1 and 2-3 are the two groups of ep=2.
VF = np.array([[[1.0, 3.0], [2.0, 1.0], [0.0, 0.0], [4.0, 0.0]]])
LM = np.array([[[10.0, 10.0], [10.0, 10.0], [5.0, 5.0], [5.0, 9.0]]])
VB = 2 * VF


def test_groups_meet_only_inside_themselves_and_at_the_end():
    r = simulate_timeline(VF, LM, VB, sync="microstep", ep=2)
    # group A (ranks 0, 1): m0 VF ends 1 / 2 -> LM 2..12 -> VB ends 14 / 16;
    #   m1 VF ends 17 / 17 -> LM 17..27 -> VB ends 33 / 29
    # group B (ranks 2, 3): m0 VF ends 0 / 4 -> LM 4..9 -> VB ends 9 / 17;
    #   m1 VF ends 9 / 17 -> LM 17..26 (max 5, 9) -> VB ends 26 / 26
    assert r["compute_end"].tolist() == [33.0]
    assert r["busy"].tolist() == [[32.0, 29.0, 10.0, 26.0]]
    assert r["wait"].tolist() == [[1.0, 4.0, 23.0, 7.0]]
    # everybody in one group: m0 VF ends 1, 2, 0, 4 -> LM 4..14 -> VB ends 16, 18, 14, 22;
    # m1 VF ends 19, 19, 14, 22 -> LM 22..32 -> VB ends 38, 34, 32, 32
    one = simulate_timeline(VF, LM, VB, sync="microstep")
    assert one["compute_end"].tolist() == [38.0]
    same = simulate_timeline(VF, LM, VB, sync="microstep", ep=4)
    assert all(np.array_equal(one[k], same[k]) for k in one)


def test_every_rank_its_own_group_is_pure_data_parallelism():
    alone = simulate_timeline(VF, LM, VB, sync="microstep", ep=1)
    step = simulate_timeline(VF, LM, VB, sync="step")
    assert all(np.array_equal(alone[k], step[k]) for k in step)


def test_images_timeline_meets_inside_the_group():
    x = np.zeros_like(VF)
    a2a = np.zeros((1, 4, 2))
    r = simulate_images_timeline(VF, LM, VB, x=x, a2a_fwd=a2a, a2a_bwd=a2a, ep=2)
    plain = simulate_timeline(VF, LM, VB, sync="microstep", ep=2)
    assert r["compute_end"].tolist() == plain["compute_end"].tolist()


@pytest.mark.parametrize("ep, match", [("3", "--ep 3 does not divide --dp 8"), ("0", "--ep must be >= 1"),
                                       ("x", "--ep must be an integer"), ("2,2", "twice")])
def test_bad_ep_is_one_line(ep, match, tmp_path, capsys):
    rc = main(["simulate", "heldout", "--samples", "1000", "--dp", "8", "--ep", ep, "--no-progress",
               "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and match in err


def test_ep_needs_microstep_sync(tmp_path, capsys):
    rc = main(["simulate", "heldout", "--samples", "1000", "--dp", "8", "--ep", "2", "--sync", "step",
               "--no-progress", "--out", str(tmp_path / "o")])
    assert rc == 2 and "--ep needs --sync microstep" in capsys.readouterr().err


def test_group_placement_and_frames_in_the_groups(tmp_path):
    out = tmp_path / "out"
    rc = main(["simulate", "native-res", "--samples", "4000", "--dp", "16", "--ga", "4",
               "--batches", "2", "--timing", "vlm_30b_moe", "--ep", "4,dp", "--no-progress",
               "--no-plots", "--strategies",
               "none,redistribute-overlap,redistribute-groups,redistribute-frames",
               "--frame-plan-ms", "2", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    check_report(report)
    runs = {(r["ep"], r["strategy"]): r for r in report["runs"]}
    assert report["meta"]["config"]["frame_plan_ms"] == 2.0
    for ep in (4, 16):
        none = runs[(ep, "none")]
        for s in ("redistribute-overlap", "redistribute-groups", "redistribute-frames"):
            assert runs[(ep, s)]["objective_over_perfect"] < none["objective_over_perfect"]
            assert runs[(ep, s)]["objective_over_perfect"] >= runs[(ep, "floor-packs")][
                "objective_over_perfect"] - 1e-9 or s == "redistribute-frames"
        assert runs[(ep, "redistribute-frames")]["objective_over_perfect"] >= runs[
            (ep, "floor-frames")]["objective_over_perfect"] - 1e-9
    # in groups of 4: fewer packs across groups than today's placement, never a worse objective
    today, groups = runs[(4, "redistribute-overlap")], runs[(4, "redistribute-groups")]
    assert groups["inter_group_moved_fraction"] < today["inter_group_moved_fraction"]
    assert groups["objective_over_perfect"] <= today["objective_over_perfect"] + 1e-12
    # waiting falls with the group size: fewer ranks wait for each other
    assert runs[(4, "none")]["wait_share"] < runs[(16, "none")]["wait_share"]
    # EP = DP: the group placement is today's
    assert runs[(16, "redistribute-groups")]["time_per_batch_ms"] == \
        runs[(16, "redistribute-overlap")]["time_per_batch_ms"]
