"""Moves and swaps after the frame planner (solver/frame_swaps.py): where the patch cap
blocks the one move that helps, a swap lowers the largest load; the cap holds for every
receiving rank; the largest load never rises; nothing moves for less than the planner's
tolerance; against the exact lowest level on small instances."""
import numpy as np
import pytest

from megatron_mm_balance.solver.frame_swaps import lower_by_swaps
from megatron_mm_balance.solver.frames import default_patch_cap, plan_frames

ALPHA = 352                                       # the Bridge CPU config's 2*hidden + ffn


def _load(owner, enc, cost, transfer=None):
    transfer = np.zeros_like(cost) if transfer is None else transfer
    return np.bincount(enc, weights=cost + np.where(enc != owner, transfer, 0), minlength=int(owner.max()) + 1)


def test_a_swap_where_the_cap_blocks_the_one_helpful_move():
    """A micro-step of the Bridge benchmark: rank 0 holds frames of 2,624 and 1,200 patches,
    rank 1 six of 588. Moving the 1,200 alone would take rank 1 above the cap (the most any
    rank held, 3,824), so the planner moves nothing; sending it and taking two of rank 1's
    frames back fits, and lowers the largest load."""
    owner = np.array([0, 0, 1, 1, 1, 1, 1, 1])
    patches = np.array([2624, 1200, 588, 588, 588, 588, 588, 588])
    cost = patches * (patches + ALPHA)
    cap = default_patch_cap(owner, patches, 2)
    assert cap == 3824
    planned = plan_frames(owner, cost, 2, patches=patches, patch_cap=cap).encoder
    assert planned.tolist() == owner.tolist()
    enc = lower_by_swaps(owner, planned, cost, 2, patches=patches, patch_cap=cap)
    assert enc[1] == 1 and (enc[2:] == 0).sum() >= 1          # the 1,200 leaves, small ones come back
    assert _load(owner, enc, cost).max() < _load(owner, owner, cost).max()
    for r in (0, 1):
        assert patches[enc == r].sum() <= cap
    assert enc.tolist() == lower_by_swaps(owner, planned, cost, 2, patches=patches, patch_cap=cap).tolist()


def test_never_worse_within_the_cap_and_at_the_exact_level_often():
    from megatron_mm_balance.solver.frames_exact import exact_min_level
    rng = np.random.default_rng(7)
    reached = lowered = steps = 0
    for _ in range(60):
        D = int(rng.integers(2, 4))
        owner = np.sort(rng.integers(0, D, int(rng.integers(2, 9))))
        patches = rng.choice([64, 144, 588, 1200, 2624], owner.size)
        cost = patches * (patches + ALPHA)
        transfer = patches * int(rng.choice([0, 40]))
        cap = default_patch_cap(owner, patches, D)
        planned = plan_frames(owner, cost, D, patches=patches, patch_cap=cap, transfer=transfer).encoder
        enc = lower_by_swaps(owner, planned, cost, D, patches=patches, patch_cap=cap, transfer=transfer)
        before, after = _load(owner, planned, cost, transfer).max(), _load(owner, enc, cost, transfer).max()
        assert after <= before
        receives = np.bincount(enc[enc != owner], minlength=D) > 0
        assert (np.bincount(enc, weights=patches, minlength=D)[receives] <= cap).all()
        if after == before:
            assert enc.tolist() == planned.tolist()             # nothing moves for nothing
        best = exact_min_level(owner, cost, D, patches=patches, patch_cap=cap, transfer=transfer)
        assert best.optimal and after >= best.value
        steps += 1
        reached += int(after == best.value)
        lowered += int(after < before)
    print(f"\nswaps lowered {lowered} of {steps} plans; at the exact level {reached}")
    assert lowered > 0 and reached > steps // 2


def test_a_gain_under_the_planners_tolerance_moves_nothing_and_bad_input_is_refused():
    owner = np.array([0, 0, 1])
    # loads 2,049 and 2,047: moving the 1 lowers the largest to 2,048, a gain of 1, under the
    # tolerance 2,049 // 1024 = 2: nothing moves
    assert lower_by_swaps(owner, owner, np.array([2048, 1, 2047]), 2).tolist() == [0, 0, 1]
    # loads 2,058 and 2,036: the 11 moves (both 2,047, a gain of 11)
    assert lower_by_swaps(owner, owner, np.array([2047, 11, 2036]), 2).tolist() == [0, 1, 1]
    assert lower_by_swaps(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), 4).size == 0
    with pytest.raises(ValueError, match="one entry per frame"):
        lower_by_swaps(owner, owner[:2], np.array([1, 2, 3]), 2)
