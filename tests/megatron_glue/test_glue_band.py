"""megatron/band.py and ``mm-balance compare-logs OFF ON --control CONTROL``: on vs off judged
against the control run's arithmetic-order band, on synthetic logs written the way
``training_log`` writes them (:func:`test_glue_logs.megatron_log`) plus our telemetry lines."""
import json
import os
import subprocess
import sys

import pytest

from megatron_mm_balance.megatron import band, logs

sys.path.insert(0, os.path.dirname(__file__))
from test_glue_logs import LOSSES, ROOT, megatron_log  # noqa: E402

ITERS = range(1, 7)


def _perturbed(rel):
    """LOSSES with iteration i moved by ``rel[i]`` (relative)."""
    return {i: v * (1 + rel.get(i, 0.0)) for i, v in LOSSES.items()}


def _telemetry(iters=ITERS, control=True, moved=0):
    extra = " | control: 1 | packs_reordered: 6" if control else ""
    return "".join(f"[mm-balance] iteration {i} | imbalance_before: 1.4 | packs_moved: {moved}{extra}\n"
                   for i in iters)


#: the control drifts from off by ~1e-5 relative, growing with the iteration
CONTROL_DRIFT = {i: 2e-6 * i for i in ITERS}


def _write(tmp_path, on_rel, control_rel=CONTROL_DRIFT, control_telemetry=None):
    off, on, ctl = (tmp_path / f"{n}.log" for n in ("off", "on", "control"))
    off.write_text(megatron_log(LOSSES, 1, 6))
    on.write_text(megatron_log(_perturbed(on_rel), 1, 6) + _telemetry(control=False, moved=5))
    ctl.write_text(megatron_log(_perturbed(control_rel), 1, 6)
                   + (_telemetry() if control_telemetry is None else control_telemetry))
    return off, on, ctl


def _cli(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_mm_balance.cli", "compare-logs", *map(str, argv)],
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT))


def test_verdicts_of_the_rule():
    assert band.judge(0.0, 0.0, 4, 1e-6, identical=True) == band.EQUAL
    assert band.judge(3.9e-5, 1e-5, 4, 1e-6, identical=False) == band.WITHIN_BAND
    assert band.judge(4.1e-5, 1e-5, 4, 1e-6, identical=False) == band.DIFFERENT
    assert band.judge(3e-6, 0.0, 4, 1e-6, identical=False) == band.WITHIN_BAND      # the floor
    assert band.judge(5e-6, 0.0, 4, 1e-6, identical=False) == band.DIFFERENT


def test_band_is_the_job_maximum_of_control_vs_off():
    """The band is the job's: a control that lands back on off's value at one iteration does
    not make that iteration's difference DIFFERENT."""
    off = logs.read_log(megatron_log(LOSSES, 1, 6))
    ctl = logs.read_log(megatron_log(_perturbed({4: 1e-4}), 1, 6))
    on = logs.read_log(megatron_log(_perturbed({2: 2e-4}), 1, 6))
    cmp = band.compare_with_control(off, on, ctl, ["lm loss"])
    cells = [row["lm loss"] for _, row in cmp.rows]
    assert all(c.band == pytest.approx(1e-4, rel=1e-2) for c in cells)
    assert cells[1].control_diff == 0 and cells[1].verdict == band.WITHIN_BAND
    assert cmp.verdict == band.WITHIN_BAND
    assert band.compare_with_control(off, off, ctl, ["lm loss"]).verdict == band.EQUAL


