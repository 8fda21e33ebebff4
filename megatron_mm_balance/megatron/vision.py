"""``--mm-balance-vision images``: the vision encoder of a LLaVA-style model balanced tile by
tile inside each micro-step's meeting group, planned ahead on the exchange thread.

Per-tile encoders (the example's CLIP/SigLIP/InternViT) compute each tile on its own, so a
rank may encode another rank's tiles and send the embeddings back: the embeddings, the loss
and every gradient are the unbalanced run's. Ranks wait for each other within an iteration
only inside their expert-parallel group (``ExchangeGroups.meetings``), so that is where each
micro-step's tiles are balanced; without expert parallelism nothing is gained per micro-step,
and one line says so.

This module is glue over the runtime's images mode (``runtime/frame_ahead.py``: the exchange
thread reads every pack's tiles, gathers the batch's table once at its meeting, plans each
micro-step in its group and sends the tiles ahead; ``runtime/image_exchange.py``: the
micro-step's point-to-point transfers of embeddings and their gradients), the same component
Megatron-Bridge's frames use. What is Megatron-LM's:

* :class:`TileReader`: a pack's units are the tiles of its ``imgs`` ``[tiles, C, H, W]``
  (``[1, 1]``: a text-only sample), each costing its pixels;
* :class:`BalancedVision`: on the first pipeline stage's model chunk that has a
  ``vision_model`` (Megatron's ``LLaVAModel``), with no change to Megatron's code, a forward
  pre-hook takes the micro-step's plan in training forwards, the vision model's ``forward``
  returns the balanced embeddings when the model calls it, and a rank whose pack has no tile
  (the model skips its encoder) takes part from a forward hook on ``language_model.embedding``
  (the empty result joined to the text embeddings as ``0 * sum``, so backward meets the
  transfers where the other ranks do). Received tiles are cast to the encoder's parameter
  dtype, as Megatron's ``Float16Module`` casts the model's inputs.

The training thread's transfers run on groups of their own (:func:`init_vision_groups`: the
data-parallel groups of the first pipeline stage), never the exchange thread's or DDP's.
Evaluation and no-grad forwards are not balanced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from ..runtime.log_line import emit_line


class TileReader:
    """A Megatron-LM pack's units: the tiles of its ``imgs`` (one row each, costing its pixels)."""

    meta_width = 0

    def __call__(self, pack):
        from ..runtime.frame_ahead import Units
        imgs = pack.get("imgs") if isinstance(pack, dict) else getattr(pack, "imgs", None)
        if imgs is None or imgs.dim() < 2 or tuple(imgs.shape) == (1, 1) or imgs.shape[0] == 0:
            return Units.none(0)
        n = int(imgs.shape[0])
        ones = np.ones(n, dtype=np.int64)
        return Units(cost=ones * int(np.prod(imgs.shape[1:])), in_rows=ones, out_rows=ones,
                     meta=np.zeros((n, 0), dtype=np.int64), rows=imgs)

    def encode_args(self, meta) -> tuple:
        return ()


@dataclass
class VisionBalanceStats:
    """Counts of one step group's micro-steps with tiles (every rank of a group sees the same)."""

    microsteps: int = 0
    tiles: int = 0
    tiles_moved: int = 0
    ranks: int = 1
    #: summed over the micro-steps: the largest per-rank tile count before and after balancing
    max_before_sum: int = 0
    max_after_sum: int = 0


def format_stats(s: VisionBalanceStats, upto: int) -> str:
    """One log line of a window of micro-steps (the step group's first rank prints it)."""
    first = upto - s.microsteps + 1
    ideal = s.tiles / max(1, s.microsteps) / max(1, s.ranks)
    return (f"[mm-balance] vision images: micro-steps {first}-{upto}: tiles {s.tiles}, moved "
            f"{s.tiles_moved} ({100.0 * s.tiles_moved / max(1, s.tiles):.1f}%), most tiles on one "
            f"rank per micro-step {s.max_before_sum / max(1, s.microsteps):.2f} -> "
            f"{s.max_after_sum / max(1, s.microsteps):.2f} (even "
            f"split {ideal:.2f})")


