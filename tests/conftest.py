"""Shared test settings: hypothesis profile sized for a 2-core CI machine, and the
Python 3.12 interpreter fixture that the newer-release tests share."""
import os
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
