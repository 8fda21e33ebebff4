#!/usr/bin/env bash
# Launch patched Megatron-LM examples/multimodal pretraining with --mm-balance on one node
# (torchrun). scripts/slurm_pretrain_vlm_moe.sh calls it once per node for multi-node jobs.
#
#   MEGATRON_LM_DIR=/path/to/Megatron-LM DATA_PATH=/data/vlm.yaml \
#     scripts/pretrain_vlm_moe.sh [--config configs/megatron/vlm_30b_moe.sh] [extra Megatron flags...]
#
# Environment:
#   MEGATRON_LM_DIR  Megatron-LM checkout of a supported release (core_v0.16.1, core_v0.17.1,
#                    core_v0.18.2, core_v0.19.0, or a patch release of their lines; main of
#                    the 0.20 line; the 0.17 line and later need Python >= 3.12) with our patches applied
#                    (scripts/apply_patches.sh MEGATRON_LM_DIR); required
#   FORCE_RELEASE=1  accept a checkout of a newer line that apply_patches.sh --force patched
#   MM_BALANCE_OVERLAY=1
#                    leave MEGATRON_LM_DIR unpatched (read-only): the same hooks are applied
#                    at import, in each rank's memory (apply_patches.sh DIR --check --overlay)
#   DATA_PATH        energon dataset (directory or blend .yaml); required unless DRY_RUN=1
#   TOKENIZER_MODEL  HuggingFace tokenizer (name or local directory); default from the config
#   OUTPUT_DIR       checkpoints, dataloader state and TensorBoard (default
#                    ./runs/<config>-mm-balance, or ./runs/<config>-baseline with MM_BALANCE=0,
#                    so the two jobs never resume from each other's checkpoints)
#   MM_BALANCE       1 (default) adds --mm-balance; 0 runs the same job unbalanced
#   TRAIN_ITERS, TP, PP, EP, GBS, EVAL_ITERS, LOG_INTERVAL, PRECISION (bf16|fp16),
#   NUM_WORKERS, PACKING_BUFFER_SIZE
#                    override the config's values where the config reads them from the
#                    environment (configs/megatron/tiny_cpu.sh does)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE
#                    torchrun rendezvous (defaults: the config's NNODES, 0, 127.0.0.1, 29500,
#                    the config's GPUS_PER_NODE)
#   DRY_RUN=1        print the command (one argument per line) and exit; without
#                    MEGATRON_LM_DIR it prints with a placeholder path
# examples/multimodal needs transformer-engine (--transformer-impl transformer_engine --use-te):
# its no-TE specs cannot build the vision projector and CLIP's ln_pre, and local attention
# refuses packed sequences, so the launcher refuses to start without it. apex's fused kernels
# are used when importable. A config with CPU_HARNESS=auto (configs/megatron/tiny_cpu.sh) runs
# on a machine without CUDA through megatron_mm_balance.testing.cpu_pretrain (gloo, local
# implementations, the CPU stand-ins documented in docs/cpu.md); with CUDA it runs as above.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
CONFIG=$HERE/configs/megatron/vlm_30b_moe.sh
if [ "${1:-}" = "--config" ]; then
  [ $# -ge 2 ] || { echo "usage: $0 [--config FILE] [megatron flags...]" >&2; exit 2; }
  CONFIG=$2; shift 2
fi
[ -f "$CONFIG" ] || { echo "pretrain_vlm_moe: no such config $CONFIG" >&2; exit 2; }
ENV_NNODES=${NNODES:-}            # the job's node count (Slurm) wins over the config's
# shellcheck source=/dev/null
source "$CONFIG"
NNODES=${ENV_NNODES:-$NNODES}
NAME=$(basename "$CONFIG" .sh)
PY=${PYTHON:-python3}
# The interpreter itself, not a version-manager shim that may pick another Python after `cd`.
PY=$("$PY" -c "import sys; print(sys.executable)") || { echo "pretrain_vlm_moe: cannot run ${PYTHON:-python3}" >&2; exit 1; }
DRY_RUN=${DRY_RUN:-0}

die() { echo "pretrain_vlm_moe: $*" >&2; exit 1; }
if [ "$DRY_RUN" = 1 ] && [ -z "${MEGATRON_LM_DIR:-}" ]; then
  MEGATRON_LM_DIR=/path/to/Megatron-LM          # printing only: no checkout needed
else
  [ -n "${MEGATRON_LM_DIR:-}" ] || die "set MEGATRON_LM_DIR to a Megatron-LM checkout of a supported release ($(bash "$HERE/scripts/apply_patches.sh" --supported))"
  [ -f "$MEGATRON_LM_DIR/examples/multimodal/train.py" ] || die "$MEGATRON_LM_DIR has no examples/multimodal/train.py"
  # The checkout's release (apply_patches.sh detects it and refuses unsupported ones).
  # A patch release of a supported line is accepted as apply_patches.sh accepts it;
  # FORCE_RELEASE=1 accepts a newer line patched with apply_patches.sh --force.
  FORCE=(); [ "${FORCE_RELEASE:-0}" != 1 ] || FORCE=(--force)
  OVERLAY=(); [ "${MM_BALANCE_OVERLAY:-0}" != 1 ] || OVERLAY=(--overlay)
  state=$(PYTHON=$PY bash "$HERE/scripts/apply_patches.sh" "$MEGATRON_LM_DIR" --check "${FORCE[@]}" "${OVERLAY[@]}" 2>&1) \
    || { echo "$state" >&2; exit 1; }
  if [ ${#OVERLAY[@]} = 0 ] && grep -q ": pending" <<<"$state"; then
    die "patches are not applied to $MEGATRON_LM_DIR: run scripts/apply_patches.sh $MEGATRON_LM_DIR${FORCE:+ --force} (or MM_BALANCE_OVERLAY=1: the hooks at import, no file written)"
  fi
  RELEASE=$(sed -n '1s/^\(overlay: \)\{0,1\}Megatron-LM \(core_v[0-9A-Za-z.]*\) .*/\2/p' <<<"$state")
  # The 0.17 line and later use typing.override (Python >= 3.12) in megatron/training.
  if [ "${RELEASE%.*}" != core_v0.16 ] && ! "$PY" -c "import typing; typing.override" 2>/dev/null; then
    die "Megatron-LM $RELEASE needs Python >= 3.12 (typing.override); $PY is $("$PY" -V 2>&1): set PYTHON (scripts/setup_env_py312.sh builds one)"
  fi
fi
if [ "$DRY_RUN" != 1 ]; then
  [ -n "${DATA_PATH:-}" ] || die "set DATA_PATH to an energon dataset (directory or blend .yaml)"
fi
DATA_PATH=${DATA_PATH:-/path/to/energon/dataset}
if [ "${MM_BALANCE:-1}" = 1 ]; then
  OUTPUT_DIR=${OUTPUT_DIR:-$PWD/runs/$NAME-mm-balance}
else
  OUTPUT_DIR=${OUTPUT_DIR:-$PWD/runs/$NAME-baseline}
fi
EVAL_ITERS=${EVAL_ITERS:-10}
LOG_INTERVAL=${LOG_INTERVAL:-10}
# examples/multimodal/train.py reaches the model through Float16Module (model.module.module):
# it runs in bf16 or fp16 only.
case "${PRECISION:-bf16}" in
  bf16) PRECISION_ARGS=(--bf16) ;;
  fp16) PRECISION_ARGS=(--fp16) ;;
  *) die "PRECISION must be bf16 or fp16 (got $PRECISION; examples/multimodal/train.py needs one of them)" ;;
