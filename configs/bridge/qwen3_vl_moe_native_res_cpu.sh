# The native-resolution benchmark's toy Qwen3-VL MoE through Megatron-Bridge on CPU: world 2,
# DP=2 x EP=2 (the experts split across the two data-parallel ranks, which meet in every MoE
# layer of every micro-step), 8 micro-batches per rank per iteration (GBS 16, one sample per
# micro-batch). Sourced by scripts/pretrain_bridge_vlm.sh; the model, data and optimizer are
# RECIPE (configs/bridge/qwen3_vl_moe_native_res_cpu.py: the vision tower sized so that its
# share of the FLOPs matches Qwen3-VL-30B-A3B at 8K on the native-res mix). Data:
# mm-balance make-dataset OUT --format bridge-qwen-vl --mix native-res.
NNODES=1
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
TP=${TP:-1}
PP=${PP:-1}
EP=${EP:-2}
CP=${CP:-1}
MBS=1
GBS=${GBS:-16}
TRAIN_ITERS=${TRAIN_ITERS:-20}
LOG_INTERVAL=${LOG_INTERVAL:-1}
NUM_WORKERS=${NUM_WORKERS:-1}
RECIPE=$HERE/configs/bridge/qwen3_vl_moe_native_res_cpu.py:config
STEP=qwen3_vl
OVERRIDES=(dataset.num_workers="$NUM_WORKERS")
case "${PRECISION:-bf16}" in
  bf16) ;;
  fp32) OVERRIDES+=(mixed_precision=null model.bf16=false model.params_dtype=torch.float32) ;;
  *) echo "qwen3_vl_moe_native_res_cpu: PRECISION must be bf16 or fp32 (got $PRECISION)" >&2; exit 2 ;;
esac
CPU_HARNESS=auto
CPU_OVERRIDES=(dist.distributed_backend=gloo)
