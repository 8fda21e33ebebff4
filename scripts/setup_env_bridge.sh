#!/usr/bin/env bash
# Build (idempotently) the Python 3.12 environment of the Megatron-Bridge path
# (Megatron-Bridge v0.6.0 requires Python >=3.12,<3.13). Separate from scripts/setup_env.sh
# and scripts/setup_env_py312.sh; see docs/bridge.md.
#
#   scripts/setup_env_bridge.sh                         create or complete .venv-bridge/ at the repo root
#   MM_BALANCE_BRIDGE_VENV=DIR scripts/setup_env_bridge.sh   put it elsewhere
#   PYTHON312=/path/to/python3.12 scripts/setup_env_bridge.sh choose the interpreter
#
# Installs only what Bridge's Qwen3-VL pretraining path imports and runs, pinned: torch
# 2.13.0 (the registry's Python 3.12 build is the CUDA one, about 4.7 GB; it runs on the
# CPU), torchvision, transformers 5.12.1 (Bridge: >=5.8,<=5.12.1), hydra-core, omegaconf,
# rich, qwen-vl-utils, tensorboard, megatron-energon, einops, pyyaml, tokenizers. Not
# installed: Bridge itself and megatron-core (the checkouts go on PYTHONPATH:
# MEGATRON_BRIDGE_DIR/src and MEGATRON_LM_DIR, as scripts/pretrain_bridge_vlm.sh does), this
# package (PYTHONPATH=<repo>), and Bridge's GPU-side dependencies (transformer-engine,
# nvidia-modelopt, nvidia-resiliency-ext, flashinfer, datasets, ...): a GPU node brings those
# (e.g. the NGC PyTorch container); the CPU harness (megatron_mm_balance/testing/cpu_bridge.py)
# stands in for the ones Bridge imports at load. The pip cache makes a rebuild cheap.
# Prints the venv's python path on success.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MM_BALANCE_BRIDGE_VENV:-$PWD/.venv-bridge}
REQS=(
  "torch==2.13.0" "torchvision==0.28.0"
  "transformers==5.12.1" "tokenizers==0.22.2" "huggingface_hub==1.33.0"
  "hydra-core==1.3.2" "omegaconf==2.3.0" "rich==15.0.0" "qwen-vl-utils==0.0.14" "av==19.0.2"
  "tensorboard==2.21.0" "megatron-energon==7.4.1" "einops==0.8.2" "pyyaml==6.0.4"
  "packaging==26.4" "numpy==2.5.5" "pillow==13.0.0"
)
# Import names checked before installing (a complete venv installs nothing).
MODULES=(torch torchvision transformers tokenizers huggingface_hub hydra omegaconf rich qwen_vl_utils av
         tensorboard megatron.energon einops yaml packaging numpy PIL)

find_python312() {
  if [ -n "${PYTHON312:-}" ]; then echo "$PYTHON312"; return; fi
  if command -v pyenv >/dev/null && [ -x "$(pyenv root)/versions/3.12.1/bin/python" ]; then
    echo "$(pyenv root)/versions/3.12.1/bin/python"; return
  fi
  command -v python3.12 || true
}

PY=$VENV/bin/python
if [ ! -x "$PY" ]; then
  BASE=$(find_python312)
  [ -n "$BASE" ] && "$BASE" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
    || { echo "setup_env_bridge: no Python 3.12 found (set PYTHON312=/path/to/python3.12)" >&2; exit 1; }
  "$BASE" -m venv "$VENV"      # no system site-packages: only what is listed here
fi
# Presence check without importing (importing the CUDA build of torch takes seconds).
have() { "$PY" -c 'import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))' "$@"; }
if ! have "${MODULES[@]}"; then
  "$PY" -m pip install -q --disable-pip-version-check "${REQS[@]}" 2>&1 \
    | grep -v -E "^(WARNING: (Running pip as|Location .* is ignored)|\[notice\])" || true
  "$PY" -c "import torch, transformers, hydra, omegaconf, qwen_vl_utils, megatron.energon, tensorboard" \
    || { echo "setup_env_bridge: install into $VENV failed" >&2; exit 1; }
fi
echo "$PY"
