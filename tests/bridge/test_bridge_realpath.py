"""The user's path on Megatron-Bridge: ``scripts/pretrain_bridge_vlm.sh --config
configs/bridge/qwen3_vl_moe_tiny_cpu.sh`` runs Bridge's own ``pretrain()`` (config container,
training loop, torch_dist checkpoints, energon loader, ``qwen3_vl_step.forward_step``) on CPU
over gloo through the CPU harness, with the Bridge environment of ``scripts/setup_env_bridge.sh``
(built here when missing) and Megatron-Bridge v0.6.0 + its pinned Megatron-LM from the archives,
patched with ``patches/megatron-bridge-v0.6.0/``. Off vs on equal per iteration in two layouts
(DP=2 x EP=2 MoE, 4 ranks, microstep sync; DP=2, 2 ranks, step sync), packs moved, exit 0;
resume equals the uninterrupted run; shadow mode moves nothing and trains exactly as off;
bf16 under expert parallelism is judged against a control run (``mm_balance.mode=control``)
by ``mm-balance compare-logs --control``, on two data sets, and fp32's final checkpoints
against the control's on their bits (``mm-balance compare-checkpoints``).
Slow: ``python -m pytest tests/bridge -m realpath``.
"""
from __future__ import annotations

import pytest

import bridge_util as bu

pytestmark = [pytest.mark.realpath, pytest.mark.timeout(3600)]

REL_TOL = 1e-5          # bf16; the same bound as the Megatron-LM path
ITERS = 6
#: name -> launcher environment. DP=2 in bf16, DP=4 in fp32 (shared with the images runs); the MoE layout with
#: expert parallelism in fp32 (in bf16 its experts' weight gradients are rounded to bf16 per
#: micro-step over the tokens of the micro-batches that meet there, so moving micro-batches
#: changes that rounding: docs/bridge.md gives the bf16 figures).
LAYOUTS = {
    "dp2": dict(nproc_per_node=2, ep=1, iters=3),
    "dp4": dict(nproc_per_node=4, ep=1, iters=3, precision="fp32", gbs=16),   # its off run is also images' off
    "dp2_ep2_fp32": dict(nproc_per_node=4, ep=2, iters=ITERS, precision="fp32"),   # DP=4 = expert DP=2 x EP=2
}
#: bf16 under expert parallelism: judged against the control run's band, not a fixed tolerance
BAND_LAYOUT = dict(nproc_per_node=4, ep=2, iters=4)


@pytest.fixture(scope="module")
def runner(bridge_python, bridge_trees, bridge_dataset, bridge_runs_dir):
    """``runner(name, layout, mm_balance, extra=(), output=None, data=None, env=None)`` ->
    :class:`bu.Run`, cached by name; ``layout`` names a LAYOUTS entry or is a dict of its own;
    ``env``: more of the launcher's environment."""
    cache = {}

    def go(name, layout, mm_balance, extra=(), output=None, data=None, env=None):
        if name not in cache:
            lay = dict(LAYOUTS[layout] if isinstance(layout, str) else layout)
            iters = lay.pop("iters")
            launch = bu.launcher_env(bridge_trees, data or bridge_dataset, bridge_python, mm_balance=mm_balance,
                                     output_dir=output or bridge_runs_dir / name, train_iters=iters, **lay)
            cache[name] = bu.run({**launch, **(env or {})}, list(extra), log_path=bridge_runs_dir / f"{name}.log")
        return cache[name]

    return go


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_off_on_equal(runner, layout, bridge_runs_dir):
    off, on = runner(f"{layout}-off", layout, False), runner(f"{layout}-on", layout, True)
    table = bu.loss_table({"off": off, "on": on})
    assert off.rc == 0, f"off: exit {off.rc}\n{off.tail()}"
    assert on.rc == 0, f"on: exit {on.rc}\n{on.tail()}"
    want = list(range(1, LAYOUTS[layout]["iters"] + 1))
    assert sorted(off.losses) == want and sorted(on.losses) == want, table
    diff = bu.max_rel_diff(on.losses, off.losses, want)
    moved = on.stat("packs_moved")
    print(f"\n{layout}: max relative lm-loss difference {diff:.2e}; packs moved "
          f"{[int(moved[i]) for i in sorted(moved)]}; wall off {off.wall_s:.0f}s on {on.wall_s:.0f}s\n{table}")
    assert diff <= REL_TOL, f"lm loss off vs on differs by {diff:.2e} > {REL_TOL}\n{table}"
    assert not off.telemetry, "telemetry printed with balancing off"
    assert sum(moved.values()) > 0, on.tail()
    # the statistics the Megatron-LM path logs, here per Bridge iteration
    for key in ("imbalance_before", "imbalance_after", "solver_ms", "allgather_ms", "consumer_wait_ms"):
        assert on.stat(key), f"{key} missing from the telemetry\n{on.tail()}"
    # TensorBoard: Bridge writes on the last rank; the reporting rank adds its own events file
    # ... every reported iteration's scalars in it (the writer is closed at exit: its thread
    # flushes every 2 minutes or 10 events, which left a short job's last ones unwritten)
    events = list((bridge_runs_dir / f"{layout}-on" / "tensorboard").glob("*.mm_balance"))
    written = sum(p.read_bytes().count(b"mm-balance/imbalance_after\x15") for p in events)
    assert events and written == len(on.stat("imbalance_after")), (events, written, on.stat("imbalance_after"))
    later = [on.stat("prefetched")[i] for i in sorted(on.stat("prefetched"))[1:]]
    assert later and all(v == 1.0 for v in later), f"global batches not prefetched: {on.stat('prefetched')}"


