"""``mm_balance.vision=images``: Qwen3-VL's vision tower balanced frame by frame across the
data-parallel group, every training micro-step.

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

Per training forward of a model chunk with a ``vision_model`` (the first pipeline stage):

1. when Bridge's forward calls the tower (``vision_model(hidden_states=..., grid_thw=...)``,
   after ``reorganize_inputs`` and, under context parallelism with ``vision_dp_when_cp``, its
   frame split: this rank's share), the tower's replaced ``forward`` all-gathers the frames'
   integer costs and sizes on this rank's vision group (:func:`gather_unit_table`: one small
   collective with the counts, the headers and the per-frame integers, sized to the most
   frames a rank has held so far; a second only when a rank holds more), plans which rank encodes each
   frame (:func:`~megatron_mm_balance.runtime.frames.plan_frame_encoders`: the same plan on
   every rank), sends pixel rows to their encoder ranks, runs the real tower on what
   arrived (through its own ``__call__``, so hooks still fire) and returns the main
   embeddings and every deepstack feature in one exchange (concatenated along the feature
   dimension, split after), in this rank's own row order
   (:class:`~megatron_mm_balance.runtime.image_exchange.UnitExchange`: autograd both ways);
2. a rank that does not call the tower takes part at the point it would have: with no
   grids at all, from a forward hook on ``language_model.embedding`` (the next thing
   Bridge calls; nothing collective lies between), and the empty result is joined to the
   text embeddings as ``0 * sum``; under the context-parallel split, a rank whose share is
   empty does it from Bridge's ``AllGatherVisionEmbeddings`` (replaced by name in the model
   module by a wrapper of Bridge's own), joining the empty result to Bridge's empty
   placeholder that enters the gather. Either way backward meets the exchange where the
   other ranks do (after the decoder; under context parallelism after the gather's
   backward), and no value changes;
3. a micro-step with no frame on any rank of the group costs that one collective only.

Evaluation and no-grad forwards are not balanced (no collectives). The vision groups are
the data-parallel groups of the first pipeline stage, one per tensor- and context-parallel
position (:func:`megatron_mm_balance.megatron.vision.init_vision_groups`, shared with the
Megatron-LM path), on communicators of their own, created collectively at setup.

Frames are first split across the context-parallel ranks (Bridge's split, or
``mm_balance.cp_split=cost``), then balanced across the data-parallel group of the same
context-parallel rank; packs move first (the balanced iterator), frames then even out what
packs cannot. The per-frame cost is :func:`~.cp_split.frame_cost_for` (``p * (p + alpha)``,
``alpha`` the whole tower's per-patch work over its per-squared-patch attention); no rank
receiving frames ends above ``mm_balance.image_patch_cap`` patches (default: the most any
rank held before balancing); a moved frame's transfer time counts on
its receiver, at the settings' rates or (``mm_balance.image_rates=measured``) at those the
group measures (:mod:`megatron_mm_balance.runtime.rates`: each rank's medians ride in the
micro-step's first collective, so every rank agrees). Every log interval the group's first
rank writes one ``[mm-balance-vision] iteration N | ...`` line
(:meth:`~megatron_mm_balance.runtime.frames.FrameWindow.summary`) and ``mm-balance-vision/*``
scalars through Bridge's writers (else its own ``.mm_balance_vision`` events file).
"""
from __future__ import annotations

import sys
import time
from typing import Callable, List, Optional

import numpy as np

from ..megatron.config import CROSSOVER_MODES, MEASURING_MODES, crossover_parity
from ..runtime.log_line import emit_line
from .cp_split import QWEN3_VL_MODEL

