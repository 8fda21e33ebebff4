"""The user's path on the newest supported release, core_v0.19.0, under Python 3.12.

The same launcher and config as test_real_path.py (``scripts/pretrain_vlm_moe.sh --config
configs/megatron/tiny_cpu.sh``, 4 CPU ranks over gloo through the CPU harness), against
``Megatron-LM-core_v0.19.0`` from the release archives, patched with
``patches/core_v0.19.0/``, run by the interpreter of ``scripts/setup_env_py312.sh``
(built here when missing; skipped with the reason only when it cannot be built):
DP=2 x EP=2 off vs on with equal per-iteration lm loss, and one resume. The environment is
checked too: it sees no system site-packages, and its setup script imports this release's
training entry points (``MEGATRON_LM_DIR=... scripts/setup_env_py312.sh``).
Slow: ``python -m pytest tests/realpath -m realpath``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

import realpath_util as rp

#: matrix: main (test_real_path_main.py) runs the same hooks through the launcher in CI; this
#: line's own (0008, the pre-main model.py) before each release
pytestmark = [pytest.mark.realpath, pytest.mark.matrix, pytest.mark.timeout(3600)]

TAG = "core_v0.19.0"
REL_TOL = 1e-5
ITERS = 6
RUN_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def tree() -> Path:
    return rp.release_tree_or_skip(TAG)


@pytest.fixture(scope="module")
def runner(py312, tree, dataset, runs_dir):
    return rp.cached_launcher_runs(tree, dataset, runs_dir, tag=TAG, iters=ITERS, python=py312,
                                   timeout=RUN_TIMEOUT_S)


def test_dp2_ep2_off_on_equal(runner):
    off, on = runner("off", False), runner("on", True)
    table = rp.loss_table({"off": off, "on": on})
    assert off.rc == 0, f"off: exit {off.rc}\n{off.tail()}"
    assert on.rc == 0, f"on: exit {on.rc}\n{on.tail()}"
    want = list(range(1, ITERS + 1))
    assert sorted(off.losses) == want and sorted(on.losses) == want, table
    diff = rp.max_rel_diff(on.losses, off.losses, want)
    print(f"\n{TAG} DP=2 x EP=2: max relative lm-loss difference {diff:.2e}; packs moved "
          f"{[on.moved[i] for i in sorted(on.moved)]}; wall off {off.wall_s:.0f}s on {on.wall_s:.0f}s\n{table}")
    assert diff <= REL_TOL, f"lm loss off vs on differs by {diff:.2e} > {REL_TOL}\n{table}"
    assert not off.moved and sum(on.moved.values()) > 0, on.tail()


def test_resume_equals_uninterrupted(runner, runs_dir):
    full = runner("on", True)
    out = runs_dir / f"{TAG}-resume"
    first = runner("resume-first", True, extra=["--exit-interval", "3"], output=out)
    second = runner("resume-second", True, output=out)
    rp.check_resume(full, first, second, f"{TAG} resume (DP=2 x EP=2, --mm-balance)", REL_TOL)


def test_py312_environment_is_isolated_and_imports_the_training_path(py312, tree):
    venv = Path(py312).parent.parent
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    probe = ("import json, site, sys, sysconfig; print(json.dumps({'prefix': sys.prefix, "
             "'base': sys.base_prefix, 'path': sys.path, 'user_site': site.ENABLE_USER_SITE, "
             "'base_site': sysconfig.get_paths(vars={'base': sys.base_prefix, "
             "'platbase': sys.base_prefix})['purelib']}))")
    info = json.loads(subprocess.run([py312, "-c", probe], capture_output=True, text=True, check=True,
                                     timeout=60, env={"PATH": "/usr/bin:/bin"}).stdout)
    assert info["prefix"] != info["base"] and not info["user_site"]
    assert not [p for p in info["path"] if p.startswith(info["base_site"])], info["path"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(MEGATRON_LM_DIR=str(tree), MM_BALANCE_PY312_VENV=str(venv))
    r = subprocess.run(["bash", str(rp.REPO / "scripts" / "setup_env_py312.sh")], capture_output=True,
                       text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    # (megatron.core's version: 0.19.1, plus a git hash when the tree sits in a git checkout)
    assert re.search(rf"training entry points import: Megatron-LM 0\.19\.1\S* at {re.escape(str(tree))} ",
                     r.stdout), r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == py312
