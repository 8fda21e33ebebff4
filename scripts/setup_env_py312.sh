#!/usr/bin/env bash
# Build (idempotently) the Python 3.12 environment used to test Megatron-LM releases
# core_v0.17.1 and later, which require Python >= 3.12 (megatron/training uses
# typing.override). It is separate from the main environment of scripts/setup_env.sh.
#
#   scripts/setup_env_py312.sh            create or complete .venv-py312/ at the repo root
#   MM_BALANCE_PY312_VENV=DIR scripts/setup_env_py312.sh     put it elsewhere
#   PYTHON312=/path/to/python3.12 scripts/setup_env_py312.sh  choose the interpreter
#
# megatron-mm-balance itself is not installed into it: tests run it from the source tree
# (PYTHONPATH=<repo>), and a Megatron-LM checkout supplies megatron/core (put it first
# on PYTHONPATH). torch 2.13.0 from the registry for Python 3.12 is a CUDA build (about
# 4.7 GB); it runs on the CPU. When .venv-bridge/ already has that torch pair, its files are
# hard-linked instead of installed again (scripts/py312_venv.sh: MM_BALANCE_TORCH_FROM); failing
# that, the Python-independent CUDA libraries of python3's environment (share_torch.py --cuda-libs).
# The venv never sees the system's site-packages (checked).
# pydantic (megatron.rl) and tensorboard (--tensorboard-dir) as in scripts/setup_env.sh;
# every install after torch is constrained to the torch pair installed, so no requirement
# replaces it.
#
#   MEGATRON_LM_DIR=/path/to/Megatron-LM scripts/setup_env_py312.sh
#       also check that the checkout's training entry points import in the venv
#       (scripts/check_training_imports.py, with the checkout and this repository on the path)
#
# Prints the venv's python path on success (last line).
set -euo pipefail
if [ -n "${MEGATRON_LM_DIR:-}" ]; then MEGATRON_LM_DIR=$(cd "$MEGATRON_LM_DIR" && pwd); fi
cd "$(dirname "$0")/.."
VENV=${MM_BALANCE_PY312_VENV:-$PWD/.venv-py312}
TORCH_VERSION=${MM_BALANCE_PY312_TORCH_VERSION:-2.13.0}
TORCHVISION_VERSION=${MM_BALANCE_PY312_TORCHVISION_VERSION:-0.28.0}

source scripts/py312_venv.sh
PY=$VENV/bin/python
make_venv312 setup_env_py312 "$VENV"
installed=0
if ! have torch torchvision; then
  share_torch "$VENV" "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}"
  pipq312 "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}"; installed=1
fi
REQS=("megatron-energon==7.4.1" "transformers>=4.40,<5" "pybind11" "numpy" "einops" "packaging"
      "pydantic>=2,<3" "tensorboard>=2.14"
      "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "pyyaml>=6")
if ! have megatron.energon transformers pybind11 numpy einops packaging pydantic tensorboard pytest pytest_timeout hypothesis yaml; then
  KEEP=$(mktemp)
  "$PY" -c "import importlib.metadata as m; print(f\"torch=={m.version('torch')}\"); print(f\"torchvision=={m.version('torchvision')}\")" > "$KEEP"
  pipq312 -c "$KEEP" "${REQS[@]}"; installed=1
  rm -f "$KEEP"
fi
if [ $installed = 1 ]; then
  "$PY" -c "import torch, torchvision, megatron.energon, transformers, pybind11, numpy, einops, pydantic, tensorboard, pytest" \
    || { echo "setup_env_py312: install into $VENV failed" >&2; exit 1; }
fi
if [ -n "${MEGATRON_LM_DIR:-}" ]; then
  "$PY" scripts/check_training_imports.py "$MEGATRON_LM_DIR"
fi
echo "$PY"
