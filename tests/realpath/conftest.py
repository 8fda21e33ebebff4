"""Fixtures of the real-path tests: a patched Megatron-LM and a synthetic dataset (session)."""
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