CHOICES = ("packs", "images")
#: ``mm_balance.image_rates``: moves charged at the settings' rates, or at those the run measures
RATE_CHOICES = ("settings", "measured")
#: ``mm_balance.image_pack_cost``: what packs are placed on ahead of the frame exchange
PACK_COST_CHOICES = ("heaviest-frame", "cost")
#: a pixel exchange moving fewer bytes through a rank than this is not a link sample (it
#: times the latency, not the link)
LINK_SAMPLE_MIN_BYTES = 256 * 1024
#: nominal ``(link GB/s, vision tower TFLOP/s)`` by device type, used where
#: ``mm_balance.image_link_gbps`` / ``vision_tflops`` are not set: on GPUs one 200 Gb/s NIC
#: per GPU (the inter-node link a data-parallel group crosses) and bf16 dense at about 40% of
#: an H100's peak; on CPU gloo between processes and fp32 GEMMs on one core
#: (benchmarks/bench_cpu_transfer_rates.py; docs/bridge.md §9)
NOMINAL_RATES = {"cuda": (25.0, 400.0), "cpu": (2.0, 0.05)}
GATHER_NAME = "AllGatherVisionEmbeddings"
#: frames per rank the unit table's first collective carries until a rank holds more (three
#: integers each: a few hundred bytes)
TABLE_ROWS_AT_START = 16
#: dtype codes of the per-micro-step header (the same table on every rank)
DTYPES = ("float32", "bfloat16", "float16", "float64")


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


def balanced_iterations(mode: str, iteration_fn: Callable[[], Optional[int]]) -> Optional[Callable[[], bool]]:
    """``mm_balance.mode=crossover-even`` / ``crossover-odd``: a callable saying whether the
    training iteration now running (``iteration_fn``, the number Bridge prints) balances its
    frames: those whose packs move (:func:`~megatron_mm_balance.runtime.engine.delivery_mode`),
    so one job times every other iteration balanced at both levels and the rest as ``off`` runs
    them. None for the other modes (every training iteration balanced)."""
    parity = crossover_parity(mode)
    if parity is None:
        return None
    from ..runtime.config import BalancerConfig
    from ..runtime.engine import delivery_mode
    config = BalancerConfig(crossover=parity)

    def now() -> bool:
        iteration = iteration_fn()
        return iteration is not None and delivery_mode(config, iteration) == "exchange"
    return now


# -- frames of Qwen3-VL grids -----------------------------------------------------------------

def frames_of(grid_thw) -> np.ndarray:
    """``[frames, 2]`` (h, w) of every frame of ``(t, h, w)`` grids, in row order."""
    if grid_thw is None:
        return np.zeros((0, 2), dtype=np.int64)
    g = np.asarray(grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw, dtype=np.int64).reshape(-1, 3)
    return np.repeat(g[:, 1:], g[:, 0], axis=0)


def frame_grid(hw: np.ndarray, device=None):
    """``(t, h, w)`` grids of frames ``hw``, consecutive frames of one size merged (as
    Bridge's ``collapse_thw``: a frame is its own attention segment either way)."""
    import torch
    rows = []
    for h, w in np.asarray(hw, dtype=np.int64).tolist():
        if rows and rows[-1][1:] == [h, w]:
            rows[-1][0] += 1
        else:
            rows.append([1, h, w])
    return torch.tensor(rows, dtype=torch.long, device=device).reshape(-1, 3)


#: what a rank's header reports about its own inputs (0: nothing wrong), read on every rank
_PROBLEMS = {1: "its pixel rows are not the patches of its grids (sum of t*h*w)",
             2: f"its pixel rows' dtype is none of {', '.join(DTYPES)}"}


def _header(pixels, patches: int) -> list:
    """This rank's integers for the micro-step: pixel row width, dtype code, whether they need
    gradients, and a problem code, so that bad inputs fail on every rank, not one."""
    if pixels is None or pixels.shape[0] == 0:
        return [-1, -1, 0, 1 if patches else 0]
    name = str(pixels.dtype).split(".")[-1]
    problem = 1 if pixels.shape[0] != patches else 2 if name not in DTYPES else 0
    return [int(pixels.shape[-1]), DTYPES.index(name) if not problem else -1, int(pixels.requires_grad), problem]


