"""``benchmarks/images_gather_wait.py``: images mode's unit-table all-gather split into the
collective itself (the last rank to arrive waits for nobody) and the other ranks' waiting."""
from __future__ import annotations

import pytest


def _records(rows, rank):
    """rows: (iteration, micro-batch, gather ms of rank 0, of rank 1, frames anywhere)."""
    return [dict(iteration=it, microbatch=mb, grids=[[1, 8, 8]] if frames and rank == 0 else [],
                 details=dict(vision_gather_ms=(g0, g1)[rank])) for it, mb, g0, g1, frames in rows]


def test_the_last_rank_to_arrive_is_the_collective_the_rest_waiting(tmp_path, capsys, load_benchmark,
                                                                      write_timing):
    rows = [(1, 0, 500.0, 1.0, True), (1, 1, 500.0, 1.0, True),     # warm-up iterations: dropped
            (2, 0, 500.0, 1.0, True), (2, 1, 500.0, 1.0, True),
            (3, 0, 2.0, 12.0, True), (3, 1, 3.0, 3.0, False),
            (4, 0, 7.0, 1.0, True), (4, 1, 1.0, 1.0, True)]
    timing = write_timing(tmp_path / "timing", {r: _records(rows, r) for r in (0, 1)})
    mod = load_benchmark("images_gather_wait")
    s = mod.split_gather(timing, warmup=2)
    assert s["iterations"] == 2
    frames, none = s["per_iteration"]["frames"], s["per_iteration"]["none"]
    # frames: (2+12) + (7+1) + (1+1) = 24 over 2 iterations; collective 2*(2+1+1) = 8
    assert frames == pytest.approx(dict(gather=12.0, collective=4.0, waiting=8.0, steps=1.5))
    assert none == pytest.approx(dict(gather=3.0, collective=3.0, waiting=0.0, steps=0.5))
    assert s["collective_p50"] == pytest.approx(1.5)             # of 2, 3, 1, 1
    mod.main([str(timing)])
    assert "12.0" in capsys.readouterr().out
