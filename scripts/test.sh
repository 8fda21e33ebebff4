#!/usr/bin/env bash
# The whole test suite (what CI runs). See README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -m pytest tests -q "$@"
