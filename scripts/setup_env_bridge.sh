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
# stands in for the ones Bridge imports at load. When .venv-py312/ already has the same torch
# pair, its files are hard-linked instead of installed again (scripts/py312_venv.sh:
# MM_BALANCE_TORCH_FROM); failing that, the Python-independent CUDA libraries of python3's
# environment (scripts/share_torch.py --cuda-libs: about 2 GB not written twice when it has a
# CUDA torch; MM_BALANCE_CUDA_LIBS_FROM); the pip cache makes a rebuild cheap.
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

source scripts/py312_venv.sh
PY=$VENV/bin/python
make_venv312 setup_env_bridge "$VENV"      # no system site-packages: only what is listed here
if ! have "${MODULES[@]}"; then
  have torch torchvision || share_torch "$VENV" "${REQS[0]}" "${REQS[1]}"
  pipq312 "${REQS[@]}"
  "$PY" -c "import torch, transformers, hydra, omegaconf, qwen_vl_utils, megatron.energon, tensorboard" \
    || { echo "setup_env_bridge: install into $VENV failed" >&2; exit 1; }
fi
echo "$PY"
