"""The planner and the agreement record: pure pieces of the exchange, tested without processes."""
import subprocess
import sys

import numpy as np
import pytest

from megatron_mm_balance.runtime.agreement import (HEADER, INLINE_COSTS, MAGIC, BatchRecord,
                                                   BatchStatus, check_agreement, settings_hash)
from megatron_mm_balance.runtime.config import BalancerConfig, SettingError
from megatron_mm_balance.runtime.errors import InconsistentConfig, PeerFailure
from megatron_mm_balance.runtime.planner import node_of_ranks, plan_batch
from megatron_mm_balance.solver.placement import PlanStats, check_placement, plan_placement


def _costs(D=4, G=6, seed=0, phases=False):
    rng = np.random.default_rng(seed)
    shape = (D, G, 2) if phases else (D, G)
    return rng.choice([0, 64, 256, 2048, 8192], size=shape, p=[.3, .3, .2, .15, .05]).astype(np.int64)


@pytest.mark.parametrize("sync", ["microstep", "step"])
def test_plan_batch_is_the_runtime_placement_and_its_stats(sync):
    c = _costs(seed=1)
    placement, stats = plan_batch(c, BalancerConfig(sync=sync))
    want = plan_placement(c, sync=sync)
    assert np.array_equal(placement.src_rank, want.src_rank)
    assert np.array_equal(placement.src_index, want.src_index)
    assert stats == PlanStats.of(c, want)
    check_placement(placement, *c.shape)


def test_plan_batch_two_phase_costs_and_nodes():
    c = _costs(D=4, G=5, seed=2, phases=True)
    placement, stats = plan_batch(c, BalancerConfig(sync="microstep"))
    assert stats == PlanStats.of(c.sum(axis=2), placement)        # stats on the totals
    # Nodes come from the global ranks of the data-parallel ranks (rank // ranks_per_node).
    cfg = BalancerConfig(sync="step", ranks_per_node=2)
    flat = _costs(D=4, G=6, seed=3)
    aware, _ = plan_batch(flat, cfg, ranks=[0, 2, 4, 6])           # every rank its own node
    want = plan_placement(flat, sync="step", ranks_per_node=[0, 1, 2, 3])
    assert np.array_equal(aware.src_rank, want.src_rank)
    unaware, _ = plan_batch(flat, cfg)                             # no ranks: a flat plan
    assert np.array_equal(unaware.src_rank, plan_placement(flat, sync="step").src_rank)
    assert node_of_ranks([0, 1, 2, 3], 2) == (0, 0, 1, 1) and node_of_ranks(None, 2) is None


def test_plan_batch_imports_no_torch():
    code = ("import sys\nfrom megatron_mm_balance.runtime.planner import plan_batch\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_config_resolves_the_default_tolerance_once_and_names_bad_fields():
    from megatron_mm_balance.solver.placement import DEFAULT_BALANCE_TOLERANCE
    assert BalancerConfig(balance_tolerance=None).balance_tolerance == DEFAULT_BALANCE_TOLERANCE
    assert BalancerConfig().balance_tolerance == DEFAULT_BALANCE_TOLERANCE
    for field, value in [("balance_tolerance", 1.0), ("balance_tolerance", -0.1), ("timeout", 0),
                         ("sync", "auto"), ("ranks_per_node", 0), ("stats_history", 0)]:
        with pytest.raises(SettingError) as exc:
            BalancerConfig(**{field: value})
        assert exc.value.field == field and str(exc.value).startswith(field)


# -- the agreement record ------------------------------------------------------------------------
def test_record_round_trips_with_named_fields_in_wire_order():
    rec = BatchRecord(global_batch=3, num_microbatches=4, packs_pulled=4, settings_hash=99,
                      status=BatchStatus.COST_ERROR, costs=(1, 2, 3, 4))
    row = rec.encode()
    assert row.shape == (HEADER + INLINE_COSTS,) and row.dtype == np.int64
    assert list(row[:6]) == [MAGIC, 3, 4, 4, 99, 2] and list(row[HEADER:HEADER + 4]) == [1, 2, 3, 4]
    assert BatchRecord.decode(row, 4) == rec
    assert BatchRecord.decode(row).costs == ()
    with pytest.raises(ValueError, match="do not fit"):
        BatchRecord(0, 1, 1, 0, costs=tuple(range(INLINE_COSTS + 1))).encode()


def _records(**odd):
    base = dict(global_batch=5, num_microbatches=2, packs_pulled=2, settings_hash=settings_hash("s"))
    recs = [BatchRecord(**base) for _ in range(3)]
    for i, kw in odd.items():
        recs[int(i[1:])] = BatchRecord(**{**base, **kw})
    return recs


def _check(recs, **kw):
    check_agreement(recs, ranks=[10, 11, 12], me=10, global_batch=5, num_microbatches=2,
                    settings="s", **kw)


def test_agreement_names_the_rank_that_differs():
    _check(_records())                                              # all agree: no error
    with pytest.raises(InconsistentConfig, match=r"different global batches \{10: 5, 11: 6, 12: 5\}"):
        _check(_records(r1={"global_batch": 6}))
    with pytest.raises(InconsistentConfig, match=r"num_microbatches differs .* \{10: 2, 11: 2, 12: 3\}"):
        _check(_records(r2={"num_microbatches": 3}))
    with pytest.raises(InconsistentConfig, match=r"ranks \[11\] disagree with this rank's \[s\]"):
        _check(_records(r1={"settings_hash": 1}))
    with pytest.raises(InconsistentConfig, match=r"ranks \[12\] sent a malformed record"):
        _check(_records(r2={"magic": 7}))
    with pytest.raises(PeerFailure, match="rank 11's data source raised: it broke"):
        _check(_records(r1={"status": BatchStatus.SOURCE_ERROR}), peer_message=lambda r: ": it broke")
    own = KeyError("mine")
    with pytest.raises(KeyError):                                   # the failing rank: its own error
        _check(_records(r0={"status": BatchStatus.COST_ERROR}), own_error=own)
