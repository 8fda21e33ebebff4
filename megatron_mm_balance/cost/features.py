"""What a cost model sees of a timing record and of a micro-batch: the features extension point.

One object per encoder family says how its inputs become the cost model's
:class:`~.model.PackFeatures`, the same from a timing record (what the per-pack timing hooks
wrote) and from a micro-batch (what the balancer costs), so that a model fitted on records
prices batches in the same terms. The online calibration (``--mm-balance-cost auto`` /
``mm_balance.cost=auto``: :class:`~.calibration.AutoCost`), the offline replay
(:mod:`.replay`, ``mm-balance replay``) and :func:`~.calibration.fit_phases` all take it.

Its members:

* ``identity``: what the units are (saved with a fit; a resumed job checks it);
* ``needed``: the record fields :meth:`of_record` reads;
* ``of_record(record)`` / ``of_pack(pack)``: the :class:`~.model.PackFeatures`;
* ``tokens(pack)``: the default cost before any fit (image tokens / the patch count);
* ``candidates``: the replay candidates (:data:`~.replay.CANDIDATES` names) that make sense
  for these units, the default first;
* ``flops_model``: a :class:`~.model.CostModel` derived from the encoder's config by FLOP
  count (:func:`~.flops.vision_cost_model`), or None (``flops_note`` says why).

:class:`TileFeatures`: the tiled encoders of Megatron-LM's ``examples/multimodal`` (one unit
per image, its tokens). :class:`QwenVLFeatures`: Qwen-VL's native-resolution grids, one unit
per **frame** (:mod:`.frames`: a ``(t, h, w)`` image or video is ``t`` frames of ``h*w``
patches, attention within each).

Pure: no torch.
"""
from __future__ import annotations

from typing import Optional

from .frames import grid_frames
from .model import CostModel, PackFeatures
from .pack import DEFAULT_TOKENS_PER_TILE, ImageTokenCost, QwenVLGridFeatures, check_tokens_per_tile, pack_features

#: the default cost of both families (a pack's image tokens; Qwen-VL: its patch count)
IMAGE_TOKENS = "image-tokens"


def _missing(record: dict, needed) -> None:
    missing = [k for k in needed if k not in record]
    if missing:
        raise ValueError(f"timing record of iteration {record.get('iteration')}, rank {record.get('rank')}: "
                         f"missing {missing}")


class TileFeatures:
    """Tiled encoders: a record's ``images`` (per-image tokens) and ``lengths``; a pack's
    :func:`~.pack.pack_features`. Before the fit a pack costs its image tokens
    (:class:`~.pack.ImageTokenCost`). The replay's FLOP candidate is ``vit-flops`` (a ViT
    body of the shape given to the replay)."""

    needed = ("images", "lengths")
    candidates = (IMAGE_TOKENS, "vit-flops", "fit", "fit+pack", "fit+image", "fit-linear+pack")
    flops_model: Optional[CostModel] = None
    flops_note = "tiled encoders: the vit-flops candidate"

    def __init__(self, tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE):
        self.tokens_per_tile = check_tokens_per_tile(tokens_per_tile)
        self._tokens = ImageTokenCost(self.tokens_per_tile)

    @property
    def identity(self) -> str:
        return f"tiles(tokens_per_tile={self.tokens_per_tile})"

    @staticmethod
    def of_record(record: dict) -> PackFeatures:
        _missing(record, TileFeatures.needed)
        return PackFeatures(tuple(int(n) for n in record["images"]), tuple(int(n) for n in record["lengths"]))

    def of_pack(self, pack) -> PackFeatures:
        return pack_features(pack, self.tokens_per_tile)

    def tokens(self, pack) -> int:
        return self._tokens(pack)


class QwenVLFeatures:
    """Qwen-VL records and micro-batches, one unit per frame: from the ``(t, h, w)`` grids (a
    record's ``grids``; a batch's ``image_grid_thw`` / ``video_grid_thw``, also inside
    ``visual_inputs``) each image or video gives ``t`` units of ``h*w`` patches
    (:func:`~.frames.grid_frames`), its image count is one per grid, and the per-sample
    lengths are a record's ``lengths`` / a batch's :meth:`~.pack.QwenVLGridFeatures.lengths`.
    So a fitted quadratic term is attention within each frame, and a per-unit term a
    per-frame constant. Before the fit a pack costs its patch count ``sum(t*h*w)``
    (``QwenVLCost`` without a model).

    ``flops_model``: the tower's (and language model's) FLOP-derived model
    (:func:`~.flops.vision_cost_model`, what ``cost=model`` balances with without a cost
    file), for the replay's ``flops`` candidate; ``flops_note``: why there is none."""

    needed = ("grids", "lengths")
    candidates = (IMAGE_TOKENS, "flops", "fit", "fit+frame", "fit+image")

    def __init__(self, spatial_merge_size: int = 2, *, flops_model: Optional[CostModel] = None,
                 flops_note: str = "no vision config given"):
        self.grid_features = QwenVLGridFeatures(spatial_merge_size)
        self.flops_model = flops_model
        self.flops_note = flops_note

    @property
    def identity(self) -> str:
        return f"qwen_vl_frames(merge={self.grid_features.merge})"

    @staticmethod
    def of_grids(grids, lengths) -> PackFeatures:
        grids = [tuple(int(v) for v in g) for g in grids]
        return PackFeatures(grid_frames(grids), tuple(int(n) for n in lengths), num_images=len(grids))

    def of_record(self, record: dict) -> PackFeatures:
        if "grids" not in record:
            raise ValueError("Qwen-VL costs need timing records with \"grids\" "
                             f"(iteration {record.get('iteration')}, rank {record.get('rank')} has none)")
        _missing(record, self.needed)
        return self.of_grids(record["grids"], record["lengths"])

    def of_pack(self, pack) -> PackFeatures:
        return self.of_grids(self.grid_features.grids(pack), self.grid_features.lengths(pack))

    def tokens(self, pack) -> int:
        return int(sum(self.grid_features.encoder_tokens(pack)))


def features_for_records(records, *, tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE,
                         flops_model: Optional[CostModel] = None, flops_note: str = "no vision config given"):
    """The features a run's records call for: :class:`QwenVLFeatures` when every record has
    ``grids`` (Megatron-Bridge's Qwen-VL timing hooks), :class:`TileFeatures` when none has;
    a one-line error for a mix."""
    with_grids = sum(1 for r in records if isinstance(r, dict) and "grids" in r)
    if with_grids and with_grids != len(records):
        raise ValueError(f"{with_grids} of {len(records)} timing records have \"grids\": "
                         "records of one run are all Qwen-VL's or all tiled")
    if with_grids:
        return QwenVLFeatures(flops_model=flops_model, flops_note=flops_note)
    return TileFeatures(tokens_per_tile)
