"""The vision tower's share of a micro-batch's FLOPs at the mean pack, on the native-resolution
mix: Qwen3-VL-30B-A3B at 8K and the CPU benchmark config (``configs/bridge/
qwen3_vl_moe_native_res_cpu.py``), which is sized so that its share matches the 30B's.

FLOPs come from :mod:`megatron_mm_balance.cost.flops` (a whole training step: forward,
backward, under each model's training regime): the vision tower per frame
``a*p + b*p^2`` (:func:`~megatron_mm_balance.cost.flops.vision_flops`) and the language
model per position and per squared causal segment
(:func:`~megatron_mm_balance.cost.flops.language_terms`). The samples are the native-res
mix's (:mod:`megatron_mm_balance.data.native_res`, ``--samples`` drawn from ``--seed``).
Three ways a micro-batch holds them:

* ``30B, 8K packs``: the samples packed whole into 8,192-token sequences
  (:func:`~megatron_mm_balance.data.packing.pack_greedy`), each sample its own causal
  segment: the 8K pack of the simulator's ``vlm_30b_moe`` setting, and the target;
* ``30B, 8K rows``: one sample per row, padded to 8,192 (what Bridge 0.6's
  ``qwen3_vl_step`` does under expert or pipeline parallelism, where it pads every row to
  the sequence length: the language model then computes 8,192 positions per sample);
* ``CPU config``: one sample per micro-batch padded to the config's sequence length (the
  same step on the CPU job).

The share is mean vision FLOPs over mean (vision + language) FLOPs per micro-batch.

``python -m megatron_mm_balance.bench.native_share`` prints the table (``--json`` too).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

import numpy as np

from ..cost.flops import LanguageModel, TrainingRegime, VisionTower, language_terms, vision_flops
from ..data import native_res
from ..data.packing import pack_greedy
from ..data.traces import Sample

REPO = Path(__file__).resolve().parents[2]
CPU_CONFIG = REPO / "configs" / "bridge" / "qwen3_vl_moe_native_res_cpu.py"

#: Qwen3-VL-30B-A3B-Instruct (Hugging Face config.json): the vision tower ...
QWEN3_VL_30B_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                           temporal_patch_size=2, in_channels=3, spatial_merge_size=2, out_hidden_size=2048,
                           deepstack_visual_indexes=[8, 16, 24])
#: ... and the language model as Bridge's provider names it (48 layers, hidden 2048, 32 query
#: heads of 128 in 4 groups, 128 experts of 768 with top-8 SwiGLU, vocabulary 151,936, untied).
QWEN3_VL_30B_LANGUAGE = dict(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                             kv_channels=128, gated_linear_unit=True, num_moe_experts=128,
                             moe_ffn_hidden_size=768, moe_router_topk=8, ffn_hidden_size=6144,
                             vocab_size=151936)
#: Bridge's Qwen3-VL-30B-A3B SFT recipe trains everything, no recompute.
QWEN3_VL_30B_REGIME = TrainingRegime()
SEQ_8K = 8192
#: The CPU config's share must lie within this many percentage points of the 30B's 8K packs.
SHARE_TOLERANCE_POINTS = 2.0
DEFAULT_SAMPLES, DEFAULT_SEED = 4096, 0


@dataclass(frozen=True)
class Shapes:
    """One model: vision tower and language model configs, training regime, sequence length."""

    name: str
    vision: dict
    language: dict
    seq_length: int
    regime: TrainingRegime = TrainingRegime()

    def terms(self):
        """(vision per patch, per squared frame patch, language per position, per squared segment)."""
        a, b = vision_flops(VisionTower.from_config(self.vision), self.regime)
        t, s = language_terms(LanguageModel.from_config(self.language), self.regime)
        return a, b, t, s


def cpu_shapes(path: Path = CPU_CONFIG) -> Shapes:
    """The CPU config's shapes, read from its module-level constants (no Bridge import)."""
    spec = importlib.util.spec_from_file_location("_native_res_cpu_config", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return Shapes("CPU config", dict(mod.VISION_CONFIG), dict(mod.LANGUAGE_CONFIG), int(mod.SEQ_LENGTH))


def qwen3_vl_30b() -> Shapes:
    return Shapes("Qwen3-VL-30B-A3B", QWEN3_VL_30B_VISION, QWEN3_VL_30B_LANGUAGE, SEQ_8K, QWEN3_VL_30B_REGIME)


def _vision(samples: Sequence[native_res.NativeResSample], a: float, b: float) -> np.ndarray:
    return np.array([a * s.patches + b * sum(p * p for p in s.frames) for s in samples], dtype=np.float64)


def _tokens(samples) -> np.ndarray:
    return np.array([native_res.sample_tokens(s.grids, s.videos, s.text_tokens) for s in samples], dtype=np.int64)


def padded_rows(samples, shapes: Shapes) -> dict:
    """One sample per micro-batch, its row padded to the sequence length (one causal segment)."""
    a, b, t, s = shapes.terms()
    vision = _vision(samples, a, b)
    lm = t * shapes.seq_length + s * shapes.seq_length ** 2
    return _row(shapes, "one sample per row, padded", vision, np.full(len(samples), lm), 1.0)


def packed(samples, shapes: Shapes) -> dict:
    """Samples packed whole into ``seq_length`` sequences, each sample its own causal segment."""
    a, b, t, s = shapes.terms()
    vision = _vision(samples, a, b)
    tokens = _tokens(samples)
    result = pack_greedy([Sample(int(n), ()) for n in tokens], shapes.seq_length)
    pv, pl = [], []
    for pack in result.packs:
        idx = list(pack.samples)
        pv.append(vision[idx].sum())
        pl.append(t * shapes.seq_length + s * float((tokens[idx].astype(np.float64) ** 2).sum()))
    return _row(shapes, f"samples packed into {shapes.seq_length}-token sequences", np.array(pv), np.array(pl),
                len(samples) / len(result.packs))


def _row(shapes: Shapes, layout: str, vision: np.ndarray, language: np.ndarray, per_pack: float) -> dict:
    a, b, _, _ = shapes.terms()
    v, l_ = float(vision.mean()), float(language.mean())
    return {"model": shapes.name, "layout": layout, "seq_length": shapes.seq_length,
            "samples_per_micro_batch": per_pack, "vision_gflop": v / 1e9, "language_gflop": l_ / 1e9,
            "share": v / (v + l_), "vision_b_over_a": a / b,
            "vision_cv": float(vision.std() / vision.mean()) if vision.mean() else 0.0,
            "vision": shapes.vision, "language": shapes.language}


def table(samples: int = DEFAULT_SAMPLES, seed: int = DEFAULT_SEED, cpu: Shapes | None = None) -> dict:
    """The three rows (module docstring), the target and whether the CPU config meets it."""
    drawn = native_res.draw(np.random.default_rng(seed), samples, native_res.NativeResMix())
    big = qwen3_vl_30b()
    cpu = cpu or cpu_shapes()
    rows = [packed(drawn, big), padded_rows(drawn, big), padded_rows(drawn, cpu)]
    target, got = rows[0]["share"], rows[2]["share"]
    return {"samples": samples, "seed": seed, "rows": rows, "target_share": target, "cpu_share": got,
            "tolerance_points": SHARE_TOLERANCE_POINTS,
            "within_tolerance": abs(got - target) * 100 <= SHARE_TOLERANCE_POINTS}


def format_table(rep: dict) -> str:
    lines = [f"native-res mix, {rep['samples']} samples (seed {rep['seed']}); FLOPs of one training step "
             f"per micro-batch, at the mean",
             f"{'model':<18} {'micro-batch':<46} {'samples':>7} {'vision GFLOP':>13} {'language GFLOP':>15} "
             f"{'vision share':>12} {'vision b/a':>10}"]
    for r in rep["rows"]:
        lines.append(f"{r['model']:<18} {r['layout']:<46} {r['samples_per_micro_batch']:>7.2f} "
                     f"{r['vision_gflop']:>13.2f} {r['language_gflop']:>15.2f} {100 * r['share']:>11.1f}% "
                     f"{r['vision_b_over_a']:>10,.0f}")
    lines.append(f"target: the 30B's 8K packs, {100 * rep['target_share']:.1f}%; CPU config "
                 f"{100 * rep['cpu_share']:.1f}% ({'within' if rep['within_tolerance'] else 'NOT within'} "
                 f"{rep['tolerance_points']:g} points)")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_mm_balance.bench.native_share",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--config", default=str(CPU_CONFIG), help="the CPU config (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    a = p.parse_args(argv)
    rep = table(a.samples, a.seed, cpu_shapes(Path(a.config)))
    print(json.dumps(rep, indent=1) if a.json else format_table(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
