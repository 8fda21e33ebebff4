# ~30B-total / ~3B-active MoE VLM: 48-layer LM with 128 experts (top-8) + CLIP ViT-L/14-336.
# 4 nodes x 8 GPUs: TP=2, PP=2, EP=8, DP=8. The vision encoder lives on pipeline stage 0
# (examples/multimodal builds it where pre_process is true) with decoder layers 0-23.
# Sourced by scripts/pretrain_vlm_moe.sh. See configs/megatron/README.md.
NNODES=4
GPUS_PER_NODE=8
TP=2
PP=2
EP=8
CP=1
MBS=1
GBS=256
SEQ_LEN=4096
TRAIN_ITERS=${TRAIN_ITERS:-20000}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-Qwen/Qwen2.5-7B-Instruct}
PROMPT_FORMAT=qwen2p5
MODEL_ARGS=(
  --language-model-type qwen2.5_7B          # SiLU GLU, qkv bias; sizes below
  --num-layers 48 --hidden-size 2048 --num-attention-heads 32
  --group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
  --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
  --moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-router-dtype fp32
  --vision-model-type clip --img-h 336 --img-w 336 --patch-dim 14
  --disable-vision-class-token --use-tiling --max-num-tiles 6 --use-thumbnail --pixel-shuffle
  --normalization RMSNorm --position-embedding-type rope --rotary-base 1000000
  --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
)
