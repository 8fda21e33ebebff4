"""``mm_balance.vision=images``: Qwen3-VL's vision tower balanced frame by frame inside each
micro-step's meeting group, planned and sent ahead on the exchange thread.

Moving whole packs cannot even out the encoder when one pack holds most of a micro-step's
frames (a few large images or a video next to text-only packs). Bridge's Qwen3-VL tower
(``modelling_qwen3_vl/vision_model.py``) encodes every frame on its own: a grid ``(t, h,
w)`` is ``t`` frames of ``h*w`` patch rows (``build_packed_seq_params`` gives each frame its
own attention segment, ``cu_seqlens = repeat_interleave(h*w, t)``; the position
embeddings (``fast_pos_embed_interpolate``) and rotary positions (``rot_pos_emb``) depend on
``(h, w)`` only and repeat per frame; the mergers turn each frame's ``h*w`` rows into
``h*w/merge^2`` rows). So a frame may be encoded on any rank and its rows sent back: the
outputs, the loss and every gradient are the unbalanced run's, up to the arithmetic order
of GEMMs over other row counts (tests/bridge/test_vision_images_realpath.py).

Ranks wait for each other within an iteration only inside their expert-parallel group (the
exchange group's meeting groups, ``runtime/meeting.py``), so that is where a micro-step's frames
are balanced; without expert parallelism nothing is gained per micro-step, and one line says so.
This module is glue over the runtime's images mode, the component the Megatron-LM path's tiles
use too:

* the exchange thread (``runtime/frame_ahead.py``) reads each pulled pack's frames as the tower
  will receive them (:class:`FrameReader`: Bridge's own ``reorganize_inputs`` on the pack's
  ids and visual inputs and, under context parallelism with ``vision_dp_when_cp``, its frame
  split, this rank's share), gathers the global batch's frame table once at its meeting, plans
  each micro-step's frames in its group one micro-step ahead and sends the pixel rows each rank
  encodes for others ahead of time;
* in the micro-step (``runtime/image_exchange.py``), the tower's replaced ``forward``
  (:class:`BalancedFrames`) encodes the received frames, sends their outputs (the main
  embeddings and every deepstack feature side by side) to their owners, encodes its own kept
  frames while they travel, and puts every row back in this rank's order; backward sends the
  output gradients the other way. Only point-to-point transfers inside the group, on
  communicators of their own (:func:`~megatron_mm_balance.megatron.vision.init_vision_groups`);
  a rank that does not call the tower takes part where it would have (a forward hook on
  ``language_model.embedding``, or, for an empty context-parallel share, Bridge's
  ``AllGatherVisionEmbeddings``, replaced by name in Bridge's model module by a wrapper of
  Bridge's own), its empty result joined to the graph as ``0 * sum``.

The per-frame cost is :func:`~.cp_split.frame_cost_for` (``p * (p + alpha)``); no rank receiving
frames ends above ``mm_balance.image_patch_cap`` patches (default: the most any rank held); a
moved frame's outputs and their gradients count on its receiver, at the settings' rates or
(``mm_balance.image_rates=measured``) at those the group measured, agreed at each batch's
meeting. With ``mm_balance.mode=crossover-*`` the frames are balanced at the iterations whose
packs move (the exchange thread's delivery mode), and the plain tower runs at the others.
Every log interval each step group's first rank writes one ``[mm-balance-vision] iteration N |
...`` line (:meth:`~megatron_mm_balance.runtime.frames.FrameWindow.summary`) and
``mm-balance-vision/*`` scalars through Bridge's writers (else its own ``.mm_balance_vision``
events file). Evaluation and no-grad forwards are not balanced.
"""
from __future__ import annotations

import sys
from typing import Callable, List, Optional

import numpy as np

from ..megatron.config import CROSSOVER_MODES, MEASURING_MODES
from ..runtime.log_line import emit_line
from .cp_split import QWEN3_VL_MODEL

