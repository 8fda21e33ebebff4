"""The native-resolution benchmark's toy Qwen3-VL MoE for Megatron-Bridge on CPU (``mm-balance
bench-realpath --bridge``, docs/notes/2026-12-02-bridge-native-resolution-bench.md).

The tiny config (``qwen3_vl_moe_tiny_cpu.py``, loaded from beside this file: its recipe steps,
2-layer MoE language model of hidden 128 with 4 experts top-2, not gated here, sequence length
1024) with a vision tower sized so
that its share of a micro-batch's training FLOPs at the mean pack of the native-res mix
(``make-dataset --format bridge-qwen-vl --mix native-res``) matches Qwen3-VL-30B-A3B's at 8K
(29%): one layer of hidden 48 (3 heads), ffn 256, one deepstack merger.
``python -m megatron_mm_balance.bench.native_share`` prints the computation (it reads
``VISION_CONFIG``, ``LANGUAGE_CONFIG`` and ``SEQ_LENGTH`` below, which ``model_provider``
builds the model from). The processor's pixel bounds keep every image and video of the mix
at its own grid; 8 micro-batches per rank (GBS 16 at DP=2).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from megatron_mm_balance.bridge.native_dataset import MAX_PIXELS, MIN_PIXELS


def _tiny():
    """``qwen3_vl_moe_tiny_cpu.py`` beside this file (recipes are loaded by path, not as a package)."""
    path = Path(__file__).resolve().with_name("qwen3_vl_moe_tiny_cpu.py")
    spec = importlib.util.spec_from_file_location("_mm_balance_recipe_qwen3_vl_moe_tiny_cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = _tiny()
SEQ_LENGTH = TINY.SEQ_LENGTH
#: Qwen3VLVisionConfig fields of the tower: the tiny config's, one narrower layer with a wider MLP.
VISION_CONFIG = dict(TINY.VISION, depth=1, hidden_size=48, intermediate_size=256, num_heads=3)
#: The language model's shapes (provider fields; ``vocab_size``: the processor's 2,048 tokens).
LANGUAGE_CONFIG = dict(TINY.LANGUAGE, gated_linear_unit=False, vocab_size=2048)


def model_provider():
    language = {k: v for k, v in LANGUAGE_CONFIG.items() if k != "vocab_size"}
    return TINY.model_provider(vision=VISION_CONFIG, language=language)


def config():
    return TINY.config(provider=model_provider, name="qwen3_vl_moe_native_res_cpu", global_batch_size=16,
                       min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
