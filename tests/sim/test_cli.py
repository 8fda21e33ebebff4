"""`mm-balance simulate`: the report.json contract, plots, and bad input."""
import argparse
import json
import os
import subprocess
import sys

import pytest

from megatron_mm_balance.sim.cli import main, register
from megatron_mm_balance.sim.report import REQUIRED_KEYS, check_report

SMALL = ["--ga", "4", "--batches", "2", "--pool-samples", "3000", "--no-progress"]


def test_report_contract_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["simulate", "mixed", "--dp", "8,32", "--seq-len", "8192", "--sync", "microstep",
               "--budgets", "2048,4096", "--out", str(out), *SMALL])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    check_report(report)
    runs = [r for r in report["runs"] if not r.get("bound")]
    names = {r["strategy"] for r in runs}
    assert names == {"none", "budget", "local", "redistribute-sync", "redistribute-overlap"}
    bounds = [r["strategy"] for r in report["runs"] if r.get("bound")]
    assert bounds == ["perfect", "floor-packs", "floor-frames"] * 2
    budgets = sorted(r["budget"] for r in runs if r["strategy"] == "budget")
    assert budgets == [2048, 2048, 4096, 4096]
    assert {r["dp"] for r in runs} == {8, 32}
    for r in runs:
        assert isinstance(r["dp"], int) and isinstance(r["strategy"], str)
        for k in REQUIRED_KEYS[2:]:
            assert isinstance(r[k], float), k
        assert 0 <= r["wait_share"] < 1 and 0 < r["efficiency"] <= 1
        if r["strategy"] == "none":
            assert r["throughput_rel"] == 1.0 and r["bytes_moved_per_step"] == 0.0
        if r["strategy"].startswith("redistribute"):
            assert r["bytes_moved_per_step"] > 0
    pngs = [f for f in os.listdir(out) if f.endswith(".png")]
    assert len(pngs) >= 2
    assert all((out / f).stat().st_size < 200_000 for f in pngs)
    table = capsys.readouterr().out
    assert "redistribute-overlap" in table and "budget@2048" in table


def test_trace_file_step_sync_and_pipeline(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [json.dumps({"tokens": 300 + 37 * (i % 11) + 256 * (i % 4),
                         "images": [256] * (i % 4)}) for i in range(400)]
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "o"
    rc = main(["simulate", str(trace), "--dp", "4", "--seq-len", "2048", "--sync", "step",
               "--pp", "2", "--strategies", "none,local,redistribute-overlap", "--no-plots",
               "--out", str(out), *SMALL])
    assert rc == 0
    runs = json.loads((out / "report.json").read_text())["runs"]
    local = next(r for r in runs if r["strategy"] == "local")
    none = next(r for r in runs if r["strategy"] == "none")
    # Reordering a rank's own packs cannot change its total: no effect in pure DP.
    assert local["time_per_batch_ms"] == pytest.approx(none["time_per_batch_ms"])
    assert all(r["pp"] == 2 for r in runs)


def _bad(argv, capsys, tmp_path):
    argv = [a.replace("TMP", str(tmp_path)) for a in argv]
    try:
        rc = main(["simulate", *argv])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err.strip()
    return rc, err


@pytest.mark.parametrize("argv,match", [
    (["nope.jsonl", "--out", "TMP/o"], "neither a file nor a built-in mixture"),
    (["mixed", "--dp", "0", "--out", "TMP/o"], "--dp must be between"),
    (["mixed", "--dp", "8,x", "--out", "TMP/o"], "--dp must be an integer"),
    (["mixed", "--ga", "0", "--out", "TMP/o"], "--ga must be >= 1"),
    (["mixed", "--sync", "sometimes", "--out", "TMP/o"], "--sync must be one of"),
    (["mixed", "--timing", "TMP/missing.yaml", "--out", "TMP/o"], "no such file"),
    (["mixed", "--timing-set", "exchange.link_gbps=0", "--out", "TMP/o"], "link_gbps"),
    (["mixed", "--strategies", "none,magic", "--out", "TMP/o"], "--strategies must be one of"),
    (["mixed", "--budgets", "-5", "--out", "TMP/o"], "--budgets must be >= 1"),
    (["mixed", "--llm-params", "0", "--out", "TMP/o"], "--llm-params must be > 0"),
    (["TMP/bad.jsonl", "--out", "TMP/o"], "malformed JSON line"),
    (["TMP/long.jsonl", "--seq-len", "16", "--out", "TMP/o"], "no packs"),
    (["mixed", "--out", "TMP/file.txt"], "not a directory"),
    (["mixed"], "required: --out"),
    (["mixed", "--bogus", "--out", "TMP/o"], "unrecognized arguments"),
    (["mixed", "--ranks-per-node", "0", "--out", "TMP/o"], "--ranks-per-node must be >= 1"),
    (["mixed", "--balance-cost", "vibes", "--out", "TMP/o"], "--balance-cost must be one of"),
])
def test_bad_input_one_line(argv, match, capsys, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"tokens": 5}\n{"tokens": 5,\n')
    (tmp_path / "long.jsonl").write_text('{"tokens": 500}\n')
    (tmp_path / "file.txt").write_text("x")
    rc, err = _bad(argv + ["--no-progress", "--pool-samples", "200"], capsys, tmp_path)
    assert rc != 0
    assert len(err.splitlines()) == 1, err
    assert err.startswith("mm-balance simulate: error:")
    assert match in err
    assert "Traceback" not in err


def test_entry_point_subprocess_has_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "megatron_mm_balance.sim", "simulate",
                        "missing-trace", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


def test_register_adds_the_subcommand():
    parser = argparse.ArgumentParser(prog="mm-balance")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", "mixed", "--out", "x"])
    assert args.func.__name__ == "run" and args.dp == "64,256,1024" and args.sync == "microstep"
