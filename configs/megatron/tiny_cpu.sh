# Tiny VLM + MoE, DP=2 x EP=2 on 4 ranks: argument-path checks on CPU, GPU smoke test.
# Sourced by scripts/pretrain_vlm_moe.sh. See configs/megatron/README.md.
NNODES=1
GPUS_PER_NODE=4
TP=1
PP=1
EP=2
CP=1
MBS=1
GBS=16
SEQ_LEN=1024
TRAIN_ITERS=${TRAIN_ITERS:-20}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
PROMPT_FORMAT=qwen2p5
MODEL_ARGS=(
  --language-model-type qwen2.5_7B          # activation/bias settings only; sizes below
  --num-layers 2 --hidden-size 128 --num-attention-heads 4
  --group-query-attention --num-query-groups 2
  --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 256
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
  --moe-token-dispatcher-type allgather
  --vision-model-type clip --img-h 336 --img-w 336 --patch-dim 14
  --disable-vision-class-token --max-num-tiles 1
  --normalization RMSNorm --position-embedding-type rope --rotary-base 1000000
  --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
)