# -- the hooks ---------------------------------------------------------------------------------

class BalancedFrames:
    """The hooks of one model chunk (a Bridge ``Qwen3VLModel``); :meth:`remove` takes them off."""

    def __init__(self, model, group, *, frame_cost: Callable[[int], int], patch_cap: Optional[int] = None,
                 report: Optional["FrameReport"] = None, rates: Optional[tuple] = None,
                 flops_per_unit: Optional[float] = None, measured_rates: bool = False, overlap: bool = True,
                 detail: Optional[Callable[[str, float], None]] = None,
                 balanced_now: Optional[Callable[[], bool]] = None):
        from ..runtime.rates import RateMeter, RateWindow
        self.model, self.group, self.frame_cost = model, group, frame_cost
        self.patch_cap, self.report = patch_cap, report
        #: ``(link GB/s, tower TFLOP/s)`` and the forward FLOPs of a unit of frame cost: a
        #: moved frame's transfer time in the plan (None: moves are free); with
        #: ``measured_rates`` the rates are the group's measured ones once it has them
        self.rates, self.flops_per_unit, self.measured_rates = rates, flops_per_unit, measured_rates
        #: transfers in flight while the tower encodes (:meth:`_overlapped`), else one after another
        self.overlap = overlap
        #: ``detail(name, value)``: where this rank's share of the vision forward goes, per
        #: micro-step (the timing records' ``details``; host clock): ``vision_gather_ms`` (the
        #: unit table's all-gather, waiting for the group's last rank included),
        #: ``vision_plan_ms``, ``vision_tower_ms`` over ``vision_tower_calls`` calls, and
        #: ``vision_exchange_ms``, the whole exchange (the rest of it: transfers and waits)
        self.detail = detail
        #: whether this training iteration's frames are balanced (``mm_balance.mode=crossover-*``:
        #: the packs' parity, :func:`balanced_iterations`); the others run the plain tower, with no
        #: collective. None: every iteration. The same answer on every rank (the iteration's number)
        self.balanced_now = balanced_now
        self.vision = model.vision_model
        self._meter = RateMeter(next(self.vision.parameters()).device.type)
        self._link = RateWindow(min_amount=LINK_SAMPLE_MIN_BYTES)     # bytes / s of this rank's moves
        self._tower = RateWindow()                                    # FLOP / s of this rank's tower
        self.last_rates = None          # the latest plan's (link GB/s, tower TFLOP/s), and measured
        self.merge = int(self.vision.spatial_merge_size)
        self.width = int(model.config.hidden_size)
        self.deepstack = len(model.vision_transformer_config.deepstack_visual_indexes)
        self.last_figures = None        # the latest micro-step's FrameFigures (None: no frames)
        self.last_plan = None           # and its frames: owner, cost, patches, encoder (arrays)
        #: frames per rank the unit table's first collective carries: the most any rank has
        #: held (read from the tables, so the same on every rank), so a micro-step costs one
        self.table_rows = TABLE_ROWS_AT_START
        self._armed = False             # inside a training forward of the model
        self._done = False              # this forward took part in its exchange
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
        self._armed = bool(module.training and torch.is_grad_enabled()
                           and (self.balanced_now is None or self.balanced_now()))
        self._done = False

    def _vision_forward(self, hidden_states=None, grid_thw=None, *args, **kwargs):
        if self._encoding or not self._armed or self._done:
            return self._original_forward(hidden_states, grid_thw, *args, **kwargs)
        if args or any(v is not None for v in kwargs.values()):
            raise RuntimeError("mm_balance.vision=images: the vision tower was called with arguments "
                               "beyond hidden_states and grid_thw")
        self._done = True
        return self.exchange(hidden_states, grid_thw)

    def before_cp_gather(self, x):
        """Bridge's context-parallel gather of this rank's embeddings is next: a rank whose
        share was empty (so the tower was not called) takes part in its exchange here."""
        if not self._armed or self._done:
            return x
        if x.shape[0] != 0:
            raise RuntimeError("mm_balance.vision=images: the vision embeddings reached the context-"
                               "parallel gather without the balanced tower")
        self._done = True
        return _joined(x, self.exchange(None, None))

    def _after_text_embedding(self, module, args, output):
        if not self._armed or self._done:
            return None
        self._done = True               # no grids here: the tower is not called
        return _joined(output, self.exchange(None, None))

    def _after_model(self, module, args, output):
        armed, done = self._armed, self._done
        self._armed = False
        if armed and not done:
            raise RuntimeError("mm_balance.vision=images: a training forward ended without reaching "
                               "the vision exchange (the other ranks of its group are waiting)")

    # -- the exchange ------------------------------------------------------------------------------
    def exchange(self, pixels, grid_thw):
        """This rank's frames (``pixels`` rows of ``grid_thw``; None: none) encoded across the
        group. Returns ``(embeddings, [deepstack features])`` in this rank's row order, or
        None when no rank of the group has a frame. Collective over the group."""
        import torch

        from ..runtime.frames import frame_figures, plan_frame_encoders
        from ..runtime.image_exchange import UnitExchange, gather_unit_table

        began = time.perf_counter()
        device = next(self.vision.parameters()).device
        hw = frames_of(grid_thw)
        patches_here = hw[:, 0] * hw[:, 1]
        has_rows = pixels is not None and pixels.shape[0] > 0
        costs = np.array([int(self.frame_cost(int(p))) for p in patches_here], dtype=np.int64)
        table = gather_unit_table(np.column_stack([costs, hw]).reshape(-1, 3),
                                  _header(pixels, int(patches_here.sum())) + self._rate_header(),
                                  self.group, device, rows_in_first=self.table_rows)
        gathered = time.perf_counter()
        self._note("vision_gather_ms", (gathered - began) * 1e3)
        if table is None:
            self._account(None)
            self._note("vision_exchange_ms", (time.perf_counter() - began) * 1e3)
            return None
        self.table_rows = max(self.table_rows, int(np.bincount(table.owner, minlength=table.num_ranks).max()))
        in_dim, dtype, pixel_grad = self._agreed_inputs(table)
        cost, h, w = table.columns[:, 0], table.columns[:, 1], table.columns[:, 2]
        patches = h * w
        if np.any(patches % (self.merge * self.merge)):
            raise ValueError(f"mm_balance.vision=images: a frame's patches are not a multiple of the "
                             f"{self.merge}x{self.merge} merge")
        out_dtype, trains = self._tower_output()
        rates, measured = self._agreed_rates(table)
        transfer = self._transfer(patches, in_dim, dtype, pixel_grad, out_dtype, trains, rates)
        encoder = plan_frame_encoders(table.owner, cost, table.num_ranks, patches=patches,
                                      patch_cap=self.patch_cap, transfer=transfer)
        self.last_plan = dict(owner=table.owner, cost=cost, patches=patches, encoder=encoder,
                              transfer=np.zeros_like(cost) if transfer is None else transfer)
        self.last_rates = dict(used=rates, measured=measured)
        self._account(frame_figures(table.owner, encoder, cost, patches, table.num_ranks, transfer,
                                    rates if transfer is not None else None, measured))
        route = UnitExchange(table.owner, encoder, patches, patches // (self.merge * self.merge),
                             self.group, table.num_ranks)
        local = pixels if has_rows else torch.empty((0, in_dim), dtype=dtype, device=device)
        if pixel_grad and not local.requires_grad:
            local = local.detach().requires_grad_(True)
        pixel_bytes = in_dim * torch.empty((), dtype=dtype).element_size()
        encode = lambda rows, units: self._encode(rows, table, units, device, pixel_grad or trains,  # noqa: E731
                                                  out_dtype)
        self._note("vision_plan_ms", (time.perf_counter() - gathered) * 1e3)
        if self.overlap:
            back = self._overlapped(route, local, encode, cost, patches, pixel_bytes)
        else:
            moved_rows = self._moved_rows(table.owner, encoder, patches, route.rank)
            started = self._meter.start()
            arrived = route.to_encoders(local)
            self._meter.stop(started, moved_rows * pixel_bytes, self._link)
            back = route.to_owners(encode(arrived, route.encoded_units))
        embeddings, *deepstack = [part.contiguous() for part in back.split(self.width, dim=1)]
        self._note("vision_exchange_ms", (time.perf_counter() - began) * 1e3)
        return embeddings, deepstack

    def _agreed_inputs(self, table):
        """The pixel row width and dtype of the ranks holding frames (they must agree), and
        whether any of them needs pixel gradients."""
        import torch
        for rank, problem in enumerate(table.headers[:, 3].tolist()):
            if problem:
                raise ValueError(f"mm_balance.vision=images: rank {rank} of the vision group: {_PROBLEMS[problem]}")
        held = table.headers[np.bincount(table.owner, minlength=table.num_ranks) > 0]
        kinds = {(int(a), int(b)) for a, b in held[:, :2].tolist()}
        if len(kinds) != 1:
            raise ValueError(f"mm_balance.vision=images: the ranks' pixel rows differ in width or dtype "
                             f"({sorted(kinds)})")
        in_dim, code = kinds.pop()
        return in_dim, getattr(torch, DTYPES[code]), bool(held[:, 2].any())

    def _tower_output(self):
        """The tower's output dtype (its first floating parameter's) and whether it trains (a
        parameter needs gradients); read each micro-step, as a frozen tower may be unfrozen."""
        params = [p for p in self.vision.parameters() if p.is_floating_point()]
        return params[0].dtype, any(p.requires_grad for p in params)

    def _rate_header(self) -> list:
        """This rank's measured link MB/s and tower MFLOP/s as the header's integers (0: none
        yet): every rank reads every rank's, so all agree on one value
        (:mod:`megatron_mm_balance.runtime.rates`)."""
        from ..runtime.rates import LINK_UNIT, TOWER_UNIT, header_value
        self._meter.poll()
        return [header_value(self._link.rate(), LINK_UNIT), header_value(self._tower.rate(), TOWER_UNIT)]

    def _agreed_rates(self, table):
        """``(rates the plan charges moves at, rates the group measured)``, each ``(link GB/s,
        tower TFLOP/s)``, the same on every rank: the group's medians of the header's
        measured integers (0 where no rank has measured one); the plan's are the settings',
        or with ``measured_rates`` the measured ones where there are any. (None, measured)
        without rates."""
        from ..runtime.rates import LINK_UNIT, TOWER_UNIT, agreed_rate
        measured = (agreed_rate(table.headers[:, 4], LINK_UNIT, 0.0) / 1e9,
                    agreed_rate(table.headers[:, 5], TOWER_UNIT, 0.0) / 1e12)
        if self.rates is None or self.flops_per_unit is None:
            return None, measured
        if not self.measured_rates:
            return tuple(self.rates), measured
        return tuple(m if m > 0 else r for m, r in zip(measured, self.rates)), measured

    def _overlapped(self, route, local, encode, cost, patches, pixel_bytes: int):
        """:meth:`~megatron_mm_balance.runtime.image_exchange.UnitExchange.encode_overlapped`:
        this rank encodes kept frames while the frames it receives arrive (enough of them to
        cover the pixels' transfer at the settings' rates), the rest while its outputs travel
        back. The link sample: the pixel bytes it received over the time it still waited for
        them (what the overlap did not hide)."""
        from ..runtime.frames import FrameTransfer
        from ..runtime.image_exchange import kept_before_arrivals
        me = route.rank
        received = (route.encoder == me) & (route.owner != me)
        kept = np.flatnonzero((route.owner == me) & (route.encoder == me))
        hide = 0
        if self.rates is not None and self.flops_per_unit is not None and received.any():
            link, tflops = self.rates                      # forward only: the pixels' way there
            hide = int(FrameTransfer(pixel_bytes, link, self.flops_per_unit / (tflops * 1e12))
                       .cost(patches[received]).sum())
        arrived_bytes = int(patches[received].sum()) * pixel_bytes
        timer = (self._meter.start, lambda started: self._meter.stop(started, arrived_bytes, self._link))
        return route.encode_overlapped(local, encode, kept_before_arrivals(cost[kept], hide), timer)

    @staticmethod
    def _moved_rows(owner, encoder, patches, rank: int) -> int:
        """Pixel rows this rank sends away or receives in the plan (the link sample's size)."""
        out = (owner == rank) & (encoder != rank)
        into = (encoder == rank) & (owner != rank)
        return int(patches[out].sum() + patches[into].sum())

    def _transfer(self, patches, in_dim: int, dtype, pixel_grad: bool, out_dtype, trains: bool, rates):
        """Each frame's transfer cost (:class:`~megatron_mm_balance.runtime.frames.FrameTransfer`),
        from numbers every rank holds alike: the agreed pixel rows, this tower's output width
        and dtype, whether backward crosses the exchange, and ``rates`` (``(link GB/s, tower
        TFLOP/s)``, the same on every rank); None without rates."""
        import torch

        from ..runtime.frames import FrameTransfer
        if rates is None:
            return None
        pixel_bytes = in_dim * torch.empty((), dtype=dtype).element_size()
        out_size = torch.empty((), dtype=out_dtype).element_size()
        out_bytes = (1 + self.deepstack) * self.width * out_size / (self.merge * self.merge)
        # forward: pixels out, embeddings back; backward: their gradients in, pixels' back
        per_patch = pixel_bytes * (2 if pixel_grad else 1) + out_bytes * (2 if trains or pixel_grad else 1)
        passes = 3 if trains else 2 if pixel_grad else 1
        link, tflops = rates
        unit_seconds = self.flops_per_unit * passes / (tflops * 1e12)
        return FrameTransfer(per_patch, link, unit_seconds).cost(patches)

    def _encode(self, rows, table, units, device, needs_grad: bool, out_dtype):
        """The real tower on the frames this rank encodes, main and deepstack outputs side by
        side ``[rows, (1 + deepstack) * width]``; an empty tensor (with gradients when the
        pixels or the tower need them) when it encodes none."""
        import torch
        if units.size == 0:
            return torch.zeros((0, (1 + self.deepstack) * self.width), dtype=out_dtype, device=device,
                               requires_grad=needs_grad)
        grid = frame_grid(table.columns[units, 1:], device)
        self._encoding = True
        started, wall = self._meter.start(), time.perf_counter()
        try:
            embeddings, deepstack = self.vision(hidden_states=rows, grid_thw=grid)
        finally:
            self._encoding = False
        self._note("vision_tower_ms", (time.perf_counter() - wall) * 1e3)
        self._note("vision_tower_calls", 1)
        if self.flops_per_unit is not None:
            self._meter.stop(started, self.flops_per_unit * float(table.columns[units, 0].sum()), self._tower)
        out = torch.cat([embeddings, *deepstack], dim=1)
        if out.dtype != out_dtype or out.shape[1] != (1 + self.deepstack) * self.width:
            raise RuntimeError(f"mm_balance.vision=images: the tower returned {tuple(out.shape)} "
                               f"{out.dtype} side by side, expected width {(1 + self.deepstack) * self.width} "
                               f"in {out_dtype}")
        return out

    def _note(self, name: str, value: float) -> None:
        if self.detail is not None:
            self.detail(name, value)

    def _account(self, figures) -> None:
        self.last_figures = figures
        if self.report is not None:
            self.report.add(figures)

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
    if result is None:
        return x
    embeddings, deepstack = result
    parts = [t for t in (embeddings, *deepstack) if t.requires_grad]
    if not parts:
        return x
    return x + (sum(t.sum() for t in parts) * 0).to(x.dtype)


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
    """One ``[mm-balance-vision] iteration N | ...`` line (and ``mm-balance-vision/*`` scalars)
    every ``interval`` iterations, on the reporting rank; the other ranks only count."""

    def __init__(self, *, interval: int, iteration_fn: Callable[[], Optional[int]], reporter: bool,
                 writers: tuple = (None, None)):
        from ..runtime.frames import FrameWindow
        self.interval, self.iteration_fn, self.reporter = max(1, int(interval)), iteration_fn, reporter
        self.tb_writer, self.wandb_writer = writers
        self.window = FrameWindow()
        self._iteration = None
        self.lines: List[str] = []

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
        summary, self.window = self.window.summary(), FrameWindow()
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

