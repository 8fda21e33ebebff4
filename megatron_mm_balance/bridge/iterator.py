"""``wrap_train_data_iterator``: the one call the setup.py patch makes.

Bridge's ``setup()`` builds the train iterator(s) (``setup_data_iterators``), then
restores the energon dataloader state of a resumed run
(``maybe_load_dataloader_state``: ``train_iterator.iterable.restore_state``), and its
training loop hands the iterator to ``forward_backward_func`` with
``num_microbatches=get_num_microbatches()``; every micro-batch is read by the
model's step function (``qwen3_vl_step.forward_step``: ``next(data_iterator)``, an
unpacked collate batch). The patch calls this function after that restore (the
exchange thread starts reading at once, and energon refuses a restore once its
workers run), on every rank; with ``mm_balance.enabled`` it returns a
``RerunDataIterator`` around the core package's balanced iterator
(:class:`~megatron_mm_balance.megatron.iterator.ExchangeCoordinator`, the same one
the Megatron-LM path uses): each global batch's micro-batches are moved between
data-parallel ranks whole, in the form the loader produced them, so the step
function receives exactly what it accepts.

What Bridge relies on, and how it is kept:

* ``.iterable.save_state()`` (checkpoints) is the balancer's paired state: the
  loader position that matches the global batches the loop has consumed.
* ``mm_balance.timing`` / ``timing_dir`` (balancing on or off) and ``cost=auto``: the
  patch also passes the model, and the core package's timing hooks go on it
  (:mod:`.timing`); ``cost=auto`` fits them with the core package's calibration on each
  exchange group, from the Qwen-VL grids' frames
  (:class:`~megatron_mm_balance.cost.features.QwenVLFeatures`), its fit beside
  ``checkpoint.save`` and restored from ``checkpoint.load`` on resume; with
  ``timing_dir``, the provider's FLOP-derived model is written beside the records
  (:func:`save_flops_model`) for ``mm-balance replay``.
* ``mm_balance.vision=images``: after the packs, each training micro-step's frames are
  spread inside its expert-parallel group: the vision chunk's iterator plans them and sends
  their pixel rows ahead on its exchange thread, hooks on the Qwen3-VL model encode them
  (:func:`~.vision.install_frame_balance`; its groups are created here, collectively);
  the packs are placed on their heaviest frame first (``image_pack_cost``,
  :func:`~.vision.pack_cost_for`).
* every rank of a data-parallel group reads data in Bridge's VLM steps (each tensor-,
  pipeline- and context-parallel rank draws from its own loader): one exchange group
  per data-parallel group (``pg_collection.dp``), created collectively over the world;
  its meeting groups (who waits for whom every micro-step) are read from
  ``pg_collection``'s expert-parallel and expert tensor-parallel groups
  (:func:`~megatron_mm_balance.megatron.groups.process_group_layout`).
"""
from __future__ import annotations

from typing import Optional

from ..megatron.iterator import ExchangeCoordinator


class BridgeCoordinator(ExchangeCoordinator):
    """The exchange coordinator, reporting through Bridge's TensorBoard / W&B writers."""

    def __init__(self, cfg, *, cost_fn, tb_writer=None, wandb_writer=None, timing=None,
                 auto_features=None):
        super().__init__(cfg, cost_fn=cost_fn, timing=timing, auto_features=auto_features)
        self._writers = (tb_writer, wandb_writer)

    def _telemetry(self, stats_source, group, chunk):
        from ..megatron.telemetry import Telemetry
        tb, wandb = self._writers
        return Telemetry(stats_source, interval=self.cfg.log_interval,
                         start_iteration=self.cfg.megatron.start_iteration, group=group,
                         chunk=chunk, tensorboard_dir=self.cfg.tensorboard_dir, tb_writer=tb,
                         wandb_writer=wandb)


def cost_fn_for(core_cfg, spec):
    """The Qwen-VL cost the checked config asks for (merge size from the model's
    :class:`~.model_spec.ModelSpec`): patch count by default; ``cost=model`` a cost file's
    model, or without one the FLOP count of the provider's vision tower and language model
    under its training regime (:attr:`~.model_spec.ModelSpec.flops_model`). Under ``microstep``
    sync a model gives (vision, language) for the two-phase solver. None for ``auto``: each
    exchange group fits its own (:func:`auto_features_for`)."""
    from ..cost.pack import QwenVLCost
    merge = spec.spatial_merge_size
    if core_cfg.cost == "auto":
        return None
    if core_cfg.cost != "model":
        return QwenVLCost(merge)
    phases = core_cfg.sync == "microstep"
    if core_cfg.cost_file:
        return QwenVLCost.from_file(core_cfg.cost_file, merge, phases=phases)
    from ..megatron.checks import MMBalanceConfigError
    try:
        model = spec.required_flops_model()
    except ValueError as exc:
        raise MMBalanceConfigError(f"mm_balance.cost=model: {exc}") from None
    return QwenVLCost(merge, model=model, phases=phases, source="flops")


