"""``mm_balance.cp_split``: Qwen3-VL's context-parallel frame split by cost, not count.

With ``context_parallel_size > 1`` and ``vision_dp_when_cp``, Bridge's Qwen3-VL forward
(``modelling_qwen3_vl/model.py``) calls ``qwen3vl_cp_split(cp_size, pixel_values,
grid_thw)``, which expands videos into frames (``expand_thw``) and returns
``cp_img_num``, the frames per context-parallel rank, by equal count
(``qwen2vl_pad_and_split``); ``get_vision_cp_data`` then gives each rank its contiguous
range, the tower encodes it, and ``AllGatherVisionEmbeddings`` gathers the embeddings
(and each deepstack feature) back in rank order, sized by the per-rank lengths it is
given (its backward all-reduces and slices).

:func:`install_cp_split` replaces that one name in the model module with
:func:`cost_split_qwen3vl` around Bridge's own function: Bridge still expands, copies and
checks the frames, and only ``cp_img_num`` is recomputed, by
:func:`megatron_mm_balance.solver.cp_split.cost_split` on the per-frame cost. The ranges
stay contiguous and in order, so the gathered embeddings are in Bridge's order, and the
collectives are Bridge's, unchanged (the same all-gather, with other per-rank sizes).
Every context-parallel rank reads the same micro-batch and computes the same split.

Replacing the function rather than patching it keeps the Bridge patch set as it is and
follows any 0.6.x whose model module still calls ``qwen3vl_cp_split`` by that name (a
module that has lost it is refused with a clear error, never silently left at count).

The per-frame cost is :func:`frame_cost_for` (the one place to swap in a calibrated
per-frame model): ``p * (p + alpha)`` for ``p = h*w`` patches, ``alpha`` the whole vision
tower's multiply-adds per patch over those per squared patch
(:meth:`~megatron_mm_balance.cost.flops.VisionTower.frame_alpha`, from ``model.vision_config``).
"""
from __future__ import annotations

import sys

from ..solver.cp_split import cost_split, default_frame_cost

#: The Bridge module whose forward calls ``qwen3vl_cp_split`` (looked up at call time).
QWEN3_VL_MODEL = "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model"
SPLIT_NAME = "qwen3vl_cp_split"
CHOICES = ("cost", "count")


def frame_alpha_for(spec) -> int:
    """``alpha`` of the model's vision tower (:func:`frame_cost_for`): its layers' projections
    and MLPs, the patch embedding and the mergers per patch, over its attention per squared
    patch (:meth:`~megatron_mm_balance.cost.flops.VisionTower.frame_alpha`, read once into the
    :class:`~.model_spec.ModelSpec`); a one-line ``ValueError`` when the tower has none."""
    return spec.required_frame_alpha()


def frame_cost_for(spec):
    """The per-frame cost ``p -> p * (p + alpha)`` of the model's vision tower (:func:`frame_alpha_for`)."""
    return default_frame_cost(frame_alpha_for(spec))


def cost_split_qwen3vl(bridge_split, frame_cost):
    """Bridge's ``qwen3vl_cp_split`` with ``cp_img_num`` split by ``frame_cost``.

    Same signature and results as ``bridge_split`` but the frames per rank; Bridge's
    result is kept unchanged when it has no frames or padded a rank (never for
    Qwen3-VL, which asserts that no rank is padded).
    """

    def qwen3vl_cp_split(cp_size, pixel_values, image_grid_thw):
        pixel_values, grid_thw, cp_img_num, images_padded = bridge_split(cp_size, pixel_values, image_grid_thw)
        if pixel_values is None or any(images_padded):
            return pixel_values, grid_thw, cp_img_num, images_padded
        costs = [int(t) * frame_cost(int(h) * int(w)) for t, h, w in grid_thw.tolist()]
        return pixel_values, grid_thw, cost_split(costs, cp_size), images_padded

    qwen3vl_cp_split.mm_balance_wraps = bridge_split
    return qwen3vl_cp_split


def checked_choice(value) -> str:
    if value not in CHOICES:
        from ..megatron.checks import MMBalanceConfigError
        raise MMBalanceConfigError(f"mm_balance.cp_split must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def install_cp_split(mm, spec) -> bool:
    """Split Qwen3-VL's context-parallel frames by cost for ``mm_balance.cp_split=cost``
    (``mm``: ``cfg.mm_balance``; ``spec``: the model's :class:`~.model_spec.ModelSpec`).

    Acts only where Bridge splits frames at all (``context_parallel_size > 1`` with
    ``vision_dp_when_cp``) and the Qwen3-VL model module is loaded (the model is built
    before the train iterators); idempotent. Returns whether the cost split is in place.
    """
    if checked_choice(getattr(mm, "cp_split", "cost")) == "count":
        return False
    if not spec.splits_frames_across_cp:
        return False
    module = sys.modules.get(QWEN3_VL_MODEL)
    if module is None:
        return False
    current = getattr(module, SPLIT_NAME, None)
    if current is None:
        raise RuntimeError(f"mm_balance.cp_split=cost: {QWEN3_VL_MODEL} has no {SPLIT_NAME} in this "
                           f"Megatron-Bridge; set mm_balance.cp_split=count")
    if getattr(current, "mm_balance_wraps", None) is None:
        setattr(module, SPLIT_NAME, cost_split_qwen3vl(current, frame_cost_for(spec)))
    return True
