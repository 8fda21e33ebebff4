"""``benchmarks/lm_by_microstep.py``: the language model's own time at each micro-step index
(the least rank's, as the rank that arrived last waited least), per mode of a bench run."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_by_microstep.py"


def _module():
    spec = importlib.util.spec_from_file_location("lm_by_microstep", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(out: Path, name: str, rows):
    """rows: (iteration, micro-batch, (forward, backward) of rank 0, of rank 1)."""
    timing = out / name / "timing"
    timing.mkdir(parents=True)
    for rank in (0, 1):
        lines = [json.dumps(dict(iteration=it, microbatch=mb, rank=rank, lm_forward_ms=r[rank][0],
                                 lm_backward_ms=r[rank][1])) for it, mb, *r in rows]
        (timing / f"timing-rank{rank:05d}.jsonl").write_text("\n".join(lines) + "\n")


def test_the_least_rank_per_micro_step_averaged_by_index(tmp_path, capsys):
    _run(tmp_path, "round1-packs", [(1, 0, (900, 900), (900, 900)),             # warm-up: dropped
                                    (3, 0, (70, 90), (100, 90)), (3, 1, (80, 100), (70, 90))])
    _run(tmp_path, "round2-packs", [(3, 0, (60, 90), (70, 80)), (3, 1, (90, 110), (95, 105))])
    mod = _module()
    rows = mod.lm_by_index(sorted(tmp_path.glob("round*-packs")), warmup=2)
    assert set(rows) == {0, 1}
    # index 0: min(160, 190) = 160 and min(150, 150) = 150; forward min 70 and 60; backward 90 and 80
    assert rows[0] == pytest.approx(dict(lm=155.0, forward=65.0, backward=85.0, n=2))
    # index 1: min(180, 160) = 160 and min(200, 200) = 200
    assert rows[1] == pytest.approx(dict(lm=180.0, forward=80.0, backward=97.5, n=2))   # 90 and 105
    mod.main([str(tmp_path), "--modes", "packs,off"])
    out = capsys.readouterr().out
    assert "335.0" in out and "(2 runs)" in out and "off         no runs" in out
