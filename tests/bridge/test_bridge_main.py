"""The user's path on Megatron-Bridge main (0.7.0 dev, 067f987d) with the Megatron-LM it pins
(2a75ac12, 0.20.0 dev), patched with ``patches/megatron-bridge-v0.7.0/``:
``scripts/pretrain_bridge_vlm.sh`` on CPU over gloo (the CPU harness), the toy Qwen3-VL MoE
(DP=4 x EP=2, 4 ranks) and the native-resolution one:

* fp32: off and on (the timing hooks writing their records) within 1e-5, the Megatron-LM path's
  bound (under expert parallelism fp32's last bit follows which micro-batches meet and in which
  order the ranks' losses are summed); the printed and the full-precision (TensorBoard)
  differences are reported;
* the overlay: the same on-run on an unpatched read-only copy of the trees
  (``MM_BALANCE_OVERLAY=1``, ``chmod -R a-w``): losses and the final checkpoint bit for bit the
  patched tree's, no file of the trees written, the same code digest;
* resume: stopped after iteration 3, resumed to 6: losses, every rank's micro-batches (the timing
  records' grids and lengths, micro-batch by micro-batch) and the final checkpoint bit for bit the
  uninterrupted run's;
* bf16 with ``mm_balance.cost=auto``: off, auto and control, within the control's band;
* native resolution (``configs/bridge/qwen3_vl_moe_native_res_cpu.sh``, ``make-dataset --mix
  native-res``: images, documents and videos at their own grids), fp32 off and on within 1e-5.

Slow: ``python -m pytest tests/bridge/test_bridge_main.py -m realpath``. Bridge v0.6.0's runs
that repeat these on the 0.6 line are in the ``matrix`` tier.
"""
from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest

import bridge_util as bu
from realpath_util import tb_scalars, tree_digest

pytestmark = [pytest.mark.realpath, pytest.mark.timeout(3600)]

ITERS = 6
FP32 = dict(nproc_per_node=4, ep=2, iters=ITERS, precision="fp32")
BAND = dict(nproc_per_node=4, ep=2, iters=ITERS)                      # bf16
AUTO = ["mm_balance.cost=auto", "mm_balance.calibration_iters=3"]     # fitted on 2-3, used from 5
NATIVE_CONFIG = bu.REPO / "configs" / "bridge" / "qwen3_vl_moe_native_res_cpu.sh"
NATIVE = dict(nproc_per_node=2, ep=2, iters=2, precision="fp32")
#: fp32 under expert parallelism: the Megatron-LM path's off/on bound (tests/realpath/test_real_path.py)
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def read_only_trees(tmp_path_factory) -> dict:
    """Bridge main and its Megatron-LM unpacked, unpatched, without write permission."""
    dest = tmp_path_factory.mktemp("read-only-bridge-main")
    for name in (bu.BRIDGE_MAIN_ARCHIVE, bu.MLM_MAIN_ARCHIVE):
        with tarfile.open(bu.archive_dir() / name) as tf:
            tf.extractall(dest, filter="data")
    subprocess.run(["chmod", "-R", "a-w", str(dest)], check=True)
    yield {"bridge": dest / bu.BRIDGE_MAIN_ARCHIVE[:-7], "mlm": dest / bu.MLM_MAIN_ARCHIVE[:-7], "root": dest}
    subprocess.run(["chmod", "-R", "u+w", str(dest)], check=False)


@pytest.fixture(scope="module")
def runner(bridge_python, bridge_main_trees, bridge_dataset, bridge_runs_dir):
    cache = {}

    def go(name, layout, mm_balance, extra=(), output=None, data=None, trees=None, config=bu.CONFIG, **env):
        if name not in cache:
            lay = dict(layout)
            iters = lay.pop("iters")
            e = bu.launcher_env(trees or bridge_main_trees, data or bridge_dataset, bridge_python,
                                mm_balance=mm_balance, output_dir=output or bridge_runs_dir / f"main-{name}",
                                train_iters=iters, **lay)
            e.update(env)
            cache[name] = bu.run(e, list(extra), log_path=bridge_runs_dir / f"main-{name}.log", config=config)
        return cache[name]

    return go


