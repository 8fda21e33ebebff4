#!/usr/bin/env bash
# Multi-node --mm-balance pretraining under Slurm: one torchrun per node, each running
# scripts/pretrain_vlm_moe.sh with this node's rank.
#
#   MEGATRON_LM_DIR=/shared/Megatron-LM DATA_PATH=/shared/data/vlm.yaml \
#     sbatch --nodes 4 scripts/slurm_pretrain_vlm_moe.sh [--config configs/megatron/vlm_30b_moe.sh] [flags...]
#
# The node count must match the config's NNODES (4 for vlm_30b_moe.sh, 2 for vlm_2b_dense.sh)
# unless NPROC_PER_NODE/--nodes are chosen so the world stays a multiple of TP*PP*CP and
# GBS a multiple of MBS*DP (the launcher checks). Optional: CONTAINER_IMAGE (pyxis/enroot,
# mounted at the same paths via CONTAINER_MOUNTS), OUTPUT_DIR, MM_BALANCE=0 for a baseline.
#SBATCH --job-name=mm-balance-vlm
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
set -euo pipefail
HERE=${MM_BALANCE_HOME:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}}
[ -f "$HERE/scripts/pretrain_vlm_moe.sh" ] || {
  echo "slurm_pretrain_vlm_moe: set MM_BALANCE_HOME to the megatron-mm-balance checkout" >&2; exit 1; }
[ -n "${SLURM_JOB_NODELIST:-}" ] || { echo "slurm_pretrain_vlm_moe: run it with sbatch (or inside salloc)" >&2; exit 1; }

# Refuse an unsupported or unpatched Megatron-LM checkout here, before N nodes start.
if [ "${DRY_RUN:-0}" != 1 ]; then
  [ -n "${MEGATRON_LM_DIR:-}" ] || { echo "slurm_pretrain_vlm_moe: set MEGATRON_LM_DIR to a Megatron-LM checkout of a supported release ($(bash "$HERE/scripts/apply_patches.sh" --supported))" >&2; exit 1; }
  FORCE=(); [ "${FORCE_RELEASE:-0}" != 1 ] || FORCE=(--force)    # as scripts/pretrain_vlm_moe.sh
  state=$(bash "$HERE/scripts/apply_patches.sh" "$MEGATRON_LM_DIR" --check "${FORCE[@]}" 2>&1) || { echo "$state" >&2; exit 1; }
  if grep -q ": pending" <<<"$state"; then
    echo "slurm_pretrain_vlm_moe: patches are not applied to $MEGATRON_LM_DIR: run scripts/apply_patches.sh $MEGATRON_LM_DIR" >&2; exit 1
  fi
else
  MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-/path/to/Megatron-LM}   # printing only, as the launcher does
fi

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')  # awk reads all: no SIGPIPE under pipefail
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-29500} NNODES=$SLURM_JOB_NUM_NODES
export NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
export OUTPUT_DIR=${OUTPUT_DIR:-$HERE/runs/slurm-$SLURM_JOB_ID}
mkdir -p "$OUTPUT_DIR"

SRUN_ARGS=(--ntasks-per-node=1 --kill-on-bad-exit=1 --output "$OUTPUT_DIR/node-%n.log")
if [ -n "${CONTAINER_IMAGE:-}" ]; then
  SRUN_ARGS+=(--container-image "$CONTAINER_IMAGE"
              --container-mounts "${CONTAINER_MOUNTS:-$HERE:$HERE,$MEGATRON_LM_DIR:$MEGATRON_LM_DIR}")
fi
# NODE_RANK comes from each task's SLURM_NODEID; everything else is exported above. The
# ranks find their node from torchrun's GROUP_RANK (= NODE_RANK) at start-up: no
# --mm-balance-ranks-per-node needed (docs/notes/2026-12-02-several-nodes-megatron.md).
srun "${SRUN_ARGS[@]}" bash -c 'NODE_RANK=$SLURM_NODEID exec bash "$0/scripts/pretrain_vlm_moe.sh" "${@:1}"' "$HERE" "$@"