CHOICES = ("packs", "images")
#: ``mm_balance.image_rates``: moves charged at the settings' rates, or at those the run measures
RATE_CHOICES = ("settings", "measured")
#: ``mm_balance.image_pack_cost``: what packs are placed on ahead of the frame exchange
PACK_COST_CHOICES = ("heaviest-frame", "cost")
#: a transfer moving fewer bytes through a rank than this is not a link sample (it times the
#: latency, not the link)
LINK_SAMPLE_MIN_BYTES = 256 * 1024
#: nominal ``(link GB/s, vision tower TFLOP/s)`` by device type, used where
#: ``mm_balance.image_link_gbps`` / ``vision_tflops`` are not set: on GPUs one 200 Gb/s NIC
#: per GPU (the inter-node link a data-parallel group crosses) and bf16 dense at about 40% of
#: an H100's peak; on CPU gloo between processes and fp32 GEMMs on one core
#: (benchmarks/bench_cpu_transfer_rates.py; docs/bridge.md §9)
NOMINAL_RATES = {"cuda": (25.0, 400.0), "cpu": (2.0, 0.05)}
GATHER_NAME = "AllGatherVisionEmbeddings"
#: the one line of a job whose ranks do not meet within an iteration
NOTHING_TO_BALANCE = ("[mm-balance-vision] no expert parallelism, so no rank waits for another within an "
                      "iteration and no micro-step is balanced: frames stay with their packs")


# -- settings -----------------------------------------------------------------------------

def checked_vision(mm, spec) -> str:
    """``mm_balance.vision`` and ``mm_balance.image_patch_cap`` checked against the run (``spec``:
    the model's :class:`~.model_spec.ModelSpec`; the same answer on every rank: settings only);
    one-line errors naming the setting."""
    from ..megatron.checks import MMBalanceConfigError
    vision = getattr(mm, "vision", "packs")
    if vision not in CHOICES:
        raise MMBalanceConfigError(f"mm_balance.vision must be one of {', '.join(CHOICES)}, got {vision!r}")
    cap = getattr(mm, "image_patch_cap", None)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise MMBalanceConfigError(f"mm_balance.image_patch_cap must be a positive integer (patches), got {cap!r}")
    if not isinstance(getattr(mm, "image_overlap", True), bool):
        raise MMBalanceConfigError(f"mm_balance.image_overlap must be true or false, got {mm.image_overlap!r}")
    pack_cost = getattr(mm, "image_pack_cost", PACK_COST_CHOICES[0])
    if pack_cost not in PACK_COST_CHOICES:
        raise MMBalanceConfigError(f"mm_balance.image_pack_cost must be one of {', '.join(PACK_COST_CHOICES)}, "
                                   f"got {pack_cost!r}")
    rates = getattr(mm, "image_rates", "settings")
    if rates not in RATE_CHOICES:
        raise MMBalanceConfigError(f"mm_balance.image_rates must be one of {', '.join(RATE_CHOICES)}, got {rates!r}")
    for name, unit in (("image_link_gbps", "GB/s"), ("vision_tflops", "TFLOP/s")):
        value = getattr(mm, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0 or (name == "vision_tflops" and value == float("inf"))):
            raise MMBalanceConfigError(f"mm_balance.{name} must be a positive number ({unit}), got {value!r}")
    if vision == "packs":
        return vision
    refusal = _refusal(mm, spec)
    if refusal:
        raise MMBalanceConfigError(f"mm_balance.vision=images {refusal}")
    return vision


def pack_cost_for(mm, spec, default_cost):
    """The pack placement's cost under ``mm_balance.vision=images`` with
    ``image_pack_cost=heaviest-frame``: each pack's heaviest frame by the frame planner's own
    per-frame cost (:func:`~.cp_split.frame_cost_for`,
    :class:`~megatron_mm_balance.cost.pack.QwenVLHeaviestFrameCost`); else ``default_cost``
    (``mm_balance.cost``'s)."""
    if getattr(mm, "vision", "packs") != "images" or getattr(mm, "image_pack_cost", PACK_COST_CHOICES[0]) != \
            "heaviest-frame":
        return default_cost
    from ..cost.pack import QwenVLHeaviestFrameCost
    from .cp_split import frame_alpha_for, frame_cost_for
    return QwenVLHeaviestFrameCost(spec.spatial_merge_size, frame_cost_for(spec),
                                   name=f"alpha={frame_alpha_for(spec)}")


