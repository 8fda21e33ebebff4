"""A toy Qwen3-VL MoE recipe for Megatron-Bridge: trains on CPU (CI, laptops) and on one GPU node.

``config()`` returns a Bridge ``ConfigContainer`` built the way Bridge's Qwen3-VL recipes
build theirs (``recipes/common._pretrain_common`` + ``Qwen3VLMoEModelProvider`` + the
Qwen-VL energon dataset), only small: a 2-layer MoE language model (hidden 128, 4
experts, top-2, aux-loss router) and a 2-layer Qwen3-VL vision tower (hidden 64, patch
16, 2 x 2 merge, one deepstack layer), from scratch (no Hugging Face weights). Paths,
layout and run length come as Hydra overrides from ``scripts/pretrain_bridge_vlm.sh``
(``dataset.path=... model.expert_model_parallel_size=... mm_balance.enabled=true``).

The special-token ids are those ``mm-balance make-dataset --format bridge-qwen-vl``
gives its processor (special tokens first, in ``SPECIAL_TOKENS`` order).
On CPU the fused kernels Bridge's providers ask for by default (rope fusion,
persistent layer norm, bias-activation / bias-dropout fusion, MoE permute fusion,
gradient-accumulation fusion, grouped GEMM) are off; they are not needed for the
maths. The MoE dispatcher is ``allgather``: Bridge's Qwen3-VL step pads every
micro-batch to ``seq_length`` under expert parallelism, so token counts match.
"""
from __future__ import annotations

import os

import torch

from megatron_mm_balance.bridge.dataset import MAX_PIXELS, MIN_PIXELS, PATCH, SPECIAL_TOKENS

SEQ_LENGTH = 1024
#: The language model's shapes (``Qwen3VLMoEModelProvider`` fields; ``head_dim`` is ``kv_channels``).
LANGUAGE = dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                num_query_groups=2, kv_channels=32, num_moe_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=128)
#: ``Qwen3VLVisionConfig`` fields of the tower (``out_hidden_size``: the language model's hidden).
VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=PATCH,
              spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
              out_hidden_size=LANGUAGE["hidden_size"], num_position_embeddings=256,
              deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh")


def _token_ids() -> dict:
    at = SPECIAL_TOKENS.index
    return dict(image_token_id=at("<|image_pad|>"), video_token_id=at("<|video_pad|>"),
                vision_start_token_id=at("<|vision_start|>"), vision_end_token_id=at("<|vision_end|>"),
                bos_token_id=at("<|endoftext|>"), eos_token_id=at("<|im_end|>"))


def model_provider(vision: dict = VISION, language: dict = LANGUAGE):
    """The provider of this toy model; other configs pass their own tower and language shapes."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    from megatron.bridge.models.qwen_vl.qwen3_vl_provider import Qwen3VLMoEModelProvider

    return Qwen3VLMoEModelProvider(
        **language, head_dim=language["kv_channels"], mrope_section=[4, 6, 6],
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_router_dtype="fp32",
        seq_length=SEQ_LENGTH, language_max_sequence_length=SEQ_LENGTH, make_vocab_size_divisible_by=128,
        vision_config=Qwen3VLVisionConfig(**vision), **_token_ids(),
        freeze_language_model=False, freeze_vision_model=False, freeze_vision_projection=False,
        add_bias_linear=False, init_method_std=0.02,
        hidden_dropout=0.0, attention_dropout=0.0,
        persist_layer_norm=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        cross_entropy_loss_fusion=False, deallocate_pipeline_outputs=False,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=2,
        context_parallel_size=1, sequence_parallel=False,
    )


def config(provider=model_provider, name: str = "qwen3_vl_moe_tiny_cpu", global_batch_size: int = 8,
           min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    """The ``ConfigContainer``: ``provider()`` as the model, outputs under ``runs/NAME``, the
    processor's pixel bounds; the rest (optimizer, precision, checkpoints) shared by every
    config built on this one."""
    from megatron.bridge.data.builders.energon import EnergonDatasetConfig, QwenVLEnergonTaskEncoderConfig
    from megatron.bridge.recipes.common import _pretrain_common
    from megatron.bridge.recipes.utils.optimizer_utils import distributed_fused_adam_with_cosine_annealing
    from megatron.bridge.training.tokenizers.config import TokenizerConfig

    out = os.path.join(os.getcwd(), "runs", name)
    cfg = _pretrain_common()
    cfg.model = provider()
    cfg.train.train_iters = 20
    cfg.train.global_batch_size = global_batch_size
    cfg.train.micro_batch_size = 1
    cfg.train.manual_gc = False
    cfg.validation.eval_iters = 0
    cfg.validation.eval_interval = 1000
    opt, sched = distributed_fused_adam_with_cosine_annealing(lr_warmup_iters=1, lr_decay_iters=None,
                                                              max_lr=1e-4, min_lr=1e-5)
    opt.use_precision_aware_optimizer = False
    cfg.optimizer, cfg.scheduler = opt, sched
    cfg.ddp.overlap_grad_reduce = False
    cfg.ddp.overlap_param_gather = False
    cfg.ddp.use_distributed_optimizer = True
    cfg.mixed_precision = "bf16_mixed"
    cfg.tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None,
                                    use_tokenizer_vocab_size=True)
    cfg.dataset = EnergonDatasetConfig(
        path=None, seq_length=SEQ_LENGTH, micro_batch_size=1, num_workers=1,
        task_encoder=QwenVLEnergonTaskEncoderConfig(hf_processor_path="processor", patch_size=PATCH,
                                                    min_pixels=min_pixels, max_pixels=max_pixels,
                                                    max_visual_tokens=None, trust_remote_code=False),
        shuffle_buffer_size=100, pin_memory=False, do_validation=False)
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = os.path.join(out, "tensorboard")
    cfg.checkpoint.save = cfg.checkpoint.load = os.path.join(out, "checkpoints")
    cfg.checkpoint.save_interval = 1000
    cfg.checkpoint.ckpt_format = "torch_dist"
    cfg.checkpoint.async_save = False
    cfg.rng.seed = 1234
    cfg.model.bf16 = True
    cfg.model.params_dtype = torch.bfloat16
    return cfg
