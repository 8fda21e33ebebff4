#!/usr/bin/env bash
# Install megatron-mm-balance and what its demo, its tests and the real Megatron-LM path
# (examples/multimodal/train.py on energon data, core_v0.16.1) need, idempotently.
#
#   scripts/setup_env.sh                                  into python3's environment
#   PYTHON=venv/bin/python scripts/setup_env.sh           into a virtual environment
#   MM_BALANCE_TORCH_FROM=ENV PYTHON=venv/bin/python scripts/setup_env.sh
#                       hard-link the pinned torch pair's files from ENV (a venv or an
#                       interpreter's prefix that has exactly that pair, same filesystem)
#                       instead of installing 5.5 GB again (scripts/share_torch.py)
#   MEGATRON_LM_DIR=/path/to/Megatron-LM scripts/setup_env.sh
#                       also check that the checkout's training entry points import
#                       (scripts/check_training_imports.py: megatron.training.training,
#                       examples/multimodal's model, dataloader_provider and train)
#
# Pins, and why:
#   torch 2.14.1 + torchvision 0.29.1  examples/multimodal imports torchvision; a torchvision
#                                     must match its torch build (PyPI's torchvision does not
#                                     import beside the 2.13.0 CPU wheel). Both run on CPU.
#                                     MM_BALANCE_TORCH_VERSION / MM_BALANCE_TORCHVISION_VERSION
#                                     override them; an importable pair already installed is
#                                     kept, and every later install is constrained to it (no
#                                     requirement below may replace the torch installed here).
#   transformers 4.x                  Megatron's MultimodalTokenizer at core_v0.16.1 breaks on 5.x
#                                     ('tokenizers.Encoding' object has no attribute 'copy').
#   pybind11                          Megatron-LM compiles its dataset helpers at start-up.
#   pydantic 2.x                      megatron/training/training.py imports megatron.rl at
#                                     core_v0.16.1, which needs pydantic (BaseModel, ConfigDict).
#   tensorboard                       the launcher's --tensorboard-dir: without it Megatron
#                                     writes no TensorBoard logs and the mm-balance/* series
#                                     are lost (megatron/training/global_vars.py warns only).
#   megatron-core 0.16.1, megatron-energon 7.4.1
#   the [data] extra (Pillow, tokenizers) for mm-balance make-dataset.
set -euo pipefail
if [ -n "${MEGATRON_LM_DIR:-}" ]; then MEGATRON_LM_DIR=$(cd "$MEGATRON_LM_DIR" && pwd); fi
# The interpreter itself (a relative PYTHON=venv/bin/python, or a version-manager shim, is
# resolved where the command was given).
PY=$("${PYTHON:-python3}" -c "import sys; print(sys.executable)") || { echo "setup_env: cannot run ${PYTHON:-python3}" >&2; exit 1; }
cd "$(dirname "$0")/.."
TORCH_VERSION=${MM_BALANCE_TORCH_VERSION:-2.14.1}
TORCHVISION_VERSION=${MM_BALANCE_TORCHVISION_VERSION:-0.29.1}
quiet() { grep -v -E "^(WARNING: (Running pip as|Location 'file:)|\[notice\])" || true; }
if ! "$PY" -c "import torch, torchvision" >/dev/null 2>&1; then
  if [ -n "${MM_BALANCE_TORCH_FROM:-}" ] && [ "$MM_BALANCE_TORCH_FROM" != none ]; then
    PREFIX=$("$PY" -c "import sys; print(sys.prefix)")
    "$PY" scripts/share_torch.py "$MM_BALANCE_TORCH_FROM" "$PREFIX" \
      "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" || true
  fi
  "$PY" -m pip install -q "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" 2>&1 | quiet
fi
# Keep the torch pair that is there now: a bare `torch` requirement below must not pull
# another (multi-GB) build.
KEEP=$(mktemp)
trap 'rm -f "$KEEP"' EXIT
"$PY" -c "import importlib.metadata as m; print(f\"torch=={m.version('torch')}\"); print(f\"torchvision=={m.version('torchvision')}\")" > "$KEEP" \
  || { echo "setup_env: torch/torchvision installed but without package metadata" >&2; exit 1; }
"$PY" -m pip install -q -c "$KEEP" -e ".[test,sim,data]" "megatron-core==0.16.1" "megatron-energon==7.4.1" \
  "transformers>=4.40,<5" "pybind11>=2.12" "pydantic>=2,<3" "tensorboard>=2.14" 2>&1 | quiet
"$PY" -c "import megatron_mm_balance, torch, torchvision, numpy, megatron.core, megatron.energon, transformers, pybind11, pydantic, tensorboard, PIL, tokenizers" 2>/dev/null \
  || { echo "setup_env: install failed (torch, torchvision, megatron-core, megatron-energon, transformers, pybind11, pydantic, tensorboard, Pillow or tokenizers does not import)" >&2; exit 1; }
if [ -n "${MEGATRON_LM_DIR:-}" ]; then
  "$PY" scripts/check_training_imports.py "$MEGATRON_LM_DIR"
fi