def _refusal(mm, spec) -> Optional[str]:
    if not getattr(mm, "enabled", False):
        return "needs mm_balance.enabled=true (packs move first, frames then even out what packs cannot)"
    if getattr(mm, "mode", "auto") in MEASURING_MODES and mm.mode not in CROSSOVER_MODES:
        return (f"moves frames between ranks; mm_balance.mode={mm.mode} moves nothing: use exchange, auto, "
                "crossover-even or crossover-odd")
    if getattr(mm, "cost", None) == "auto":
        return ("cannot be combined with mm_balance.cost=auto: a pack's vision timing would be that of "
                "other ranks' frames; use mm_balance.cost=image-tokens or model")
    if not spec.qwen3_tower:
        return ("needs a Qwen3-VL vision tower (model.vision_config with deepstack_visual_indexes); "
                f"{spec.provider} has none")
    if spec.vision_cuda_graph_impl != "none":
        return (f"cannot run with vision CUDA graphs (model.vision_cuda_graph_impl={spec.vision_cuda_graph_impl}: "
                "every micro-batch padded to one length); set it to none")
    if spec.dist_train:
        return ("cannot be combined with model.dist_train.use_dist_train (the vision tower on ranks of "
                "its own); turn one off")
    return None


def transfer_rates(mm, device_type: str) -> tuple:
    """``(link GB/s, tower TFLOP/s)``: the settings, else :data:`NOMINAL_RATES` of the device."""
    link, tflops = NOMINAL_RATES.get(device_type, NOMINAL_RATES["cuda"])
    given_link, given_tflops = getattr(mm, "image_link_gbps", None), getattr(mm, "vision_tflops", None)
    return (float(link if given_link is None else given_link),
            float(tflops if given_tflops is None else given_tflops))


def tower_flops_per_unit(spec) -> float:
    """Forward FLOPs of one unit of the frame cost ``p * (p + alpha)``
    (:func:`~.cp_split.frame_alpha_for`): the tower multiplies and adds
    ``2*hidden*p*(p + alpha)`` times per full-attention layer (``alpha`` carries the
    projections, MLPs, patch embedding and mergers), so a unit is one layer's attention
    multiply-adds per squared patch
    (:meth:`~megatron_mm_balance.cost.flops.VisionTower.attention_macs_per_patch_sq`), two
    FLOPs each, over the full-attention layers."""
    tower = spec.required_tower()
    return 2.0 * tower.attention_macs_per_patch_sq() * tower.full_attention_layers


# -- frames of Qwen3-VL packs ----------------------------------------------------------------

def frames_of(grid_thw) -> np.ndarray:
    """``[frames, 2]`` (h, w) of every frame of ``(t, h, w)`` grids, in row order (host tensors)."""
    if grid_thw is None:
        return np.zeros((0, 2), dtype=np.int64)
    g = np.asarray(grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw, dtype=np.int64).reshape(-1, 3)
    return np.repeat(g[:, 1:], g[:, 0], axis=0)


def frame_grid(hw: np.ndarray, device=None):
    """``(t, h, w)`` grids of frames ``hw``, consecutive frames of one size merged (as
    Bridge's ``collapse_thw``: a frame is its own attention segment either way)."""
    import torch
    rows = []
    for h, w in np.asarray(hw, dtype=np.int64).reshape(-1, 2).tolist():
        if rows and rows[-1][1:] == [h, w]:
            rows[-1][0] += 1
        else:
            rows.append([1, h, w])
    return torch.tensor(rows, dtype=torch.long, device=device).reshape(-1, 3)


#: the visual fields Bridge's Qwen3-VL forward takes (``visual_inputs.normalized_for_model()``)
VISUAL_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw")


