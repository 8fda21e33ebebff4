"""The crossover estimate (``megatron_mm_balance.bench.crossover``, printed by
``benchmarks/crossover_gain.py``) cancels each job's own speed."""
from __future__ import annotations

import pytest

from megatron_mm_balance.bench import crossover as mod


def _log(times: dict, waits: dict) -> str:
    """A Bridge log: one line per iteration (its elapsed ms), and our telemetry's consumer wait."""
    lines = []
    for it, ms in sorted(times.items()):
        lines.append(f" [2026-12-04 10:00:00] iteration {it:8d}/{len(times):8d} | consumed samples: 16 | "
                     f"elapsed time per iteration (ms): {ms:.1f} | learning rate: 1.0E-04 | "
                     f"lm loss: 6.400000E+00 | loss scale: 1.0 |")
        lines.append(f"[mm-balance] iteration {it} | packs_moved: 2 | consumer_wait_ms: {waits[it]:.1f}")
    return "\n".join(lines) + "\n"


def _write_round(out, rnd, data, gain, speed_even, speed_odd, pair="crossover"):
    """Round ``rnd``: iteration ``i`` costs ``data[i]`` ms unbalanced, ``data[i] / (1 + gain)``
    balanced; each job's times scaled by its own speed factor."""
    for parity, speed in (("even", speed_even), ("odd", speed_odd)):
        on = {i: i % 2 == (0 if parity == "even" else 1) for i in data}
        times = {i: speed * (ms / (1 + gain) if on[i] else ms) for i, ms in data.items()}
        waits = {i: 60.0 if on[i] else 3.0 for i in data}
        d = out / f"round{rnd}-{pair}-{parity}"
        d.mkdir(parents=True)
        (d / "train.log").write_text(_log(times, waits))


def test_the_jobs_own_speeds_cancel(tmp_path, load_benchmark, capsys):
    data = {i: 1800.0 + 300.0 * ((i * 7) % 5) for i in range(1, 13)}     # iterations differ in work
    _write_round(tmp_path, 1, data, 0.08, 1.00, 1.10)                   # the odd job ran 10% slower
    _write_round(tmp_path, 2, data, 0.08, 0.93, 1.00)
    rep = mod.report(tmp_path, warmup=2)
    assert [r["round"] for r in rep["rounds"]] == [1, 2]
    for r in rep["rounds"]:
        assert r["gain"] == pytest.approx(0.08, rel=1e-3)              # whatever the speeds (ms printed to 0.1)
        assert r["iterations"] == 10                                   # iterations 3..12
    assert rep["gain"] == pytest.approx(0.08, rel=1e-3)
    # the plain paired mean carries the speeds: each pair mixes the two jobs
    biased = ((1.08 * 1.10 - 1) + (1.08 / 1.10 - 1)) / 2
    assert rep["rounds"][0]["paired_mean"] == pytest.approx(biased, rel=1e-3) and biased > 0.0845
    assert rep["wait_on_ms"] == pytest.approx(60.0) and rep["wait_off_ms"] == pytest.approx(3.0)
    load_benchmark("crossover_gain").main([str(tmp_path)])               # the script prints it
    out = capsys.readouterr().out
    assert "all 2 rounds: +8.0%" in out and "consumer wait per iteration: balanced 60.0 ms" in out


def test_a_round_without_its_partner_is_left_out_and_none_is_an_error(tmp_path):
    data = {i: 2000.0 for i in range(1, 9)}
    _write_round(tmp_path, 1, data, 0.05, 1.0, 1.0)
    (tmp_path / "round2-crossover-even").mkdir()
    assert mod.rounds_in(tmp_path) == [1]
    assert mod.report(tmp_path, warmup=2)["gain"] == pytest.approx(0.05, rel=1e-3)
    with pytest.raises(mod.CrossoverError, match="no round with both"):
        mod.report(tmp_path / "round2-crossover-even", warmup=2)


def test_each_pair_reads_its_own_runs(tmp_path):
    """Pack crossover and images crossover runs in one OUT: each pair reads its own (the pack
    pair's name is a suffix of the images pair's)."""
    data = {i: 2000.0 for i in range(1, 9)}
    _write_round(tmp_path, 1, data, 0.05, 1.0, 1.0)
    _write_round(tmp_path, 1, data, 0.09, 1.0, 1.02, pair="images-crossover")
    _write_round(tmp_path, 2, data, 0.09, 1.0, 1.0, pair="images-crossover")
    assert mod.rounds_in(tmp_path) == [1] and mod.rounds_in(tmp_path, "images-crossover") == [1, 2]
    assert mod.report(tmp_path, warmup=2)["gain"] == pytest.approx(0.05, rel=1e-3)
    assert mod.report(tmp_path, warmup=2, pair="images-crossover")["gain"] == pytest.approx(0.09, rel=1e-3)


