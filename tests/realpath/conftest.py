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