#: the least checkpoint band (||control - off|| / ||off||): a tenth of fp32's epsilon
FP32_CHECKPOINT_FLOOR = 1e-8


def test_fp32_off_on_checkpoints_within_the_control_band(runner):
    """fp32 DP=2 x EP=2 (the layout test's off and on runs, and a control run): compare-logs
    is not DIFFERENT (the printed losses are identical in most runs; a last printed digit may
    differ, e.g. ``load_balancing_loss`` by 8.8e-7 at iteration 5 on one machine, which the
    band's floor admits), and on the bits of the final torch_dist checkpoints (``mm-balance
    compare-checkpoints``, every model tensor) balancing is within the control's band. Not
    bit-identical: under expert parallelism an expert's weight gradient sums the tokens that
    met there in another order, which fp32 rounds too."""
    from megatron_mm_balance.megatron.band import DEFAULT_K
    from megatron_mm_balance.megatron.checkpoints import compare_checkpoints
    off, on = runner("dp2_ep2_fp32-off", "dp2_ep2_fp32", False), runner("dp2_ep2_fp32-on", "dp2_ep2_fp32", True)
    ctl = runner("dp2_ep2_fp32-control", "dp2_ep2_fp32", True, extra=["mm_balance.mode=control"])
    bu.check_band(off, on, ctl, "Bridge fp32 dp2_ep2")
    ckpt = {name: str(r.output_dir / "checkpoints") for name, r in (("off", off), ("on", on), ("control", ctl))}
    on_off = compare_checkpoints(ckpt["off"], ckpt["on"])
    ctl_off = compare_checkpoints(ckpt["off"], ckpt["control"])
    print(f"\nfp32 final checkpoints (model tensors): on vs off {on_off.summary()}\n"
          f"control vs off {ctl_off.summary()}")
    assert on_off.same and not (on_off.only_a or on_off.only_b), on_off.summary()
    band = max(ctl_off.norm_relative_difference, FP32_CHECKPOINT_FLOOR)
    assert on_off.norm_relative_difference <= DEFAULT_K * band, (on_off.summary(), ctl_off.summary())


#: heldout in the matrix tier: CI has Bridge main's band (test_bridge_main.py, the same hooks), and
#: default's off and control runs are the bf16 images test's too
@pytest.mark.parametrize("which", ["default", pytest.param("heldout", marks=pytest.mark.matrix)])
def test_bf16_expert_parallel_off_on_within_the_control_band(runner, request, which):
    """bf16 DP=2 x EP=2, 4 iterations: off, on and control (``mm_balance.mode=control``:
    every rank its own micro-batches, reordered across micro-steps in balancing's order).
    ``mm-balance compare-logs --format bridge OFF ON --control CONTROL`` is not DIFFERENT and
    the control moved nothing. ``default``: the session's data set; ``heldout``: 192 samples,
    seed 7."""
    data = request.getfixturevalue("bridge_dataset" if which == "default" else "bridge_heldout_dataset")
    name = f"band-{which}"
    off = runner(f"{name}-off", BAND_LAYOUT, False, data=data)
    on = runner(f"{name}-on", BAND_LAYOUT, True, data=data)
    ctl = runner(f"{name}-control", BAND_LAYOUT, True, extra=["mm_balance.mode=control"], data=data)
    bu.check_band(off, on, ctl, f"Bridge bf16 dp2_ep2, {which} data set")


