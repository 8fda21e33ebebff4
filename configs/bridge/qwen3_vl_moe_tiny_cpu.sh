# Toy Qwen3-VL MoE through Megatron-Bridge on 4 ranks, DP=4 x EP=2 (two expert-parallel groups of
# 2): trains on CPU (CI, laptops), smoke test on one GPU node. Sourced by
# scripts/pretrain_bridge_vlm.sh; the model, data and optimizer settings are the recipe function
# RECIPE (configs/bridge/qwen3_vl_moe_tiny_cpu.py).
# Layout and run length come from the environment when set (TP, PP, EP, CP, GBS, TRAIN_ITERS, ...).
NNODES=1
GPUS_PER_NODE=4
TP=${TP:-1}
PP=${PP:-1}
EP=${EP:-2}
CP=${CP:-1}
MBS=1
GBS=${GBS:-8}
TRAIN_ITERS=${TRAIN_ITERS:-20}
LOG_INTERVAL=${LOG_INTERVAL:-1}
NUM_WORKERS=${NUM_WORKERS:-1}
RECIPE=$HERE/configs/bridge/qwen3_vl_moe_tiny_cpu.py:config
STEP=qwen3_vl
# Hydra overrides of the recipe (Bridge's own syntax), after the launcher's paths and layout.
OVERRIDES=(dataset.num_workers="$NUM_WORKERS")
# PRECISION=bf16 (default, the recipe's bf16_mixed) or fp32 (no mixed precision).
case "${PRECISION:-bf16}" in
  bf16) ;;
  fp32) OVERRIDES+=(mixed_precision=null model.bf16=false model.params_dtype=torch.float32) ;;
  *) echo "qwen3_vl_moe_tiny_cpu: PRECISION must be bf16 or fp32 (got $PRECISION)" >&2; exit 2 ;;
esac
# Without CUDA the launcher runs the ranks through megatron_mm_balance.testing.cpu_bridge
# (gloo, CPU stand-ins for CUDA-only pieces; docs/bridge.md) with these overrides.
CPU_HARNESS=auto
CPU_OVERRIDES=(dist.distributed_backend=gloo)
