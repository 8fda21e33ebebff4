"""Fixtures of the Megatron-Bridge tests: the Bridge Python 3.12 environment, a patched
Bridge tree, a dataset in Bridge's Qwen-VL form (all session-scoped)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import bridge_util as bu  # noqa: E402


@pytest.fixture(scope="session")
def bridge_python() -> str:
    """The interpreter of ``scripts/setup_env_bridge.sh``'s environment: reused when complete,
    built the first time (from nothing on a fresh clone: about 2 minutes and 5 GB, less with a
    warm pip cache); skips with the reason if it cannot be built here."""
    try:
        r = subprocess.run(["bash", str(bu.REPO / "scripts" / "setup_env_bridge.sh")], capture_output=True,
                           text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        pytest.skip("scripts/setup_env_bridge.sh did not finish in 30 minutes")
    if r.returncode != 0:
        pytest.skip(f"the Bridge environment cannot be built here: {(r.stderr or r.stdout).strip()[-500:]}")
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def bridge_trees() -> dict:
    trees = bu.bridge_trees()
    if trees is None:
        pytest.skip(f"no Megatron-Bridge: set MEGATRON_BRIDGE_DIR or provide {bu.archive_dir() / bu.BRIDGE_ARCHIVE}")
    return trees


@pytest.fixture(scope="session")
def bridge_main_trees() -> dict:
    """Bridge main (0.7.0 dev) patched with its set, and the Megatron-LM it pins (2a75ac12)."""
    trees = bu.bridge_trees("main")
    if trees is None:
        pytest.skip(f"no {bu.archive_dir() / bu.BRIDGE_MAIN_ARCHIVE} or {bu.MLM_MAIN_ARCHIVE}")
    return trees


@pytest.fixture(scope="session")
def bridge_source(tmp_path_factory) -> Path:
    """The unmodified Megatron-Bridge v0.6.0 archive, unpacked once per session (never written)."""
    src = bu.unpack_bridge_source(tmp_path_factory.mktemp("bridge-source"))
    if src is None:
        pytest.skip(f"no {bu.archive_dir() / bu.BRIDGE_ARCHIVE}")
    return src


@pytest.fixture(scope="session")
def bridge_main_source(tmp_path_factory) -> Path:
    """The unmodified Megatron-Bridge main (0.7.0 dev) archive, unpacked once per session."""
    src = bu.unpack_bridge_source(tmp_path_factory.mktemp("bridge-main-source"), bu.BRIDGE_MAIN_ARCHIVE)
    if src is None:
        pytest.skip(f"no {bu.archive_dir() / bu.BRIDGE_MAIN_ARCHIVE}")
    return src


@pytest.fixture(scope="session")
def bridge_dataset(tmp_path_factory) -> dict:
    return bu.make_dataset(tmp_path_factory.mktemp("bridge-data") / "data", samples=128, seed=0)


@pytest.fixture(scope="session")
def bridge_heldout_dataset(tmp_path_factory) -> dict:
    """A held-out data set for the off/on/control band (192 samples, seed 7)."""
    return bu.make_dataset(tmp_path_factory.mktemp("bridge-data-heldout") / "data", samples=192, seed=7)


@pytest.fixture(scope="session")
def bridge_runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bridge-runs")