def test_cli_equal_within_band_and_different(tmp_path):
    off, on, ctl = _write(tmp_path, on_rel={})
    r = _cli(off, on, "--control", ctl)
    assert r.returncode == 0 and r.stdout.strip().endswith(": EQUAL"), r.stdout + r.stderr
    on.write_text(megatron_log(_perturbed({i: 3e-6 * i for i in ITERS}), 1, 6))
    r = _cli(off, on, "--control", ctl)
    assert r.returncode == 0 and r.stdout.strip().endswith(": WITHIN BAND"), r.stdout + r.stderr
    assert "lm loss:" in r.stdout and "load_balancing_loss:" in r.stdout and "band" in r.stdout
    on.write_text(megatron_log(_perturbed({i: 3e-6 * i for i in ITERS} | {5: 1e-3}), 1, 6))
    r = _cli(off, on, "--control", ctl)
    assert r.returncode == 1 and r.stdout.strip().endswith(": DIFFERENT"), r.stdout + r.stderr
    assert "| DIFFERENT" in r.stdout                                       # the span is named
    assert _cli(off, on, "--control", ctl, "--band-k", "200").returncode == 0
    assert _cli(off, on, "--control", ctl, "--band-k", "1").returncode == 1
    r = _cli(off, on, "--control", ctl, "--json")
    out = json.loads(r.stdout)
    assert out["verdict"] == "DIFFERENT" and out["k"] == band.DEFAULT_K
    assert [row["iteration"] for row in out["rows"]] == ["1", "2", "3", "4", "5", "6"]
    assert out["rows"][4]["lm loss"]["verdict"] == "DIFFERENT" and out["controls"][0]["packs_reordered"] == 36


def test_several_controls_widen_the_band(tmp_path):
    """With a second control that drifted further, the band is the widest of the two."""
    off, on, ctl = _write(tmp_path, on_rel={i: 20e-6 * i for i in ITERS})
    assert _cli(off, on, "--control", ctl).returncode == 1            # 20e-6 i > 8 x 2e-6 i
    wide = tmp_path / "control2.log"
    wide.write_text(megatron_log(_perturbed({i: -3e-6 * i for i in ITERS}), 1, 6) + _telemetry())  # 20/3 < 8
    r = _cli(off, on, "--control", ctl, "--control", wide)
    assert r.returncode == 0 and r.stdout.strip().endswith(": WITHIN BAND"), r.stdout + r.stderr
    assert r.stdout.count("control: ") == 2


def test_second_line_averaging_is_undone_for_all_three(tmp_path):
    """Without undoing the job's first-iteration averaging, iteration 2's printed on-vs-off
    difference is half the real one: the band compares recomputed values."""
    off, on, ctl = _write(tmp_path, on_rel={2: 3e-5}, control_rel={2: 1e-5})
    out = json.loads(_cli(off, on, "--control", ctl, "--json").stdout)
    cell = out["rows"][1]["lm loss"]
    assert cell["on_diff"] == pytest.approx(3e-5, rel=1e-2) and cell["control_diff"] == pytest.approx(1e-5, rel=1e-2)


def test_bridge_format_reads_lines_as_printed():
    text = megatron_log(LOSSES, 1, 3)
    bridge = logs.read_log(text, "bridge")
    megatron = logs.read_log(text)
    assert [s.recomputed for s in bridge.spans] == [False] * 3
    assert megatron.spans[1].recomputed and not bridge.spans[1].recomputed
    printed = logs.parse_line(text.splitlines()[2]).values["lm loss"]
    assert bridge.values()[2] == printed != megatron.values()[2]
    with pytest.raises(logs.LogError, match="log format"):
        logs.read_log(text, "nemo")


@pytest.mark.parametrize("telemetry,msg", [
    ("", "no [mm-balance] telemetry line"),
    (_telemetry(control=False), "is not control mode's"),
    (_telemetry(moved=3), "moved packs across ranks"),
])
def test_a_log_that_is_not_a_control_run_is_refused(tmp_path, telemetry, msg):
    off, on, ctl = _write(tmp_path, on_rel={}, control_telemetry=telemetry)
    r = _cli(off, on, "--control", ctl)
    assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_without_control_compare_logs_is_unchanged(tmp_path):
    off, on, _ = _write(tmp_path, on_rel={i: 3e-6 * i for i in ITERS})
    r = _cli(off, on)
    assert r.returncode == 1 and r.stdout.strip().endswith(": DIFFERENT")     # 1.8e-5 > rtol 1e-5
    assert "band" not in r.stdout


@pytest.mark.parametrize("opt,value", [("--band-k", "0.5"), ("--band-floor", "-1")])
def test_band_options_are_checked(tmp_path, opt, value):
    off, on, ctl = _write(tmp_path, on_rel={})
    r = _cli(off, on, "--control", ctl, opt, value)
    assert r.returncode == 2 and opt in r.stderr, r.stderr