def _timing(runs_dir: Path, name: str) -> list:
    return [f"mm_balance.timing_dir={runs_dir / f'main-{name}-timing'}"]


def _digest(log: str) -> str:
    return log.split("[mm-balance] code: digest ")[1].split()[0]


def _by_microbatch(directory: Path, iterations) -> dict:
    """``{(rank, iteration, micro-batch): (grids, lengths)}`` from a run's timing records."""
    from megatron_mm_balance.cost.timing_files import read_timing_records
    return {(r["rank"], r["iteration"], r["microbatch"]): (r["grids"], r["lengths"])
            for r in read_timing_records(str(directory)) if r["iteration"] in iterations}


def test_fp32_off_on_within_bound(runner, bridge_runs_dir):
    """fp32 DP=4 x EP=2: off and on (the timing hooks writing records). Under expert parallelism
    moving micro-batches changes which tokens meet at an expert and the order the ranks' losses
    are summed, so fp32's last printed digit may differ: bounded by REL_TOL, both differences
    reported."""
    off = runner("off", FP32, False)
    on = runner("on", FP32, True, extra=_timing(bridge_runs_dir, "on"))
    table = bu.loss_table({"off": off, "on": on})
    assert off.rc == 0 and on.rc == 0, f"exit {off.rc}/{on.rc}\n{on.tail()}"
    assert sorted(on.losses) == list(range(1, ITERS + 1)), table
    full = [tb_scalars(bridge_runs_dir / f"main-{n}" / "tensorboard") for n in ("off", "on")]
    assert sorted(full[0]) == sorted(full[1]) == list(range(1, ITERS + 1)), full
    diff = bu.max_rel_diff(full[1], full[0], range(1, ITERS + 1))
    printed = bu.max_rel_diff(on.losses, off.losses, range(1, ITERS + 1))
    moved = on.stat("packs_moved")
    same = sum(on.losses[i] == off.losses[i] for i in on.losses)
    print(f"\nBridge main fp32 DP=4 x EP=2: printed lm loss equal at {same} of {ITERS} iterations, largest "
          f"relative difference {printed:.2e}; full precision (TensorBoard) {diff:.2e}; packs moved "
          f"{[int(moved[i]) for i in sorted(moved)]}\n{table}")
    assert sum(moved.values()) > 0, on.tail()
    assert printed <= REL_TOL and diff <= REL_TOL, table
    records = _by_microbatch(bridge_runs_dir / "main-on-timing", range(1, ITERS + 1))
    assert sorted({k[0] for k in records}) == [0, 1, 2, 3] and len(records) == 4 * ITERS * 2, sorted(records)


def test_overlay_on_read_only_trees_equals_the_patched_tree(runner, bridge_runs_dir, read_only_trees):
    from megatron_mm_balance.megatron.checkpoints import compare_checkpoints
    on = runner("on", FP32, True, extra=_timing(bridge_runs_dir, "on"))
    before = tree_digest(read_only_trees["root"])
    ro = runner("overlay", FP32, True, extra=_timing(bridge_runs_dir, "overlay"), trees=read_only_trees,
                MM_BALANCE_OVERLAY="1", PYTHONDONTWRITEBYTECODE="1")
    assert ro.rc == 0, ro.tail()
    assert tree_digest(read_only_trees["root"]) == before, "the overlay wrote into the read-only trees"
    assert ro.losses == on.losses, bu.loss_table({"patched": on, "overlay": ro})
    assert tb_scalars(bridge_runs_dir / "main-overlay" / "tensorboard") == \
        tb_scalars(bridge_runs_dir / "main-on" / "tensorboard")
    same = compare_checkpoints(str(bridge_runs_dir / "main-on" / "checkpoints"),
                               str(bridge_runs_dir / "main-overlay" / "checkpoints"))
    assert same.identical, same.summary()
    assert "overlay: Megatron-Bridge megatron-bridge-v0.7.0 for Megatron-Bridge at" in ro.log
    assert "(from the overlay)" in ro.log and _digest(ro.log) == _digest(on.log), ro.tail()
    print(f"\noverlay on read-only Bridge main: losses and final checkpoint bit for bit the patched tree's "
          f"({same.summary()}); code digest {_digest(ro.log)} both ways")


