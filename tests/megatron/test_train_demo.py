"""The demo (``mm-balance demo``, ``bash scripts/demo.sh``).

Fast (< 10 s): the training demo's bad input fails with a one-line message before any
process starts; without a Megatron-LM tree the demo stops at once saying what to provide;
the real part's headline, the paired gain of the two crossover jobs, is computed from
Megatron's own log lines.

Real path (marker ``realpath``, about 2 minutes on 2 cores): the whole demo in a smoke
setting (two measured iterations of a 2-layer-CLIP vision-heavy job in each crossover job, 2
emulated steps), through the user's launcher on the patched tree the real-path tests share.
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


def _log(times_ms, losses, balanced=lambda i: False):
    lines = []
    for i, (t, loss) in enumerate(zip(times_ms, losses), start=1):
        lines.append(f" [2026-01-01 00:00:0{i}] iteration        {i}/       {len(times_ms)} | consumed samples: "
                     f"{32 * i} | elapsed time per iteration (ms): {t} | learning rate: 1.0E-04 | global batch "
                     f"size:    32 | lm loss: {loss:.6E} | loss scale: 1.0 |")
        lines.append(f"[mm-balance] iteration {i} | packs_moved: {8 if balanced(i) else 0} | "
                     f"consumer_wait_ms: {60.0 if balanced(i) else 3.0}")
    return "\n".join(lines) + "\n"


def _crossover(tmp_path, work, gain, speeds, losses, noise=((), ())):
    """The two crossover jobs: iteration ``i`` takes ``work[i]`` ms as drawn, ``work[i] / (1 +
    gain)`` balanced, times each job's own speed (and its ``noise[i]``, when given)."""
    runs = []
    for parity, speed, job_losses, noise in zip(("even", "odd"), speeds, losses, noise):
        on = (lambda i, p=parity: i % 2 == (0 if p == "even" else 1))
        times = [round(speed * (w / (1 + gain) if on(i) else w) * (noise[i - 1] if noise else 1.0), 1)
                 for i, w in enumerate(work, start=1)]
        elapsed, parsed, tele, fit = realpath.parse_log(_log(times, job_losses, on))
        runs.append(realpath.RunResult(f"crossover-{parity}", 1, 0, 1.0, str(tmp_path / parity), elapsed, parsed,
                                       tele, fit))
    return runs


def test_headline_is_the_paired_gain_of_the_two_jobs_whatever_their_speeds(tmp_path):
    # Iterations 1-2 are the warm-up; 3-10 make 4 pairs, each one iteration of each parity timed
    # balanced in one job and as drawn in the other: the jobs' speeds (the odd job 9% slower)
    # cancel in every pair.
    work = [9000, 9500, 1500, 1400, 1600, 1450, 1700, 1500, 1650, 1400]
    losses = [6.5, 6.4, 6.3, 6.2, 6.1, 6.0, 5.9, 5.8, 5.7, 5.6]
    even, odd = _crossover(tmp_path, work, 0.12, (1.0, 1.09), (losses, losses))
    s = real_demo.summarize(even, odd, warmup=2)
    assert len(s["pairs"]) == 4 and all(g == pytest.approx(0.12, abs=2e-4) for g in s["pairs"])
    assert s["gain"] == pytest.approx(0.12, abs=2e-4) and s["low"] == pytest.approx(0.12, abs=1e-3)
    assert s["losses_equal"] and s["max_loss_rel_diff"] == 0.0
    assert s["packs_moved_per_iteration"] == 8
    assert s["wait_balanced_ms"] == 60.0 and s["wait_unbalanced_ms"] == 3.0
    assert sorted(s["iterations"]) == list(range(3, 11))
    line = real_demo.headline(s)
    assert line.startswith("REAL (Megatron-LM's own 'elapsed time per iteration', each iteration timed balanced")
    assert "--mm-balance +12.0% (paired 95% interval +12.0% to +12.0%, 4 pairs of iterations)" in line

    noise = ([1, 1, 1.0, 1.1, 0.9, 1.0, 1.08, 0.95, 1.0, 1.05],      # each job's own noise, iteration by
             [1, 1, 1.06, 0.97, 1.0, 1.04, 0.95, 1.0, 1.1, 0.98])    # iteration
    noisy = real_demo.summarize(*_crossover(tmp_path, work, 0.02, (1.0, 1.09), (losses, losses), noise), warmup=2)
    assert noisy["low"] < 0 < noisy["high"]
    assert "it includes 0: within this machine's noise" in real_demo.headline(noisy)

    changed = real_demo.summarize(*_crossover(tmp_path, work, 0.12, (1.0, 1.0), (losses, losses[:9] + [5.61])),
                                  warmup=2)
    assert not changed["losses_equal"] and "equal within 1e-5: NO" in real_demo.details(changed)


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
    assert len(real["pairs"]) == 1 and real["low"] is None and sorted(real["iterations"]) == ["3", "4"], real
    assert real["losses_equal"], real                                              # training unchanged
    assert real["predicted_perfect_gain"] is not None                             # from the runs' own timings
    for parity in ("even", "odd"):            # each job balanced its parity only: packs moved there
        lines = realpath.parse_log((out / "real" / f"round1-crossover-{parity}" / "train.log").read_text())[2]
        assert any(t.get("packs_moved") for i, t in lines.items() if i % 2 == (parity == "odd")), lines
        assert not any(t.get("packs_moved") for i, t in lines.items() if i % 2 != (parity == "odd")), lines
    assert (out / "real" / "timeline.png").stat().st_size > 10_000 and (out / "real" / "timeline.svg").is_file()
    emulated = json.loads((out / "emulated.json").read_text())
    assert emulated["equal"] and emulated["steps"] == 2 and emulated["microbatches"] == 2, emulated
    summary = r.stdout.split("== summary\n", 1)[1].strip().splitlines()
    assert [line.split(" ", 1)[0] for line in summary] == ["REAL", "EMULATED", "PLACEMENT"], summary
    assert summary[0] == real["summary"] and summary[1] == emulated["summary"]