def test_shadow_moves_nothing_trains_as_off(runner):
    off = runner("dp2-off", "dp2", False)
    shadow = runner("dp2-shadow", "dp2", True, extra=["mm_balance.mode=shadow"])
    assert shadow.rc == 0, shadow.tail()
    table = bu.loss_table({"off": off, "shadow": shadow})
    assert shadow.losses == off.losses, f"shadow mode changed training\n{table}"
    # every line a shadow one (what balancing would do: packs_would_move, *_would_be), and
    # the delivered figures those of the unbalanced run: nothing moved, nothing sent
    would, moved = shadow.stat("packs_would_move"), shadow.stat("packs_moved")
    assert would and sorted(would) == sorted(shadow.telemetry), shadow.tail()
    assert sum(would.values()) > 0, "shadow mode predicts no moves"
    assert moved and not any(moved.values()) and not any(shadow.stat("bytes_sent").values()), shadow.tail()
    assert shadow.stat("imbalance_after") == shadow.stat("imbalance_before"), shadow.tail()
    print(f"\nshadow: predicted packs moved {would}, imbalance {shadow.stat('imbalance_before')} -> "
          f"would be {shadow.stat('imbalance_would_be')}")


@pytest.mark.extended              # CI: the killed-rank test resumes this layout, and the images resume
def test_resume_equals_uninterrupted(runner, bridge_runs_dir):
    """3 iterations (``train.exit_interval=3``: torch_dist checkpoint, exit 0), then the same
    command resumed to 6: every iteration's lm loss equals the uninterrupted run's, the energon
    dataloader state was restored, and each resumed global batch is the uninterrupted one's
    (the balancer's per-iteration figures of the data it was given, costs before balancing
    and the moves they call for, are the same: a stream resumed elsewhere would differ)."""
    layout = "dp2_ep2_fp32"
    full = runner(f"{layout}-on", layout, True)
    out = bridge_runs_dir / f"{layout}-resume"
    first = runner("resume-first", layout, True, extra=["train.exit_interval=3"], output=out)
    second = runner("resume-second", layout, True, output=out)
    table = bu.loss_table({"uninterrupted": full, "first job": first, "resumed": second})
    assert full.rc == 0 and first.rc == 0 and second.rc == 0, f"exit {full.rc}/{first.rc}/{second.rc}\n{second.tail()}"
    assert sorted(first.losses) == [1, 2, 3], table
    assert sorted(second.losses) == [4, 5, 6], f"the second job did not resume at iteration 4\n{table}"
    assert "restoring dataloader state at iteration 3" in second.log, "energon dataloader state was not restored"
    assert "restoring dataloader state" not in first.log, "the first job resumed from an old checkpoint"
    before = bu.max_rel_diff(first.losses, full.losses, [1, 2, 3])
    diff = bu.max_rel_diff(second.losses, full.losses, [4, 5, 6])
    print(f"\nresume ({layout}, mm_balance on): max relative lm-loss difference iterations 1-3 "
          f"{before:.2e}, 4-6 {diff:.2e}\n{table}")
    assert before <= REL_TOL, table
    assert diff <= REL_TOL, f"resumed iterations differ by {diff:.2e}\n{table}"
    # (a global batch is reported when the next one starts: the last iteration has no line)
    for key in ("imbalance_before", "packs_moved"):
        got, want = second.stat(key), {i: v for i, v in full.stat(key).items() if i > 3}
        assert got and min(got) == 4 and got == want, (
            f"{key} of the resumed global batches differs from the uninterrupted run's: {got} vs {want}")
    assert sum(second.stat("packs_moved").values()) > 0, "no packs moved after the resume"


