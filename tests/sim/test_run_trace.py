"""A job's own per-pack timings as the simulator's input (sim/run_trace.py) and
``mm-balance simulate RUN_DIR --timing run``: hand-computed timelines, the fitted timing
model, the job's layout, bad input."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_mm_balance.sim.run_trace import (RunTraceError, fit_timing_model, load_run, measured_phases,
                                               predicted_times, simulate_layout, vision_share)

ROOT = Path(__file__).resolve().parents[2]


def write_run(d: Path, rows):
    """rows[(iteration, rank, microbatch)] = (images, vf, vb, lf, lb, start, end)."""
    d.mkdir(parents=True, exist_ok=True)
    files = {}
    for (it, rank, m), (images, vf, vb, lf, lb, start, end) in sorted(rows.items()):
        files.setdefault(rank, []).append(json.dumps(dict(
            iteration=it, microbatch=m, rank=rank, images=images, lengths=[600, 400],
            vision_forward_ms=vf, vision_backward_ms=vb, lm_forward_ms=lf, lm_backward_ms=lb,
            start_s=start, end_s=end)))
    for rank, lines in files.items():
        (d / f"timing-rank{rank:05d}.jsonl").write_text("\n".join(lines) + "\n")
    return d


def two_by_two(d: Path) -> Path:
    """Iterations 1-3, 2 ranks x 2 micro-steps. Rank 0 has the heavy pack first, rank 1 second;
    the rank that arrives last at the language model (rank 0 both times: its heavy backward
    precedes its light m=1) has the pure compute time (100 ms fwd + 50 bwd); the other waited."""
    rows = {}
    for it in (1, 2, 3):
        t = 10.0 * it                   # seconds on each rank's clock
        # rank 0: m0 vf 300 vb 600 (waits 0 at m0), m1 vf 100 vb 200
        rows[(it, 0, 0)] = ([512], 300.0, 600.0, 100.0, 50.0, t, t + 1.05)
        rows[(it, 0, 1)] = ([128], 100.0, 200.0, 100.0, 50.0, t + 1.06, t + 2.10)
        rows[(it, 1, 0)] = ([128], 100.0, 200.0, 100.0 + 200.0, 50.0, t, t + 0.65)
        rows[(it, 1, 1)] = ([512], 300.0, 600.0, 100.0 + 200.0, 50.0, t + 0.66, t + 1.70)
    return write_run(d, rows)


def test_measured_phases_take_the_last_arriver_and_the_gaps(tmp_path):
    run = load_run(str(two_by_two(tmp_path / "t")), skip_iterations=0)
    assert run.shape == (3, 2, 2) and run.iterations == [1, 2, 3] and run.ranks == [0, 1]
    ph = measured_phases(run)
    np.testing.assert_allclose(ph.lm, 150.0)                      # compute, no wait
    np.testing.assert_allclose(ph.gap[:, :, 1], 10.0)             # 10 ms between micro-batches
    np.testing.assert_allclose(ph.vf[:, 0, :], [[300.0, 110.0]] * 3)
    np.testing.assert_allclose(ph.tail_ms, 10_000 - 2100)         # rank 0 ends at t + 2.10 s


def test_predicted_times_by_hand(tmp_path):
    run = load_run(str(two_by_two(tmp_path / "t")), skip_iterations=0)
    p = predicted_times(run)
    # laid out: m0 meets at max(300, 100) = 300, LM to 450, then vision backward 600 / 200:
    # rank 0 at 1050, rank 1 at 650; m1: arrive 1050 + 110 = 1160 and 650 + 310 = 960, LM to
    # 1310, backward 200 / 600: ends 1510 and 1910. Plus the tail 7900.
    np.testing.assert_allclose(p["laid_out_ms"], 1910.0 + 7900.0)
    # perfect: each micro-step's mean of vision (fwd + gap + bwd) plus the LM phase
    perfect = (900 + 300) / 2 + 150 + (310 + 910) / 2 + 150
    np.testing.assert_allclose(p["perfect_ms"], perfect + 7900.0)
    assert 0 < vision_share(run) < 1


def test_fitted_timing_model_and_the_layout_simulation(tmp_path):
    from megatron_mm_balance.cost.model import CostModel, FeatureArrays, PackFeatures
    true = CostModel(vision_ms_per_token=0.4, vision_ms_per_pack=40.0, vision_backward_ratio=1.5,
                     llm_ms_per_token=0.15, llm_backward_ratio=1.0)
    rng = np.random.default_rng(0)
    rows = {}
    for it in range(1, 6):
        for rank in range(2):
            clock = 20.0 * it
            for m in range(6):
                images = [int(16 * v) for v in rng.integers(1, 13, size=rng.integers(0, 4))]
                f = PackFeatures(tuple(images), (600, 400))
                ph = true.phase_ms(FeatureArrays.of([f]))
                vf, vb, lf = float(ph.vision_forward[0]), float(ph.vision_backward[0]), float(ph.llm_forward[0])
                dur = (vf + vb + 2 * lf) / 1e3
                rows[(it, rank, m)] = (images, vf, vb, lf, lf, clock, clock + dur)
                clock += dur + 0.005
    d = write_run(tmp_path / "fit", rows)
    run = load_run(str(d))
    t, rep = fit_timing_model(run)
    assert t.vision_ms_per_token == pytest.approx(0.4, rel=1e-6)
    assert t.vision_ms_per_pack == pytest.approx(40.0, rel=1e-6) and t.vision_bwd_fwd_ratio == pytest.approx(1.5)
    assert rep["r2_vision"] == pytest.approx(1.0) and rep["gap_ms"] == pytest.approx(5.0, abs=1e-6)
    runs = {r["strategy"]: r for r in simulate_layout(run, t)}
    assert set(runs) == {"none", "local", "redistribute-sync", "redistribute-overlap"}
    assert runs["redistribute-overlap"]["time_per_batch_ms"] < runs["none"]["time_per_batch_ms"]
    assert runs["none"]["batches"] == 3                             # iterations 3-5


def test_simulate_cli_on_a_run_directory(tmp_path):
    d = two_by_two(tmp_path / "t")
    r = subprocess.run([sys.executable, "-m", "megatron_mm_balance.sim", "simulate", str(d), "--timing", "run",
                        "--skip-iterations", "0", "--balance-cost", "image-tokens", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert {x["strategy"] for x in rep["runs"]} == {"none", "local", "redistribute-sync", "redistribute-overlap"}
    assert rep["meta"]["layout"]["iterations"] == [1, 2, 3] and "budget left out" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "megatron_mm_balance.sim", "simulate", str(tmp_path),
                          "--timing", "run", "--out", str(tmp_path / "o2")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "timing-rank" in bad.stderr


def test_bad_run_directories(tmp_path):
    with pytest.raises(RunTraceError, match="no such timing directory"):
        load_run(str(tmp_path / "missing"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "timing-rank00000.jsonl").write_text('{"iteration": 1}\n')
    with pytest.raises(RunTraceError, match="missing"):
        load_run(str(tmp_path / "d"))
    d = two_by_two(tmp_path / "t")
    with pytest.raises(RunTraceError, match="no complete iteration"):
        load_run(str(d), skip_iterations=5)


def test_noise_and_sync_batch_terms(tmp_path):
    """The timing model's noise spreads every slot's compute (the same draw for every
    strategy, deterministic, none at 0) and the synchronous exchange's per-batch cost lands
    on the synchronous run only."""
    from dataclasses import replace

    from megatron_mm_balance.sim.run_trace import placement_order, time_breakdown
    from megatron_mm_balance.sim.timing import load_timing, model_from_dict

    run = load_run(str(two_by_two(tmp_path / "t")), skip_iterations=0)
    t, _ = fit_timing_model(run)
    base = {r["strategy"]: r["time_per_batch_ms"] for r in simulate_layout(run, replace(t, vision_noise_cv=0.0,
                                                                                     llm_noise_cv=0.0))}
    noisy = replace(t, vision_noise_cv=0.3, llm_noise_cv=0.3)
    a = {r["strategy"]: r["time_per_batch_ms"] for r in simulate_layout(run, noisy)}
    b = {r["strategy"]: r["time_per_batch_ms"] for r in simulate_layout(run, noisy)}
    assert a == b and a != base
    slow = {r["strategy"]: r["time_per_batch_ms"]
            for r in simulate_layout(run, replace(t, vision_noise_cv=0.0, llm_noise_cv=0.0, sync_batch_ms=500.0))}
    assert slow["redistribute-sync"] == pytest.approx(base["redistribute-sync"] + 500.0)
    assert slow["redistribute-overlap"] == base["redistribute-overlap"] and slow["none"] == base["none"]
    d = load_timing("default")
    assert (d.vision_noise_cv, d.llm_noise_cv, d.sync_batch_ms) == (0.0, 0.0, 0.0)
    parsed = model_from_dict({"vision": {"ms_per_token": 1.0, "noise_cv": 0.2}, "llm": {"ms_per_token": 1.0},
                              "exchange": {"bytes_per_image_token": 1, "link_gbps": 1, "sync_batch_ms": 9}})
    assert (parsed.vision_noise_cv, parsed.sync_batch_ms) == (0.2, 9.0)
    # the runtime's placement of each iteration: a permutation of its slots
    order = placement_order(run)
    assert all(sorted(o.reshape(-1)) == list(range(4)) for o in order)
    parts = time_breakdown(run)
    assert parts["lm_compute_ms"] == pytest.approx(300.0) and parts["host_gap_ms"] == pytest.approx(10.0)
    assert parts["waiting_ms"] == pytest.approx((0 + 400) / 2)        # rank 1 waited 200 ms twice


def test_the_image_exchange_split_from_the_records_details(tmp_path):
    """Records with the image-level exchange's ``details`` (``mm_balance.vision=images`` with
    the timing hooks) add its split of the vision forward to the breakdown, per iteration and
    rank: the gathers, the plan, the tower and the rest of the exchange; runs without them
    add nothing."""
    from megatron_mm_balance.sim.run_trace import time_breakdown
    run = load_run(str(two_by_two(tmp_path / "t")), skip_iterations=0)
    assert "exchange_ms" not in time_breakdown(run)
    for iteration in run.records:
        for rank, per_rank in enumerate(iteration):
            for m, r in enumerate(per_rank):
                r["details"] = {"vision_gather_ms": 5.0 + rank, "vision_plan_ms": 1.0, "vision_tower_ms": 80.0,
                                "vision_tower_calls": 2.0 if m == 0 else 1.0, "vision_exchange_ms": 100.0 + rank}
    parts = time_breakdown(run)
    # two micro-batches per iteration: rank 0 gathers 2 x 5 ms, rank 1 2 x 6 ms
    assert parts["exchange_gather_ms"] == pytest.approx(11.0) and parts["exchange_plan_ms"] == pytest.approx(2.0)
    assert parts["exchange_tower_ms"] == pytest.approx(160.0) and parts["exchange_ms"] == pytest.approx(201.0)
    assert parts["exchange_rest_ms"] == pytest.approx(201.0 - 11.0 - 2.0 - 160.0)
    assert parts["tower_calls_per_microbatch"] == pytest.approx(1.5)


def _with_grids(run, heavy_grids):
    """The two-by-two run's records with grids: each light pack (128 patches) one frame, each
    heavy pack (512) ``heavy_grids``."""
    for iteration in run.records:
        for per_rank in iteration:
            for r in per_rank:
                r["grids"] = heavy_grids if r["images"] == [512] else [[1, 8, 16]]
    return run


@pytest.mark.parametrize("heavy_grids, frames_floor", [
    ([[1, 16, 16], [1, 16, 16]], 1510.0),     # two equal frames: frames can reach perfect balance
    ([[1, 16, 32]], 1520.0),                  # one frame: no better than whole packs
])
def test_floors_of_whole_packs_and_frames_by_hand(tmp_path, heavy_grids, frames_floor):
    """Per pack: vision = forward (with the gap before it) + backward: rank 0 900, 310; rank 1
    300, 910; language 150 each. Perfect: (2420 + 4 * 150) / 2 = 1510. Whole packs: at best the
    two heavy packs share a micro-step: 910 + 310 + 2 * 150 = 1520. Whole frames: a heavy
    pack's heaviest frame is its vision's share by frame cost (half of it for two equal frames)."""
    from megatron_mm_balance.sim.run_trace import predicted_floors
    run = _with_grids(load_run(str(two_by_two(tmp_path / "t")), skip_iterations=0), heavy_grids)
    fl = predicted_floors(run, lambda p: float(p))
    np.testing.assert_allclose(fl["perfect_ms"], 1510.0 + 7900.0)
    np.testing.assert_allclose(fl["perfect_ms"], predicted_times(run)["perfect_ms"])
    np.testing.assert_allclose(fl["floor_packs_ms"], 1520.0 + 7900.0)
    np.testing.assert_allclose(fl["floor_frames_ms"], frames_floor + 7900.0)


def test_placement_on_a_cost_models_costs(tmp_path):
    """``model_costs``: the two-phase integer costs ``mm_balance.cost=model`` balances with, from
    the records' grids; the placement on them, and a refusal of costs of another run's shape."""
    from megatron_mm_balance.cost.model import CostModel
    from megatron_mm_balance.sim.run_trace import frame_ms_of, model_costs, placement_order
    run = _with_grids(load_run(str(two_by_two(tmp_path / "t")), skip_iterations=0), [[1, 16, 32]])
    model = CostModel(vision_ms_per_token=1e-3, vision_ms_per_token_sq=1e-6, vision_backward_ratio=2.0,
                      llm_ms_per_token=1e-2, llm_backward_ratio=2.0)
    costs = model_costs(run, model)
    assert costs.shape == (3, 2, 2, 2) and costs.dtype.kind == "i"
    heavy = 3 * (512e-3 + 512 ** 2 * 1e-6) * 1000          # forward + backward, microseconds
    assert costs[0, 0, 0, 0] == pytest.approx(heavy, abs=1) and costs[0, 0, 1, 0] == pytest.approx(
        3 * (128e-3 + 128 ** 2 * 1e-6) * 1000, abs=1)
    assert len({int(c) for c in costs[..., 1].ravel()}) == 1          # the same language work
    order = placement_order(run, costs=costs)
    for i in range(3):      # a permutation; the heavy packs (flat 0 and 3) meet in one micro-step
        assert sorted(order[i].ravel().tolist()) == [0, 1, 2, 3]
        assert any({int(order[i, d, g]) for d in range(2)} == {0, 3} for g in range(2))
    with pytest.raises(ValueError, match="shape"):
        placement_order(run, costs=costs[:2])
    assert frame_ms_of(model)(100) == pytest.approx(0.1 + 0.01)


def test_the_placement_objective_as_laid_out_and_on_measured_costs(tmp_path):
    """The two-by-two run's objective: as laid out each micro-step holds one heavy pack,
    max(900, 300) + 150 + max(310, 910) + 150 = 2110; the placement on the packs' measured
    times puts the heavy packs together, 910 + 150 + 310 + 150 = 1520 (the packs floor); with
    the measured tail."""
    from megatron_mm_balance.sim.run_trace import measured_costs, objective_ms, placement_order
    run = load_run(str(two_by_two(tmp_path / "t")), skip_iterations=0)
    np.testing.assert_allclose(objective_ms(run), 2110.0 + 7900.0)
    costs = measured_costs(run)
    assert costs.shape == (3, 2, 2, 2) and costs[0, 0, 0, 0] == 900_000 and costs[0, 1, 1, 1] == 150_000
    np.testing.assert_allclose(objective_ms(run, placement_order(run, costs=costs)), 1520.0 + 7900.0)


def test_what_the_frame_exchange_can_reach_after_a_placement(tmp_path):
    """Each micro-step's vision at its mean or its heaviest frame, whichever is more. Two equal
    frames per heavy pack: as laid out, means 600 and 610 are above every frame, 1510 (perfect).
    One frame per heavy pack: as laid out 900 + 910; placed on the heaviest frame the two heavy
    packs share a micro-step, max(905, 910) + max(305, 310) = 1220; plus the language phases
    (2 x 150) and the tail."""
    from megatron_mm_balance.sim.run_trace import frames_objective_ms, heaviest_frame_costs, placement_order
    linear = lambda p: float(p)  # noqa: E731
    split = _with_grids(load_run(str(two_by_two(tmp_path / "a")), skip_iterations=0), [[1, 16, 16], [1, 16, 16]])
    np.testing.assert_allclose(frames_objective_ms(split, linear), 1510.0 + 7900.0)
    whole = _with_grids(load_run(str(two_by_two(tmp_path / "b")), skip_iterations=0), [[1, 16, 32]])
    np.testing.assert_allclose(frames_objective_ms(whole, linear), 1810.0 + 300.0 + 7900.0)
    costs = heaviest_frame_costs(whole, linear)
    assert costs.shape == (3, 2, 2) and costs[0, 0, 0] == 900_000 and costs[0, 0, 1] == 310_000
    order = placement_order(whole, costs=costs)
    np.testing.assert_allclose(frames_objective_ms(whole, linear, order), 1220.0 + 300.0 + 7900.0)
