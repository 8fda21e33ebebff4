"""The user's path in an environment the project's own setup built from nothing.

``python -m venv`` (no system site-packages) + ``PYTHON=<venv>/bin/python MEGATRON_LM_DIR=...
bash scripts/setup_env.sh``, then ``mm-balance make-dataset`` (its defaults) and one short
off/on pair of ``scripts/pretrain_vlm_moe.sh --config configs/megatron/tiny_cpu.sh`` on
core_v0.16.1, all run by the venv's interpreter: a package the training path imports but
the setup does not install (pydantic, for megatron.rl, was one) fails here, whatever the
machine's own Python has. Only the torch pair's files are hard-linked from the test run's
own environment when it has exactly that pair (scripts/share_torch.py; 5.5 GB not written
twice); every other package is installed from nothing. The venv is reused across sessions when it exists (see the
``fresh_venv`` fixture); CI builds it once per run.
Slow: ``python -m pytest tests/realpath -m realpath``.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

import realpath_util as rp

pytestmark = [pytest.mark.realpath, pytest.mark.timeout(3600)]

REL_TOL = 1e-5
ITERS = 3


def test_venv_sees_no_system_site_packages(fresh_venv):
    cfg = (Path(fresh_venv.python).parent.parent / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    probe = ("import json, site, sys, sysconfig; print(json.dumps({'prefix': sys.prefix, "
             "'base': sys.base_prefix, 'path': sys.path, 'user_site': site.ENABLE_USER_SITE, "
             "'base_site': sysconfig.get_paths(vars={'base': sys.base_prefix, "
             "'platbase': sys.base_prefix})['purelib']}))")
    info = json.loads(subprocess.run([fresh_venv.python, "-c", probe], capture_output=True, text=True,
                                     check=True, timeout=60, env={"PATH": "/usr/bin:/bin"}).stdout)
    assert info["prefix"] != info["base"] and not info["user_site"]
    assert not [p for p in info["path"] if p.startswith(info["base_site"])], info["path"]
    print(f"\nfresh venv {Path(fresh_venv.python).parent.parent}: "
          f"{'built' if fresh_venv.built else 'reused'}, setup {fresh_venv.setup_s:.0f} s")


def test_setup_checked_the_training_entry_points(fresh_venv, megatron_lm):
    assert re.search(rf"training entry points import: Megatron-LM 0\.16\.1\S* at {re.escape(str(megatron_lm))} ",
                     fresh_venv.setup_log), fresh_venv.setup_log[-3000:]


def test_off_on_in_the_fresh_venv(fresh_venv, megatron_lm, tmp_path_factory):
    out = tmp_path_factory.mktemp("fresh-env")
    data = rp.make_dataset(out / "data", samples=None, seed=None, python=fresh_venv.python)
    runs = {}
    for on in (False, True):
        env = rp.launcher_env(megatron_lm, data, mm_balance=on, output_dir=out / f"run-{int(on)}",
                              train_iters=ITERS, python=fresh_venv.python)
        env["PYTHONPATH"] = str(rp.REPO)          # nothing from the outer environment
        runs[on] = rp.run(env, log_path=out / f"run-{int(on)}.log", timeout=900)
    off, on = runs[False], runs[True]
    table = rp.loss_table({"off": off, "on": on})
    print(f"\nfresh venv, core_v0.16.1 DP=2 x EP=2, make-dataset defaults: wall off {off.wall_s:.0f} s, "
          f"on {on.wall_s:.0f} s; packs moved {on.moved}\n{table}")
    assert off.rc == 0, off.tail()
    assert on.rc == 0, on.tail()
    want = list(range(1, ITERS + 1))
    assert sorted(off.losses) == want and sorted(on.losses) == want, table
    assert rp.max_rel_diff(on.losses, off.losses, want) <= REL_TOL, table
    assert not off.moved and sum(on.moved.values()) > 0, on.tail()
    # tensorboard is installed: Megatron's writer and our own series (the reporting rank
    # holds no Megatron writer here, so it writes its own events file).
    for run in (off, on):
        assert "TensorBoard writing requested but is not available" not in run.log
    events = list((out / "run-1" / "tensorboard").glob("events.out.tfevents.*.mm_balance"))
    assert events, "no mm-balance TensorBoard events written"
