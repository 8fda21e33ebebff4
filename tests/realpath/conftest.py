"""Fixtures of the real-path tests: a patched Megatron-LM, synthetic datasets, and a virtual
environment built from nothing by scripts/setup_env.sh (session)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import realpath_util as rp  # noqa: E402


@pytest.fixture(scope="session")
def megatron_lm() -> Path:
    tree = rp.megatron_lm_dir()
    if tree is None:
        pytest.skip(f"no Megatron-LM: set MEGATRON_LM_DIR or provide {rp.ARCHIVE}")
    return tree


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> dict:
    data = rp.make_dataset(tmp_path_factory.mktemp("vlm-data") / "data", samples=256, seed=0)
    return data


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def default_dataset(tmp_path_factory) -> dict:
    """``mm-balance make-dataset OUT`` with no options (512 samples, seed 1234)."""
    return rp.make_dataset(tmp_path_factory.mktemp("vlm-data-default") / "data", samples=None, seed=None)


@pytest.fixture(scope="session")
def heldout_dataset(tmp_path_factory) -> dict:
    """A held-out data set for the off/on/control band: ``make-dataset --samples 384 --seed 7``."""
    return rp.make_dataset(tmp_path_factory.mktemp("vlm-data-heldout") / "data", samples=384, seed=7)


@pytest.fixture(scope="session")
def fresh_venv(megatron_lm) -> rp.FreshVenv:
    """A virtual environment without the system's site-packages, set up by
    ``PYTHON=<venv>/bin/python MEGATRON_LM_DIR=<patched core_v0.16.1> scripts/setup_env.sh``
    (which also imports the checkout's training entry points). Reused when it exists
    (``MM_BALANCE_FRESH_VENV``, default ``.venv-fresh/`` at the repository root, gitignored;
    setup_env.sh then only checks it); created from nothing otherwise, once per CI run."""
    return rp.fresh_venv(megatron_lm)


@pytest.fixture(scope="session")
def runner(megatron_lm, dataset, runs_dir):
    """``runner(name, mm_balance, iters, extra=(), output=None, data=None, **layout)`` ->
    :class:`rp.Run`, cached. Every run records what each rank consumed
    (``--mm-balance-record-samples OUTPUT_DIR/samples``); ``data`` defaults to the session's
    256-sample dataset. Session-wide, so that test modules share runs (test_real_path.py's
    DP=2 x EP=2 balanced run is test_real_path_faults.py's uninterrupted reference)."""
    cache = {}

    def go(name, mm_balance, iters, extra=(), output=None, data=None, **layout):
        key = (name, mm_balance)
        if key not in cache:
            out = output or runs_dir / f"{name}-{'on' if mm_balance else 'off'}"
            env = rp.launcher_env(megatron_lm, data or dataset, mm_balance=mm_balance, output_dir=out,
                                  train_iters=iters, **layout)
            cache[key] = rp.run(env, [*extra, "--mm-balance-record-samples", str(out / "samples")],
                                log_path=runs_dir / f"{name}-{int(mm_balance)}.log", timeout=rp.RUN_TIMEOUT_S,
                                samples_dir=out / "samples")
        return cache[key]

    return go