def test_the_premise_is_checked_against_the_off_runs(tmp_path):
    """With ``off`` runs beside them, the crossover iterations are compared with the off job's
    same iterations: here the unbalanced ones run 6% slower than off, which the check shows."""
    data = {i: 2000.0 + 100.0 * (i % 3) for i in range(1, 11)}
    _write_round(tmp_path, 1, {i: 1.06 * ms for i, ms in data.items()}, 0.10, 1.0, 1.0)
    off = tmp_path / "round1-off"
    off.mkdir()
    (off / "train.log").write_text(_log(data, {i: 0.0 for i in data}))
    rep = mod.report(tmp_path, warmup=2)
    assert rep["gain"] == pytest.approx(0.10, rel=1e-3)
    unbalanced, n = rep["against_off"]["unbalanced"]
    assert unbalanced == pytest.approx(1.06, rel=1e-3) and n == 8          # 4 of 8 measured, 2 jobs
    assert rep["against_off"]["balanced"][0] == pytest.approx(1.06 / 1.10, rel=1e-3)
    (off / "train.log").unlink()
    assert mod.report(tmp_path, warmup=2)["against_off"] == {}


def _write_timing(run_dir, iterations, lm_ms, G=2, ranks=2):
    """Per-pack timing records: every micro-batch's language model ``lm_ms[i] / G`` (forward
    and backward halves), no images."""
    import json
    d = run_dir / "timing"
    d.mkdir()
    for r in range(ranks):
        rows, t = [], 0.0
        for i in iterations:
            for k in range(G):
                half = lm_ms[i] / G / 2
                rows.append(dict(iteration=i, microbatch=k, rank=r, images=[], lengths=[1024],
                                 vision_forward_ms=0.0, vision_backward_ms=0.0, lm_forward_ms=half,
                                 lm_backward_ms=half, start_s=t, end_s=t + 2 * half / 1e3))
                t += 2 * half / 1e3
        (d / f"timing-rank{r:05d}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))


def test_the_premise_with_each_jobs_speed_divided_out(tmp_path):
    """A crossover job that ran 5% slower than ``off`` on the same work (its language model's
    compute 5% longer) shows unbalanced iterations at 1.05 of ``off``; with its speed divided
    out they are at 1.00, and the balanced ones at 1 / (1 + gain)."""
    data = {i: 2000.0 + 100.0 * (i % 3) for i in range(1, 11)}
    lm = {i: 1200.0 + 10.0 * i for i in data}
    _write_round(tmp_path, 1, data, 0.10, 1.05, 1.05)
    for parity in ("even", "odd"):
        _write_timing(tmp_path / f"round1-crossover-{parity}", data, {i: 1.05 * ms for i, ms in lm.items()})
    off = tmp_path / "round1-off"
    off.mkdir()
    (off / "train.log").write_text(_log(data, {i: 0.0 for i in data}))
    _write_timing(off, data, lm)
    rep = mod.report(tmp_path, warmup=2)
    assert rep["speeds"] == {(1, "even"): pytest.approx(1.05), (1, "odd"): pytest.approx(1.05)}
    assert rep["against_off"]["unbalanced"][0] == pytest.approx(1.05, rel=1e-3)
    assert rep["against_off_at_speed"]["unbalanced"][0] == pytest.approx(1.0, rel=1e-3)
    assert rep["against_off_at_speed"]["balanced"][0] == pytest.approx(1 / 1.10, rel=1e-3)
    for d in tmp_path.glob("round1-*/timing"):
        for f in d.iterdir():
            f.unlink()
    assert mod.report(tmp_path, warmup=2)["speeds"] == {}           # no timings: no speed figure


def test_where_the_time_goes_at_balanced_and_unbalanced_iterations(tmp_path, write_timing):
    """Unbalanced, rank 0's tower takes 90 ms a micro-step and rank 1's 10, and rank 1 waits 80 ms
    in the language model's collectives; balanced, both towers take 60 ms (the exchange's 10 ms
    included) and nobody waits. Per iteration and rank (2 micro-steps): vision 100 against 120 ms,
    waiting 80 against 0, the language model's 400 ms of compute in both."""
    data = {i: 1000.0 for i in range(1, 9)}
    _write_round(tmp_path, 1, data, 0.05, 1.0, 1.0, pair="images-crossover")
    for parity in ("even", "odd"):
        by_rank = {}
        for rank in (0, 1):
            rows, t = [], 0.0
            for i in data:
                on = mod.balanced(parity, i)
                vision = 60.0 if on else (90.0, 10.0)[rank]
                lm = 200.0 if on or rank == 0 else 280.0
                for k in range(2):
                    rows.append(dict(iteration=i, microbatch=k, images=[256], vision_forward_ms=vision,
                                     lm_forward_ms=lm / 2, lm_backward_ms=lm / 2,
                                     start_s=t, end_s=t + (vision + lm) / 1e3))
                    t += (vision + lm) / 1e3
            by_rank[rank] = rows
        write_timing(tmp_path / f"round1-images-crossover-{parity}" / "timing", by_rank)
    phases = mod.report(tmp_path, warmup=2, pair="images-crossover")["phases"]
    assert phases["balanced"] == pytest.approx(dict(vision=120.0, lm_compute=400.0, waiting=0.0))
    assert phases["unbalanced"] == pytest.approx(dict(vision=100.0, lm_compute=400.0, waiting=80.0))
    for f in tmp_path.glob("round1-*/timing/*.jsonl"):
        f.unlink()
    assert mod.report(tmp_path, warmup=2, pair="images-crossover")["phases"] == {}     # no timings
