"""MeetingGroups and the per-micro-step partition: pure pieces, tested without processes
(the groups read from Megatron's and Bridge's process groups are tested on gloo ranks in
tests/megatron_glue/test_glue_meeting.py)."""
import subprocess
import sys

import numpy as np
import pytest

from megatron_mm_balance.runtime.meeting import MeetingGroups, step_groups_from_collectives


def test_two_expert_groups_in_four_data_parallel_ranks():
    m = MeetingGroups.of([6, 4, 0, 2], [[6, 4], [2, 0]], rank=4, via="expert parallel")
    assert m.iteration == (0, 2, 4, 6) and m.steps == ((0, 2), (4, 6))
    assert m.labels() == (0, 0, 1, 1) and m.step_group == (4, 6) and m.size == 4
    assert m.meet_within_iteration and not m.all_meet_each_step and m.sync() == "microstep"
    assert m.describe() == ("per iteration: data parallel of 4 [0, 2, 4, 6]; per micro-step: "
                            "2 groups of 2 (expert parallel) [0, 2] [4, 6]")
    assert m.as_dict() == {"iteration": [0, 2, 4, 6], "steps": [[0, 2], [4, 6]],
                           "via": "expert parallel", "sync": "microstep"}


def test_without_expert_parallel_each_rank_is_alone_and_with_ep_dp_all_meet():
    alone = MeetingGroups.of(range(4), rank=3, via="expert parallel")
    assert alone.steps == ((0,), (1,), (2,), (3,)) and alone.labels() == (0, 1, 2, 3)
    assert not alone.meet_within_iteration and alone.sync() == "step" and alone.via == ""
    assert alone.describe().endswith("per micro-step: none (each rank alone)")
    assert alone.step_group == (3,)
    everyone = MeetingGroups.everyone_meets([3, 1, 2, 0], via="expert parallel")
    assert everyone.labels() == (0, 0, 0, 0) and everyone.all_meet_each_step
    assert "1 group of 4 (expert parallel)" in everyone.describe()
    one = MeetingGroups.of([5], rank=5)       # a single data-parallel rank
    assert one.labels() == (0,) and one.sync() == "step"


def test_numpy_ranks_are_accepted_and_labels_follow_the_iteration_order():
    m = MeetingGroups.of(np.array([1, 3, 5, 7]), [np.array([1, 7]), [3], [5]])
    assert m.steps == ((1, 7), (3,), (5,)) and m.labels() == (0, 1, 2, 0)
    assert all(type(r) is int for g in m.steps for r in g)


@pytest.mark.parametrize("iteration, steps, rank, message", [
    ([], [], None, "per-iteration group is empty"),
    ([0, 1], [[0], [1, 2]], None, r"rank 2 of per-micro-step group \[1, 2\] is not in"),
    ([0, 1, 2], [[0, 1], [1, 2]], None, "rank 1 is in two per-micro-step groups"),
    ([0, 1, 2], [[0, 1]], None, r"rank\(s\) \[2\] of the per-iteration group"),
    ([0, 1], [[0], []], None, "an empty per-micro-step group"),
    ([0, 1], [[0], [1]], 4, "rank 4 is not in the per-iteration group"),
    ([0, -1], None, None, "-1 is not a global rank"),
    ([0, True], None, None, "True is not a global rank"),
    ([0, "1"], None, None, "'1' is not a global rank"),
])
def test_bad_groups_get_one_line_naming_them(iteration, steps, rank, message):
    with pytest.raises(ValueError, match=message) as exc:
        MeetingGroups.of(iteration, steps, rank=rank)
    assert "\n" not in str(exc.value)


def test_the_constructor_checks_canonical_order_and_step_group_needs_a_rank():
    with pytest.raises(ValueError, match="not in ascending order"):
        MeetingGroups((2, 0), ((0,), (2,)))
    with pytest.raises(ValueError, match="not ordered by their first rank"):
        MeetingGroups((0, 2), ((2,), (0,)))
    with pytest.raises(ValueError, match="needs the rank"):
        MeetingGroups.of([0, 1]).step_group


# -- the partition from the framework's per-micro-step collectives --------------------------------
def _dense(tp, cp, dp, pp):
    """Megatron-core's default order tp-cp-ep-dp-pp: each global rank's coordinates."""
    return {((p * dp + d) * cp + c) * tp + t: (t, c, d, p)
            for p in range(pp) for d in range(dp) for c in range(cp) for t in range(tp)}


def _expert_groups(tp, cp, dp, pp, ep):
    """The expert-parallel groups Megatron-core carves out of each stage's TP x CP x DP ranks
    with expert tensor parallel = tensor parallel (its default): the tp-ep-dp-pp order, so a
    group is ``ep`` ranks ``tp`` apart inside a block of ``ep * tp`` of a stage's ranks."""
    per_stage = tp * cp * dp
    return [list(range(p * per_stage + s, p * per_stage + s + ep * tp, tp))
            for p in range(pp) for block in range(0, per_stage, ep * tp) for s in range(block, block + tp)]


@pytest.mark.parametrize("tp, cp, dp, pp, ep, want", [
    (1, 1, 4, 1, 2, [[(0, 1), (2, 3)]]),                  # DP=4 x EP=2: two groups of 2
    (1, 1, 4, 1, 1, [[(0,), (1,), (2,), (3,)]]),          # no expert parallel: each alone
    (1, 1, 4, 1, 4, [[(0, 1, 2, 3)]]),                    # EP = DP: all meet
    (1, 2, 2, 1, 2, [[(0,), (2,)], [(1,), (3,)]]),        # EP spans the CP ranks only
    (1, 2, 2, 1, 4, [[(0, 2)], [(1, 3)]]),                # EP across CP and DP: DP meets
    (2, 1, 4, 2, 2, [[(0, 2), (4, 6)], [(8, 10), (12, 14)]]),   # TP=2 x PP=2: TP rank 0 reads
])
def test_step_groups_from_megatron_core_layouts(tp, cp, dp, pp, ep, want):
    coords = _dense(tp, cp, dp, pp)
    position = {r: d for r, (t, c, d, p) in coords.items()}
    experts = _expert_groups(tp, cp, dp, pp, ep)
    assert sorted(r for g in experts for r in g) == sorted(coords)
    exchange = sorted({tuple(sorted(r for r, (t, c, d, p) in coords.items() if (t, c, p) == key))
                       for key in {(0, c, p) for (t, c, d, p) in coords.values() if p in (0, pp - 1)}})
    got = [step_groups_from_collectives(group, position, experts) for group in exchange]
    assert got == [tuple(w) for w in want]


def test_partition_refuses_a_rank_without_a_position_and_a_position_held_twice():
    with pytest.raises(ValueError, match="rank 9 has no data-parallel position"):
        step_groups_from_collectives([0, 1], {0: 0, 1: 1}, [[0, 9]])
    with pytest.raises(ValueError, match="holds one position twice"):
        step_groups_from_collectives([0, 1], {0: 0, 1: 0}, [])
    # Chains link positions: 0-1 and 1-2 put 0, 1 and 2 in one group.
    assert step_groups_from_collectives([0, 1, 2, 3], {r: r for r in range(4)},
                                        [[0, 1], [1, 2]]) == ((0, 1, 2), (3,))


def test_meeting_imports_no_torch():
    code = ("import sys\nimport megatron_mm_balance.runtime.meeting\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
