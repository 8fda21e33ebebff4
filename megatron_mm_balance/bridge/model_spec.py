"""Bridge's model config, read once: :class:`ModelSpec`, what the glue needs of the provider.

``wrap_train_data_iterator`` reads ``cfg.model`` (the model provider: Qwen3-VL's, or any
other) here, once, into one frozen description of the vision tower and the model, which
the checks (:func:`~.config.as_args`, :func:`~.vision.checked_vision`), the costs
(:mod:`.iterator`), the context-parallel split (:mod:`.cp_split`) and the frame exchange
(:mod:`.vision`) take instead of the provider. What the config cannot give (a tower that is
not Qwen-VL's, vision CUDA graphs under a FLOP cost) is read once too, as the one-line
reason, and raised by whoever needs the missing value, as before.

Imports nothing from Bridge, Megatron or torch at import time (:meth:`ModelSpec.read` asks
torch only whether CUDA is there, for the FLOP model's nominal throughput).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..cost.flops import TrainingRegime, VisionTower
from ..cost.model import CostModel

#: what errors about the vision tower's config name
VISION_CONFIG = "model.vision_config"


def spatial_merge_size(model_cfg) -> int:
    """Qwen-VL's patch merge (2 x 2 by default) from Bridge's model config."""
    vision: Optional[object] = getattr(model_cfg, "vision_config", None)
    return int(getattr(vision, "spatial_merge_size", None)
               or getattr(model_cfg, "spatial_merge_size", 2) or 2)


def training_regime(model_cfg) -> TrainingRegime:
    """What the provider trains, recomputes and pads (Bridge 0.6 names; the Qwen3-VL tower
    takes the language model's recompute settings, Qwen2.5-VL's Hugging Face tower none)."""
    get = lambda name, default=None: getattr(model_cfg, name, default)  # noqa: E731
    megatron_tower = hasattr(get("vision_config"), "deepstack_visual_indexes")
    return TrainingRegime(
        freeze_vision_model=bool(get("freeze_vision_model", False)),
        freeze_vision_projection=bool(get("freeze_vision_projection", False)),
        freeze_language_model=bool(get("freeze_language_model", False)),
        recompute_granularity=get("recompute_granularity") if megatron_tower else None,
        recompute_method=get("recompute_method"), recompute_num_layers=get("recompute_num_layers"),
        recompute_modules=tuple(get("recompute_modules", None) or ("core_attn",)),
        language_recompute_granularity=get("recompute_granularity"),
        vision_cuda_graphs=(get("vision_cuda_graph_impl", "none") or "none") != "none")


def _size(model_cfg, name: str) -> int:
    return int(getattr(model_cfg, name, 1) or 1)


@dataclass(frozen=True)
class ModelSpec:
    """The provider as the glue sees it (see the module docstring). Build with :meth:`read`."""

    #: the provider's type name (refusals name it)
    provider: str
    # -- parallelism and the language model's settings the checks read
    expert_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    #: Qwen3-VL splits each micro-batch's frames across the context-parallel ranks
    vision_dp_when_cp: bool
    num_moe_experts: Optional[int]
    moe_router_load_balancing_type: Optional[str]
    moe_aux_loss_coeff: float
    calculate_per_token_loss: bool
    hybrid_context_parallel: bool
    #: upstream's per-global-batch rebalancing where the pinned megatron-core has it (the
    #: config's ``dynamic_context_parallel``, ``sequence_packing_scheduler``): refused with ours
    dynamic_context_parallel: bool
    sequence_packing_scheduler: Optional[str]
    # -- the vision tower
    #: Qwen-VL's patch merge per side
    spatial_merge_size: int
    #: the tower is Qwen3-VL's (its config names ``deepstack_visual_indexes``)
    qwen3_tower: bool
    #: ``model.vision_cuda_graph_impl`` (``"none"``: no vision CUDA graphs)
    vision_cuda_graph_impl: str
    #: the vision tower runs on ranks of its own (``model.dist_train.use_dist_train``)
    dist_train: bool
    #: what runs besides the forward (freezing, recompute, padding)
    regime: TrainingRegime
    #: the tower's shapes (None: the config gives none; ``tower_problem`` says why)
    tower: Optional[VisionTower]
    tower_problem: str
    #: the tower's frame cost ``alpha`` (None: ``alpha_problem`` says why)
    frame_alpha: Optional[int]
    alpha_problem: str
    #: the FLOP-derived cost model of the tower and the language model at the device's
    #: nominal throughput (None: ``flops_problem`` says why)
    flops_model: Optional[CostModel]
    flops_problem: str

    @classmethod
    def read(cls, model_cfg, *, flops_per_ms: Optional[float] = None) -> "ModelSpec":
        """Read Bridge's ``cfg.model`` once. ``flops_per_ms``: the FLOP model's throughput
        (None: a GPU's nominal one with CUDA, else the CPU harness's)."""
        from ..cost.flops import CPU_FLOPS_PER_MS, DEFAULT_FLOPS_PER_MS, vision_cost_model
        if flops_per_ms is None:
            import torch
            flops_per_ms = DEFAULT_FLOPS_PER_MS if torch.cuda.is_available() else CPU_FLOPS_PER_MS
        get = lambda name, default=None: getattr(model_cfg, name, default)  # noqa: E731
        vision = get("vision_config")
        regime = training_regime(model_cfg)
        tower, tower_problem = _attempt(lambda: VisionTower.from_config(vision or {}, where=VISION_CONFIG))
        alpha, alpha_problem = (None, tower_problem) if tower is None else _attempt(tower.frame_alpha)
        flops, flops_problem = _attempt(lambda: vision_cost_model(vision, regime, language_config=model_cfg,
                                                                  flops_per_ms=flops_per_ms,
                                                                  where=VISION_CONFIG))
        return cls(
            provider=type(model_cfg).__name__,
            expert_model_parallel_size=_size(model_cfg, "expert_model_parallel_size"),
            pipeline_model_parallel_size=_size(model_cfg, "pipeline_model_parallel_size"),
            context_parallel_size=_size(model_cfg, "context_parallel_size"),
            vision_dp_when_cp=bool(get("vision_dp_when_cp", False)),
            num_moe_experts=get("num_moe_experts"),
            moe_router_load_balancing_type=get("moe_router_load_balancing_type"),
            moe_aux_loss_coeff=get("moe_aux_loss_coeff", 0.0),
            calculate_per_token_loss=bool(get("calculate_per_token_loss", False)),
            hybrid_context_parallel=bool(get("hybrid_context_parallel", False)),
            dynamic_context_parallel=bool(get("dynamic_context_parallel", False)),
            sequence_packing_scheduler=get("sequence_packing_scheduler"),
            spatial_merge_size=spatial_merge_size(model_cfg),
            qwen3_tower=vision is not None and getattr(vision, "deepstack_visual_indexes", None) is not None,
            vision_cuda_graph_impl=str(get("vision_cuda_graph_impl", "none") or "none"),
            dist_train=bool(getattr(get("dist_train"), "use_dist_train", False)),
            regime=regime, tower=tower, tower_problem=tower_problem,
            frame_alpha=alpha, alpha_problem=alpha_problem,
            flops_model=flops, flops_problem=flops_problem)

    @property
    def splits_frames_across_cp(self) -> bool:
        """Bridge's Qwen3-VL forward splits frames across context-parallel ranks."""
        return self.context_parallel_size > 1 and self.vision_dp_when_cp

    def required_tower(self) -> VisionTower:
        """The tower's shapes; a one-line ``ValueError`` naming the config when it has none."""
        if self.tower is None:
            raise ValueError(self.tower_problem)
        return self.tower

    def required_frame_alpha(self) -> int:
        """The tower's frame cost ``alpha``; a one-line ``ValueError`` when there is none."""
        if self.frame_alpha is None:
            raise ValueError(self.alpha_problem)
        return self.frame_alpha

    def required_flops_model(self) -> CostModel:
        """The FLOP-derived cost model; a one-line ``ValueError`` when the config gives none."""
        if self.flops_model is None:
            raise ValueError(self.flops_problem)
        return self.flops_model


def _attempt(make):
    """``(value, "")``, or ``(None, the one-line reason)`` when the config cannot give it."""
    try:
        return make(), ""
    except (ValueError, TypeError) as exc:
        return None, str(exc)