esac

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
# The CPU harness (configs that set CPU_HARNESS=auto, on a machine without CUDA).
ENTRY=(examples/multimodal/train.py)
# MM_BALANCE_OVERLAY=1: the script runs under the import-time overlay (the CPU harness installs
# it itself, from the same variable).
[ "${MM_BALANCE_OVERLAY:-0}" != 1 ] || ENTRY=(-m megatron_mm_balance.patching run examples/multimodal/train.py)
CPU_RUN=0
if [ "${CPU_HARNESS:-off}" = auto ] && [ "$DRY_RUN" != 1 ] && \
   ! cuda_visible; then
  CPU_RUN=1
  ENTRY=(-m megatron_mm_balance.testing.cpu_pretrain examples/multimodal/train.py)
fi

# transformer-engine (required on GPU) / apex when present: one interpreter start probes
# both (each imports torch), printing "HAS_TE HAS_APEX".
read -r HAS_TE HAS_APEX < <("$PY" - 2>/dev/null <<'PYEOF' || echo "0 0"
import importlib
def ok(name):
    try:
        importlib.import_module(name)
        return 1
    except Exception:
        return 0
print(ok("transformer_engine"), ok("apex"))
PYEOF
)
IMPL_ARGS=()
if [ "$CPU_RUN" = 1 ]; then
  IMPL_ARGS+=(--transformer-impl local "${CPU_ARGS[@]}")
  MODEL_ARGS=("${MODEL_ARGS[@]/--moe-grouped-gemm/}")      # TE's grouped GEMM only
