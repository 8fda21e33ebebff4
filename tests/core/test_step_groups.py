"""Per-micro-step meeting groups in the solver: the contract, the reductions, the stats."""
import numpy as np
import pytest

from megatron_mm_balance.runtime.config import BalancerConfig
from megatron_mm_balance.runtime.planner import plan_batch
from megatron_mm_balance.solver.placement import PlanStats, SolverOptions, plan_placement
from megatron_mm_balance.solver.step_groups import group_objective, step_group_ids


def _costs(D, G, seed, phases=False):
    rng = np.random.default_rng(seed)
    shape = (D, G, 2) if phases else (D, G)
    return rng.choice([0, 64, 256, 2048, 8192], size=shape, p=[.3, .3, .2, .15, .05]).astype(np.int64)


def _same(a, b):
    return np.array_equal(a.src_rank, b.src_rank) and np.array_equal(a.src_index, b.src_index)


@pytest.mark.parametrize("bad, message", [
    ((0, 0, 1), "3 labels for 4"),
    ((0, 0, 1, 1, 2), "5 labels for 4"),
    ((0, -1, 1, 1), r"step_groups\[1\] must be >= 0"),
    ((0, 0.5, 1, 1), r"step_groups\[1\] must be an integer"),
    ((0, 1.0, 1, 1), r"step_groups\[1\] must be an integer"),
    ((0, True, 1, 1), r"step_groups\[1\] must be an integer"),
    ((0, "a", 1, 1), r"step_groups\[1\] must be an integer"),
    ("0011", "sequence of integer labels"),
    (3, "sequence of integer labels"),
    ((), "non-empty"),
    (((0, 1), (0, 1)), "1-D"),
])
def test_bad_labels_get_a_clear_error(bad, message):
    c = _costs(4, 3, 0)
    with pytest.raises(ValueError, match=message):
        plan_placement(c, step_groups=bad)
    with pytest.raises(ValueError, match=message):
        plan_batch(c, BalancerConfig(), step_groups=bad)


def test_labels_are_checked_once_in_the_options():
    assert SolverOptions(step_groups=[3, 3, np.int64(7), 7]).step_groups == (3, 3, 7, 7)
    with pytest.raises(ValueError, match="plan_placement takes options or"):
        plan_placement(_costs(4, 3, 0), SolverOptions(), step_groups=(0, 0, 1, 1))
    assert step_group_ids(4, (9, 2, 9, 2)).tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("phases", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_one_group_is_todays_placement(seed, phases):
    rng = np.random.default_rng(seed)
    D, G = int(rng.integers(2, 17)), int(rng.integers(1, 9))
    c = _costs(D, G, seed, phases)
    nodes = [r // 2 for r in range(D)] if seed % 2 else None
    want = plan_placement(c, ranks_per_node=nodes)
    label = int(rng.integers(0, 5))
    got = plan_placement(c, ranks_per_node=nodes, step_groups=[label] * D)
    assert _same(got, want)


@pytest.mark.parametrize("phases", [False, True])
@pytest.mark.parametrize("seed", range(10))
def test_every_rank_its_own_group_is_step_mode(seed, phases):
    rng = np.random.default_rng(100 + seed)
    D, G = int(rng.integers(2, 17)), int(rng.integers(1, 9))
    c = _costs(D, G, seed, phases)
    got = plan_placement(c, step_groups=list(range(D))[::-1])
    assert _same(got, plan_placement(c, sync="step"))


def test_step_mode_ignores_the_labels():
    c = _costs(8, 6, 1)
    assert _same(plan_placement(c, sync="step", step_groups=[0, 0, 1, 1, 2, 2, 3, 3]),
                 plan_placement(c, sync="step"))


def test_group_objective_by_hand():
    placed = np.array([[5, 1], [2, 4], [3, 3], [1, 1]])
    assert group_objective(placed, None) == 5 + 4
    groups = np.array([0, 0, 1, 1])
    assert group_objective(placed, groups) == max(5 + 4, 3 + 3)
    assert group_objective(placed, np.arange(4)) == 6                 # rank totals
    pairs = np.stack([placed, placed[::-1]], axis=2)                   # (vision, language)
    assert group_objective(pairs, groups) == max(5 + 4 + 3 + 3, 3 + 3 + 5 + 4)


def test_plan_batch_passes_the_groups_and_reports_them():
    c = _costs(8, 6, 2, phases=True)
    labels = (0, 0, 0, 0, 1, 1, 1, 1)
    nodes = (0, 0, 1, 1, 2, 2, 3, 3)
    placement, stats = plan_batch(c, BalancerConfig(), nodes=nodes, step_groups=labels)
    want = plan_placement(c, ranks_per_node=list(nodes), step_groups=labels)
    assert _same(placement, want)
    scalar = c.sum(axis=2)
    assert stats == PlanStats.of(scalar, want, step_groups=labels, nodes=nodes)
    groups = np.array(labels)
    assert stats.step_groups == 2
    assert stats.group_cost_before == group_objective(scalar, groups)
    assert stats.group_cost_after == group_objective(want.apply(scalar), groups)
    assert stats.inter_group_moves == int((groups[want.src_rank] != groups[:, None]).sum())
    node = np.array(nodes)
    assert stats.inter_node_moves == int((node[want.src_rank] != node[:, None]).sum())
    assert stats.record()["inter_group_moves"] == stats.inter_group_moves
    _, flat = plan_batch(c, BalancerConfig())
    assert flat.step_groups == 1 and flat.inter_group_moves == 0 and flat.inter_node_moves is None
    assert flat.group_cost_after == flat.microstep_cost_after
