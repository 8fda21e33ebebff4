#!/usr/bin/env bash
# Install megatron-mm-balance and what its demo and tests need, idempotently.
# torch is pinned: on a machine without CUDA, 2.13.0 resolves to the CPU wheel; an
# unpinned 'torch' could pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${MM_BALANCE_TORCH_VERSION:-2.13.0}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==${TORCH_VERSION}"
fi
"$PY" -m pip install -q -e ".[test,sim]" "megatron-core==0.16.1" "megatron-energon==7.4.1" 2>&1 | grep -v -E "^(WARNING: Running pip as|\[notice\])" || true
"$PY" -c "import megatron_mm_balance, torch, numpy, megatron.core" 2>/dev/null || { echo "setup_env: install failed" >&2; exit 1; }