class FrameReader:
    """A Qwen3-VL pack's frames as this rank's tower will receive them (run on the exchange
    thread, on the pack's host tensors): Bridge's own ``reorganize_inputs`` on the pack's ids
    (``tokens``, else ``input_ids``) and ``visual_inputs``, then, when ``cp_size > 1`` and the
    model splits frames across context-parallel ranks, the split Bridge's forward runs
    (``qwen3vl_cp_split`` as the model module holds it, ``get_vision_cp_data``,
    ``collapse_thw``) for ``cp_rank``. Each frame: cost ``frame_cost(h*w)``, ``h*w`` pixel rows
    in, ``h*w / merge^2`` rows out, ``(h, w)`` to encode it elsewhere."""

    meta_width = 2

    def __init__(self, model, frame_cost: Callable[[int], int], *, cp_rank: int = 0, cp_size: int = 1,
                 split_across_cp: bool = False):
        self.image_token_id, self.video_token_id = model.image_token_id, model.video_token_id
        self.square = int(model.square_merge_size)
        self.frame_cost = frame_cost
        self.cp_rank, self.cp_size, self.split = int(cp_rank), int(cp_size), bool(split_across_cp) and cp_size > 1

    def __call__(self, pack):
        import torch

        from ..runtime.frame_ahead import Units
        data, grid = self._tower_input(pack)
        if grid is None or grid.shape[0] == 0 or data is None or data.shape[0] == 0:
            return Units.none(self.meta_width)
        hw = frames_of(grid)
        patches = hw[:, 0] * hw[:, 1]
        if int(patches.sum()) != int(data.shape[0]) or np.any(patches % self.square):
            raise ValueError(f"mm_balance.vision=images: a pack's pixel rows ({int(data.shape[0])}) are not its "
                             f"frames' patches ({int(patches.sum())}, each a multiple of {self.square})")
        cost = np.array([int(self.frame_cost(int(p))) for p in patches], dtype=np.int64)
        return Units(cost=cost, in_rows=patches, out_rows=patches // self.square, meta=hw,
                     rows=data.detach() if isinstance(data, torch.Tensor) else data)

    def encode_args(self, meta) -> tuple:
        return (frame_grid(meta),)

    def _tower_input(self, pack):
        qmodel = sys.modules.get(QWEN3_VL_MODEL)
        if qmodel is None:
            raise RuntimeError(f"mm_balance.vision=images: {QWEN3_VL_MODEL} is not imported")
        visual = _visual_fields(pack)
        if visual.get("pixel_values") is None and visual.get("pixel_values_videos") is None:
            return None, None
        ids = pack.get("tokens") if pack.get("tokens") is not None else pack.get("input_ids")
        data, grid, _ = qmodel.reorganize_inputs(input_ids=ids, image_token_id=self.image_token_id,
                                                 video_token_id=self.video_token_id,
                                                 square_merge_size=self.square, **visual)
        if grid is None or grid.shape[0] == 0 or not self.split:
            return data, grid
        data, grid, cp_img_num, padded = qmodel.qwen3vl_cp_split(self.cp_size, data, grid)
        data, grid, _ = qmodel.get_vision_cp_data(data, grid, self.square, cp_img_num, padded, self.cp_rank,
                                                  self.cp_size)
        return data, qmodel.collapse_thw(grid)


def _visual_fields(pack) -> dict:
    """The pack's visual fields as Bridge's step hands them to the model."""
    holder = pack.get("visual_inputs") if hasattr(pack, "get") else None
    if holder is None:
        return {k: pack.get(k) for k in VISUAL_KEYS if hasattr(pack, "get") and pack.get(k) is not None}
    if hasattr(holder, "normalized_for_model"):
        fields = holder.normalized_for_model()
    elif isinstance(holder, dict):
        fields = holder
    else:
        fields = vars(holder)
    return {k: fields.get(k) for k in VISUAL_KEYS if fields.get(k) is not None}


# -- the hooks ---------------------------------------------------------------------------------

