# Tiny VLM + MoE on 4 ranks, DP=4 x EP=2 (two expert-parallel groups of 2): trains on CPU (CI, laptops),
# smoke test on one GPU node.
# Sourced by scripts/pretrain_vlm_moe.sh. See configs/megatron/README.md.
# Layout and run length come from the environment when set (TP, PP, EP, GBS, TRAIN_ITERS, ...).
NNODES=1
GPUS_PER_NODE=4
TP=${TP:-1}
PP=${PP:-1}
EP=${EP:-2}
CP=1
MBS=1
GBS=${GBS:-8}
SEQ_LEN=1024
TRAIN_ITERS=${TRAIN_ITERS:-20}
EVAL_ITERS=${EVAL_ITERS:-0}
LOG_INTERVAL=${LOG_INTERVAL:-1}
NUM_WORKERS=${NUM_WORKERS:-1}
PACKING_BUFFER_SIZE=${PACKING_BUFFER_SIZE:-32}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
PROMPT_FORMAT=qwen2p5
MODEL_ARGS=(
  --language-model-type qwen2.5_7B          # activation/bias settings only; sizes below
  --num-layers 2 --hidden-size 128 --num-attention-heads 4
  --group-query-attention --num-query-groups 2
  --vision-model-type clip --img-h 56 --img-w 56 --patch-dim 14
  --use-tiling --max-num-tiles 4
  --disable-vision-class-token
  --normalization RMSNorm --position-embedding-type rope --rotary-base 1000000
  --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
)
# NUM_EXPERTS=0: a dense LM (megatron-core refuses MoE with TP > 1 without sequence parallelism).
if [ "${NUM_EXPERTS:-4}" -gt 0 ]; then
  MODEL_ARGS+=(--num-experts "${NUM_EXPERTS:-4}" --moe-router-topk 2 --moe-ffn-hidden-size 256
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall)   # packs differ in length: allgather needs equal counts
fi
# Without CUDA the launcher runs the ranks through megatron_mm_balance.testing.cpu_pretrain
# (gloo, CPU stand-ins for CUDA-only pieces, a 2-layer CLIP; docs/cpu.md) with these flags.
CPU_HARNESS=auto
CPU_ARGS=(--distributed-backend gloo --no-rope-fusion --no-persist-layer-norm
          --no-bias-swiglu-fusion --no-bias-dropout-fusion)
