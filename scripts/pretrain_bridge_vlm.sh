#!/usr/bin/env bash
# Launch Megatron-Bridge VLM pretraining (Qwen3-VL recipes) with image-token balancing on one
# node (torchrun). Balancing is Bridge's config field mm_balance.enabled (patched in by
# scripts/apply_patches.sh MEGATRON_BRIDGE_DIR, or --installed); MM_BALANCE=1 sets it.
#
#   [MEGATRON_BRIDGE_DIR=/path/to/Megatron-Bridge] DATA_PATH=/data/qwen-vl-energon \
#     scripts/pretrain_bridge_vlm.sh [--config configs/bridge/qwen3_vl_moe_tiny_cpu.sh] [override=value...]
#
# Environment:
#   MEGATRON_BRIDGE_DIR  a Megatron-Bridge checkout (0.6.x, or main of the 0.7 line), or a directory holding an installed
#                        Megatron-Bridge (site-packages/megatron/bridge/), with our patches
#                        applied; default: the megatron.bridge that PYTHON imports (pip, or a
#                        container's Bridge), patched with scripts/apply_patches.sh --installed
#   MEGATRON_LM_DIR      the Megatron-LM tree Bridge pins (its megatron/core); default
#                        MEGATRON_BRIDGE_DIR/3rdparty/Megatron-LM for a checkout that has it,
#                        else the megatron.core that PYTHON imports
#   FORCE_RELEASE=1      accept a Bridge of a newer line that apply_patches.sh --force patched
#   MM_BALANCE_OVERLAY=1 leave Bridge unpatched (read-only): the same hooks are applied at import,
#                        in each rank's memory (apply_patches.sh DIR --check --overlay)
#   DATA_PATH            energon ChatML dataset directory (mm-balance make-dataset --format
#                        bridge-qwen-vl writes one); required unless DRY_RUN=1
#   PROCESSOR            Hugging Face Qwen-VL processor directory or name (default DATA_PATH/processor)
#   OUTPUT_DIR           checkpoints and TensorBoard (default ./runs/<config>-mm-balance, or
#                        ./runs/<config>-baseline with MM_BALANCE=0)
#   MM_BALANCE           1 (default): mm_balance.enabled=true; 0: the same job unbalanced
#   TRAIN_ITERS, TP, PP, EP, GBS, LOG_INTERVAL, NUM_WORKERS
#                        override the config's values where the config reads them from the
#                        environment (configs/bridge/qwen3_vl_moe_tiny_cpu.sh does)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE
#                        torchrun rendezvous (defaults: the config's NNODES, 0, 127.0.0.1, 29500,
#                        the config's GPUS_PER_NODE)
#   PYTHON               the interpreter (scripts/setup_env_bridge.sh builds a Python 3.12 one)
#   DRY_RUN=1            print the command (one argument per line) and exit, after the same
#                        checks of Bridge; with no Bridge at all it prints with a placeholder path
# Extra arguments are more Hydra overrides (mm_balance.mode=shadow, train.exit_interval=3, ...).
# A config with CPU_HARNESS=auto runs on a machine without CUDA through
# megatron_mm_balance.testing.cpu_bridge (gloo, the CPU stand-ins listed in docs/bridge.md).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
CONFIG=$HERE/configs/bridge/qwen3_vl_moe_tiny_cpu.sh
if [ "${1:-}" = "--config" ]; then
  [ $# -ge 2 ] || { echo "usage: $0 [--config FILE] [override=value...]" >&2; exit 2; }
  CONFIG=$2; shift 2
fi
[ -f "$CONFIG" ] || { echo "pretrain_bridge_vlm: no such config $CONFIG" >&2; exit 2; }
ENV_NNODES=${NNODES:-}
# shellcheck source=/dev/null
source "$CONFIG"
NNODES=${ENV_NNODES:-$NNODES}
NAME=$(basename "$CONFIG" .sh)
PY=${PYTHON:-python3}
PY=$("$PY" -c "import sys; print(sys.executable)") || { echo "pretrain_bridge_vlm: cannot run ${PYTHON:-python3}" >&2; exit 1; }
DRY_RUN=${DRY_RUN:-0}

die() { echo "pretrain_bridge_vlm: $*" >&2; exit 1; }
# Where "$PY" imports a package from (its directory; empty when it cannot), without running
# the package's __init__; $2: extra PYTHONPATH entries in front.
import_dir() {
  PYTHONPATH="${2:+$2${PYTHONPATH:+:}}${PYTHONPATH:-}" "$PY" -c '
import importlib.util, sys
try:
    spec = importlib.util.find_spec(sys.argv[1])
except ImportError:
    spec = None
print(list(spec.submodule_search_locations)[0] if spec and spec.submodule_search_locations else "")' "$1" 2>/dev/null || true
}
# Megatron-Bridge: MEGATRON_BRIDGE_DIR (a checkout, or a directory with an installed package:
# site-packages/megatron/bridge/), else the megatron.bridge that $PY imports (pip, a container's
# /opt/...). BRIDGE_PATH: what goes on PYTHONPATH for it (nothing when $PY imports it anyway).
BRIDGE_PATH=""
if [ -z "${MEGATRON_BRIDGE_DIR:-}" ] && found=$(import_dir megatron.bridge) && [ -n "$found" ]; then
  MEGATRON_BRIDGE_DIR=$found
  echo "pretrain_bridge_vlm: Megatron-Bridge as $PY imports it: $found" >&2
elif [ -n "${MEGATRON_BRIDGE_DIR:-}" ]; then
  if [ -d "$MEGATRON_BRIDGE_DIR/src/megatron/bridge" ]; then BRIDGE_PATH=$MEGATRON_BRIDGE_DIR/src
  elif [ -d "$MEGATRON_BRIDGE_DIR/megatron/bridge" ]; then BRIDGE_PATH=$MEGATRON_BRIDGE_DIR
  else die "$MEGATRON_BRIDGE_DIR has no src/megatron/bridge (a checkout) nor megatron/bridge (an installed package)"; fi
fi
if [ "$DRY_RUN" = 1 ] && [ -z "${MEGATRON_BRIDGE_DIR:-}" ]; then
  MEGATRON_BRIDGE_DIR=/path/to/Megatron-Bridge          # printing only: no checkout needed
  MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-$MEGATRON_BRIDGE_DIR/3rdparty/Megatron-LM}
