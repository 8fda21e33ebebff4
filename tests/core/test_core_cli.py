import json
import subprocess
import sys

import pytest

from megatron_mm_balance.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def packs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "packs.jsonl"
    assert main(["pack", "mixed", "--seq-len", "8192", "--out", str(path), "--json"]) == 0
    return path


def test_pack_contract(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"tokens": t, "images": [t // 2]}) for t in
                               [100, 300, 5000, 9000, 700]) + "\n")
    out = tmp_path / "p.jsonl"
    code, stdout, _ = run(capsys, "pack", str(trace), "--seq-len", "8192", "--out", str(out), "--json")
    assert code == 0
    rep = json.loads(stdout)
    assert rep["samples"] == 5 and rep["dropped"] == 1 and rep["packs"] >= 1
    assert 0 < rep["efficiency"] <= 1
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(i for p in lines for i in p["samples"]) == [0, 1, 2, 4]
    assert all(set(p) >= {"tokens", "image_tokens", "images", "samples"} for p in lines)


def test_pack_budget_and_overlong_error(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"tokens": 10}\n{"tokens": 9000}\n')
    code, _, err = run(capsys, "pack", str(trace), "--on-overlong", "error")
    assert code == 2 and "sample 1 has 9000 tokens" in err
    code, _, err = run(capsys, "pack", "mixed", "--packer", "budget")
    assert code == 2 and "--image-budget" in err


def test_place_contract(capsys, packs_file, tmp_path):
    out = tmp_path / "placement.jsonl"
    code, stdout, _ = run(capsys, "place", str(packs_file), "--dp", "16", "--ga", "8",
                          "--out", str(out), "--json")
    assert code == 0
    rep = json.loads(stdout)
    for key in ("global_batches", "solver_ms_p50", "solver_ms_max", "moved_fraction",
                "microstep_ratio", "rank_ratio", "baseline_microstep_ratio", "baseline_rank_ratio"):
        assert key in rep
    assert rep["microstep_ratio"] < rep["baseline_microstep_ratio"]
    n_packs = sum(1 for _ in open(packs_file))
    assert rep["global_batches"] == n_packs // 128 and rep["skipped_packs"] == n_packs % 128
    batches = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(batches) == rep["global_batches"]
    for b in batches[:3]:
        slots = b["slots"]
        assert len(slots) == 128
        assert sorted((s[2], s[3]) for s in slots) == [(r, m) for r in range(16) for m in range(8)]
        assert sorted((s[0], s[1]) for s in slots) == [(r, m) for r in range(16) for m in range(8)]


def test_place_writes_the_delivered_plan(capsys, packs_file, tmp_path):
    """--out holds what the runtime delivers (solve, then the micro-step order), not the
    solver's raw slots; --ranks-per-node reaches the solver and the report."""
    import numpy as np

    from megatron_mm_balance.cli import read_pack_costs
    from megatron_mm_balance.solver.placement import SolverOptions, _solve, plan_placement
    out = tmp_path / "placement.jsonl"
    code, stdout, _ = run(capsys, "place", str(packs_file), "--dp", "16", "--ga", "8",
                          "--ranks-per-node", "4", "--out", str(out), "--json")
    assert code == 0
    rep = json.loads(stdout)
    assert rep["ranks_per_node"] == 4 and 0 < rep["inter_node_fraction"] <= rep["moved_fraction"]
    costs = read_pack_costs(str(packs_file))
    reordered = 0
    for b, line in enumerate(out.read_text().splitlines()):
        c = costs[b * 128:(b + 1) * 128].reshape(16, 8)
        want = plan_placement(c, ranks_per_node=4)
        assert json.loads(line)["slots"] == want.slots().tolist()
        moved = want.moved().sum(axis=0)
        assert moved[0] == moved.min()
        reordered += not np.array_equal(want.src_rank, _solve(c, SolverOptions(ranks_per_node=4)).src_rank)
    assert reordered, "no batch needed a new micro-step order: the check would pass on raw slots"


@pytest.mark.parametrize("lines, argv, needle", [
    (None, ["--dp", "2", "--ga", "2"], "no such file"),
    (['{"image_tokens": 5}', '{"image_tokens": '], ["--dp", "1", "--ga", "1"], ":2: malformed JSON"),
    (['{"image_tokens": -5}'], ["--dp", "1", "--ga", "1"], "must be >= 0"),
    (['{"images": [3, -1]}'], ["--dp", "1", "--ga", "1"], "negative image token count"),
    (['{"tokens": 5}'], ["--dp", "1", "--ga", "1"], "missing 'image_tokens'"),
    (['{"image_tokens": 5}'] * 3, ["--dp", "0", "--ga", "2"], "--dp and --ga must be >= 1"),
    (['{"image_tokens": 5}'] * 3, ["--dp", "2", "--ga", "0"], "--dp and --ga must be >= 1"),
    (['{"image_tokens": 5}'] * 3, ["--dp", "2", "--ga", "2"], "fewer than one global batch"),
])
def test_place_bad_input_is_one_line(capsys, tmp_path, lines, argv, needle):
    path = tmp_path / "packs.jsonl"
    if lines is not None:
        path.write_text("\n".join(lines) + "\n")
    code, _, err = run(capsys, "place", str(path), *argv)
    assert code != 0
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("content, needle", [
    ('{"tokens": -3}\n', "'tokens' must be >= 0"),
    ('{"tokens": 3}\nnot json\n', ":2: malformed JSON"),
])
def test_pack_bad_trace_is_one_line(capsys, tmp_path, content, needle):
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    code, _, err = run(capsys, "pack", str(path))
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_console_entry_point_reports_errors_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_mm_balance.cli", "place",
                           str(tmp_path / "missing.jsonl"), "--dp", "2", "--ga", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"mm-balance: error: {tmp_path / 'missing.jsonl'}: no such file"


def test_demo_runs_and_reports_balance(capsys, tmp_path):
    code, out, _ = run(capsys, "demo", "--no-train", "--no-real", "--dp", "16", "--ga", "8",
                       "--out", str(tmp_path / "demo"))
    assert code == 0
    assert "efficiency 0.99" in out and "sync=microstep" in out and "packs moved" in out
    # no training runs, so the summary has the placement line only, and nothing was written
    summary = out.split("== summary\n", 1)[1].strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith("PLACEMENT (") and "DP=16 x GA=8" in summary[0], summary
    assert not (tmp_path / "demo").exists()


def test_demo_refuses_a_bad_real_iteration_count(capsys):
    for count in ("0", "3"):
        code, _, err = run(capsys, "demo", "--real-iters", count)
        assert code == 2 and "--real-iters must be even and >= 2" in err
