# Vision-heavy VLM + MoE on 2 CPU ranks: the real-speed benchmark's job (mm-balance bench-realpath).
# Sourced by scripts/pretrain_vlm_moe.sh; docs/results.md. Data: mm-balance make-dataset OUT --mix
# vision-heavy (1-12 tiles per image, multi-image documents, ~30% text-only samples).
#
# World size 2, one rank per core (OMP_NUM_THREADS=1), DP=2 x EP=2 MoE with the alltoall dispatcher:
# the two ranks meet in every MoE layer of every micro-step, so the rank with the image-heavier pack
# makes the other wait, as expert parallelism does on a cluster. GA = GBS / DP = 16 micro-batches.
# The CLIP encoder is sized (MM_BALANCE_CPU_VIT, read by megatron_mm_balance.testing.cpu_pretrain)
# so that at the mean pack the vision encoder is at least half of a micro-batch's compute (measured
# with --mm-balance-timing, docs/notes/2026-12-01-megatron-lm-speed-off-on.md). With CUDA the launcher runs the example's own
# ViT-L/14 (the harness is CPU-only), so the sizes below are a CPU concern.
NNODES=1
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
TP=${TP:-1}
PP=${PP:-1}
EP=${EP:-2}
CP=1
MBS=1
GBS=${GBS:-32}
SEQ_LEN=${SEQ_LEN:-1024}
TRAIN_ITERS=${TRAIN_ITERS:-12}
EVAL_ITERS=${EVAL_ITERS:-0}
LOG_INTERVAL=${LOG_INTERVAL:-1}
NUM_WORKERS=${NUM_WORKERS:-1}
PACKING_BUFFER_SIZE=${PACKING_BUFFER_SIZE:-32}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
PROMPT_FORMAT=qwen2p5
# The CPU vision encoder: LAYERS,HIDDEN,HEADS,FFN (CLIP's architecture; the harness's default is
# 2 layers of 64).
export MM_BALANCE_CPU_VIT=${MM_BALANCE_CPU_VIT:-8,512,8,2048}
# One intra-op thread per rank: two ranks, two cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
MODEL_ARGS=(
  --language-model-type qwen2.5_7B          # activation/bias settings only; sizes below
  --num-layers 2 --hidden-size 128 --num-attention-heads 4
  --group-query-attention --num-query-groups 2
  --vision-model-type clip --img-h 56 --img-w 56 --patch-dim 14
  --use-tiling --max-num-tiles 12
  --disable-vision-class-token
  --normalization RMSNorm --position-embedding-type rope --rotary-base 1000000
  --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
  --num-experts "${NUM_EXPERTS:-4}" --moe-router-topk 2 --moe-ffn-hidden-size 256
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --moe-token-dispatcher-type alltoall    # ranks meet in every MoE layer; packs differ in length
)
CPU_HARNESS=auto
CPU_ARGS=(--distributed-backend gloo --no-rope-fusion --no-persist-layer-norm
          --no-bias-swiglu-fusion --no-bias-dropout-fusion)
