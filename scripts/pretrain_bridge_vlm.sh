#!/usr/bin/env bash
# Launch Megatron-Bridge VLM pretraining (Qwen3-VL recipes) with image-token balancing on one
# node (torchrun). Balancing is Bridge's config field mm_balance.enabled (patched in by
# scripts/apply_patches.sh MEGATRON_BRIDGE_DIR); MM_BALANCE=1 sets it.
#
#   MEGATRON_BRIDGE_DIR=/path/to/Megatron-Bridge DATA_PATH=/data/qwen-vl-energon \
#     scripts/pretrain_bridge_vlm.sh [--config configs/bridge/qwen3_vl_moe_tiny_cpu.sh] [override=value...]
#
# Environment:
#   MEGATRON_BRIDGE_DIR  Megatron-Bridge v0.6.0 checkout with our patches applied; required
#   MEGATRON_LM_DIR      the Megatron-LM tree Bridge pins (its megatron/core); default
#                        MEGATRON_BRIDGE_DIR/3rdparty/Megatron-LM
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
#   DRY_RUN=1            print the command (one argument per line) and exit; without
#                        MEGATRON_BRIDGE_DIR it prints with a placeholder path
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
if [ "$DRY_RUN" = 1 ] && [ -z "${MEGATRON_BRIDGE_DIR:-}" ]; then
  MEGATRON_BRIDGE_DIR=/path/to/Megatron-Bridge          # printing only: no checkout needed
  MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-$MEGATRON_BRIDGE_DIR/3rdparty/Megatron-LM}
else
  [ -n "${MEGATRON_BRIDGE_DIR:-}" ] || die "set MEGATRON_BRIDGE_DIR to a Megatron-Bridge v0.6.0 checkout"
  [ -d "$MEGATRON_BRIDGE_DIR/src/megatron/bridge" ] || die "$MEGATRON_BRIDGE_DIR has no src/megatron/bridge"
  state=$(bash "$HERE/scripts/apply_patches.sh" "$MEGATRON_BRIDGE_DIR" --check 2>&1) || { echo "$state" >&2; exit 1; }
  if grep -q ": pending" <<<"$state"; then
    die "patches are not applied to $MEGATRON_BRIDGE_DIR: run scripts/apply_patches.sh $MEGATRON_BRIDGE_DIR"
  fi
  MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-$MEGATRON_BRIDGE_DIR/3rdparty/Megatron-LM}
  [ -f "$MEGATRON_LM_DIR/megatron/core/__init__.py" ] \
    || die "no megatron-core at $MEGATRON_LM_DIR (set MEGATRON_LM_DIR to the Megatron-LM tree Bridge pins)"
  "$PY" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" \
    || die "Megatron-Bridge v0.6.0 needs Python 3.12; $PY is $("$PY" -V 2>&1): set PYTHON (scripts/setup_env_bridge.sh builds one)"
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

ENTRY=(-m megatron_mm_balance.bridge.run)
EXTRA=()
if [ "${CPU_HARNESS:-off}" = auto ] && [ "$DRY_RUN" != 1 ] && \
   ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
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
export PYTHONPATH="$MEGATRON_LM_DIR:$MEGATRON_BRIDGE_DIR/src:$HERE${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUTPUT_DIR"
cd "$OUTPUT_DIR"
exec "${CMD[@]}"