elif [ "$HAS_TE" = 1 ] || [ "$DRY_RUN" = 1 ]; then
  IMPL_ARGS+=(--transformer-impl transformer_engine --use-te)
else
  die "transformer-engine is not importable by $PY: examples/multimodal needs it (vision projector and CLIP specs, packed-sequence attention); install it (pip install --no-build-isolation transformer_engine[pytorch]) or use the NGC PyTorch container"
fi
if [ "$HAS_APEX" != 1 ]; then
  IMPL_ARGS+=(--no-gradient-accumulation-fusion --no-masked-softmax-fusion)
fi

BALANCE_ARGS=()
if [ "${MM_BALANCE:-1}" = 1 ]; then
  BALANCE_ARGS=(--mm-balance --mm-balance-sync auto --mm-balance-log-interval "$LOG_INTERVAL")
fi

ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
  --expert-model-parallel-size "$EP" --context-parallel-size "$CP"
  "${MODEL_ARGS[@]}"
  "${IMPL_ARGS[@]}"
  --seq-length 576 --decoder-seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --packing-seq-length "$SEQ_LEN" --packing-buffer-size "${PACKING_BUFFER_SIZE:-256}"
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS"
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01
  --clip-grad 1.0 --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.014
  --attention-dropout 0.0 --hidden-dropout 0.0 "${PRECISION_ARGS[@]}" --attention-softmax-in-fp32
  --use-distributed-optimizer
  --tokenizer-type MultimodalTokenizer --tokenizer-model "$TOKENIZER_MODEL"
  --tokenizer-prompt-format "$PROMPT_FORMAT"
  # The example's own default, stated: from core_v0.18.2 Megatron's --tokenizer-special-tokens
  # shares its dest and shadows that default with None.
  --special-tokens "<image>"
  --dataloader-type external --data-path "$DATA_PATH" --num-workers "${NUM_WORKERS:-4}" --split 100,0,0
  --prompt-path "$MEGATRON_LM_DIR/examples/multimodal/manual_prompts.json"
  --save "$OUTPUT_DIR/checkpoints" --load "$OUTPUT_DIR/checkpoints" --save-interval 1000
  --dataloader-save "$OUTPUT_DIR/checkpoints/dataloader" --ckpt-format torch
  --tensorboard-dir "$OUTPUT_DIR/tensorboard" --log-interval "$LOG_INTERVAL"
  --eval-iters "$EVAL_ITERS" --eval-interval 1000 --distributed-timeout-minutes 60
  "${BALANCE_ARGS[@]}"
)
# Drop the empty words left by removing a flag above.
CLEAN=(); for a in "${ARGS[@]}"; do [ -n "$a" ] && CLEAN+=("$a"); done

CMD=("$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "${NODE_RANK:-0}" --nproc-per-node "$NPROC_PER_NODE"
     --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}"
     "${ENTRY[@]}" "${CLEAN[@]}" "$@")
if [ "$DRY_RUN" = 1 ]; then
  printf '%s\n' "${CMD[@]}"
  exit 0
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1 NVTE_APPLY_QK_LAYER_SCALING=0
export PYTHONPATH="$MEGATRON_LM_DIR:$MEGATRON_LM_DIR/examples/multimodal:$HERE${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUTPUT_DIR"
cd "$MEGATRON_LM_DIR"
exec "${CMD[@]}"
