"""A cost model from the model's own shapes, by FLOP count: right to first order before any timing.

:func:`vision_cost_model` turns a Qwen-VL vision config (Hugging Face
``Qwen3VLVisionConfig`` / ``Qwen2_5_VLVisionConfig`` field names, an object or a dict)
and the training regime into a :class:`~megatron_mm_balance.cost.model.CostModel` on the
per-frame features of :mod:`.frames`. Per frame of ``p`` patches (``M``: multiply-adds,
2 FLOPs each; ``h`` hidden, ``f`` ffn, ``m`` merge size, ``o`` output width):

* every layer, per patch: ``4*h^2`` (QKV and output projections) plus ``2*h*f`` (MLP;
  ``3*h*f`` gated, as in Qwen2.5-VL);
* a full-attention layer, per frame: ``2*h*p^2`` (scores and values) — all layers of
  Qwen3-VL, the ``fullatt_block_indexes`` of Qwen2.5-VL;
* a window-attention layer (Qwen2.5-VL's others): ``2*h*W*p`` with ``W`` the window's
  patches (``(window_size / patch_size)^2``, 64): linear (a partial window at a frame's
  edge is smaller, so this is an upper bound);
* the patch embedding: ``in_channels*temporal_patch_size*patch_size^2*h`` per patch;
* each merger (the final one and one per ``deepstack_visual_indexes`` entry):
  ``h^2*m^2 + h*o`` per patch (two linears on merged tokens of ``h*m^2``).

So ``b/a`` per full-attention layer is ``2*h + f`` (6.6k for Qwen3-VL's 1152/4304).
The training regime (:class:`TrainingRegime`) sets what runs besides the forward: a
trainable part's backward is 2 forwards (weight and input gradients); a frozen tower has
none (its input needs no gradient), a trainable merger above it only its weight gradient
(1), a frozen merger under a trainable tower only its input gradient (1); full activation
recompute adds a forward of the recomputed layers, selective (``core_attn``) one of the
attention core. The language model (:func:`language_terms`, Megatron ``TransformerConfig``
names) is counted the same way. Vision CUDA graphs pad every micro-batch to one fixed
length, so its vision cost is the same for all: :func:`vision_cost_model` refuses it.

FLOPs become milliseconds at ``flops_per_ms`` (default 4e11, 400 TFLOP/s: what a current
GPU sustains on bf16 GEMMs); only the placement's units depend on it, not its order. The
model's terms hold a whole step (forward, backward and recompute), its backward ratios
are 0: per-term ratios differ under the regimes above, and the solver reads only the
sum of each phase.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from .model import CostModel

#: nominal sustained throughput that turns FLOPs into milliseconds (GPU, bf16 GEMMs)
DEFAULT_FLOPS_PER_MS = 4.0e11
#: the same on CPU (the CPU harness): costs stay whole microseconds for toy towers
CPU_FLOPS_PER_MS = 5.0e7


#: Vision configs by name (Hugging Face field names), for ``mm-balance replay --vision-config``:
#: Qwen3-VL-30B-A3B's and Qwen2.5-VL-7B's towers, and the CPU toy of
#: ``configs/bridge/qwen3_vl_moe_tiny_cpu.py`` (with the throughput its costs use there).
VISION_PRESETS = {
    "qwen3-vl-30b-a3b": dict(depth=27, hidden_size=1152, intermediate_size=4304, patch_size=16,
                             temporal_patch_size=2, in_channels=3, spatial_merge_size=2, out_hidden_size=2048,
                             deepstack_visual_indexes=[8, 16, 24]),
    "qwen2.5-vl-7b": dict(depth=32, hidden_size=1280, intermediate_size=3420, patch_size=14, temporal_patch_size=2,
                          in_channels=3, spatial_merge_size=2, out_hidden_size=3584, window_size=112,
                          fullatt_block_indexes=[7, 15, 23, 31]),
    "qwen3-vl-tiny-cpu": dict(depth=2, hidden_size=64, intermediate_size=128, patch_size=16, temporal_patch_size=2,
                              in_channels=3, spatial_merge_size=2, out_hidden_size=128, deepstack_visual_indexes=[0]),
}
#: presets whose costs are taken at the CPU harness's throughput (:data:`CPU_FLOPS_PER_MS`)
CPU_PRESETS = ("qwen3-vl-tiny-cpu",)


def _field(config, name, default=None):
    value = config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
    return default if value is None else value


def _required(config, name, where):
    value = _field(config, name)
    if value is None:
        raise ValueError(f"{where}: the config has no {name!r} (expected a Qwen3-VL or Qwen2.5-VL "
                         "vision config: depth, hidden_size, intermediate_size, patch_size, ...)")
    return value


def _size(value) -> int:
    """A patch size given as an int or a pair (square patches: every Qwen-VL's)."""
    if isinstance(value, (list, tuple)):
        return int(value[0])
    return int(value)


@dataclass(frozen=True)
class VisionTower:
    """The shapes that set a Qwen-VL vision tower's FLOPs (see the module docstring)."""

    depth: int
    hidden: int
    ffn: int
    gated_mlp: bool
    full_attention_layers: int
    window_patches: int        # patches per attention window of the other layers (0: none)
    patch_inputs: int          # in_channels * temporal_patch_size * patch_size^2
    merge: int
    out_hidden: int
    mergers: int               # the final merger plus one per deepstack layer

    @classmethod
    def from_config(cls, vc, *, where: str = "vision config") -> "VisionTower":
        """From a Hugging Face Qwen3-VL (``deepstack_visual_indexes``) or Qwen2.5-VL
        (``fullatt_block_indexes``, ``window_size``, gated MLP) vision config."""
        depth = int(_required(vc, "depth", where))
        hidden = int(_required(vc, "hidden_size", where))
        patch = _size(_required(vc, "patch_size", where))
        merge = int(_field(vc, "spatial_merge_size", 2))
        full = _field(vc, "fullatt_block_indexes")
        qwen25 = full is not None or str(_field(vc, "model_type", "")).startswith("qwen2_5")
        if qwen25:
            window = int(_required(vc, "window_size", where))
            side = window // (patch * merge) * merge          # the tower's window, in patches
            full_layers, window_patches = len(set(int(i) for i in full or ())), side * side
        else:
            full_layers, window_patches = depth, 0
        if not 0 <= full_layers <= depth:
            raise ValueError(f"{where}: {full_layers} full-attention layers of {depth}")
        return cls(depth=depth, hidden=hidden, ffn=int(_required(vc, "intermediate_size", where)),
                   gated_mlp=qwen25, full_attention_layers=full_layers, window_patches=window_patches,
                   patch_inputs=int(_field(vc, "in_channels", 3)) * _size(_field(vc, "temporal_patch_size", 2))
                   * patch * patch,
                   merge=merge, out_hidden=int(_required(vc, "out_hidden_size", where)),
                   mergers=1 + len(_field(vc, "deepstack_visual_indexes", ()) or ()))

    # multiply-adds
    def layer_macs_per_patch(self) -> int:
        """Projections and MLP of one layer, per patch."""
        return 4 * self.hidden ** 2 + (3 if self.gated_mlp else 2) * self.hidden * self.ffn

    def attention_macs_per_patch_sq(self) -> int:
        """Scores and values of one full-attention layer, per squared frame patch."""
        return 2 * self.hidden

    def window_macs_per_patch(self) -> int:
        """Scores and values of one window-attention layer, per patch."""
        return 2 * self.hidden * self.window_patches

    def embed_macs_per_patch(self) -> int:
        return self.patch_inputs * self.hidden

    def merger_macs_per_patch(self) -> int:
        """One merger, per patch (its linears act on ``merge^2`` patches at once)."""
        return self.hidden ** 2 * self.merge ** 2 + self.hidden * self.out_hidden

    def frame_alpha(self) -> int:
        """``alpha`` of the per-frame cost ``p * (p + alpha)`` in units of the full-attention
        layers' ``attention_macs_per_patch_sq() * p^2``: the whole tower's multiply-adds per
        patch (every layer's projections and MLP, the window layers' attention, the patch
        embedding and every merger) over its multiply-adds per squared frame patch, rounded.
        One layer's ``2*hidden + ffn`` leaves out the embedding and the mergers, which in a
        shallow tower are most of the per-patch work."""
        if not self.full_attention_layers:
            raise ValueError("the vision tower has no full-attention layer: a frame's cost has no "
                             "quadratic term to scale alpha by")
        linear = (self.depth * self.layer_macs_per_patch()
                  + (self.depth - self.full_attention_layers) * self.window_macs_per_patch()
                  + self.embed_macs_per_patch() + self.mergers * self.merger_macs_per_patch())
        return round(linear / (self.attention_macs_per_patch_sq() * self.full_attention_layers))


@dataclass(frozen=True)
class TrainingRegime:
    """What runs besides the forward (Megatron-Bridge provider names)."""

    freeze_vision_model: bool = False
    freeze_vision_projection: bool = False
    freeze_language_model: bool = False
    #: the tower's activation recompute: None, ``full`` or ``selective``
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None          # ``uniform`` (all layers) or ``block``
    recompute_num_layers: Optional[int] = None      # ``block``: the first this many layers
    recompute_modules: tuple = ("core_attn",)       # ``selective``: what is recomputed
    #: the language model's recompute (Bridge gives the tower the same settings)
    language_recompute_granularity: Optional[str] = None
    #: the tower pads every micro-batch to one length (vision CUDA graphs)
    vision_cuda_graphs: bool = False


def _recomputed_layers(regime: TrainingRegime, depth: int) -> int:
    if regime.recompute_granularity != "full":
        return 0
    if regime.recompute_method == "block":
        return min(depth, int(regime.recompute_num_layers or 0))
    return depth


def vision_flops(tower: VisionTower, regime: TrainingRegime = TrainingRegime()) -> tuple[float, float]:
    """``(per patch, per squared frame patch)`` FLOPs of one training step of the tower."""
    tower_trains = not regime.freeze_vision_model
    merger_trains = not regime.freeze_vision_projection
    layer_pass = 3.0 if tower_trains else 1.0                  # forward + weight and input grads
    embed_pass = 2.0 if tower_trains else 1.0                  # pixels need no input gradient
    merger_pass = 1.0 + (1.0 if merger_trains else 0.0) + (1.0 if tower_trains else 0.0)
    linear_layer = tower.layer_macs_per_patch() * tower.depth
    window = tower.window_macs_per_patch() * (tower.depth - tower.full_attention_layers)
    square = tower.attention_macs_per_patch_sq() * tower.full_attention_layers
    recomputed = _recomputed_layers(regime, tower.depth) if tower_trains else 0
    extra_linear = recomputed * tower.layer_macs_per_patch()
    extra_square = recomputed / tower.depth * square if tower.depth else 0.0
    extra_window = recomputed / tower.depth * window if tower.depth else 0.0
    if tower_trains and regime.recompute_granularity == "selective" and "core_attn" in regime.recompute_modules:
        extra_square, extra_window = square, window
    per_patch = (layer_pass * (linear_layer + window) + extra_linear + extra_window
                 + embed_pass * tower.embed_macs_per_patch()
                 + merger_pass * tower.mergers * tower.merger_macs_per_patch())
    per_sq = layer_pass * square + extra_square
    return 2.0 * per_patch, 2.0 * per_sq


@dataclass(frozen=True)
class LanguageModel:
    """The shapes that set a Megatron GPT model's FLOPs per token (``TransformerConfig`` names)."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    mlp_macs: int          # per token per layer: dense MLP, or the routed experts + shared ones
    vocab: int

    @classmethod
    def from_config(cls, cfg, *, where: str = "language config") -> "LanguageModel":
        h = int(_required(cfg, "hidden_size", where))
        heads = int(_required(cfg, "num_attention_heads", where))
        gated = 3 if _field(cfg, "gated_linear_unit", False) else 2
        experts = _field(cfg, "num_moe_experts")
        if experts:
            ffn = int(_field(cfg, "moe_ffn_hidden_size") or _required(cfg, "ffn_hidden_size", where))
            mlp = (gated * h * ffn * int(_field(cfg, "moe_router_topk", 2)) + h * int(experts)
                   + gated * h * int(_field(cfg, "moe_shared_expert_intermediate_size", 0)))
        else:
            mlp = gated * h * int(_required(cfg, "ffn_hidden_size", where))
        return cls(layers=int(_required(cfg, "num_layers", where)), hidden=h, heads=heads,
                   groups=int(_field(cfg, "num_query_groups", heads)),
                   head_dim=int(_field(cfg, "kv_channels", h // heads)), mlp_macs=mlp,
                   vocab=int(_field(cfg, "vocab_size", 0)))

    def macs_per_token(self) -> int:
        q = self.heads * self.head_dim
        attn = self.hidden * q + 2 * self.hidden * self.groups * self.head_dim + q * self.hidden
        return self.layers * (attn + self.mlp_macs) + self.vocab * self.hidden

    def macs_per_len_sq(self) -> int:
        """Causal attention: half the ``len^2`` scores, then the values."""
        return self.layers * self.heads * self.head_dim


def language_terms(lm: LanguageModel, regime: TrainingRegime = TrainingRegime()) -> tuple[float, float]:
    """``(per position, per squared sample length)`` FLOPs of one training step of the
    language model (its backward carries the gradient to the vision side, so a frozen
    language model still computes input gradients when the vision side trains)."""
    vision_trains = not (regime.freeze_vision_model and regime.freeze_vision_projection)
    passes = 3.0 if not regime.freeze_language_model else (2.0 if vision_trains else 1.0)
    full = regime.language_recompute_granularity == "full"
    selective = regime.language_recompute_granularity == "selective"
    per_token = lm.macs_per_token() * (passes + (1.0 if full and passes > 1 else 0.0))
    per_sq = lm.macs_per_len_sq() * (passes + (1.0 if (full or selective) and passes > 1 else 0.0))
    return 2.0 * per_token, 2.0 * per_sq


def vision_cost_model(vision_config, regime: TrainingRegime = TrainingRegime(), *,
                      language_config=None, flops_per_ms: float = DEFAULT_FLOPS_PER_MS,
                      where: str = "vision config") -> CostModel:
    """The FLOP-derived :class:`CostModel` of a Qwen-VL tower (and, given its config, the
    language model) on per-frame features (:mod:`.frames`); see the module docstring."""
    if regime.vision_cuda_graphs:
        raise ValueError("the vision tower pads every micro-batch to one length (vision CUDA graphs), "
                         "so every micro-batch costs it the same: there is no vision cost to balance; "
                         "set vision_cuda_graph_impl=none or leave mm_balance off")
    if not flops_per_ms > 0:
        raise ValueError(f"flops_per_ms must be > 0, got {flops_per_ms!r}")
    per_patch, per_sq = vision_flops(VisionTower.from_config(vision_config, where=where), regime)
    lm_token = lm_sq = 0.0
    if language_config is not None:
        lm_token, lm_sq = language_terms(LanguageModel.from_config(language_config), regime)
    return CostModel(vision_ms_per_token=per_patch / flops_per_ms, vision_ms_per_token_sq=per_sq / flops_per_ms,
                     llm_ms_per_token=lm_token / flops_per_ms, llm_ms_per_len_sq=lm_sq / flops_per_ms,
                     const_ms=0.0, vision_backward_ratio=0.0, llm_backward_ratio=0.0)
