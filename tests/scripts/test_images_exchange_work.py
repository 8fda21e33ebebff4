"""``benchmarks/images_exchange_work.py``: images mode's own work on the training thread, from the
timing records' details: the exchange's forward and backward less the tower and the waits."""
from __future__ import annotations

import pytest


def _records(rank):
    crossed = dict(vision_exchange_ms=30.0, vision_tower_ms=20.0, vision_tower_calls=2, vision_wait_ms=4.0,
                   vision_grad_exchange_ms=5.0, vision_grad_wait_ms=2.0)
    rows = []
    for it in (1, 2, 3, 4):
        for mb in (0, 1):
            details = crossed if (rank == 0 or mb == 0) and it > 1 else {}
            rows.append(dict(iteration=it, microbatch=mb, grids=[], details=dict(details)))
    return rows


def test_own_work_is_the_exchange_less_the_tower_and_the_waits(tmp_path, capsys, load_benchmark, write_timing):
    timing = write_timing(tmp_path / "timing", {r: _records(r) for r in (0, 1)})
    mod = load_benchmark("images_exchange_work")
    s = mod.exchange_work(timing, warmup=1, balanced_only=False)
    assert s["iterations"] == 3 and s["ranks"] == 2
    # per crossed micro-step: (30 - 20 - 4) + (5 - 2) = 9 ms own, 6 ms waiting, 20 ms tower;
    # rank 0 crosses at both micro-steps, rank 1 at one
    assert s["own"] == pytest.approx(dict(mean=13.5, max=18.0))
    assert s["wait"] == pytest.approx(dict(mean=9.0, max=12.0))
    assert s["tower"] == pytest.approx(dict(mean=30.0, max=40.0))
    assert s["crossed"] == pytest.approx(dict(mean=1.5, max=2.0))
    mod.main([str(timing), "--warmup", "1", "--all-iterations"])
    assert "13.5 / 18.0" in capsys.readouterr().out
    # iteration 1 (dropped here) crosses nothing: the balanced iterations are the same three
    assert mod.exchange_work(timing, warmup=0)["iterations"] == 3