def install_frame_balance(model, mm, spec, core_cfg, args, pg_collection, state=None,
                          timing=None) -> List[BalancedFrames]:
    """``mm_balance.vision=images``: the vision groups (collective over the world: call on
    every rank at the same point) and the hooks on this rank's Qwen3-VL model chunks that
    have a vision tower. Returns the installed hooks (none off the first pipeline stage).
    ``mm``: ``cfg.mm_balance``; ``spec``: the model's :class:`~.model_spec.ModelSpec`.
    ``timing``: this rank's timing recorder (``mm_balance.timing``), whose records then split
    the exchange's forward (:attr:`BalancedFrames.detail`)."""
    import torch.distributed as dist

    from ..megatron.config import live_iteration
    from ..megatron.groups import RankLayout
    from ..megatron.timing import unwrap
    from ..megatron.vision import init_vision_groups
    from .cp_split import frame_cost_for

    if checked_vision(mm, spec) != "images":
        return []
    if model is None:
        raise ValueError("mm_balance.vision=images needs the model: the setup.py patch passes model=model "
                         "to wrap_train_data_iterator (re-apply scripts/apply_patches.sh)")
    first_stage = pg_collection.pp.rank() == 0
    layout = RankLayout(first_stage, tuple(int(r) for r in dist.get_process_group_ranks(pg_collection.dp)))
    group = init_vision_groups(core_cfg.timeout, layout=layout)
    if group is None:
        return []
    if spec.splits_frames_across_cp:
        _install_cp_gather()
    reporter = dist.get_rank() == min(dist.get_process_group_ranks(group))
    report = FrameReport(interval=core_cfg.log_interval, iteration_fn=live_iteration(args), reporter=reporter,
                         writers=_report_writers(state, core_cfg.tensorboard_dir, reporter))
    installed = []
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        inner = unwrap(chunk)
        if getattr(inner, "vision_model", None) is None:
            continue
        if not hasattr(inner, "vision_transformer_config") or getattr(inner, "language_model", None) is None:
            raise RuntimeError(f"mm_balance.vision=images needs Bridge's Qwen3-VL model; this rank's model "
                               f"is a {type(inner).__name__}")
        device = next(inner.vision_model.parameters()).device
        installed.append(BalancedFrames(inner, group, frame_cost=frame_cost_for(spec),
                                        patch_cap=getattr(mm, "image_patch_cap", None),
                                        report=report, rates=transfer_rates(mm, device.type),
                                        flops_per_unit=tower_flops_per_unit(spec),
                                        measured_rates=getattr(mm, "image_rates", "settings") == "measured",
                                        overlap=bool(getattr(mm, "image_overlap", True)),
                                        detail=None if timing is None else timing.add_detail,
                                        balanced_now=balanced_iterations(getattr(mm, "mode", "auto"),
                                                                         live_iteration(args))))
    return installed
