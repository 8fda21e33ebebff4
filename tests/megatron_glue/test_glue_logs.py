"""megatron/logs.py and ``mm-balance compare-logs``: Megatron's log lines, a job's
first-iteration averaging undone, runs compared span by span.

The logs here are written by :func:`megatron_log`, a model of ``training_log`` (core_v0.16.1
to core_v0.19.0): loss sums and the elapsed time accumulate over the iterations since the
last printed line, the advanced and skipped counts too, every job prints its first iteration
and does not reset after it (``should_reset = not is_first_iteration``). The real logs are
read by the real-path tests (tests/realpath), which compare resumed and uninterrupted runs
with the same code.
"""
import json
import subprocess
import sys

import pytest

from megatron_mm_balance.megatron import logs

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def megatron_log(losses, first, last, interval=1, skipped=(), train_iters=None, elapsed=None):
    """The lines one job (iterations first..last) prints, as training_log builds them."""
    train_iters = train_iters or last
    out = ["[before the start of training step] datetime: 2026-01-01 00:00:00 "]
    acc = {"lm loss": 0.0, "load_balancing_loss": 0.0}
    adv = skip = n = 0
    t = 0.0
    for it in range(first, last + 1):
        is_first = it == first
        if it in skipped:
            skip += 1
        else:
            adv += 1
            acc["lm loss"] += losses[it]
            acc["load_balancing_loss"] += 1.0 + losses[it] / 100
        n += 1
        t += (elapsed or {}).get(it, 1000.0)
        if it % interval == 0 or is_first:
            fields = [f"consumed samples: {8 * it:12d}", f"elapsed time per iteration (ms): {t / n:.1f}",
                      "learning rate: 1.000000E-04", "global batch size:     8"]
            for k, v in acc.items():
                avg = v / max(1, adv)
                if avg > 0:
                    fields.append(f"{k}: {avg:.6E}")
            fields += ["loss scale: 1.0", f"grad norm: {losses[it] / 3:.3f}",
                       f"number of skipped iterations: {skip:3d}", "number of nan iterations:   0"]
            out.append(f" [2026-01-01 00:00:{it:02d}.000000] iteration {it:8d}/{train_iters:8d} | "
                       + " | ".join(fields) + " |")
            if not is_first:
                acc = dict.fromkeys(acc, 0.0)
                adv = skip = n = 0
                t = 0.0
    return "\n".join(out) + "\n"


LOSSES = {i: 6.5 - 0.03 * i + 0.001 * (i % 3) for i in range(1, 13)}


def test_fresh_job_second_line_is_recomputed():
    text = megatron_log(LOSSES, 1, 6)
    printed = logs.read_log(text.replace("[before the start of training step]", "x"))
    got = printed.values("lm loss")
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for i in range(1, 7):
        assert got[i] == pytest.approx(LOSSES[i], rel=1e-6)
    raw = logs.parse_line(text.splitlines()[2])
    assert raw.iteration == 2 and raw.values["lm loss"] == pytest.approx((LOSSES[1] + LOSSES[2]) / 2, rel=1e-6)
    assert [s.recomputed for s in printed.spans] == [False, True, False, False, False, False]


def test_resumed_job_equals_uninterrupted_after_recomputing():
    full = logs.read_log(megatron_log(LOSSES, 1, 6))
    resumed = logs.read_log([megatron_log(LOSSES, 1, 3, train_iters=6), megatron_log(LOSSES, 4, 6)])
    assert resumed.jobs == [(1, 3), (4, 6)]
    cmp = logs.compare(full, resumed)
    assert cmp.columns == ["lm loss", "load_balancing_loss"]
    assert [label for label, _ in cmp.rows] == ["1", "2", "3", "4", "5", "6"]
    assert cmp.equal and cmp.max_rel < 1e-6, cmp.max_rel
    # As printed, the resumed job's second line (iteration 5) is the mean of 4 and 5.
    printed5 = logs.parse_line(megatron_log(LOSSES, 4, 6).splitlines()[2]).values["lm loss"]
    assert logs.relative_difference(printed5, full.values()[5]) > 1e-3


def test_one_file_with_both_jobs_and_a_wrong_resume_is_different():
    both = logs.read_log(megatron_log(LOSSES, 1, 3, train_iters=6) + megatron_log(LOSSES, 4, 6))
    assert both.jobs == [(1, 3), (4, 6)]
    assert logs.compare(logs.read_log(megatron_log(LOSSES, 1, 6)), both).equal
    skipped_batch = {**LOSSES, 5: LOSSES[5] + 0.01}
    wrong = logs.read_log([megatron_log(LOSSES, 1, 3, train_iters=6), megatron_log(skipped_batch, 4, 6)])
    cmp = logs.compare(logs.read_log(megatron_log(LOSSES, 1, 6)), wrong)
    assert not cmp.equal and cmp.max_rel > 1e-3
    assert [label for label, row in cmp.rows if row["lm loss"][2] > 1e-5] == ["5"]


