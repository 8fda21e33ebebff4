"""Control mode on real gloo ranks: every rank gets exactly its own packs, each once,
permuted across micro-steps in balancing's micro-step order, nothing sent; and the
permutation itself (pure): local, deterministic, a bijection of each rank's packs."""
import importlib.util
import os

import numpy as np
import pytest

from megatron_mm_balance.solver.placement import (Placement, PlanStats, check_placement,
                                                  control_placement, plan_placement, reordered_packs)

_spec = importlib.util.spec_from_file_location(
    "rt_harness", os.path.join(os.path.dirname(__file__), "rt_harness.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


def _balanced_step(solved: Placement, rank: int, index: int) -> int:
    """The micro-step at which ``solved`` computes rank ``rank``'s pack ``index``."""
    hit = np.argwhere((solved.src_rank == rank) & (solved.src_index == index))
    assert len(hit) == 1
    return int(hit[0][1])


@pytest.mark.parametrize("shape,seed", [((2, 4), 0), ((4, 8), 1), ((3, 5), 2), ((8, 16), 3)])
def test_control_keeps_each_rank_its_own_packs_in_balanced_step_order(shape, seed):
    costs = np.random.RandomState(seed).randint(0, 500, shape)
    solved = plan_placement(costs)
    control = control_placement(solved)
    D, G = shape
    check_placement(control, D, G)                                   # every pack exactly once
    assert not control.moved().any()                                 # nothing crosses ranks
    for r in range(D):
        assert sorted(control.src_index[r]) == list(range(G))
        # balancing's micro-step order of the rank's own packs, rotated by the rank's index
        unrotated = np.roll(control.src_index[r], r % G)
        steps = [_balanced_step(solved, r, int(i)) for i in unrotated]
        assert steps == sorted(steps)
        ties = [int(i) for i in unrotated]
        assert all(ties[m] < ties[m + 1] for m in range(G - 1) if steps[m] == steps[m + 1])
    again = control_placement(plan_placement(costs.copy()))
    assert np.array_equal(again.src_index, control.src_index)        # deterministic
    stats = PlanStats.of(costs, control)
    assert stats.packs_moved == 0 and stats.rank_total_max_after == stats.rank_total_max_before


def test_control_reorders_when_balancing_regroups():
    """A skewed batch: balancing regroups packs, so the control reorders some of them."""
    costs = np.array([[900, 10, 10, 10, 800, 10], [10, 700, 10, 10, 10, 600]])
    control = control_placement(plan_placement(costs))
    assert reordered_packs(control) > 0
    assert reordered_packs(Placement.identity(2, 6)) == 0


def test_control_of_the_identity_rotates_each_rank_by_its_index():
    """Even where balancing keeps every pack in place, the ranks meet other partners at every
    micro-step: rank r trains its packs r, r+1, ... (mod G)."""
    control = control_placement(Placement.identity(3, 4))
    assert control.src_index.tolist() == [[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1]]
    assert not control.moved().any() and reordered_packs(control) == 8
    assert control_placement(Placement.identity(2, 1)).src_index.tolist() == [[0], [0]]    # G = 1


@pytest.mark.parametrize("overlap", [True, False])
def test_control_mode_delivers_own_packs_permuted_nothing_sent(overlap):
    G, batches, world = 4, 3, 3
    res = harness.launch(world, "control", hard_timeout=90, G=G, batches=batches, overlap=overlap)
    for r, x in enumerate(res):
        assert "delivered" in x, f"rank {r}: {x.get('error') or x}\n{x.get('log', '')}"
        assert len(x["stats"]) == batches
    reordered = 0
    for gb in range(batches):
        sl = slice(gb * G, (gb + 1) * G)
        costs = np.array([x["costs"][sl] for x in res])
        want = control_placement(plan_placement(costs))
        for r, x in enumerate(res):
            own = x["pulled"][sl]
            got = x["delivered"][sl]
            assert got == [own[i] for i in want.src_index[r]]       # this rank's packs, the plan's order
            assert sorted(x["delivered_checksums"][sl]) == sorted(x["checksums"][sl])   # intact, once each
            st = x["stats"][gb]
            assert st["mode"] == "control" and st["control"] is True
            assert st["packs_moved"] == 0 and st["packs_sent"] == st["packs_received"] == 0
            assert st["bytes_sent"] == st["bytes_received"] == 0
            assert st["packs_reordered"] == reordered_packs(want)
            assert list(st["my_costs"]) == [x["costs"][sl][i] for i in want.src_index[r]]
        reordered += reordered_packs(want)
    assert reordered > 0, "the control reordered nothing: the test would not see a wrong order"


def test_control_and_shadow_together_refused():
    from megatron_mm_balance.runtime.config import BalancerConfig, SettingError
    with pytest.raises(SettingError, match="control cannot be combined with shadow"):
        BalancerConfig(control=True, shadow=True)


@pytest.mark.parametrize("parity,first_iteration,overlap", [("even", None, True), ("odd", 7, False)])
def test_crossover_balances_one_parity_and_delivers_the_other_as_drawn(parity, first_iteration, overlap):
    """Crossover mode on real gloo ranks: the global batches of training iterations of
    ``parity`` are delivered as the exchange places them, the others each rank's own packs in
    their own order (nothing sent), every pack once; a resumed job counts from its own
    first iteration."""
    G, batches, world = 4, 4, 3
    res = harness.launch(world, "crossover", hard_timeout=90, G=G, batches=batches, overlap=overlap,
                         parity=parity, first_iteration=first_iteration)
    for r, x in enumerate(res):
        assert "delivered" in x, f"rank {r}: {x.get('error') or x}\n{x.get('log', '')}"
        assert len(x["stats"]) == batches
    balanced = 0
    for gb in range(batches):
        iteration = (first_iteration or 1) + gb
        on = iteration % 2 == (0 if parity == "even" else 1)
        sl = slice(gb * G, (gb + 1) * G)
        solved = plan_placement(np.array([x["costs"][sl] for x in res]))
        for r, x in enumerate(res):
            got, st = x["delivered"][sl], x["stats"][gb]
            assert st["mode"] == ("exchange" if on else "shadow")
            assert st["packs_would_move"] == solved.moved().sum()
            if on:
                assert got == [res[s]["pulled"][sl][i] for s, i in zip(solved.src_rank[r], solved.src_index[r])]
                assert st["packs_moved"] == solved.moved().sum()
            else:
                assert got == x["pulled"][sl]
                assert st["packs_moved"] == st["packs_sent"] == st["packs_received"] == 0
        balanced += on and bool(solved.moved().any())
    assert balanced > 0, "no balanced batch moved a pack: the test would not see the exchange"
    pulled = sorted(c for x in res for c in x["checksums"])
    assert sorted(c for x in res for c in x["delivered_checksums"]) == pulled     # each pack once


def test_crossover_settings_refused():
    from megatron_mm_balance.runtime.config import BalancerConfig, SettingError
    with pytest.raises(SettingError, match="crossover must be 'even', 'odd' or None"):
        BalancerConfig(crossover="third")
    with pytest.raises(SettingError, match="crossover cannot be combined with shadow or control"):
        BalancerConfig(crossover="odd", shadow=True)