def save_flops_model(timing_dir: str, spec) -> Optional[str]:
    """Write the provider's FLOP-derived cost model (what ``cost=model`` balances with,
    :attr:`~.model_spec.ModelSpec.flops_model`) beside the timing records, as
    ``TIMING_DIR/flops_cost_model.json`` (a cost file), so that ``mm-balance replay
    TIMING_DIR`` replays it as its ``flops`` candidate; on global rank 0 only. The path, or
    None (another rank, or a config that gives no model: the replay then says why not)."""
    import os

    import torch.distributed as dist

    from ..cost.replay import FLOPS_MODEL_FILE
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    if spec.flops_model is None:
        return None
    os.makedirs(timing_dir, exist_ok=True)
    path = os.path.join(timing_dir, FLOPS_MODEL_FILE)
    tmp = f"{path}.tmp{os.getpid()}"
    spec.flops_model.save(tmp)
    os.replace(tmp, path)
    return path


def auto_features_for(spec):
    """What ``cost=auto`` fits, replays and costs on Qwen-VL: one unit per frame of the
    grids, and the per-sample lengths
    (:class:`~megatron_mm_balance.cost.features.QwenVLFeatures`), with the provider's
    FLOP-derived model (:attr:`~.model_spec.ModelSpec.flops_model`) for the replay's
    ``flops`` candidate, or the reason there is none."""
    from ..cost.features import QwenVLFeatures
    return QwenVLFeatures(spec.spatial_merge_size, flops_model=spec.flops_model, flops_note=spec.flops_problem)


def wrap_train_data_iterator(train_data_iterator, cfg, pg_collection, *, state=None, model=None):
    """Wrap Bridge's train iterator(s) for ``cfg.mm_balance.enabled``; a no-op otherwise.

    With it, Qwen3-VL's context-parallel frame split follows ``mm_balance.cp_split``
    (:func:`~.cp_split.install_cp_split`: by cost by default, inert without context parallelism).

    Call on **every** rank at the same point (the exchange groups are created
    collectively). Accepts what ``setup_data_iterators`` returns (a
    ``RerunDataIterator``, ``None``, or a list of them under virtual pipeline) and
    returns the same shape. ``state`` is Bridge's ``GlobalState`` (iteration counter,
    TensorBoard / W&B writers). ``model``: the model chunks, for the timing hooks of
    ``mm_balance.timing`` / ``timing_dir`` / ``cost=auto`` (installed here, with
    balancing off too).
    """
    mm = getattr(cfg, "mm_balance", None)
    if mm is None or not (getattr(mm, "enabled", False) or getattr(mm, "wraps_train_iterator", False)):
        return train_data_iterator
    from ..megatron.checks import checked_config
    from ..megatron.config import live_iteration
    from ..megatron.groups import init_exchange_groups, process_group_layout
    from ..megatron.iterator import _unwrap, agree_on_code, tap_timing, with_job_meetings
    from ..megatron.stops import StopReporter
    from .config import as_args
    from .cp_split import install_cp_split
    from .model_spec import ModelSpec
    from .timing import install_bridge_timing
    from .vision import install_frame_balance, pack_cost_for

    from ..runtime.dist_audit import install_from_env
    audit = install_from_env()          # MM_BALANCE_DIST_AUDIT (a test hook): calls counted by stack
    spec = ModelSpec.read(cfg.model)                    # the provider, read once
    args = as_args(mm, cfg, spec, train_state=getattr(state, "train_state", None))
    core_cfg = checked_config(args)
    timing = install_bridge_timing(model, core_cfg, args, state)
    if timing is not None and core_cfg.timing_dir:
        save_flops_model(core_cfg.timing_dir, spec)
    if not core_cfg.enabled:
        return tap_timing(train_data_iterator, timing)   # the hooks' features from the host copies
    agree_on_code("megatron-bridge", core_cfg.timeout)      # the same hooks and package on every rank
    install_cp_split(mm, spec)
    is_list = isinstance(train_data_iterator, list)
    iterators = train_data_iterator if is_list else [train_data_iterator]
    groups = init_exchange_groups(process_group_layout(pg_collection), num_chunks=len(iterators),
                                  timeout=core_cfg.timeout)
    core_cfg = with_job_meetings(core_cfg, groups)         # auto sync: the job's meeting groups
    frames = install_frame_balance(model, mm, spec, core_cfg, args, pg_collection, groups, state, timing)
    tb = getattr(state, "tensorboard_logger", None) if state is not None else None
    wandb = getattr(state, "wandb_logger", None) if state is not None else None
    cost_fn = pack_cost_for(mm, spec, cost_fn_for(core_cfg, spec))    # vision=images: heaviest frame
    coordinator = BridgeCoordinator(core_cfg, cost_fn=cost_fn,
                                    tb_writer=tb, wandb_writer=wandb, timing=timing,
                                    auto_features=auto_features_for(spec))
    reporter = StopReporter(live_iteration(args))       # one line per rank when training stops
    wrapped = [it if it is None or group is None
               else coordinator.wrap(_unwrap(it), group, chunk, node_ids=groups.node_ids, reporter=reporter,
                                     frames=None if frames is None else frames.frames_for(chunk))
               for chunk, (it, group) in enumerate(zip(iterators, groups))]
    if frames is not None and (frames.chunk >= len(iterators) or iterators[frames.chunk] is None):
        raise RuntimeError("mm_balance.vision=images: the model chunk with the vision tower has no train "
                           "iterator on this rank")
    if audit is not None:
        audit.training()
    return wrapped if is_list else wrapped[0]