def test_environment_without_system_site_packages(bridge_python):
    """The environment the script built: its own venv, the pinned versions, Bridge's stack importable."""
    import subprocess
    from pathlib import Path
    cfg = (Path(bridge_python).parent.parent / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    r = subprocess.run([bridge_python, "-c", "import sys, torch, transformers, hydra, megatron.energon; "
                        "print(sys.version_info[:2], torch.__version__, transformers.__version__)"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "(3, 12) 2.13.0" in r.stdout and "5.12.1" in r.stdout, r.stdout


# -- mm_balance.cost=auto and the timing hooks on the real model -----------------------------

#: the calibration window: iterations 2-3 fitted, the fit used from iteration 5 (K + 2)
AUTO = ["mm_balance.cost=auto", "mm_balance.calibration_iters=3"]
AUTO_LAYOUT = "dp2_ep2_fp32"
RANKS, MICROBATCHES = 4, 2            # GBS 8 over data-parallel size 4


def test_cost_auto_trains_as_off_and_writes_the_fit(runner, bridge_runs_dir):
    """``mm_balance.cost=auto`` with the timing hooks writing their records: the printed losses
    within the control run's band of the off run's (compare-logs; identical in most runs); on
    the bits of the final checkpoint (every model tensor, ``megatron/checkpoints.py``) it is within the control run's band of the off run (fp32 under
    expert parallelism is not bit-identical when micro-batches regroup, section 5.1 of
    docs/bridge.md), and where the calibration kept image tokens it is bit for bit the
    image-token balanced run; every micro-batch of every rank is recorded with its grids, and
    the choice is logged once and saved beside the checkpoints."""
    from megatron_mm_balance.cost.calibration import FIT_FILE, read_fit
    from megatron_mm_balance.megatron.band import DEFAULT_K
    from megatron_mm_balance.megatron.checkpoints import compare_checkpoints
    off = runner(f"{AUTO_LAYOUT}-off", AUTO_LAYOUT, False)
    on = runner(f"{AUTO_LAYOUT}-on", AUTO_LAYOUT, True)
    ctl = runner(f"{AUTO_LAYOUT}-control", AUTO_LAYOUT, True, extra=["mm_balance.mode=control"])
    timing_dir = bridge_runs_dir / "auto-timing"
    auto = runner("auto", AUTO_LAYOUT, True, extra=AUTO + [f"mm_balance.timing_dir={timing_dir}"])
    table = bu.loss_table({"off": off, "cost=auto": auto})
    assert off.rc == 0 and auto.rc == 0 and on.rc == 0 and ctl.rc == 0, f"exit {off.rc}/{auto.rc}\n{auto.tail()}"
    assert sorted(auto.losses) == list(range(1, ITERS + 1)), table
    bu.check_band(off, auto, ctl, f"Bridge fp32 {AUTO_LAYOUT}, cost=auto")
    ckpt = lambda name: str(bridge_runs_dir / name / "checkpoints")  # noqa: E731
    same = compare_checkpoints(ckpt(f"{AUTO_LAYOUT}-off"), ckpt("auto"))
    band = compare_checkpoints(ckpt(f"{AUTO_LAYOUT}-off"), ckpt(f"{AUTO_LAYOUT}-control"))
    assert same.same and not (same.only_a or same.only_b), same.summary()
    assert same.norm_relative_difference <= DEFAULT_K * max(band.norm_relative_difference, FP32_CHECKPOINT_FLOOR), \
        (same.summary(), band.summary())
    fit = read_fit(str(bridge_runs_dir / "auto" / "checkpoints" / FIT_FILE))
    assert (fit.first_iteration, fit.last_iteration, fit.effective_iteration) == (2, 3, 5)
    assert fit.records == RANKS * MICROBATCHES * 2
    lines = [x for x in auto.log.splitlines() if x.startswith("[mm-balance] cost auto:")]
    assert lines == [fit.line()], lines                 # one exchange group: logged once, by its first rank
    reported = [x for x in auto.log.splitlines() if x.startswith("[mm-balance-timing] iteration ")]
    assert len(reported) == ITERS - 1, reported        # per log interval, at the next iteration's start
    records = bu.timing_records(timing_dir)
    assert sorted(records) == list(range(RANKS)), sorted(records)
    for rank, recs in records.items():
        assert [(r["iteration"], r["microbatch"]) for r in recs] == [
            (i, m) for i in range(1, ITERS + 1) for m in range(MICROBATCHES)], f"rank {rank}"
        for r in recs:
            assert r["grids"] and r["images"] == [t * h * w for t, h, w in r["grids"]], r
            assert r["lengths"] and r["lm_forward_ms"] > 0 and r["lm_backward_ms"] > 0, r
            assert r["vision_forward_ms"] > 0 and r["vision_backward_ms"] > 0, r
    # mm-balance replay on the run's own timing directory: frames, the FLOP model the run wrote
    from megatron_mm_balance import cli
    from megatron_mm_balance.cost.replay import FLOPS_MODEL_FILE
    assert (timing_dir / FLOPS_MODEL_FILE).is_file(), sorted(p.name for p in timing_dir.iterdir())
    replayed = cli_json(cli, ["replay", str(timing_dir), "--skip-iterations", "1", "--json"])
    assert replayed["features"] == "qwen_vl_frames(merge=2)" and replayed["fit_iterations"] == [2, 3]
    rows = {r["name"]: r for r in replayed["rows"]}
    assert list(rows) == ["unbalanced", "image-tokens", "flops", "fit", "fit+frame", "fit+image", "perfect"]
    assert not rows["flops"]["refused"] and rows["flops"]["microstep_max_mean"] is not None, rows["flops"]
    print("\n".join(f"{r['name']:<13} {r['microstep_max_mean'] or float('nan'):.4f} "
                    f"{r['rank_total_max_mean'] or float('nan'):.4f} {r['refused'] or r['detail']}" for r in rows.values()))
    if not fit.ok:                   # image tokens kept: the image-token balanced run's placements
        as_on = compare_checkpoints(ckpt(f"{AUTO_LAYOUT}-on"), ckpt("auto"))
        assert as_on.identical, as_on.summary()
    print(f"\ncost=auto ({AUTO_LAYOUT}): {fit.line()}\nfinal checkpoint vs off: {same.summary()}; wall off "
          f"{off.wall_s:.0f}s auto {auto.wall_s:.0f}s\n{table}")


def cli_json(cli, argv) -> dict:
    """``mm-balance ARGV --json`` in this process, its one JSON object."""
    import contextlib
    import io
    import json
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(argv) == 0, argv
    return json.loads(out.getvalue())


@pytest.mark.extended              # CI: resume is proven by the killed-rank and images tests
def test_cost_auto_resume_restores_the_fit(runner, bridge_runs_dir):
    """Stopped after the fit took effect (``train.exit_interval=5``), resumed to the end: the
    second job restores the first job's fit (no second calibration), and its losses and final
    checkpoint equal the uninterrupted ``cost=auto`` run's bit for bit."""
    from megatron_mm_balance.cost.calibration import FIT_FILE, read_fit
    timing_dir = bridge_runs_dir / "auto-timing"
    full = runner("auto", AUTO_LAYOUT, True, extra=AUTO + [f"mm_balance.timing_dir={timing_dir}"])
    out = bridge_runs_dir / "auto-resume"
    first = runner("auto-resume-first", AUTO_LAYOUT, True, extra=AUTO + ["train.exit_interval=5"], output=out)
    saved = read_fit(str(out / "checkpoints" / FIT_FILE))
    second = runner("auto-resume-second", AUTO_LAYOUT, True, extra=AUTO, output=out)
    table = bu.loss_table({"uninterrupted": full, "first job": first, "resumed": second})
    assert full.rc == 0 and first.rc == 0 and second.rc == 0, f"exit {full.rc}/{first.rc}/{second.rc}\n{second.tail()}"
    assert sorted(first.losses) == [1, 2, 3, 4, 5] and sorted(second.losses) == [6], table
    assert {**first.losses, **second.losses} == full.losses, table
    assert f"[mm-balance] cost auto: restored the fit of iterations 2-3 from {out / 'checkpoints' / FIT_FILE}" \
           f" (effective from iteration 5" in second.log, second.tail()
    assert "[mm-balance] cost auto: fit" not in second.log, "the resumed job calibrated again"
    assert read_fit(str(out / "checkpoints" / FIT_FILE)) == saved
    from megatron_mm_balance.megatron.checkpoints import compare_checkpoints
    same = compare_checkpoints(str(bridge_runs_dir / "auto" / "checkpoints"), str(out / "checkpoints"))
    assert same.same and not (same.only_a or same.only_b), same.summary()
    full_fit = read_fit(str(bridge_runs_dir / "auto" / "checkpoints" / FIT_FILE))
    if saved.ok == full_fit.ok is False:
        # both jobs balanced with image tokens (their fits refused): the same placements, so the
        # resumed job must reproduce the uninterrupted one bit for bit
        assert same.identical, same.summary()
    else:                            # each job's own fit (its own timings): placements may differ
        assert same.norm_relative_difference <= 1e-6, same.summary()
    print(f"\ncost=auto resume: restored {saved.line()}\nfinal checkpoint vs the uninterrupted run's: "
          f"{same.summary()}; wall first {first.wall_s:.0f}s resumed {second.wall_s:.0f}s\n{table}")


def test_cost_model_from_flops_trains_within_the_control_band(runner, bridge_runs_dir):
    """``mm_balance.cost=model`` without a cost file: the FLOP-derived model of the provider's
    tower and language model (cost/flops.py) is the cost. Printed losses within the control's
    band of off's (compare-logs; identical in most runs); the final
    checkpoint is bit for bit the image-token balanced run's where it placed the same, else
    within the fp32 control's band of off (the layout test's off, on and control runs)."""
    from megatron_mm_balance.megatron.band import DEFAULT_K
    from megatron_mm_balance.megatron.checkpoints import compare_checkpoints
    off = runner(f"{AUTO_LAYOUT}-off", AUTO_LAYOUT, False)
    on = runner(f"{AUTO_LAYOUT}-on", AUTO_LAYOUT, True)
    ctl = runner(f"{AUTO_LAYOUT}-control", AUTO_LAYOUT, True, extra=["mm_balance.mode=control"])
    model = runner("model", AUTO_LAYOUT, True, extra=["mm_balance.cost=model"])
    table = bu.loss_table({"off": off, "cost=model": model})
    assert off.rc == 0 and on.rc == 0 and ctl.rc == 0 and model.rc == 0, f"exit {model.rc}\n{model.tail()}"
    assert sorted(model.losses) == list(range(1, ITERS + 1)), table
    bu.check_band(off, model, ctl, f"Bridge fp32 {AUTO_LAYOUT}, cost=model")
    # costs in the model's microseconds, not patches: the FLOP model was the cost
    assert model.stat("cost_step_mean") and model.stat("cost_step_mean") != on.stat("cost_step_mean"), model.tail()
    assert sum(model.stat("packs_moved").values()) > 0, model.tail()
    ckpt = lambda name: str(bridge_runs_dir / name / "checkpoints")  # noqa: E731
    as_on = compare_checkpoints(ckpt(f"{AUTO_LAYOUT}-on"), ckpt("model"))
    same = compare_checkpoints(ckpt(f"{AUTO_LAYOUT}-off"), ckpt("model"))
    band = compare_checkpoints(ckpt(f"{AUTO_LAYOUT}-off"), ckpt(f"{AUTO_LAYOUT}-control"))
    assert same.same and not (same.only_a or same.only_b), same.summary()
    if not as_on.identical:
        assert same.norm_relative_difference <= DEFAULT_K * max(band.norm_relative_difference, FP32_CHECKPOINT_FLOOR), \
            (same.summary(), band.summary())
    print(f"\ncost=model (FLOPs, {AUTO_LAYOUT}): packs moved {model.stat('packs_moved')} (image tokens "
          f"{on.stat('packs_moved')}); final checkpoint vs image tokens' {as_on.summary()}, vs off "
          f"{same.summary()}, control vs off {band.summary()}; wall {model.wall_s:.0f}s\n{table}")


def test_killed_rank_then_resumed_equals_uninterrupted(runner, bridge_python, bridge_trees, bridge_dataset,
                                                       bridge_runs_dir):
    """A rank SIGKILLed during the exchange (``MM_BALANCE_FAULT=kill:rank=1:iteration=4:microstep=1``,
    the test hook) on the DP=2 x EP=2 fp32 job with a checkpoint every iteration: the launcher
    exits non-zero, rank 1's line names where it died, every other rank prints where it stood
    (iteration and micro-step), the launcher's report names rank 1 (-9). The same command
    without the fault resumes from the last checkpoint and equals the uninterrupted run from
    there: every loss within 1e-5, and each resumed global batch's balancer figures (costs
    before balancing, the moves they call for) are the uninterrupted run's."""
    import re
    layout = "dp2_ep2_fp32"
    full = runner(f"{layout}-on", layout, True)
    lay = dict(LAYOUTS[layout])
    iters = lay.pop("iters")
    out = bridge_runs_dir / "fault-kill"
    env = bu.launcher_env(bridge_trees, bridge_dataset, bridge_python, mm_balance=True, output_dir=out,
                          train_iters=iters, **lay)
    extra = ["checkpoint.save_interval=1", "mm_balance.timeout=30"]
    killed = bu.run(dict(env, MM_BALANCE_FAULT="kill:rank=1:iteration=4:microstep=1"), extra,
                    log_path=bridge_runs_dir / "fault-kill.log")
    assert killed.rc != 0, killed.tail()
    assert re.search(r"\[mm-balance\] rank 1: MM_BALANCE_FAULT=kill:rank=1:iteration=4:microstep=1: SIGKILL during "
                     r"the exchange of micro-step 1 at global batch \d+ \(iteration 4\)", killed.log), killed.tail(80)
    for rank in (0, 2, 3):
        assert re.search(rf"\[mm-balance\] rank {rank}: (stopped by|training stops) .*iteration \d+.*micro-step",
                         killed.log, re.M), f"rank {rank} printed no stop line\n{killed.tail(80)}"
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9", killed.log), killed.tail(40)
    last = int((out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
    resumed = bu.run(env, extra, log_path=bridge_runs_dir / "fault-kill-resumed.log")
    table = bu.loss_table({"uninterrupted": full, "killed": killed, "resumed": resumed})
    print(f"\nkilled rank 1 at iteration 4 (micro-step 1): exit {killed.rc} after {killed.wall_s:.0f} s, last "
          f"checkpoint {last}; resumed: exit {resumed.rc} after {resumed.wall_s:.0f} s\n{table}")
    assert resumed.rc == 0, resumed.tail()
    assert 1 <= last < 4 and f"restoring dataloader state at iteration {last}" in resumed.log, resumed.tail()
    after = list(range(last + 1, iters + 1))
    assert sorted(resumed.losses) == after, table
    assert bu.max_rel_diff(resumed.losses, full.losses, after) <= REL_TOL, table
    for key in ("imbalance_before", "packs_moved"):
        got = resumed.stat(key)
        want = {i: v for i, v in full.stat(key).items() if i > last}
        assert got and got == want, f"{key} of the resumed global batches: {got} vs {want}"


# -- mm_balance.vision=images: packs first, then frames inside each expert-parallel group ----------

IMAGES = ["mm_balance.vision=images"]
#: the layout of the images runs: DP=4 x EP=2, two step groups of 2 (the layout tests' fp32 one,
#: whose off and control runs are reused); without expert parallelism images mode balances
#: nothing per micro-step (tests/bridge/test_vision_images_units.py)
IMAGE_LAYOUTS = {"dp2_ep2_fp32": LAYOUTS["dp2_ep2_fp32"]}


def _images_run(runner, runs_dir):
    """The DP=4 x EP=2 fp32 images run, with the timing hooks (``timing_dir``) and the count of
    torch.distributed calls by stack (``MM_BALANCE_DIST_AUDIT``) writing into its output."""
    out = runs_dir / "dp2_ep2_fp32-images"
    return runner("dp2_ep2_fp32-images", IMAGE_LAYOUTS["dp2_ep2_fp32"], True,
                  extra=IMAGES + [f"mm_balance.timing_dir={out / 'timing'}"],
                  env={"MM_BALANCE_DIST_AUDIT": str(out / "audit")})


def _vision_lines(run) -> dict:
    """``{(iteration, step group): {figure: value}}`` of the ``[mm-balance-vision] iteration N |
    step_group: G | ...`` lines (one per step group and log interval)."""
    out = {}
    for line in run.log.splitlines():
        if line.startswith("[mm-balance-vision] iteration "):
            head, *parts = line.split(" | ")
            figures = {k: float(v) for k, v in (p.split(": ", 1) for p in parts)}
            out[(int(head.split()[-1]), int(figures.pop("step_group")))] = figures
    return out


def _planned_figures(lines: dict) -> dict:
    """The vision lines without the measured rates (timings, which differ run to run)."""
    return {i: {k: v for k, v in fig.items() if not k.endswith("_measured")} for i, fig in lines.items()}


def test_images_mode_trains_as_off_within_the_control_band(runner, bridge_runs_dir):
    """``mm_balance.vision=images`` through the launcher, fp32, DP=4 x EP=2: frames move inside
    each expert-parallel group, every iteration's loss is off's (compare-logs against the control
    run: EQUAL or WITHIN BAND), and the final checkpoint is within the control's band of off's
    (``megatron/checkpoints.py``, every model tensor). Not bit-identical: a rank encodes other
    frames than unbalanced, so the tower's GEMMs run over other row counts
    (tests/bridge/test_vision_images_realpath.py shows it is rounding: the same comparison in fp64
    falls to 1e-16). Counted by stack on every rank (``MM_BALANCE_DIST_AUDIT``): no collective of
    ours on the training thread outside the data iterator's ``next()``; the timing records split
    the exchange's forward and backward."""
    import json

    from megatron_mm_balance.megatron.band import DEFAULT_K
    from megatron_mm_balance.megatron.checkpoints import compare_checkpoints
    layout = "dp2_ep2_fp32"
    lay = IMAGE_LAYOUTS[layout]
    off = runner(f"{layout}-off", lay, False)
    images = _images_run(runner, bridge_runs_dir)
    ctl = runner(f"{layout}-control", lay, True, extra=["mm_balance.mode=control"])
    report = bu.check_band(off, images, ctl, f"Bridge fp32 {layout}, vision=images")
    vision = _vision_lines(images)
    iters = lay["iters"]
    assert sorted({i for i, _ in vision}) == list(range(1, iters)), images.tail()   # one line per interval ...
    assert {g for _, g in vision} == {0, 1}, sorted(vision)                         # ... and step group
    moved = {key: int(v["frames_moved"]) for key, v in vision.items()}
    assert sum(moved.values()) > 0, f"no frame moved: {vision}"
    for v in vision.values():
        assert v["vision_max_after"] <= v["vision_max_before"] and v["patches_max_after"] <= v["patches_max_before"]
    assert not _vision_lines(off) and not _vision_lines(ctl)
    last = vision[max(vision)]
    assert last["tower_tflops_measured"] > 0, last          # every rank times its tower
    # each step group's first rank has no Bridge writer: its own events file
    events = list((images.output_dir / "tensorboard").glob("*.mm_balance_vision"))     # every line's scalars
    written = sum(p.read_bytes().count(b"mm-balance-vision/imbalance_after\x15") for p in events)
    assert events and written == len(vision), (events, written, sorted(vision))
    audits = [json.loads(p.read_text()) for p in sorted((images.output_dir / "audit").glob("dist-audit-rank*.json"))]
    assert len(audits) == 4 and all(a["our_collectives_in_step"] == 0 for a in audits), audits
    ckpt = {name: str(r.output_dir / "checkpoints") for name, r in (("off", off), ("images", images), ("control", ctl))}
    img_off, ctl_off = compare_checkpoints(ckpt["off"], ckpt["images"]), compare_checkpoints(ckpt["off"], ckpt["control"])
    print(f"\n{layout} vision=images: frames moved per (iteration, step group) {moved}; final checkpoints (model "
          f"tensors): images vs off {img_off.summary()}; control vs off {ctl_off.summary()}\n"
          f"{bu.loss_table({'off': off, 'images': images, 'control': ctl})}\n{report}")
    assert img_off.same and not (img_off.only_a or img_off.only_b), img_off.summary()
    band = max(ctl_off.norm_relative_difference, FP32_CHECKPOINT_FLOOR)
    assert img_off.norm_relative_difference <= DEFAULT_K * band, (img_off.summary(), ctl_off.summary())
    _check_exchange_details(bu.timing_records(images.output_dir / "timing"), iters)


def _check_exchange_details(records: dict, iters: int) -> None:
    """Every rank's micro-batch records split the exchange where its frames crossed it
    (``details``): the forward's whole holds its tower time and its wait for the outputs, the
    backward's gradient transfers their wait; over the run every rank's frames crossed."""
    assert sorted(records) == [0, 1, 2, 3], sorted(records)
    for rank, recs in records.items():
        assert len(recs) == iters * 2, (rank, len(recs))
        crossed = [r["details"] for r in recs if "vision_exchange_ms" in r.get("details", {})]
        assert crossed, rank
        for d in crossed:
            assert d["vision_exchange_ms"] + 1e-3 >= d.get("vision_tower_ms", 0.0) + d["vision_wait_ms"], (rank, d)
            assert d["vision_grad_exchange_ms"] + 1e-3 >= d["vision_grad_wait_ms"], (rank, d)
    every = [d for recs in records.values() for r in recs for d in [r.get("details", {})]]
    print("exchange per micro-batch, mean over ranks (ms): " + ", ".join(
        f"{k[len('vision_'):]} {sum(d.get(k, 0.0) for d in every) / len(every):.1f}"
        for k in ("vision_exchange_ms", "vision_tower_ms", "vision_wait_ms", "vision_grad_exchange_ms",
                  "vision_grad_wait_ms")))


def test_images_mode_resume_equals_uninterrupted(runner, bridge_runs_dir):
    """Stopped after iteration 4 (``train.exit_interval=4``), resumed to 6 with
    ``mm_balance.vision=images``: the losses, the resumed iteration's frame figures and the
    final checkpoint equal the uninterrupted images run's bit for bit (the plan depends only on
    the data, so every frame is encoded where it was)."""
    from megatron_mm_balance.megatron.checkpoints import compare_checkpoints
    layout = "dp2_ep2_fp32"
    full = _images_run(runner, bridge_runs_dir)
    out = bridge_runs_dir / f"{layout}-images-resume"
    first = runner("images-resume-first", layout, True, extra=IMAGES + ["train.exit_interval=4"], output=out)
    second = runner("images-resume-second", layout, True, extra=IMAGES, output=out)
    table = bu.loss_table({"uninterrupted": full, "first job": first, "resumed": second})
    assert full.rc == 0 and first.rc == 0 and second.rc == 0, f"exit {full.rc}/{first.rc}/{second.rc}\n{second.tail()}"
    assert sorted(first.losses) == [1, 2, 3, 4] and sorted(second.losses) == [5, 6], table
    assert "restoring dataloader state at iteration 4" in second.log, second.tail()
    assert {**first.losses, **second.losses} == full.losses, table
    full_vision = _vision_lines(full)
    assert _planned_figures(_vision_lines(second)) == {i: v for i, v in _planned_figures(full_vision).items()
                                                       if i[0] >= 5}, second.tail()
    same = compare_checkpoints(str(full.output_dir / "checkpoints"), str(out / "checkpoints"))
    print(f"\nvision=images resume ({layout}): final checkpoint vs the uninterrupted run's: {same.summary()}; "
          f"wall first {first.wall_s:.0f}s resumed {second.wall_s:.0f}s\n{table}")
    assert same.identical, same.summary()


def test_bf16_images_mode_within_the_control_band(runner, bridge_dataset):
    """bf16 DP=2 x EP=2 with ``mm_balance.vision=images`` beside the bf16 band test's off and
    control runs (the session's data set): compare-logs is not DIFFERENT."""
    off = runner("band-default-off", BAND_LAYOUT, False, data=bridge_dataset)
    images = runner("band-default-images", BAND_LAYOUT, True, extra=IMAGES, data=bridge_dataset)
    ctl = runner("band-default-control", BAND_LAYOUT, True, extra=["mm_balance.mode=control"], data=bridge_dataset)
    bu.check_band(off, images, ctl, "Bridge bf16 dp2_ep2, vision=images")
    assert _vision_lines(images), images.tail()