def test_resume_equals_uninterrupted_by_sample(runner, bridge_runs_dir):
    from megatron_mm_balance.megatron.checkpoints import compare_checkpoints
    full = runner("on", FP32, True, extra=_timing(bridge_runs_dir, "on"))
    out = bridge_runs_dir / "main-resume"
    timing = _timing(bridge_runs_dir, "resume")
    first = runner("resume-first", FP32, True, extra=timing + ["train.exit_interval=3"], output=out)
    second = runner("resume-second", FP32, True, extra=timing, output=out)
    table = bu.loss_table({"uninterrupted": full, "first job": first, "resumed": second})
    assert first.rc == 0 and second.rc == 0, f"exit {first.rc}/{second.rc}\n{second.tail()}"
    assert sorted(first.losses) == [1, 2, 3] and sorted(second.losses) == [4, 5, 6], table
    assert {**first.losses, **second.losses} == full.losses, table
    assert "restoring dataloader state at iteration 3" in second.log, second.tail()
    want = _by_microbatch(bridge_runs_dir / "main-on-timing", range(1, ITERS + 1))
    got = _by_microbatch(bridge_runs_dir / "main-resume-timing", range(1, ITERS + 1))
    assert got == want, "the resumed run consumed other micro-batches than the uninterrupted one"
    same = compare_checkpoints(str(bridge_runs_dir / "main-on" / "checkpoints"), str(out / "checkpoints"))
    assert same.identical, same.summary()
    print(f"\nBridge main resume: {len(got)} micro-batches (rank, iteration, micro-batch: grids and lengths) "
          f"identical; final checkpoint {same.summary()}\n{table}")


def test_bf16_cost_auto_within_the_control_band(runner, bridge_runs_dir):
    from megatron_mm_balance.cost.calibration import FIT_FILE, read_fit
    off = runner("bf16-off", BAND, False)
    auto = runner("bf16-auto", BAND, True, extra=AUTO)
    ctl = runner("bf16-control", BAND, True, extra=["mm_balance.mode=control"])
    bu.check_band(off, auto, ctl, "Bridge main bf16 DP=4 x EP=2, cost=auto")
    fit = read_fit(str(bridge_runs_dir / "main-bf16-auto" / "checkpoints" / FIT_FILE))
    assert (fit.first_iteration, fit.last_iteration, fit.effective_iteration) == (2, 3, 5), fit.line()


@pytest.fixture(scope="module")
def native_dataset(tmp_path_factory) -> dict:
    import os
    import re
    import sys
    out = tmp_path_factory.mktemp("bridge-native") / "data"
    env = dict(os.environ, PYTHONPATH=f"{bu.REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-m", "megatron_mm_balance.cli", "make-dataset", str(out), "--samples", "64",
                        "--seed", "0", "--format", "bridge-qwen-vl", "--mix", "native-res"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if re.match(r"^[A-Z_]+=", line))


def test_native_resolution_off_on_within_bound(runner, native_dataset):
    off = runner("native-off", NATIVE, False, data=native_dataset, config=NATIVE_CONFIG)
    on = runner("native-on", NATIVE, True, data=native_dataset, config=NATIVE_CONFIG)
    table = bu.loss_table({"off": off, "on": on})
    assert off.rc == 0 and on.rc == 0, f"exit {off.rc}/{on.rc}\n{on.tail()}"
    assert sorted(on.losses) == [1, 2] == sorted(off.losses), table
    diff = bu.max_rel_diff(on.losses, off.losses, [1, 2])
    moved = on.stat("packs_moved")
    assert sum(moved.values()) > 0, on.tail()
    print(f"\nBridge main native resolution fp32 (2 ranks, 8 micro-batches each): printed lm loss largest "
          f"relative difference {diff:.2e}, packs moved {[int(moved[i]) for i in sorted(moved)]}\n{table}")
    assert diff <= REL_TOL, table
