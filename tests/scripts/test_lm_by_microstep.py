"""``benchmarks/lm_by_microstep.py``: the language model's own time at each micro-step index
(the least rank's, as the rank that arrived last waited least), per mode of a bench run."""
from __future__ import annotations

import pytest


def _records(rows, rank):
    """rows: (iteration, micro-batch, (forward, backward) of rank 0, of rank 1)."""
    return [dict(iteration=it, microbatch=mb, lm_forward_ms=r[rank][0], lm_backward_ms=r[rank][1])
            for it, mb, *r in rows]


def test_the_least_rank_per_micro_step_averaged_by_index(tmp_path, capsys, load_benchmark, write_timing):
    warm = [(it, mb, (900, 900), (900, 900)) for it in (1, 2) for mb in (0, 1)]   # dropped
    runs = {"round1-packs": warm + [(3, 0, (70, 90), (100, 90)), (3, 1, (80, 100), (70, 90))],
            "round2-packs": warm + [(3, 0, (60, 90), (70, 80)), (3, 1, (90, 110), (95, 105))]}
    for name, rows in runs.items():
        write_timing(tmp_path / name / "timing", {r: _records(rows, r) for r in (0, 1)})
    mod = load_benchmark("lm_by_microstep")
    rows = mod.lm_by_index(sorted(tmp_path.glob("round*-packs")), warmup=2)
    assert set(rows) == {0, 1}
    # index 0: min(160, 190) = 160 and min(150, 150) = 150; forward min 70 and 60; backward 90 and 80
    assert rows[0] == pytest.approx(dict(lm=155.0, forward=65.0, backward=85.0, n=2))
    # index 1: min(180, 160) = 160 and min(200, 200) = 200
    assert rows[1] == pytest.approx(dict(lm=180.0, forward=80.0, backward=97.5, n=2))   # 90 and 105
    mod.main([str(tmp_path), "--modes", "packs,off"])
    out = capsys.readouterr().out
    assert "335.0" in out and "(2 runs)" in out and "off         no runs" in out
