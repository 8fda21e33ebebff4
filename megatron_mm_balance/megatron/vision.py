"""``--mm-balance-vision images``: the vision encoder of a LLaVA-style model balanced image
by image across data-parallel ranks, every micro-step.

Moving whole packs cannot even out the encoder when one pack holds most of a micro-step's
tiles. Per-tile encoders (the example's CLIP/SigLIP/InternViT) compute each tile on its
own, so a rank may encode another rank's tiles and send the embeddings back
(:mod:`megatron_mm_balance.runtime.image_exchange`): the embeddings, the loss and every
gradient are the unbalanced run's; only which rank computes which tile changes.

Wiring, on the first pipeline stage of every model chunk that has a ``vision_model``
(Megatron's ``LLaVAModel``), with no change to Megatron's code:

1. a forward pre-hook on the model, in training forwards only, reads the micro-step's
   ``images`` ``[num_tiles, C, H, W]`` (possibly none), all-gathers the tile costs and
   shapes over this rank's vision group, plans (:class:`ImagePlan`, the same on every
   rank), sends tiles to their encoder ranks, encodes what arrived (through the vision
   model's own ``__call__``, so hooks still fire), and sends the embeddings back;
2. the vision model's ``forward`` returns those embeddings when the model calls it;
3. a rank whose pack has no tiles is never asked for embeddings (the model skips its
   encoder), yet it may have encoded others' tiles and must take part in their backward:
   a forward hook on ``language_model.embedding`` adds ``0 * sum`` of its (empty) result
   to the text embeddings, so backward reaches the exchange at the same point of the
   graph as on the other ranks (after the decoder, before the embeddings), with no effect
   on any value.

Every rank of a vision group runs the pre-hook at the same micro-step (each runs the same
schedule), so the collectives line up; backward's send/receive of the embedding gradients
happens inside autograd. The groups are the data-parallel groups of the first pipeline
stage, one per tensor-parallel rank (TP ranks hold the same tiles and so reach the same
plan), on communicators of their own (created by :func:`init_vision_groups`), so the
transfers never interleave with the gradient reductions of Megatron's DDP.

Cost of a tile: its pixels (``H * W``), integers on every rank; the example's tiles are
one size, so this evens out the tile count. Evaluation and no-grad forwards are not
balanced (no collectives).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from ..runtime.log_line import emit_line
from ..runtime.image_exchange import ImageExchange, ImagePlan, gather_image_costs

#: dtype codes of the shapes all-gather (the same table on every rank)
_DTYPES = ("float32", "bfloat16", "float16", "float64", "uint8")
_MAX_DIMS = 6


def tile_costs(images) -> List[int]:
    """Integer cost per tile: its pixels (every tile of the example is one size)."""
    if images is None or images.shape[0] == 0:
        return []
    return [int(np.prod(images.shape[2:]))] * int(images.shape[0])


@dataclass
class VisionBalanceStats:
    """Counts since the hooks were installed (every rank of a group sees the same plans)."""

    microsteps: int = 0
    tiles: int = 0
    tiles_moved: int = 0
    #: micro-steps on which this rank's pack had no tiles but it encoded others'
    encoded_for_others_only: int = 0
    #: summed over the micro-steps: the largest per-rank tile count before and after
    #: balancing (sums, not lists: the counts live as long as the job)
    max_before_sum: int = 0
    max_after_sum: int = 0


def format_stats(s: VisionBalanceStats, upto: int, num_ranks: int) -> str:
    """One log line of a window of micro-steps (the group's first rank prints it)."""
    first = upto - s.microsteps + 1
    ideal = s.tiles / max(1, s.microsteps) / max(1, num_ranks)
    return (f"[mm-balance] vision images: micro-steps {first}-{upto}: tiles {s.tiles}, moved "
            f"{s.tiles_moved} ({100.0 * s.tiles_moved / max(1, s.tiles):.1f}%), most tiles on one "
            f"rank per micro-step {s.max_before_sum / max(1, s.microsteps):.2f} -> "
            f"{s.max_after_sum / max(1, s.microsteps):.2f} (even "
            f"split {ideal:.2f})")


class BalancedVision:
    """The hooks of one model chunk; :meth:`remove` takes them off again."""

    def __init__(self, model, group, *, cost_fn=tile_costs, log_every: int = 0):
        import torch.distributed as dist

        self.model, self.group, self.cost_fn = model, group, cost_fn
        self.log_every = int(log_every) if dist.get_rank(group) == 0 else 0
        self._window = VisionBalanceStats()
        self.vision = model.vision_model
        self.stats = VisionBalanceStats()
        self._pending = None            # this micro-step's embeddings of the local tiles
        self._encoding = False          # inside the balanced encode: the real forward runs
        self._original_forward = self.vision.forward
        self._own_forward = "forward" in vars(self.vision)    # already set on the instance
        self.vision.forward = self._vision_forward
        self._handles = [model.register_forward_pre_hook(self._before_model, with_kwargs=True),
                         model.register_forward_hook(self._after_model)]
        embedding = getattr(getattr(model, "language_model", None), "embedding", None)
        if embedding is not None:
            self._handles.append(embedding.register_forward_hook(self._after_text_embedding))

    # -- hooks ---------------------------------------------------------------------------
    def _before_model(self, module, args, kwargs):
        import torch

        if not (module.training and torch.is_grad_enabled()):
            return None
        images = kwargs["images"] if "images" in kwargs else (args[0] if args else None)
        self._pending = self._balanced_encode(images)
        return None

    def _vision_forward(self, images, *args, **kwargs):
        if self._encoding or self._pending is None:
            return self._original_forward(images, *args, **kwargs)
        embeddings, self._pending = self._pending, None
        if embeddings.shape[0] != images.shape[0]:
            raise RuntimeError(f"--mm-balance-vision images: the model asked for {images.shape[0]} "
                               f"tile embeddings, the balanced encode made {embeddings.shape[0]}")
        return embeddings

    def _after_text_embedding(self, module, args, output):
        if self._pending is None:
            return None
        unused, self._pending = self._pending, None     # no tiles here: joined to the graph
        return output + unused.sum().to(output.dtype) * 0

    def _after_model(self, module, args, output):
        if self._pending is not None:
            raise RuntimeError("--mm-balance-vision images: the model neither used this "
                               "micro-step's tile embeddings nor its text embeddings")
        return None

    # -- the balanced encode -------------------------------------------------------------
    def _balanced_encode(self, images):
        import torch

        device = images.device if images is not None else next(self.vision.parameters()).device
        local = images if images is not None and images.shape[0] > 0 else None
        costs = gather_image_costs(self.cost_fn(local), self.group, device=device)
        plan = ImagePlan.from_costs(costs)
        if plan.owner.size == 0:
            return None                 # no tiles anywhere in the group: nothing to do
        tile_shape, tile_dtype = _agreed_shape(local, self.group, device, "tiles")
        if local is None:
            local = torch.empty((0, *tile_shape), dtype=tile_dtype, device=device)
        exchange = ImageExchange(plan, self.group)
        to_encode = exchange.to_encoders(local)
        encoded = None
        if to_encode.shape[0] > 0:
            self._encoding = True
            try:
                encoded = self.vision(to_encode)
            finally:
                self._encoding = False
        emb_shape, emb_dtype = _agreed_shape(encoded, self.group, device, "tile embeddings")
        if encoded is None:
            encoded = torch.empty((0, *emb_shape), dtype=emb_dtype, device=device)
        self._count(plan, exchange, local.shape[0])
        return exchange.to_owners(encoded)

    def _count(self, plan: ImagePlan, exchange: ImageExchange, num_local: int) -> None:
        before = int(np.bincount(plan.owner, minlength=plan.num_ranks).max())
        after = int(np.bincount(plan.encoder, minlength=plan.num_ranks).max())
        for s in (self.stats, self._window):
            s.microsteps += 1
            s.tiles += int(plan.owner.size)
            s.tiles_moved += plan.moved()
            s.max_before_sum += before
            s.max_after_sum += after
            if num_local == 0 and exchange.num_encoded > 0:
                s.encoded_for_others_only += 1
        if self.log_every and self._window.microsteps >= self.log_every:
            emit_line(format_stats(self._window, self.stats.microsteps, plan.num_ranks))
            self._window = VisionBalanceStats()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        if self._own_forward:
            self.vision.forward = self._original_forward
        else:
            del self.vision.forward


def _agreed_shape(tensor, group, device, what: str):
    """The trailing shape and dtype every rank holding rows of ``what`` has (all-gathered,
    so a rank holding none can allocate matching buffers); ValueError when ranks differ."""
    import torch
    import torch.distributed as dist

    row = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
    if tensor is not None and tensor.shape[0] > 0:
        trailing = tuple(tensor.shape[1:])
        if len(trailing) > _MAX_DIMS or str(tensor.dtype).split(".")[-1] not in _DTYPES:
            raise ValueError(f"--mm-balance-vision images: {what} of shape {tuple(tensor.shape)} and "
                             f"dtype {tensor.dtype} are not supported")
        row[0] = _DTYPES.index(str(tensor.dtype).split(".")[-1])
        row[1] = len(trailing)
        row[2:2 + len(trailing)] = torch.tensor(trailing)
    row = row.to(device)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    known = {tuple(r.tolist()) for r in rows if int(r[0]) >= 0}
    if len(known) != 1:
        raise ValueError(f"--mm-balance-vision images: the ranks' {what} differ in shape or dtype "
                         f"({sorted(known)}); every tile must have one shape")
    code = known.pop()
    return tuple(code[2:2 + code[1]]), getattr(torch, _DTYPES[code[0]])


# -- groups and installation -------------------------------------------------------------

def init_vision_groups(timeout: float, layout=None) -> Optional[object]:
    """Create, collectively over the world, one communicator per data-parallel group of the
    first pipeline stage (one per tensor- and context-parallel position); return this rank's
    (None off that stage). Every rank must call it at the same point
    (:func:`~.iterator.wrap_train_data_iterator`; Megatron-Bridge's glue too). ``layout``:
    this rank's :class:`~.groups.RankLayout` (on the first stage?, its data-parallel ranks);
    default from ``megatron.core.parallel_state``."""
    import datetime

    import torch.distributed as dist

    from .groups import RankLayout, data_holding_rank_lists

    if layout is None:
        from megatron.core import parallel_state as mpu
        first_stage = mpu.get_pipeline_model_parallel_rank() == 0
        dp_ranks = dist.get_process_group_ranks(mpu.get_data_parallel_group())
        layout = RankLayout(first_stage, tuple(int(r) for r in dp_ranks))
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout)
    mine = None
    for ranks in data_holding_rank_lists(layouts):
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout))
        if dist.get_rank() in ranks:
            mine = group
    return mine


def install_vision_balance(model_chunks, group, *, log_every: int = 0) -> List[BalancedVision]:
    """Hooks on every model chunk that has a vision encoder on this rank (none elsewhere);
    the group's first rank logs every ``log_every`` micro-steps (0: never)."""
    from .timing import unwrap

    installed = []
    for chunk in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]):
        inner = unwrap(chunk)
        if group is not None and getattr(inner, "vision_model", None) is not None:
            installed.append(BalancedVision(inner, group, log_every=log_every))
    return installed
