"""The user's path on Megatron-LM main (0.20.0 dev, d98e8a64), under Python 3.12.

``scripts/pretrain_vlm_moe.sh --config configs/megatron/tiny_cpu.sh`` (4 CPU ranks over gloo
through the CPU harness, DP=4 x EP=2, bf16: the example runs in bf16 or fp16 only), against
``Megatron-LM-main-d98e8a64`` from the archives patched with ``patches/core_v0.20.0/``, run by
the interpreter of ``scripts/setup_env_py312.sh``:

* off, on (with the timing hooks writing their records) and control
  (``--mm-balance-mode control``): the printed losses within the control's band
  (``mm-balance compare-logs --control``), the largest full-precision difference of on vs off
  reported from the TensorBoard scalars; every rank's timing records cover every micro-batch;
* resume: stopped after iteration 3, resumed to 6 **under the import-time overlay on a
  read-only, unpatched copy of the tree** (``MM_BALANCE_OVERLAY=1``, ``chmod -R a-w``): every
  loss and every micro-batch of every rank (keys and content digests) equal the uninterrupted
  patched run's, and no file of the tree is written;
* ``--mm-balance-cost auto`` (calibrated on iterations 2-3, used from 5): within the control's
  band, the fit saved beside the checkpoints.

Slow: ``python -m pytest tests/realpath/test_real_path_main.py -m realpath``. core_v0.19.0's
launcher path is in the ``matrix`` tier (test_real_path_newest.py).
"""
from __future__ import annotations

import json
import subprocess
import tarfile
from pathlib import Path

import pytest

import realpath_util as rp

pytestmark = [pytest.mark.realpath, pytest.mark.timeout(3600)]

TAG = "main-d98e8a64"
ITERS = 6
REL_TOL = 1e-5
RUN_TIMEOUT_S = 900
AUTO = ["--mm-balance-cost", "auto", "--mm-balance-calibration-iters", "3"]


@pytest.fixture(scope="module")
def tree() -> Path:
    return rp.release_tree_or_skip(TAG)


@pytest.fixture(scope="module")
def read_only_tree(tmp_path_factory) -> Path:
    """The archive unpacked, unpatched, every file and directory without write permission."""
    dest = tmp_path_factory.mktemp("read-only-main")
    with tarfile.open(rp.archive(TAG)) as tf:
        tf.extractall(dest, filter="data")
    t = dest / f"Megatron-LM-{TAG}"
    subprocess.run(["chmod", "-R", "a-w", str(t)], check=True)
    yield t
    subprocess.run(["chmod", "-R", "u+w", str(dest)], check=False)


@pytest.fixture(scope="module")
def runner(py312, tree, dataset, runs_dir):
    return rp.cached_launcher_runs(tree, dataset, runs_dir, tag=TAG, iters=ITERS, python=py312,
                                   timeout=RUN_TIMEOUT_S)


def test_off_on_within_the_control_band_and_timing_hooks(runner, runs_dir):
    off = runner("off", False)
    timing_dir = runs_dir / f"{TAG}-on-timing"
    on = runner("on", True, extra=["--mm-balance-timing-dir", str(timing_dir)])
    ctl = runner("control", True, extra=["--mm-balance-mode", "control"])
    rp.check_band(off, on, ctl, f"{TAG} DP=4 x EP=2 bf16")
    assert sorted(on.losses) == list(range(1, ITERS + 1)), rp.loss_table({"off": off, "on": on})
    full = rp.tb_scalars(runs_dir / f"{TAG}-off" / "tensorboard"), rp.tb_scalars(runs_dir / f"{TAG}-on" / "tensorboard")
    assert sorted(full[0]) == sorted(full[1]) == list(range(1, ITERS + 1)), full
    diff = rp.max_rel_diff(full[1], full[0], range(1, ITERS + 1))
    print(f"\n{TAG}: printed lm loss on vs off max relative {rp.max_rel_diff(on.losses, off.losses, range(1, ITERS + 1)):.2e}; "
          f"full precision (TensorBoard) {diff:.2e}; packs moved {[on.moved[i] for i in sorted(on.moved)]}")
    records = {int(p.stem.replace("timing-rank", "")): [json.loads(x) for x in p.read_text().splitlines()]
               for p in timing_dir.glob("timing-rank*.jsonl")}
    assert sorted(records) == [0, 1, 2, 3], sorted(records)
    for rank, recs in records.items():
        assert sorted({(r["iteration"], r["microbatch"]) for r in recs}) == [
            (i, m) for i in range(1, ITERS + 1) for m in range(2)], f"rank {rank}"
        assert all(r["vision_forward_ms"] > 0 and r["lm_forward_ms"] > 0 for r in recs), recs[0]


def test_resume_under_the_overlay_on_a_read_only_tree(runner, runs_dir, read_only_tree):
    """The first job on the patched tree, the second on an unpatched read-only copy with the
    overlay: the resumed run equals the uninterrupted one by loss and by sample."""
    full = runner("on", True, extra=["--mm-balance-timing-dir", str(runs_dir / f"{TAG}-on-timing")])
    out = runs_dir / f"{TAG}-resume"
    before = rp.tree_digest(read_only_tree)
    first = runner("resume-first", True, extra=["--exit-interval", "3"], output=out)
    second = runner("resume-second", True, output=out, mlm=read_only_tree, MM_BALANCE_OVERLAY="1",
                    PYTHONDONTWRITEBYTECODE="1")
    rp.check_resume(full, first, second, f"{TAG} resume, the second job under the overlay", REL_TOL)
    assert rp.tree_digest(read_only_tree) == before, "the overlay wrote into the read-only tree"
    assert "[mm-balance] code: digest " in second.log and "(from the overlay)" in second.log, second.tail()
    digest = lambda log: log.split("[mm-balance] code: digest ")[1].split()[0]   # noqa: E731
    assert digest(second.log) == digest(first.log), "the overlay's hooks digest differently from the files'"


def test_cost_auto_within_the_control_band(runner, runs_dir):
    from megatron_mm_balance.cost.calibration import FIT_FILE, read_fit
    off, ctl = runner("off", False), runner("control", True, extra=["--mm-balance-mode", "control"])
    auto = runner("auto", True, extra=AUTO)
    rp.check_band(off, auto, ctl, f"{TAG} DP=4 x EP=2 bf16, --mm-balance-cost auto")
    fit = read_fit(str(runs_dir / f"{TAG}-auto" / "checkpoints" / FIT_FILE))
    assert (fit.first_iteration, fit.last_iteration, fit.effective_iteration) == (2, 3, 5), fit.line()
    assert [x for x in auto.log.splitlines() if x.startswith("[mm-balance] cost auto:")], auto.tail()
