#!/usr/bin/env bash
# The whole test suite (what CI runs). See README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The suite builds three more environments (Python 3.12 for core_v0.19.0 and for
# Megatron-Bridge, a venv from nothing); a pip cache would keep a second copy of torch's
# multi-GB wheels on disk for nothing.
export PIP_NO_CACHE_DIR=${PIP_NO_CACHE_DIR:-1}
# --durations=10: the ten slowest tests at the end, so a test that grows shows (a later
# --durations=N on the command line wins).
exec "${PYTHON:-python3}" -m pytest tests -q --durations=10 "$@"
