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
* every rank of a data-parallel group reads data in Bridge's VLM steps (each tensor-,
  pipeline- and context-parallel rank draws from its own loader): one exchange group
  per data-parallel group (``pg_collection.dp``), created collectively over the world.
"""
from __future__ import annotations

from ..megatron.iterator import ExchangeCoordinator


class BridgeCoordinator(ExchangeCoordinator):
    """The exchange coordinator, reporting through Bridge's TensorBoard / W&B writers."""

    def __init__(self, cfg, *, cost_fn, tb_writer=None, wandb_writer=None):
        super().__init__(cfg, cost_fn=cost_fn)
        self._writers = (tb_writer, wandb_writer)

    def _telemetry(self, stats_source, group, chunk):
        from ..megatron.telemetry import Telemetry
        tb, wandb = self._writers
        return Telemetry(stats_source, interval=self.cfg.log_interval,
                         start_iteration=self.cfg.megatron.start_iteration, group=group,
                         chunk=chunk, tensorboard_dir=self.cfg.tensorboard_dir, tb_writer=tb,
                         wandb_writer=wandb)


def cost_fn_for(core_cfg, model_cfg):
    """The Qwen-VL cost the checked config asks for (merge size from the model config);
    under ``microstep`` sync a cost model gives (vision, language) for the two-phase solver."""
    from ..cost.pack import QwenVLCost
    merge = int(getattr(getattr(model_cfg, "vision_config", None), "spatial_merge_size", None)
                or getattr(model_cfg, "spatial_merge_size", 2) or 2)
    if core_cfg.cost == "model":
        return QwenVLCost.from_file(core_cfg.cost_file, merge, phases=core_cfg.sync == "microstep")
    return QwenVLCost(merge)


def _layout(pg_collection):
    """This rank's data layout: every rank reads data; its data-parallel ranks."""
    import torch.distributed as dist

    from ..megatron.groups import RankLayout
    return RankLayout(True, tuple(int(r) for r in dist.get_process_group_ranks(pg_collection.dp)))


def wrap_train_data_iterator(train_data_iterator, cfg, pg_collection, *, state=None):
    """Wrap Bridge's train iterator(s) for ``cfg.mm_balance.enabled``; a no-op otherwise.

    With it, Qwen3-VL's context-parallel frame split follows ``mm_balance.cp_split``
    (:func:`~.cp_split.install_cp_split`: by cost by default, inert without context parallelism).

    Call on **every** rank at the same point (the exchange groups are created
    collectively). Accepts what ``setup_data_iterators`` returns (a
    ``RerunDataIterator``, ``None``, or a list of them under virtual pipeline) and
    returns the same shape. ``state`` is Bridge's ``GlobalState`` (iteration counter,
    TensorBoard / W&B writers).
    """
    mm = getattr(cfg, "mm_balance", None)
    if mm is None or not getattr(mm, "enabled", False):
        return train_data_iterator
    from ..megatron.checks import checked_config
    from ..megatron.groups import init_exchange_groups
    from ..megatron.iterator import _unwrap
    from .config import as_args
    from .cp_split import install_cp_split

    args = as_args(mm, cfg, train_state=getattr(state, "train_state", None))
    core_cfg = checked_config(args)
    install_cp_split(cfg)
    is_list = isinstance(train_data_iterator, list)
    iterators = train_data_iterator if is_list else [train_data_iterator]
    groups = init_exchange_groups(_layout(pg_collection), num_chunks=len(iterators),
                                  timeout=core_cfg.timeout)
    tb = getattr(state, "tensorboard_logger", None) if state is not None else None
    wandb = getattr(state, "wandb_logger", None) if state is not None else None
    coordinator = BridgeCoordinator(core_cfg, cost_fn=cost_fn_for(core_cfg, cfg.model),
                                    tb_writer=tb, wandb_writer=wandb)
    wrapped = [it if it is None or group is None else coordinator.wrap(_unwrap(it), group, chunk)
               for chunk, (it, group) in enumerate(zip(iterators, groups))]
    return wrapped if is_list else wrapped[0]
