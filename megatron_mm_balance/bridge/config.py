"""The ``mm_balance`` field of Megatron-Bridge's ``ConfigContainer``.

:class:`MMBalanceBridgeConfig` is a plain dataclass, so Bridge's own machinery reads
and writes it like any other section of the config: recipe code
(``cfg.mm_balance.enabled = True``), YAML (``mm_balance: {enabled: true}``) and Hydra
overrides (``mm_balance.enabled=true mm_balance.mode=shadow``). Patch
``0001-config-mm-balance-field.patch`` adds the field (default: this class, off).

Its fields are the ``--mm-balance*`` flags of the Megatron-LM path, one for one and
with the same defaults and meanings (docs/megatron.md section 2); :func:`as_args`
turns the field plus the Bridge settings the checks need into the namespace the core
package's :func:`~megatron_mm_balance.megatron.checks.checked_config` validates, so the
refusals and the ``auto`` resolutions are the same code on both paths.

Imports nothing from Bridge, Megatron or torch.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Optional

from ..megatron.config import MMBalanceConfig

_D = MMBalanceConfig()


@dataclass
class MMBalanceBridgeConfig:
    """``cfg.mm_balance``: image-token balancing across data-parallel ranks (off by default)."""

    #: balance every global batch's micro-batches across data-parallel ranks
    enabled: bool = False
    #: ``auto``/``exchange``: move micro-batches; ``shadow``: gather costs, solve, log the
    #: predicted gain, move nothing; ``control``: every rank keeps its own micro-batches,
    #: reordered across micro-steps in balancing's order (the arithmetic-order band of
    #: ``mm-balance compare-logs --control``; docs/bridge.md); ``crossover-even`` /
    #: ``crossover-odd``: exchange at iterations of that parity, shadow at the others (two
    #: jobs time every iteration balanced and not: ``bench-realpath --modes
    #: crossover-even,crossover-odd``); ``groups-crossover-even`` / ``groups-crossover-odd``: move
    #: packs every iteration, placed by the job's meeting groups at that parity and as if all
    #: data-parallel ranks met every micro-step at the others (two jobs time both placements).
    #: Sampler mode needs Megatron-LM's sampler: refused
    mode: str = "auto"
    #: ``auto`` (microstep under expert parallel, else step), ``microstep``, ``step``
    sync: str = "auto"
    #: exchange on a background thread, overlapped with compute
    overlap: bool = _D.overlap
    #: ``image-tokens`` (vision-encoder tokens from the Qwen-VL grids), ``model`` (a cost
    #: file) or ``auto`` (a cost model fitted from the job's own per-micro-batch timings)
    cost: str = _D.cost
    #: the calibrated cost model of ``cost=model``; without one, ``cost=model`` is the
    #: FLOP count of the model config's vision tower and language model (docs/bridge.md section 3)
    cost_file: Optional[str] = None
    #: ``cost=auto`` fits the timings of iterations 2..K and balances with the fit from K + 2
    calibration_iters: int = _D.calibration_iters
    #: time the vision tower and the language model, forward and backward, per micro-batch
    #: (works with ``enabled=false``); a ``[mm-balance-timing]`` line per log interval
    timing: bool = _D.timing
    #: also write the timings as JSON Lines, ``DIR/timing-rank<R>.jsonl`` (implies ``timing``)
    timing_dir: Optional[str] = None
    #: with ``timing_dir``: ``rank``, a file per rank; ``node``, ``timing-node-<node>.jsonl``, a
    #: file per node that the node's ranks append to (fewer files on a shared filesystem)
    timing_files: str = _D.timing_files
    #: with ``timing_dir``: write every N-th iteration's records only (the log lines and
    #: ``cost=auto`` still see every iteration)
    timing_every: int = _D.timing_every
    #: statistics every N iterations (None: ``logger.log_interval``)
    log_interval: Optional[int] = None
    #: the placement's tolerance above the mean (None: the solver's default)
    tolerance: Optional[float] = None
    #: seconds any exchange wait may take before a clear error
    timeout: float = _D.timeout
    #: placement's override of the nodes found at start-up: global rank r on node r // N
    #: (None: the found nodes, from torchrun's GROUP_RANK, else SLURM_NODEID, else the host)
    ranks_per_node: Optional[int] = None
    #: Qwen3-VL under context parallelism with ``vision_dp_when_cp``: ``cost`` splits each
    #: micro-batch's frames across the context-parallel ranks by per-frame cost, ``count``
    #: keeps Bridge's equal-count split (:mod:`.cp_split`); inert without context parallelism
    cp_split: str = "cost"
    #: ``packs``: the vision tower encodes the frames of the packs its rank holds; ``images``:
    #: also spread frames across the data-parallel group every micro-step (Qwen3-VL;
    #: :mod:`.vision`, docs/bridge.md section 9)
    vision: str = "packs"
    #: ``vision=images``: no rank receiving frames ends above this many patches (None: the
    #: most any rank held before balancing, per micro-step)
    image_patch_cap: Optional[int] = None
    #: ``vision=images``: the data-parallel link's bandwidth in GB/s; a moved frame's
    #: transfer time counts on its receiver, so a frame whose move costs more than it saves
    #: stays (None: a nominal figure for the device, :data:`~.vision.NOMINAL_RATES`;
    #: ``inf``: moves are free)
    image_link_gbps: Optional[float] = None
    #: ``vision=images``: the vision tower's achieved TFLOP/s, which turns a transfer time
    #: into frame cost (None: a nominal figure for the device, :data:`~.vision.NOMINAL_RATES`)
    vision_tflops: Optional[float] = None
    #: ``vision=images``: ``settings`` charges moves at the two rates above; ``measured`` at
    #: the rates the run measures (the group's median, agreed on by every rank through the
    #: micro-step's first collective), starting from the settings until it has measured them
    #: (:mod:`megatron_mm_balance.runtime.rates`). Measured rates follow the machine, so two
    #: runs (or a run and its resumption) may move other frames: the same results up to
    #: arithmetic order, not bit for bit
    image_rates: str = "settings"
    #: ``vision=images``: what the packs are placed on before their frames are spread:
    #: ``heaviest-frame``, each pack's heaviest frame (so the big frames share micro-steps and
    #: the frames even out the rest); ``cost``, ``mm_balance.cost`` as with ``vision=packs``
    image_pack_cost: str = "heaviest-frame"
    #: ``vision=images``: a rank encodes its kept frames while its moved frames' pixels and
    #: outputs are in flight (the received ones between them); false: each exchange completes
    #: before the tower runs
    image_overlap: bool = True

    @property
    def wraps_train_iterator(self) -> bool:
        """Whether the setup.py patch hands the train iterator and the model to
        :func:`~.iterator.wrap_train_data_iterator`: balancing, or the timing hooks."""
        return bool(self.enabled or self.timing or self.timing_dir)


def as_args(mm: MMBalanceBridgeConfig, cfg, spec, *, train_state=None) -> types.SimpleNamespace:
    """The ``args`` namespace of the core glue, from ``cfg.mm_balance`` and Bridge's config.

    Carries the ``mm_balance_*`` values and the Bridge settings the checks, the
    micro-batch schedule and the telemetry read (parallel sizes, batch sizes, the
    router's load balancing, the log interval and TensorBoard directory, and
    ``checkpoint.load``/``checkpoint.save``, where ``cost=auto`` keeps its fit).
    ``curr_iteration`` follows ``train_state.step`` (Bridge's iteration counter).
    ``spec``: ``cfg.model`` as read once, the :class:`~.model_spec.ModelSpec` (the model's
    settings come from it; ``cfg`` gives the training, logger, checkpoint and dataset ones).
    """
    train, logger = cfg.train, cfg.logger
    checkpoint = getattr(cfg, "checkpoint", None)
    if mm.mode == "sampler":
        from ..megatron.checks import MMBalanceConfigError
        raise MMBalanceConfigError("mm_balance.mode=sampler needs Megatron-LM's pretraining sampler; "
                                   "on Megatron-Bridge use mm_balance.mode=exchange (or auto, shadow, control, "
                                   "crossover-even, crossover-odd, groups-crossover-even, groups-crossover-odd)")
    from .cp_split import checked_choice
    from .vision import checked_vision
    checked_choice(getattr(mm, "cp_split", "cost"))
    checked_vision(mm, spec)
    return _BridgeArgs(
        train_state,
        mm_balance=bool(mm.enabled), mm_balance_mode=mm.mode, mm_balance_sync=mm.sync,
        mm_balance_overlap=mm.overlap, mm_balance_cost=mm.cost, mm_balance_cost_file=mm.cost_file,
        mm_balance_calibration_iters=mm.calibration_iters, mm_balance_timing=mm.timing,
        mm_balance_timing_dir=mm.timing_dir, mm_balance_timing_files=getattr(mm, "timing_files", "rank"),
        mm_balance_timing_every=getattr(mm, "timing_every", 1),
        mm_balance_log_interval=mm.log_interval, mm_balance_tolerance=mm.tolerance,
        mm_balance_timeout=mm.timeout, mm_balance_ranks_per_node=mm.ranks_per_node,
        log_interval=getattr(logger, "log_interval", None),
        tensorboard_dir=getattr(logger, "tensorboard_dir", None),
        expert_model_parallel_size=spec.expert_model_parallel_size,
        pipeline_model_parallel_size=spec.pipeline_model_parallel_size,
        context_parallel_size=spec.context_parallel_size,
        load=getattr(checkpoint, "load", None), save=getattr(checkpoint, "save", None),
        num_experts=spec.num_moe_experts,
        moe_router_load_balancing_type=spec.moe_router_load_balancing_type,
        moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
        calculate_per_token_loss=spec.calculate_per_token_loss,
        hybrid_context_parallel=spec.hybrid_context_parallel,
        # upstream's own per-global-batch rebalancing, where the pinned megatron-core has it
        dynamic_context_parallel=spec.dynamic_context_parallel,
        sequence_packing_scheduler=spec.sequence_packing_scheduler,
        micro_batch_size=train.micro_batch_size, global_batch_size=train.global_batch_size,
        rampup_batch_size=getattr(train, "rampup_batch_size", None),
        decrease_batch_size_if_needed=getattr(train, "decrease_batch_size_if_needed", False),
        data_parallel_size=getattr(cfg, "data_parallel_size", None),
        consumed_train_samples=getattr(train_state, "consumed_train_samples", 0) or 0,
        iteration=int(getattr(train_state, "step", 0) or 0),
        dataloader_type=getattr(cfg.dataset, "dataloader_type", None),
        mm_balance_model_cost_from_config=True,
    )


class _BridgeArgs(types.SimpleNamespace):
    """A namespace whose ``curr_iteration`` reads Bridge's live ``train_state.step``."""

    def __init__(self, train_state, **values):
        super().__init__(**values)
        object.__setattr__(self, "_train_state", train_state)

    @property
    def curr_iteration(self):
        ts = self._train_state
        return None if ts is None else int(ts.step)