def test_log_interval_spans_are_matched_only_where_they_coincide():
    full = logs.read_log(megatron_log(LOSSES, 1, 12, interval=4))
    assert [s.label for s in full.spans] == ["1", "2-4", "5-8", "9-12"]
    assert full.spans[1].values["lm loss"] == pytest.approx(sum(LOSSES[i] for i in (2, 3, 4)) / 3, rel=1e-6)
    resumed = logs.read_log([megatron_log(LOSSES, 1, 5, interval=4, train_iters=12),
                             megatron_log(LOSSES, 6, 12, interval=4)])
    # The first job's iteration 5 is never printed (not a multiple of the interval).
    assert [s.label for s in resumed.spans] == ["1", "2-4", "6", "7-8", "9-12"]
    assert resumed.spans[3].values["lm loss"] == pytest.approx((LOSSES[7] + LOSSES[8]) / 2, rel=1e-6)
    cmp = logs.compare(full, resumed)
    assert [label for label, _ in cmp.rows] == ["1", "2-4", "9-12"] and cmp.equal
    assert cmp.only_a == ["5-8"] and cmp.only_b == ["6", "7-8"]


def test_skipped_iterations_and_elapsed_time():
    elapsed = {1: 9000.0, 2: 1500.0, 3: 1400.0}
    text = megatron_log(LOSSES, 1, 3, skipped={2}, elapsed=elapsed)
    spans = logs.read_log(text).spans
    # Iteration 2 was skipped (no loss): its recomputed span has no loss, a skipped count of 1.
    assert "lm loss" not in spans[1].values and spans[1].values[logs.SKIPPED] == 1
    assert spans[2].values["lm loss"] == pytest.approx(LOSSES[3], rel=1e-6)
    assert spans[1].values[logs.ELAPSED] == pytest.approx(1500.0, abs=0.1)
    assert spans[0].values[logs.ELAPSED] == pytest.approx(9000.0, abs=0.1)


def test_a_later_job_relogging_iterations_wins():
    log = logs.read_log([megatron_log(LOSSES, 1, 4, train_iters=6), megatron_log(LOSSES, 3, 6)])
    assert log.overridden == [3, 4] and [s.label for s in log.spans] == ["1", "2", "3", "4", "5", "6"]
    assert all(s.job == 1 for s in log.spans[2:])


def test_no_iteration_line_is_an_error():
    with pytest.raises(logs.LogError, match="no Megatron iteration lines"):
        logs.read_log("nothing here\n")


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_mm_balance.cli", "compare-logs", *map(str, argv)],
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT))


def test_cli_exit_codes_and_report(tmp_path):
    full, first, second = tmp_path / "full.log", tmp_path / "first.log", tmp_path / "second.log"
    full.write_text(megatron_log(LOSSES, 1, 6))
    first.write_text(megatron_log(LOSSES, 1, 3, train_iters=6))
    second.write_text(megatron_log(LOSSES, 4, 6))
    r = _cli(full, f"{first},{second}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "recomputed for A 2, B 2, B 5" in r.stdout
    assert r.stdout.strip().splitlines()[-1].endswith(": equal")
    r = _cli(full, second, "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["equal"] and out["compared"] == ["4", "5", "6"]
    assert out["only_a"] == ["1", "2", "3"] and out["recomputed"]["b"] == ["5"]
    bad = tmp_path / "bad.log"
    bad.write_text(megatron_log({**LOSSES, 6: LOSSES[6] * 1.001}, 4, 6))
    r = _cli(second, bad)
    assert r.returncode == 1 and "DIFFERENT" in r.stdout
    assert _cli(second, bad, "--rtol", "1e-2").returncode == 0
    r = _cli(full, second, "--columns", "lm loss,grad norm")
    assert r.returncode == 0 and "grad norm A" in r.stdout


@pytest.mark.parametrize("argv,msg", [(["missing.log", "x.log"], "missing.log"),
                                      (["empty.log", "empty.log"], "no Megatron iteration lines"),
                                      (["full.log", "full.log", "--columns", "nope"], "--columns"),
                                      (["full.log", "full.log", "--rtol", "-1"], "--rtol")])
def test_cli_errors_are_one_line(tmp_path, argv, msg):
    (tmp_path / "empty.log").write_text("hello\n")
    (tmp_path / "full.log").write_text(megatron_log(LOSSES, 1, 3))
    r = _cli(*[str(tmp_path / a) if a.endswith(".log") else a for a in argv])
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
