"""The user's path, for real: ``scripts/pretrain_vlm_moe.sh --config configs/megatron/tiny_cpu.sh``.

Each test launches the patched Megatron-LM ``examples/multimodal/train.py`` (its own
``pretrain()``) on 4 CPU ranks over gloo, as a user would, with ``MM_BALANCE=0`` and
``MM_BALANCE=1``, and reads Megatron's own iteration lines (``lm loss``), our
telemetry (``packs_moved``) and the samples every rank consumed per iteration
(``--mm-balance-record-samples``); bf16 DP=2 x EP=2 off vs on is also judged against a
control run (``--mm-balance-mode control``) by ``mm-balance compare-logs --control``, on the
session's and a held-out data set. Runs are shared between tests through the session's
``runner`` (conftest.py: the 6-iteration DP=2 x EP=2 runs serve the layout test, the off/on
sample test, one resume configuration and the fault matrix's reference). Slow: ``python -m pytest tests/realpath -m realpath``.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

import realpath_util as rp

pytestmark = [pytest.mark.realpath, pytest.mark.timeout(1800)]

REL_TOL = 1e-5
#: name -> (iterations, launcher environment overrides). DP = 4 / (TP*PP).
LAYOUTS = {
    "dp2_ep2": (6, {}),                       # the config's default: DP=2 x EP=2 (MoE alltoall)
    "dp4": (3, {"EP": 1, "EVAL_ITERS": 1}),   # also Megatron's final validation (patch 0007)
    "pp2_dp2": (3, {"EP": 1, "PP": 2}),       # vision encoder on the first stage
    "tp2_dp2": (3, {"EP": 1, "TP": 2, "NUM_EXPERTS": 0}),  # dense: MoE + TP needs sequence parallel
}
RUN_TIMEOUT_S = rp.RUN_TIMEOUT_S


def _check_pair(off: rp.Run, on: rp.Run, iters: int, label: str) -> None:
    table = rp.loss_table({"off": off, "on": on})
    assert off.rc == 0, f"{label} off: exit {off.rc}\n{off.tail()}"
    assert on.rc == 0, f"{label} on: exit {on.rc}\n{on.tail()}"
    want = list(range(1, iters + 1))
    assert sorted(off.losses) == want and sorted(on.losses) == want, f"{label}: iterations\n{table}"
    diff = rp.max_rel_diff(on.losses, off.losses, want)
    print(f"\n{label}: max relative lm-loss difference {diff:.2e}; packs moved per iteration "
          f"{[on.moved[i] for i in sorted(on.moved)]}; wall off {off.wall_s:.0f}s on {on.wall_s:.0f}s\n{table}")
    assert diff <= REL_TOL, f"{label}: lm loss off vs on differs by {diff:.2e} > {REL_TOL}\n{table}"
    assert not off.moved, f"{label}: MM_BALANCE=0 printed balancer telemetry"
    assert on.moved and sum(on.moved.values()) > 0, f"{label}: no packs moved\n{on.tail()}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_off_on_equal(runner, layout):
    """Per-iteration lm loss equal off vs on, packs moved, exit 0 (both runs)."""
    iters, env = LAYOUTS[layout]
    off = runner(layout, False, iters, **env)
    on = runner(layout, True, iters, **env)
    _check_pair(off, on, iters, layout)
    if env.get("EVAL_ITERS"):
        for run in (off, on):
            assert f"validation loss at iteration {iters}" in run.log, "no final validation"


#: images mode balances tiles inside the expert-parallel groups: DP=4 x EP=2 (two groups of 2)
#: and PP=2 x DP=2 x EP=2 (the encoder on the first stage, one group per stage)
IMAGE_LAYOUTS = {"dp2_ep2": LAYOUTS["dp2_ep2"], "pp2_ep2": (3, {"PP": 2})}


@pytest.mark.parametrize("layout", list(IMAGE_LAYOUTS))
def test_vision_images_off_on_equal(runner, layout):
    """``--mm-balance --mm-balance-vision images`` (tiles also balanced inside each expert-
    parallel group every micro-step: planned and sent ahead on the exchange thread, embeddings
    and their gradients sent back point to point) against the same layout's off run: lm loss
    equal every iteration, packs and tiles moved, the busiest rank's tile count per micro-step
    never raised, exit 0. Under PP=2 the encoder is on the first stage only."""
    from megatron_mm_balance.bench.realpath import parse_vision

    iters, env = IMAGE_LAYOUTS[layout]
    off = runner(layout, False, iters, **env)
    on = runner(f"{layout}-images", True, iters, extra=["--mm-balance-vision", "images"], **env)
    _check_pair(off, on, iters, f"{layout} --mm-balance-vision images")
    windows = parse_vision(on.log)
    assert windows, f"no tile-balance log line\n{on.tail()}"
    tiles, moved = sum(w[0] for w in windows), sum(w[1] for w in windows)
    print(f"tiles moved {moved}/{tiles}; most tiles on one rank per micro-step "
          f"{[w[2] for w in windows]} -> {[w[3] for w in windows]} (even {[w[4] for w in windows]})")
    assert moved > 0 and all(after <= before for _, _, before, after, _ in windows)
    assert not parse_vision(off.log)


#: The resume matrix: {2 datasets} x {1, 2 loader workers} x {off, on}, every pair of values
#: once (an orthogonal array: 4 configurations instead of 8). name -> (dataset: "256" is the
#: session's make-dataset --samples 256 --seed 0, "default" is make-dataset's defaults;
#: NUM_WORKERS; --mm-balance). "256-w1-on" reuses the DP=2 x EP=2 layout runs.
RESUME = {"256-w1-on": ("256", 1, True), "256-w2-off": ("256", 2, False),
          "default-w1-off": ("default", 1, False), "default-w2-on": ("default", 2, True)}


#: CI runs the two balanced configurations (both data sets, both worker counts); the two
#: unbalanced ones with --extended
RESUME_PARAMS = [pytest.param(n, marks=() if RESUME[n][2] else pytest.mark.extended) for n in RESUME]


@pytest.mark.parametrize("name", RESUME_PARAMS)
def test_resume_equals_uninterrupted(runner, runs_dir, request, name):
    """3 iterations, then resume to 6 from the same OUTPUT_DIR: iterations 4-6 equal the
    uninterrupted 6-iteration run's, in lm loss (also by ``mm-balance compare-logs``) and in
    the samples each rank consumed per iteration (Megatron's sampler state and energon's
    save_state, the balancer's paired one with --mm-balance)."""
    which, workers, on = RESUME[name]
    data = request.getfixturevalue("dataset" if which == "256" else "default_dataset")
    iters, env = LAYOUTS["dp2_ep2"]
    env = {**env, "NUM_WORKERS": workers}
    if name == "256-w1-on":
        full = runner("dp2_ep2", True, iters, data=data, **env)
    else:
        full = runner(f"full-{name}", on, iters, data=data, **env)
    out = runs_dir / f"resume-{name}"
    # The first job stops after iteration 3 (checkpoint, exit 0) with the 6-iteration schedule.
    first = runner(f"resume-first-{name}", on, iters, extra=["--exit-interval", "3"], output=out,
                   data=data, **env)
    second = runner(f"resume-second-{name}", on, iters, output=out, data=data, **env)
    rp.check_resume(full, first, second, f"resume {name} (DP=2 x EP=2, dataset {which}, "
                    f"NUM_WORKERS={workers}, --mm-balance {'on' if on else 'off'})", REL_TOL, balanced=on)


def test_balanced_run_consumes_each_global_batch_of_the_unbalanced_one(runner):
    """Off vs on (DP=2 x EP=2): every iteration the data-parallel group consumes the same
    multiset of micro-batches (what balancing guarantees); some ranks consume others' packs."""
    iters, env = LAYOUTS["dp2_ep2"]
    off, on = runner("dp2_ep2", False, iters, **env), runner("dp2_ep2", True, iters, **env)
    a, b = rp.consumed(off.samples_dir), rp.consumed(on.samples_dir)
    assert set(a) == set(b) and {it for _, it in a} == set(range(1, iters + 1)), (sorted(a), sorted(b))
    moved = 0
    for it in range(1, iters + 1):
        ga, gb = rp.global_batch(a, it), rp.global_batch(b, it)
        assert ga == gb, f"iteration {it}: the data-parallel group consumed other micro-batches"
        moved += sum(len(set(a[k]) - set(b[k])) for k in a if k[1] == it)
    assert moved > 0, "balancing moved no micro-batch between ranks"
    # The resume tests' rank-by-rank check is one that can fail: here it must.
    with pytest.raises(AssertionError, match="consumed"):
        rp.check_samples(off, on.samples_dir, range(1, iters + 1), "off vs on")
    print(f"\noff vs on: same multiset of micro-batches per iteration; {moved} rank-slots differ")


@pytest.mark.parametrize("which", ["default", "heldout"])
def test_off_on_within_the_control_band(runner, request, which):
    """DP=2 x EP=2 bf16: off, on and control (``--mm-balance-mode control``: every rank keeps
    its own packs, reordered across micro-steps in balancing's order). ``mm-balance
    compare-logs OFF ON --control CONTROL`` is not DIFFERENT, and the control moved no
    micro-batch across ranks. ``default``: the session's data set (the layout test's off and
    on runs, one control run added); ``heldout``: ``make-dataset --samples 384 --seed 7``
    with 2 loader workers (three runs)."""
    iters, env = LAYOUTS["dp2_ep2"]
    control = ["--mm-balance-mode", "control"]
    if which == "default":
        off, on = runner("dp2_ep2", False, iters, **env), runner("dp2_ep2", True, iters, **env)
        ctl = runner("dp2_ep2-control", True, iters, extra=control, **env)
    else:
        data, env = request.getfixturevalue("heldout_dataset"), {**env, "NUM_WORKERS": 2}
        off = runner("heldout", False, iters, data=data, **env)
        on = runner("heldout", True, iters, data=data, **env)
        ctl = runner("heldout-control", True, iters, extra=control, data=data, **env)
    rp.check_band(off, on, ctl, f"dp2_ep2 bf16, {which} data set")


def test_energon_mixin_on(runner):
    """--mm-balance-task-encoder (patch 0005: the example builds the balancing task encoder):
    lm loss equal off vs on, packs moved."""
    extra = ["--mm-balance-task-encoder"]
    off = runner("mixin", False, 3, extra=extra)
    on = runner("mixin", True, 3, extra=extra)
    _check_pair(off, on, 3, "dp2_ep2 + --mm-balance-task-encoder")


def _rank_pids(agent_pid: int) -> dict:
    """{RANK: pid} of the launcher's worker processes (children of torch.distributed.run)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(agent_pid)], capture_output=True, text=True).stdout
    ranks = {}
    for pid in map(int, out.split()):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                ranks[int(kv[5:])] = pid
    return ranks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read() if os.path.exists(f"/proc/{pid}/stat") else ""
    return bool(stat) and stat.split(") ", 1)[1][0] != "Z"


def test_killed_peer_fails_fast(megatron_lm, dataset, runs_dir):
    """A rank SIGKILLed mid-run: the launcher exits non-zero within --mm-balance-timeout, no rank
    survives it, and torch.distributed.run's failure report names the killed rank (exit -9).

    Under the launcher the surviving ranks do not get as far as a timed-out collective: the
    torch.distributed.run agent sees the dead worker and SIGTERMs the others (within its
    monitor interval, seconds), so their exit comes from the agent, not from our PeerFailure.
    """
    timeout_s = 30
    env = rp.launcher_env(megatron_lm, dataset, mm_balance=True, output_dir=runs_dir / "kill",
                          train_iters=50)
    log_path = runs_dir / "kill.log"
    proc = rp.launch(env, ["--mm-balance-timeout", str(timeout_s)], log_path=log_path)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not re.search(r"\biteration\s+2/", log_path.read_text(errors="replace")):
            assert proc.poll() is None, f"the run ended before iteration 2:\n{log_path.read_text()[-4000:]}"
            assert time.monotonic() < deadline, "no iteration 2 within the run timeout"
            time.sleep(0.5)
        ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1, 2, 3], f"worker processes: {ranks}"
        victim = 3
        os.kill(ranks[victim], signal.SIGKILL)
        t_kill = time.monotonic()
        try:
            rc = proc.wait(timeout=timeout_s + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher still runs {timeout_s + 30} s after rank {victim} was killed")
        elapsed = time.monotonic() - t_kill
        survivors = [r for r, pid in ranks.items() if _alive(pid)]
    finally:
        rp.kill_group(proc)
    log = log_path.read_text(errors="replace")
    print(f"\nkill: rank {victim} killed; launcher exit {rc} after {elapsed:.1f} s "
          f"(--mm-balance-timeout {timeout_s}); ranks still alive: {survivors}")
    assert rc != 0, "the launcher exited 0 after a rank was killed"
    assert elapsed <= timeout_s, f"ranks took {elapsed:.1f} s > --mm-balance-timeout {timeout_s} s to exit"
    assert not survivors, f"ranks {survivors} outlived the launcher"
    assert re.search(rf"rank\s*:\s*{victim}\b.*\n.*exitcode\s*:\s*-9", log), (
        f"the launcher's failure report does not name rank {victim}:\n{log[-3000:]}")