class TileReport:
    """Counts each micro-step's figures; the step group's first rank writes a line every
    ``log_every`` micro-steps with tiles (0: never)."""

    def __init__(self, rank: int, log_every: int = 0):
        self.rank, self.log_every = rank, int(log_every)
        self.stats, self._window = VisionBalanceStats(), VisionBalanceStats()

    def __call__(self, frames) -> None:
        f = frames.figures
        if f is None:
            return
        for s in (self.stats, self._window):
            s.microsteps += 1
            s.tiles += f.frames
            s.tiles_moved += f.frames_moved
            s.ranks = len(frames.group)
            s.max_before_sum += f.patches_max_before
            s.max_after_sum += f.patches_max_after
        if self.log_every and frames.group[0] == self.rank and self._window.microsteps >= self.log_every:
            emit_line(format_stats(self._window, self.stats.microsteps))
            self._window = VisionBalanceStats()


class BalancedVision:
    """The hooks of one model chunk over :class:`~megatron_mm_balance.runtime.image_exchange.FrameSteps`;
    :meth:`remove` takes them off again."""

    def __init__(self, model, steps):
        self.model, self.steps = model, steps
        self.vision = model.vision_model
        self._encoding = False
        self._out = None                    # (trailing shape, dtype) of the encoder's output rows
        self._original_forward = self.vision.forward
        self._own_forward = "forward" in vars(self.vision)    # already set on the instance
        self.vision.forward = self._vision_forward
        self._handles = [model.register_forward_pre_hook(self._before_model),
                         model.register_forward_hook(self._after_model)]
        embedding = getattr(getattr(model, "language_model", None), "embedding", None)
        if embedding is not None:
            self._handles.append(embedding.register_forward_hook(self._after_text_embedding))

    # -- hooks ---------------------------------------------------------------------------
    def _before_model(self, module, args):
        import torch
        if module.training and torch.is_grad_enabled():
            self.steps.begin()

    def _vision_forward(self, images, *args, **kwargs):
        if self._encoding or not self.steps.balanced():
            return self._original_forward(images, *args, **kwargs)
        if args or any(v is not None for v in kwargs.values()):
            raise RuntimeError("--mm-balance-vision images: the vision model was called with arguments "
                               "beyond the tiles (dynamic resolution is not balanced tile by tile)")
        return self.steps.outputs(images)

    def _after_text_embedding(self, module, args, output):
        result = self.steps.take_part()     # no tiles here: the encoder was not called
        if result is None:
            return None
        return output + result.sum().to(output.dtype) * 0

    def _after_model(self, module, args, output):
        if self.steps.current is not None:
            self.steps.end()
        return None

    # -- what the runtime calls ------------------------------------------------------------
    def encode(self, rows, args):
        """The vision model on tiles, through its own ``__call__`` (hooks still fire)."""
        dtype = self._param_dtype()
        if rows.is_floating_point() and rows.dtype != dtype:
            rows = rows.to(dtype)
        self._encoding = True
        try:
            out = self.vision(rows)
        finally:
            self._encoding = False
        self._out = (tuple(out.shape[1:]), out.dtype)
        return out

    def empty(self):
        """Embeddings of no tile (their shape from an encode, else from one zero tile through the
        encoder's own forward, once), needing gradients when the encoder trains."""
        import torch
        if self._out is None:
            frames = self.steps.current
            with torch.no_grad():
                probe = self._original_forward(torch.zeros((1, *frames.row_shape), dtype=self._param_dtype(),
                                                           device=self._device()))
            self._out = (tuple(probe.shape[1:]), probe.dtype)
        shape, dtype = self._out
        trains = any(p.requires_grad for p in self.vision.parameters())
        return torch.zeros((0, *shape), dtype=dtype, device=self._device(), requires_grad=trains)

    def _param_dtype(self):
        return next(p for p in self.vision.parameters() if p.is_floating_point()).dtype

    def _device(self):
        return next(self.vision.parameters()).device

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        if self._own_forward:
            self.vision.forward = self._original_forward
        else:
            del self.vision.forward


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