else
  [ -n "${MEGATRON_BRIDGE_DIR:-}" ] \
    || die "no Megatron-Bridge: $PY cannot import megatron.bridge; pip install megatron-bridge (0.6.x) into its environment, set PYTHON to the python that has it, or set MEGATRON_BRIDGE_DIR to a checkout"
  FORCE=(); [ "${FORCE_RELEASE:-0}" != 1 ] || FORCE=(--force)
  OVERLAY=(); [ "${MM_BALANCE_OVERLAY:-0}" != 1 ] || OVERLAY=(--overlay)
  state=$(PYTHON=$PY bash "$HERE/scripts/apply_patches.sh" "$MEGATRON_BRIDGE_DIR" --check "${FORCE[@]}" "${OVERLAY[@]}" 2>&1) \
    || { echo "$state" >&2; exit 1; }
  if [ ${#OVERLAY[@]} = 0 ] && grep -q ": pending" <<<"$state"; then
    if [ -n "$BRIDGE_PATH" ]; then
      die "patches are not applied to $MEGATRON_BRIDGE_DIR: run scripts/apply_patches.sh $MEGATRON_BRIDGE_DIR${FORCE:+ --force} (or MM_BALANCE_OVERLAY=1: the hooks at import, no file written)"
    fi
    die "patches are not applied to the installed Megatron-Bridge ($MEGATRON_BRIDGE_DIR): run scripts/apply_patches.sh --installed --python $PY${FORCE:+ --force}"
  fi
  head -1 <<<"$state" >&2
  ROOT=$MEGATRON_BRIDGE_DIR
  [ -n "$BRIDGE_PATH" ] || ROOT=$(dirname "$(dirname "$MEGATRON_BRIDGE_DIR")")
  [ "$(basename "$ROOT")" != src ] || ROOT=$(dirname "$ROOT")
  # megatron-core: MEGATRON_LM_DIR, else the checkout's 3rdparty/Megatron-LM, else the one $PY imports
  if [ -z "${MEGATRON_LM_DIR:-}" ] && [ -f "$ROOT/3rdparty/Megatron-LM/megatron/core/__init__.py" ]; then
    MEGATRON_LM_DIR=$ROOT/3rdparty/Megatron-LM
  fi
  if [ -n "${MEGATRON_LM_DIR:-}" ]; then
    [ -f "$MEGATRON_LM_DIR/megatron/core/__init__.py" ] \
      || die "no megatron-core at $MEGATRON_LM_DIR (set MEGATRON_LM_DIR to the Megatron-LM tree Bridge pins)"
  elif [ -z "$(import_dir megatron.core "$BRIDGE_PATH")" ]; then
    die "no megatron-core: $PY cannot import megatron.core; pip install the megatron-core Megatron-Bridge requires, or set MEGATRON_LM_DIR to the Megatron-LM tree Bridge pins"
  fi
  # the megatron.bridge that will run (PYTHONPATH as exported below) is the one just checked
  want=$(import_dir megatron.bridge "${MEGATRON_LM_DIR:+$MEGATRON_LM_DIR${BRIDGE_PATH:+:}}$BRIDGE_PATH")
  checked=$ROOT/src/megatron/bridge
  [ -d "$checked" ] || checked=$ROOT/megatron/bridge
  [ "$(cd "${want:-/nonexistent}" 2>/dev/null && pwd -P)" = "$(cd "$checked" && pwd -P)" ] \
    || die "$PY would import megatron.bridge from ${want:-nowhere}, not from the patched $checked: set MEGATRON_BRIDGE_DIR to the one it imports, or remove the other from its PYTHONPATH"
  "$PY" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" \
    || die "Megatron-Bridge needs Python 3.12; $PY is $("$PY" -V 2>&1): set PYTHON (scripts/setup_env_bridge.sh builds one)"
fi
if [ "$DRY_RUN" != 1 ]; then
  [ -n "${DATA_PATH:-}" ] || die "set DATA_PATH to an energon ChatML dataset (mm-balance make-dataset --format bridge-qwen-vl)"
fi
DATA_PATH=${DATA_PATH:-/path/to/energon/dataset}
PROCESSOR=${PROCESSOR:-$DATA_PATH/processor}
if [ "${MM_BALANCE:-1}" = 1 ]; then
  OUTPUT_DIR=${OUTPUT_DIR:-$PWD/runs/$NAME-mm-balance}
  BALANCE=true
else
  OUTPUT_DIR=${OUTPUT_DIR:-$PWD/runs/$NAME-baseline}
  BALANCE=false
fi

NPROC_PER_NODE=${NPROC_PER_NODE:-$GPUS_PER_NODE}
WORLD=$(( NNODES * NPROC_PER_NODE ))
(( WORLD % (TP * PP * CP) == 0 )) || die "world size $WORLD is not a multiple of TP*PP*CP = $((TP * PP * CP))"
DP=$(( WORLD / (TP * PP * CP) ))
(( GBS % (MBS * DP) == 0 )) || die "GBS=$GBS is not a multiple of MBS*DP = $((MBS * DP))"

# Whether torch sees a CUDA (or ROCm) device here. It sees none without a GPU device node
# (/dev/nvidia*, Jetson's /dev/nvhost*, WSL's /dev/dxg, ROCm's /dev/kfd): then the answer needs
# no interpreter start (importing torch takes seconds, for every launch on a CPU machine).
cuda_visible() {
  compgen -G "/dev/nvidia*" >/dev/null || compgen -G "/dev/nvhost*" >/dev/null || [ -e /dev/dxg ] \
    || [ -e /dev/kfd ] || return 1
  "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1
}
ENTRY=(-m megatron_mm_balance.bridge.run)
EXTRA=()
if [ "${CPU_HARNESS:-off}" = auto ] && [ "$DRY_RUN" != 1 ] && \
   ! cuda_visible; then
  ENTRY=(-m megatron_mm_balance.testing.cpu_bridge "${ENTRY[@]}")
  EXTRA=("${CPU_OVERRIDES[@]}")
fi

ARGS=(
  --recipe "$RECIPE" --step "$STEP"
  model.tensor_model_parallel_size="$TP" model.pipeline_model_parallel_size="$PP"
  model.expert_model_parallel_size="$EP" model.context_parallel_size="$CP"
  train.micro_batch_size="$MBS" dataset.micro_batch_size="$MBS" train.global_batch_size="$GBS"
  train.train_iters="$TRAIN_ITERS" logger.log_interval="$LOG_INTERVAL"
  dataset.path="$DATA_PATH" dataset.task_encoder.hf_processor_path="$PROCESSOR"
  tokenizer.tokenizer_model="$PROCESSOR"
  checkpoint.save="$OUTPUT_DIR/checkpoints" checkpoint.load="$OUTPUT_DIR/checkpoints"
  logger.tensorboard_dir="$OUTPUT_DIR/tensorboard"
  mm_balance.enabled="$BALANCE" mm_balance.log_interval="$LOG_INTERVAL"
  "${OVERRIDES[@]}" "${EXTRA[@]}"
)
CMD=("$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "${NODE_RANK:-0}" --nproc-per-node "$NPROC_PER_NODE"
     --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}"
     "${ENTRY[@]}" "${ARGS[@]}" "$@")
if [ "$DRY_RUN" = 1 ]; then
  printf '%s\n' "${CMD[@]}"
  exit 0
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1 NVTE_APPLY_QK_LAYER_SCALING=0
export PYTHONPATH="${MEGATRON_LM_DIR:+$MEGATRON_LM_DIR:}${BRIDGE_PATH:+$BRIDGE_PATH:}$HERE${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUTPUT_DIR"
cd "$OUTPUT_DIR"
exec "${CMD[@]}"
