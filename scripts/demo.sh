#!/usr/bin/env bash
# The main job on the embedded default. See README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -m megatron_mm_balance.cli demo "$@"