#: the one line of a job whose ranks do not meet within an iteration
NOTHING_TO_BALANCE = ("[mm-balance] vision images: no expert parallelism, so no rank waits for another within "
                      "an iteration and no micro-step is balanced: tiles stay with their packs")


def vision_chunk(model_chunks) -> Optional[int]:
    """The index of this rank's model chunk that has a vision encoder (None: none here)."""
    from .timing import unwrap
    for i, chunk in enumerate(model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]):
        if getattr(unwrap(chunk), "vision_model", None) is not None:
            return i
    return None


def install_vision_balance(model_chunks, step_groups, group, *, timeout: float, pipeline_stages: int = 1,
                           log_every: int = 0, rank: Optional[int] = None):
    """The exchange-thread side (a :class:`~megatron_mm_balance.runtime.frame_ahead.FrameAhead`
    over ``step_groups``, the exchange group's per-micro-step groups) and the hooks on this
    rank's model chunk with a vision encoder, whose training-thread transfers run on ``group``.
    Returns ``(frame_ahead, chunk index, hooks)``, or None where this rank has no encoder."""
    import torch.distributed as dist

    from ..runtime.frame_ahead import FrameAhead
    from ..runtime.image_exchange import FrameSteps
    from .timing import unwrap

    chunk = vision_chunk(model_chunks)
    if chunk is None or group is None:
        return None
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    inner = unwrap(chunks[chunk])
    device = next(inner.vision_model.parameters()).device
    ahead = FrameAhead(TileReader(), step_groups, device=device, pipeline_stages=pipeline_stages)
    rank = dist.get_rank() if rank is None else rank
    report = TileReport(rank, log_every)
    hooks = []
    steps = FrameSteps(ahead.relay, group, encode=lambda rows, args: hooks[0].encode(rows, args),
                       empty=lambda: hooks[0].empty(), timeout=timeout, report=report,
                       device_type=device.type)
    hooks.append(BalancedVision(inner, steps))
    hooks[0].report = report
    return ahead, chunk, hooks[0]


def vision_balance_for(model, cfg, exchange_groups, *, rank: Optional[int] = None) -> Optional[tuple]:
    """``--mm-balance-vision images`` for a Megatron-LM job: its communicators (collective over
    the world: every rank, here), then, under expert parallelism, :func:`install_vision_balance`
    on this rank's encoder chunk with its exchange group's step groups; without it, the one
    line (:data:`NOTHING_TO_BALANCE`, global rank 0, or ``rank``) and nothing installed."""
    import torch.distributed as dist

    if cfg.vision != "images":
        return None
    if model is None:
        raise ValueError("--mm-balance-vision images needs the model chunks (model=...)")
    if cfg.megatron.expert_model_parallel_size <= 1:
        if (rank if rank is not None else dist.get_rank() if dist.is_initialized() else 0) == 0:
            emit_line(NOTHING_TO_BALANCE)
        return None
    group = init_vision_groups(cfg.timeout)
    if group is None or vision_chunk(model) is None:
        return None
    meetings = getattr(exchange_groups, "meetings", None)
    if meetings is None:
        raise RuntimeError("--mm-balance-vision images: the job's meeting groups were not read with the exchange "
                           "groups (megatron.groups.init_exchange_groups), so the tiles' groups are unknown")
    sched = cfg.schedule
    per_step = max(1, (sched.global_batch_size or 0) // max(1, sched.micro_batch_size * sched.data_parallel_size))
    return install_vision_balance(model, meetings.steps, group, timeout=cfg.timeout,
                                  pipeline_stages=cfg.megatron.pipeline_model_parallel_size,
                                  log_every=cfg.log_interval * per_step)


def installed_hooks(found) -> List[BalancedVision]:
    """The hooks :func:`vision_balance_for` installed (none without)."""
    return [] if found is None else [found[2]]
