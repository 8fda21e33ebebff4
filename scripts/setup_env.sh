#!/usr/bin/env bash
# Install megatron-mm-balance and what its demo, its tests and the real Megatron-LM path
# (examples/multimodal/train.py on energon data) need, idempotently.
#
# Pins, and why:
#   torch 2.14.1 + torchvision 0.29.1  examples/multimodal imports torchvision; a torchvision
#                                     must match its torch build (PyPI's torchvision does not
#                                     import beside the 2.13.0 CPU wheel). Both run on CPU.
#                                     MM_BALANCE_TORCH_VERSION / MM_BALANCE_TORCHVISION_VERSION
#                                     override them; an importable pair already installed is kept.
#   transformers 4.x                  Megatron's MultimodalTokenizer at core_v0.16.1 breaks on 5.x
#                                     ('tokenizers.Encoding' object has no attribute 'copy').
#   pybind11                          Megatron-LM compiles its dataset helpers at start-up.
#   megatron-core 0.16.1, megatron-energon 7.4.1
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${MM_BALANCE_TORCH_VERSION:-2.14.1}
TORCHVISION_VERSION=${MM_BALANCE_TORCHVISION_VERSION:-0.29.1}
quiet() { grep -v -E "^(WARNING: (Running pip as|Location 'file:)|\[notice\])" || true; }
if ! "$PY" -c "import torch, torchvision" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" 2>&1 | quiet
fi
"$PY" -m pip install -q -e ".[test,sim]" "megatron-core==0.16.1" "megatron-energon==7.4.1" \
  "transformers>=4.40,<5" "pybind11>=2.12" 2>&1 | quiet
"$PY" -c "import megatron_mm_balance, torch, torchvision, numpy, megatron.core, megatron.energon, transformers, pybind11" 2>/dev/null \
  || { echo "setup_env: install failed (torch, torchvision, megatron-core, megatron-energon, transformers or pybind11 does not import)" >&2; exit 1; }