class BalancedFrames:
    """The hooks of one model chunk (a Bridge ``Qwen3VLModel``) over the runtime's
    :class:`~megatron_mm_balance.runtime.image_exchange.FrameSteps`; :meth:`remove` takes them off."""

    def __init__(self, model, steps):
        self.model, self.steps = model, steps
        self.vision = model.vision_model
        self.width = int(model.config.hidden_size)
        self.deepstack = len(model.vision_transformer_config.deepstack_visual_indexes)
        self._encoding = False          # inside the balanced encode: the real tower runs
        self._original_forward = self.vision.forward
        self._own_forward = "forward" in vars(self.vision)
        self.vision.forward = self._vision_forward
        self._handles = [model.register_forward_pre_hook(self._before_model),
                         model.register_forward_hook(self._after_model),
                         model.language_model.embedding.register_forward_hook(self._after_text_embedding)]
        _ACTIVE.append(self)

    # -- hooks ---------------------------------------------------------------------------------
    def _before_model(self, module, args):
        import torch
        if module.training and torch.is_grad_enabled():
            self.steps.begin()

    def _vision_forward(self, hidden_states=None, grid_thw=None, *args, **kwargs):
        if self._encoding:
            return self._original_forward(hidden_states, grid_thw, *args, **kwargs)
        if not self.steps.balanced():                  # nothing crosses this rank: timed as it is
            return self.steps.plain(lambda: self._original_forward(hidden_states, grid_thw, *args, **kwargs))
        if args or any(v is not None for v in kwargs.values()):
            raise RuntimeError("mm_balance.vision=images: the vision tower was called with arguments "
                               "beyond hidden_states and grid_thw")
        out = self.steps.outputs(hidden_states)
        embeddings, *deepstack = [part.contiguous() for part in out.split(self.width, dim=1)]
        return embeddings, deepstack

    def before_cp_gather(self, x):
        """Bridge's context-parallel gather of this rank's embeddings is next: a rank whose
        share was empty (so the tower was not called) takes part in its exchange here."""
        result = self.steps.take_part()
        if result is None:
            return x
        if x.shape[0] != 0:
            raise RuntimeError("mm_balance.vision=images: the vision embeddings reached the context-"
                               "parallel gather without the balanced tower")
        return _joined(x, result)

    def _after_text_embedding(self, module, args, output):
        result = self.steps.take_part()     # no grids here: the tower is not called
        return None if result is None else _joined(output, result)

    def _after_model(self, module, args, output):
        if self.steps.current is not None:
            self.steps.end()

    # -- what the runtime calls ------------------------------------------------------------------
    def encode(self, rows, args):
        """The real tower on frames (``args``: their grid), through its own ``__call__`` (hooks,
        e.g. the timing hooks, still fire): main and deepstack outputs side by side."""
        import torch
        self._encoding = True
        try:
            embeddings, deepstack = self.vision(hidden_states=rows, grid_thw=args[0])
        finally:
            self._encoding = False
        out = torch.cat([embeddings, *deepstack], dim=1)
        if out.shape[1] != (1 + self.deepstack) * self.width:
            raise RuntimeError(f"mm_balance.vision=images: the tower returned {tuple(out.shape)} side by side, "
                               f"expected width {(1 + self.deepstack) * self.width}")
        return out

    def empty(self):
        """The outputs of no frame: the tower's output dtype, needing gradients when it trains."""
        import torch
        params = [p for p in self.vision.parameters() if p.is_floating_point()]
        return torch.zeros((0, (1 + self.deepstack) * self.width), dtype=params[0].dtype, device=params[0].device,
                           requires_grad=any(p.requires_grad for p in params))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        if self._own_forward:
            self.vision.forward = self._original_forward
        else:
            del self.vision.forward
        if self in _ACTIVE:
            _ACTIVE.remove(self)


def _joined(x, result):
    """``x`` with the (empty) exchange result joined to its graph as ``0 * sum``: no value
    changes, and backward reaches the exchange through ``x``."""
    if result is None or not result.requires_grad:
        return x
    return x + (result.sum() * 0).to(x.dtype)


#: the installed hooks (the context-parallel gather wrapper asks the one whose forward runs)
_ACTIVE: List[BalancedFrames] = []


def _gather_joining_empty_shares(bridge_gather):
    """Bridge's ``AllGatherVisionEmbeddings`` whose ``apply`` first lets a rank with an empty
    context-parallel share take part in its vision exchange (see the module docstring)."""

    class AllGatherVisionEmbeddings:
        mm_balance_wraps = bridge_gather

        @staticmethod
        def apply(x, *args):
            for hooks in list(_ACTIVE):
                x = hooks.before_cp_gather(x)
            return bridge_gather.apply(x, *args)

    return AllGatherVisionEmbeddings


def _install_cp_gather() -> None:
    module = sys.modules.get(QWEN3_VL_MODEL)
    current = getattr(module, GATHER_NAME, None) if module is not None else None
    if current is None:
        raise RuntimeError(f"mm_balance.vision=images under context parallelism: {QWEN3_VL_MODEL} has "
                           f"no {GATHER_NAME} in this Megatron-Bridge")
    if getattr(current, "mm_balance_wraps", None) is None:
        setattr(module, GATHER_NAME, _gather_joining_empty_shares(current))


