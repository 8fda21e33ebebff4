"""The demo (``mm-balance demo``, ``bash scripts/demo.sh``).

Fast (< 10 s): the training demo's bad input fails with a one-line message before any
process starts; without a Megatron-LM tree the demo stops at once saying what to provide;
the real part's headline is computed from Megatron's own log lines.

Real path (marker ``realpath``, about 2 minutes on 2 cores): the whole demo in a smoke
setting (two measured iterations of a 2-layer-CLIP vision-heavy job per mode, 2 emulated
steps), through the user's launcher on the patched tree the real-path tests share.
(The emulated report's figures are checked on the acceptance runs in ``test_cpu_e2e.py``.)
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megatron_mm_balance.bench import realpath  # noqa: E402
from megatron_mm_balance.testing import megatron_tree, real_demo  # noqa: E402
from megatron_mm_balance.testing.train_demo import main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, msg", [
    (["--steps", "1"], "--steps must be >= 2"),
    (["--", "--steps", "1"], "--steps must be >= 2"),
    (["--img-size", "30"], "--img-size must be a positive multiple"),
    (["--vision-ms-per-tile", "-1"], "must be >= 0"),
    (["--layout", "dp8"], "invalid choice"),
    (["--mixture", "nope"], "invalid choice"),
])
def test_bad_arguments_fail_with_a_clear_message(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def _demo(tmp_path, env_changes, *args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_DIR"}
    env.update(env_changes, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "megatron_mm_balance.cli", "demo", "--dp", "16", "--ga", "8",
                           "--out", str(tmp_path / "demo"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(tmp_path))


def test_demo_without_a_megatron_tree_says_what_to_provide(tmp_path):
    empty = tmp_path / "no-archives"
    empty.mkdir()
    r = _demo(tmp_path, {"MEGATRON_LM_ARCHIVES": str(empty)})
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mm-balance demo: no Megatron-LM tree"), r.stderr
    assert "set MEGATRON_LM_DIR" in err[0] and f"put Megatron-LM-core_v0.16.1.tar.gz in {empty}" in err[0]
    assert "--no-real" in err[0]
    assert "== place" in r.stdout and "== summary" not in r.stdout      # stopped before any training


def test_demo_with_a_megatron_lm_dir_that_is_no_checkout_says_so(tmp_path):
    r = _demo(tmp_path, {"MEGATRON_LM_DIR": str(tmp_path)})
    assert r.returncode == 2
    assert r.stderr.strip() == (f"mm-balance demo: MEGATRON_LM_DIR={tmp_path} has no examples/multimodal/train.py "
                                f"(a Megatron-LM core_v0.16.1 checkout is needed)")


def _log(times_ms, losses, moved=None):
    lines = []
    for i, (t, loss) in enumerate(zip(times_ms, losses), start=1):
        lines.append(f" [2026-01-01 00:00:0{i}] iteration        {i}/       {len(times_ms)} | consumed samples: "
                     f"{32 * i} | elapsed time per iteration (ms): {t} | learning rate: 1.0E-04 | global batch "
                     f"size:    32 | lm loss: {loss:.6E} | loss scale: 1.0 |")
        if moved is not None:
            lines.append(f"[mm-balance] iteration {i} | packs_moved: {moved} | consumer_wait_ms: 0.5")
    return "\n".join(lines) + "\n"


def _result(mode, text, tmp_path):
    elapsed, losses, tele, fit = realpath.parse_log(text)
    return realpath.RunResult(mode, 1, 0, 1.0, str(tmp_path / mode), elapsed, losses, tele, fit)


def test_headline_is_megatrons_own_iteration_times_after_the_warmup(tmp_path):
    # Iterations 1-2 are the warm-up (Megatron prints their mean on its second line):
    # the headline reads 3-6 of each run, and compares every loss with the off run's.
    losses = [6.5, 6.4, 6.3, 6.2, 6.1, 6.0]
    off = _result("off", _log([9000, 9500, 1500, 1400, 1600, 1450], losses), tmp_path)
    on = _result("overlap", _log([9000, 9500, 1200, 1300, 1250, 1100], losses, moved=6), tmp_path)
    s = real_demo.summarize(realpath.analyze([off, on], warmup=2, loss_tolerance=1e-5))
    assert s["off_ms"] == {"median": 1475.0, "min": 1400.0, "max": 1600.0, "n": 4}
    assert s["on_ms"] == {"median": 1225.0, "min": 1100.0, "max": 1300.0, "n": 4}
    assert s["gain"] == pytest.approx(1475 / 1225 - 1)
    assert s["losses_equal"] and s["max_loss_rel_diff"] == 0.0
    assert s["packs_moved_per_iteration"] == 6 and s["consumer_wait_ms"] == 0.5
    line = real_demo.headline(s)
    assert line.startswith("REAL (Megatron-LM's own 'elapsed time per iteration'")
    assert "off 1,475 ms [1,400-1,600] (4 iterations)" in line and "--mm-balance 1,225 ms [1,100-1,300]" in line
    assert line.endswith(f"{100 * (1475 / 1225 - 1):+.1f}%")

    slower = _result("overlap", _log([9000, 9500, 1300, 1500, 1700, 1450], losses, moved=6), tmp_path)
    noisy = real_demo.headline(real_demo.summarize(realpath.analyze([off, slower], warmup=2, loss_tolerance=1e-5)))
    assert noisy.endswith(f"{100 * (1475 / 1475 - 1):+.1f}% (the spreads overlap: the difference is within this "
                          f"machine's noise)"), noisy

    changed = _result("overlap", _log([9000, 9500, 1200, 1300, 1250, 1100], losses[:5] + [6.01], moved=6), tmp_path)
    s = real_demo.summarize(realpath.analyze([off, changed], warmup=2, loss_tolerance=1e-5))
    assert not s["losses_equal"] and "equal within 1e-5: NO" in real_demo.details(s)


@pytest.mark.realpath
@pytest.mark.timeout(900)
def test_demo_smoke_real_then_emulated_then_summary(tmp_path):
    tree = megatron_tree.user_tree()
    if tree is None:
        pytest.skip(f"no Megatron-LM: set MEGATRON_LM_DIR or provide {megatron_tree.archive()}")
    r = _demo(tmp_path, {"MEGATRON_LM_DIR": str(tree)}, "--real-iters", "2", "--real-set", "GBS=4",
              "--real-set", "MM_BALANCE_CPU_VIT=2,64,4,128", "--steps", "2", "--microbatches", "2", timeout=840)
    print(r.stdout[-4000:])
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    out = tmp_path / "demo"
    real = json.loads((out / "real.json").read_text())
    for mode in ("off_ms", "on_ms"):
        assert real[mode]["n"] == 2 and 0 < real[mode]["min"] <= real[mode]["median"] <= real[mode]["max"], real
    assert real["losses_equal"], real                                              # training unchanged
    # the balancer ran in the on run only (its telemetry lines), not in the off run
    assert "[mm-balance] iteration" in (out / "real" / "round1-overlap" / "train.log").read_text()
    assert "[mm-balance] iteration" not in (out / "real" / "round1-off" / "train.log").read_text()
    emulated = json.loads((out / "emulated.json").read_text())
    assert emulated["equal"] and emulated["steps"] == 2 and emulated["microbatches"] == 2, emulated
    summary = r.stdout.split("== summary\n", 1)[1].strip().splitlines()
    assert [line.split(" ", 1)[0] for line in summary] == ["REAL", "EMULATED", "PLACEMENT"], summary
    assert summary[0] == real["summary"] and summary[1] == emulated["summary"]
