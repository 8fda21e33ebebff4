# ~2.3B dense VLM: Llama-3.2-style LM (28 x 2048) + CLIP ViT-L/14-336, 2 nodes x 8 GPUs, DP=16.
# Sourced by scripts/pretrain_vlm_moe.sh. See configs/megatron/README.md.
NNODES=2
GPUS_PER_NODE=8
TP=1
PP=1
EP=1
CP=1
MBS=1
GBS=256
SEQ_LEN=4096
TRAIN_ITERS=${TRAIN_ITERS:-20000}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-meta-llama/Llama-3.2-1B-Instruct}
PROMPT_FORMAT=llama3p1
MODEL_ARGS=(
  --language-model-type llama3.2_1b          # SiLU GLU, no biases, ffn 8192
  --num-layers 28 --hidden-size 2048 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --kv-channels 64
  --vision-model-type clip --img-h 336 --img-w 336 --patch-dim 14
  --disable-vision-class-token --use-tiling --max-num-tiles 6 --use-thumbnail --pixel-shuffle
  --normalization RMSNorm --position-embedding-type rope --rotary-base 500000
  --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
)