# -- telemetry ----------------------------------------------------------------------------------

class FrameReport:
    """One ``[mm-balance-vision] iteration N | step_group: G | ...`` line (and
    ``mm-balance-vision/*`` scalars) every ``interval`` iterations, on each step group's first
    rank (``reporter``); the other ranks only count. ``step_group``: the group's index in the
    exchange group."""

    def __init__(self, *, interval: int, iteration_fn: Callable[[], Optional[int]], reporter: bool,
                 writers: tuple = (None, None), step_group: int = 0):
        from ..runtime.frames import FrameWindow
        self.interval, self.iteration_fn, self.reporter = max(1, int(interval)), iteration_fn, reporter
        self.tb_writer, self.wandb_writer = writers
        self.step_group = int(step_group)
        self.window = FrameWindow()
        self._iteration = None
        self.lines: List[str] = []

    def __call__(self, frames) -> None:
        """A micro-step's :class:`~megatron_mm_balance.runtime.frame_ahead.StepFrames`."""
        self.add(frames.figures)

    def add(self, figures) -> None:
        it = self.iteration_fn()
        if it is not None and it != self._iteration:
            if self._iteration is not None:
                self._maybe_report(self._iteration, it)
            self._iteration = it
        self.window.add(figures)

    def _maybe_report(self, last: int, now: int) -> None:
        """The window's line when an interval's end lies between ``last``, the iteration of its
        newest figures, and ``now``, the first iteration after it with figures, labelled
        ``last``. Every training iteration adds figures but for ``mm_balance.mode=crossover-*``,
        which balances every other one: its lines then name the balanced iterations."""
        from ..runtime.frames import FrameWindow
        if last < 1 or (now - 1) // self.interval * self.interval < last or not self.window.micro_steps:
            return
        summary = {"step_group": float(self.step_group), **self.window.summary()}
        self.window = FrameWindow()
        if not self.reporter:
            return
        line = f"[mm-balance-vision] iteration {last} | " + " | ".join(f"{k}: {v:.6g}" for k, v in summary.items())
        emit_line(line)
        self.lines = (self.lines + [line])[-64:]
        if self.tb_writer is not None:
            for k, v in summary.items():
                self.tb_writer.add_scalar(f"mm-balance-vision/{k}", v, last)
        if self.wandb_writer is not None:
            self.wandb_writer.log({f"mm-balance-vision/{k}": v for k, v in summary.items()}, last)


def _report_writers(state, tensorboard_dir, reporter: bool) -> tuple:
    """Bridge's TensorBoard / W&B writers where this rank has them; else, on the reporting
    rank, its own TensorBoard events file beside the run's (as the pack telemetry does)."""
    tb = getattr(state, "tensorboard_logger", None) if state is not None else None
    wandb = getattr(state, "wandb_logger", None) if state is not None else None
    if tb is None and wandb is None and reporter and tensorboard_dir:
        from ..megatron.telemetry import own_tensorboard_writer
        tb = own_tensorboard_writer(tensorboard_dir, ".mm_balance_vision")     # None: the line only
    return tb, wandb


# -- installation -----------------------------------------------------------------------------

class FrameBalance:
    """What :func:`install_frame_balance` set up on this rank: the exchange thread's side
    (``ahead``, for the iterator of model chunk ``chunk``) and the hooks."""

    def __init__(self, ahead, chunk: int, hooks: BalancedFrames):
        self.ahead, self.chunk, self.hooks = ahead, chunk, hooks

    def frames_for(self, chunk: int):
        """The frame side of model chunk ``chunk``'s iterator (None for the others)."""
        return self.ahead if chunk == self.chunk else None


