"""What a pack costs, as integers every rank agrees on.

* :mod:`.model` — :class:`~.model.CostModel` (vision and language terms, backward ratio),
  its least-squares fit and cost files (``--mm-balance-cost model``);
* :mod:`.pack` — reading a pack's image-token counts and lengths, and the cost
  functions the runtime calls (:class:`~.pack.ImageTokenCost`, :class:`~.pack.ModelCost`);
* :mod:`.frames` — Qwen-VL grids as per-frame features (pure functions of ``(t, h, w)`` lists);
* :mod:`.flops` — a cost model from a vision tower's (and language model's) config by FLOP
  count, under the training regime (frozen parts, recompute);
* :mod:`.features` — what a cost model sees of a timing record and of a micro-batch (tiles,
  or Qwen-VL frames): the extension point of the calibration and the replay;
* :mod:`.replay` — cost models judged by replaying a run's per-pack timings;
* :mod:`.calibration` — timing a vision encoder to fit a cost model (imports torch
  inside its functions), and ``cost=auto``'s choice by replay.

Nothing here imports torch at module level.
"""
from .model import COST_FILE_FORMAT, CostModel, PackFeatures, load_cost_file

__all__ = ["COST_FILE_FORMAT", "CostModel", "PackFeatures", "load_cost_file"]
