"""Shared test settings: hypothesis profile sized for a 2-core CI machine, the Python 3.12
interpreter fixture that the newer-release tests share, and a disk report (the suite builds
several multi-GB environments: when a machine runs out, the summary says how close it was)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parents[1]

settings.register_profile(
    "ci", max_examples=int(os.environ.get("MM_BALANCE_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def py312() -> str:
    """The Python 3.12 environment's interpreter (``scripts/setup_env_py312.sh``: reused when
    present, built the first time, about 5 GB and 3 minutes); skips with the reason if it
    cannot be built here."""
    try:
        r = subprocess.run(["bash", str(REPO / "scripts" / "setup_env_py312.sh")], capture_output=True,
                           text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        pytest.skip("scripts/setup_env_py312.sh did not finish in 30 minutes")
    if r.returncode != 0:
        pytest.skip(f"the Python 3.12 environment cannot be built here: {(r.stderr or r.stdout).strip()[-500:]}")
    return r.stdout.strip().splitlines()[-1]


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true", default=False,
                     help="also run the tests marked extended (the real-path variants that repeat a "
                          "capability CI already covers in another layout, data set or release)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``extended`` are skipped, with the way to run them, unless ``--extended``
    (or ``MM_BALANCE_EXTENDED=1``) is given: each repeats, in another layout, data set or
    release, a capability that another real-path test covers in CI, and together they would
    take the suite past its time budget on 2 cores.

    Tests marked ``matrix`` (the older supported lines' launcher paths where their patch is the
    newer line's: run before each release) are skipped unless the ``-m`` expression names the
    marker (``python -m pytest tests -m matrix``) or ``MM_BALANCE_MATRIX=1``."""
    matrix = "matrix" in (config.getoption("-m") or "") or os.environ.get("MM_BALANCE_MATRIX") == "1"
    if not matrix:
        skip_matrix = pytest.mark.skip(reason="matrix tier (before each release): python -m pytest tests -m matrix")
        for item in items:
            if item.get_closest_marker("matrix"):
                item.add_marker(skip_matrix)
    if config.getoption("--extended") or os.environ.get("MM_BALANCE_EXTENDED") == "1":
        return
    skip = pytest.mark.skip(reason="extended: bash scripts/test.sh --extended")
    for item in items:
        if item.get_closest_marker("extended"):
            item.add_marker(skip)


_lowest_free = {"bytes": None, "after": "start"}


def _note_free(where: str) -> None:
    free = shutil.disk_usage(REPO).free
    if _lowest_free["bytes"] is None or free < _lowest_free["bytes"]:
        _lowest_free.update(bytes=free, after=where)


def pytest_sessionstart(session):
    session.config._mm_balance_free_at_start = shutil.disk_usage(REPO).free
    _note_free("start")


def pytest_runtest_teardown(item, nextitem):
    _note_free(item.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    start = getattr(config, "_mm_balance_free_at_start", None)
    if start is None or _lowest_free["bytes"] is None:
        return
    gib = 2 ** 30
    terminalreporter.write_line(
        f"disk free at {REPO}: {start / gib:.1f} GiB at start, {shutil.disk_usage(REPO).free / gib:.1f} GiB "
        f"at end, lowest {_lowest_free['bytes'] / gib:.1f} GiB (after {_lowest_free['after']})")