def install_frame_balance(model, mm, spec, core_cfg, args, pg_collection, groups, state=None,
                          timing=None) -> Optional[FrameBalance]:
    """``mm_balance.vision=images``: the vision groups (collective over the world: call on
    every rank at the same point), then on this rank's Qwen3-VL model chunk with a vision tower
    the exchange thread's side over its exchange group's meeting groups (``groups.meetings``)
    and the hooks. None off the first pipeline stage, and without expert parallelism (one line
    says so). ``mm``: ``cfg.mm_balance``; ``spec``: the model's :class:`~.model_spec.ModelSpec`;
    ``timing``: this rank's timing recorder, whose records then split the exchange's forward."""
    import torch.distributed as dist

    from ..megatron.config import live_iteration
    from ..megatron.groups import RankLayout
    from ..megatron.timing import unwrap
    from ..megatron.vision import init_vision_groups
    from ..runtime.frame_ahead import FrameAhead, MeasuredRates, MovePrices
    from ..runtime.image_exchange import FrameSteps
    from .cp_split import frame_cost_for

    if checked_vision(mm, spec) != "images":
        return None
    if model is None:
        raise ValueError("mm_balance.vision=images needs the model: the setup.py patch passes model=model "
                         "to wrap_train_data_iterator (re-apply scripts/apply_patches.sh)")
    if spec.expert_model_parallel_size <= 1:
        if not dist.is_initialized() or dist.get_rank() == 0:
            emit_line(NOTHING_TO_BALANCE)
        return None
    first_stage = pg_collection.pp.rank() == 0
    layout = RankLayout(first_stage, tuple(int(r) for r in dist.get_process_group_ranks(pg_collection.dp)))
    group = init_vision_groups(core_cfg.timeout, layout=layout)
    chunks = model if isinstance(model, (list, tuple)) else [model]
    found = [(i, unwrap(c)) for i, c in enumerate(chunks) if getattr(unwrap(c), "vision_model", None) is not None]
    if group is None or not found:
        return None
    chunk, inner = found[0]
    if not hasattr(inner, "vision_transformer_config") or getattr(inner, "language_model", None) is None:
        raise RuntimeError(f"mm_balance.vision=images needs Bridge's Qwen3-VL model; this rank's model "
                           f"is a {type(inner).__name__}")
    meetings = getattr(groups, "meetings", None)
    if meetings is None:
        raise RuntimeError("mm_balance.vision=images: the job's meeting groups were not read with the exchange "
                           "groups, so the frames' groups are unknown")
    if spec.splits_frames_across_cp:
        _install_cp_gather()
    device = next(inner.vision_model.parameters()).device
    link, tflops = transfer_rates(mm, device.type)
    params = [p for p in inner.vision_model.parameters() if p.is_floating_point()]
    out_row_bytes = (1 + len(inner.vision_transformer_config.deepstack_visual_indexes)) * \
        int(inner.config.hidden_size) * params[0].element_size()
    flops_per_unit = tower_flops_per_unit(spec)
    prices = MovePrices(out_row_bytes, flops_per_unit, any(p.requires_grad for p in params), link, tflops,
                        measured=getattr(mm, "image_rates", "settings") == "measured")
    rates = MeasuredRates(LINK_SAMPLE_MIN_BYTES)
    reader = FrameReader(inner, frame_cost_for(spec), cp_rank=pg_collection.cp.rank(),
                         cp_size=pg_collection.cp.size(), split_across_cp=spec.splits_frames_across_cp)
    ahead = FrameAhead(reader, meetings.steps, device=device, patch_cap=getattr(mm, "image_patch_cap", None),
                       pipeline_stages=spec.pipeline_model_parallel_size, prices=prices, rates=rates)
    me = dist.get_rank()
    step_group = meetings.steps.index(meetings.step_group)
    reporter = me == meetings.step_group[0]
    report = FrameReport(interval=core_cfg.log_interval, iteration_fn=live_iteration(args), reporter=reporter,
                         writers=_report_writers(state, core_cfg.tensorboard_dir, reporter), step_group=step_group)
    hooks = []
    steps = FrameSteps(ahead.relay, group, encode=lambda rows, a: hooks[0].encode(rows, a),
                       empty=lambda: hooks[0].empty(), timeout=core_cfg.timeout, rates=rates,
                       flops_per_unit=flops_per_unit, detail=None if timing is None else timing.add_detail,
                       detail_backward=None if timing is None else timing.add_backward_detail,
                       report=report, device_type=device.type, overlap=bool(getattr(mm, "image_overlap", True)))
    hooks.append(BalancedFrames(inner, steps))
    return FrameBalance(ahead, chunk, hooks[0])
