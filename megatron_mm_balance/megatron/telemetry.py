"""Balance statistics every ``--mm-balance-log-interval`` iterations.

The balancer keeps one dict of statistics per global batch (``.stats``: image-token
max/mean per micro-step before and after, packs and bytes moved, exposed wait
and solver milliseconds, as the runtime names them). Every interval the numeric
entries of the global batches since the last report are averaged and written

* to the log (one line, on the lowest rank of each exchange group, chunk 0), and
* as ``mm-balance/<key>`` scalars through Megatron's TensorBoard and W&B writers
  when this rank has them (Megatron creates them on the last rank only; with
  tensor parallel > 1 that rank reads no data, so the report rank opens its own
  TensorBoard writer in ``--tensorboard-dir`` with the suffix ``.mm_balance``,
  which TensorBoard shows alongside the run's own events).

Statistics are identical on every rank of a group (they come from the
all-gathered costs), so one rank per group suffices.
"""
from __future__ import annotations

import logging
import numbers
from typing import Dict, Iterable, Optional

logger = logging.getLogger("megatron_mm_balance")


def derive(entry: dict) -> dict:
    """Per-micro-step image-token figures from the runtime's per-step lists.

    ``step_max_*``/``step_mean_*`` (one value per micro-step: the max and mean
    pack cost across ranks) become ``image_tokens_step_max_*`` (mean over
    micro-steps of the max), ``image_tokens_step_mean`` and
    ``imbalance_*`` (mean over micro-steps of max/mean: 1.0 is perfect balance).
    """
    from ..solver.placement import step_imbalance
    out = dict(entry)
    mean = entry.get("step_mean_before")
    for when in ("before", "after"):
        mx = entry.get(f"step_max_{when}")
        if not isinstance(mx, (list, tuple)) or not isinstance(mean, (list, tuple)) or not mx:
            continue
        out[f"image_tokens_step_max_{when}"] = sum(mx) / len(mx)
        if any(a for _, a in zip(mx, mean)):
            out[f"imbalance_{when}"] = step_imbalance(mx, mean)
    if isinstance(mean, (list, tuple)) and mean:
        out["image_tokens_step_mean"] = sum(mean) / len(mean)
    return out


def summarize(entries: Iterable[dict]) -> Dict[str, float]:
    """Mean of every numeric (possibly nested, dotted-key) entry over ``entries``,
    after :func:`derive` (lists themselves are left out)."""
    sums: Dict[str, float] = {}
    counts: Dict[str, int] = {}

    def visit(prefix, value):
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, numbers.Number):
            sums[prefix] = sums.get(prefix, 0.0) + float(value)
            counts[prefix] = counts.get(prefix, 0) + 1
        elif isinstance(value, dict):
            for k, v in value.items():
                visit(f"{prefix}.{k}" if prefix else str(k), v)

    n = 0
    for e in entries:
        if not isinstance(e, dict):
            e = _as_entry(e)
        visit("", derive(e))
        n += 1
    out = {k: sums[k] / counts[k] for k in sorted(sums)}
    if n:
        out["global_batches"] = float(n)
    return out


def _as_entry(st) -> dict:
    """A runtime :class:`~megatron_mm_balance.runtime.stats.BatchStats` as the flat record."""
    import dataclasses
    entry = {**st.plan.record(), **{f.name: getattr(st, f.name) for f in dataclasses.fields(st)
                                     if f.name not in ("plan", "my_costs")}}
    entry["packs_moved"] = st.plan.packs_moved
    if st.shadow:
        entry["predicted_gain"] = st.plan.predicted_gain
    else:
        del entry["shadow"]
    return entry


def format_line(iteration: int, summary: Dict[str, float], chunk: int = 0) -> str:
    parts = [f"{k}: {v:.6g}" for k, v in summary.items()]
    where = f" chunk {chunk}" if chunk else ""
    return f"[mm-balance] iteration {iteration}{where} | " + " | ".join(parts)


def _megatron_writers():
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except Exception:   # Megatron-LM not importable (megatron-core only, tests)
        return None, None
    return get_tensorboard_writer(), get_wandb_writer()


class Telemetry:
    """Reports the statistics of one model chunk's balancer every ``interval`` iterations.

    Driven by :meth:`on_batch`, called when the training loop receives the first
    micro-batch of each global batch. The iteration is counted, not read from
    Megatron: one global batch per training iteration, from ``start_iteration``
    (the iteration Megatron resumes from; the one its loop is at when global batch
    ``b`` starts is ``start_iteration + b``). A report covers the global batches
    delivered since the previous one (``stats_source.stats`` entries whose
    ``global_batch`` lies between), never one read ahead but not yet trained on.
    """

    def __init__(self, stats_source, *, interval: int, start_iteration: int = 0, group=None,
                 chunk: int = 0, tensorboard_dir: Optional[str] = None, tb_writer=None,
                 wandb_writer=None, reporter: Optional[bool] = None):
        self.stats_source = stats_source
        self.interval = int(interval)
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.start_iteration = int(start_iteration)
        self.chunk = chunk
        self._reported = 0                  # global batches already covered by a report
        if reporter is None:
            reporter = chunk == 0 and _is_lowest_rank(group)
        self.reporter = reporter
        if tb_writer is None and wandb_writer is None and reporter:
            tb_writer, wandb_writer = _megatron_writers()
            if tb_writer is None and tensorboard_dir and _on_last_stage_cp0():
                tb_writer = _own_tensorboard_writer(tensorboard_dir)
        self.tb_writer = tb_writer
        self.wandb_writer = wandb_writer
        self.lines = []   # the log lines written, newest last (bounded)

    @classmethod
    def for_config(cls, stats_source, cfg, *, group=None, chunk: int = 0) -> "Telemetry":
        """The telemetry a run's :class:`~.config.MMBalanceConfig` asks for."""
        return cls(stats_source, interval=cfg.log_interval, start_iteration=cfg.megatron.start_iteration,
                   group=group, chunk=chunk, tensorboard_dir=cfg.tensorboard_dir)

    def on_batch(self, global_batch: int) -> None:
        """Global batch ``global_batch`` (0-based) starts: report on an interval's iteration."""
        if not self.reporter:
            return
        it = self.start_iteration + int(global_batch)
        if it > 0 and it % self.interval == 0:
            self.report(it, upto=int(global_batch))

    def _new_entries(self, upto: int) -> list:
        entries = [s for s in self.stats_source.stats if self._reported <= _batch_of(s) < upto]
        self._reported = max(self._reported, upto)
        return entries

    def report(self, iteration: int, upto: int) -> Dict[str, float]:
        """Summarise the global batches before ``upto`` not yet reported and write them out."""
        summary = summarize(self._new_entries(upto))
        if not summary:
            return summary
        line = format_line(iteration, summary, self.chunk)
        logger.info(line)
        print(line, flush=True)
        self.lines = (self.lines + [line])[-64:]
        prefix = "mm-balance" if not self.chunk else f"mm-balance/chunk{self.chunk}"
        if self.tb_writer is not None:
            for k, v in summary.items():
                self.tb_writer.add_scalar(f"{prefix}/{k}", v, iteration)
        if self.wandb_writer is not None:
            self.wandb_writer.log({f"{prefix}/{k}": v for k, v in summary.items()}, iteration)
        return summary


def _batch_of(entry) -> int:
    return entry["global_batch"] if isinstance(entry, dict) else entry.global_batch


def _is_lowest_rank(group) -> bool:
    try:
        import torch.distributed as dist
        if not dist.is_initialized():
            return True
        if group is None:
            return dist.get_rank() == 0
        return dist.get_rank() == min(dist.get_process_group_ranks(group))
    except Exception:
        return True


def _on_last_stage_cp0() -> bool:
    """One TensorBoard stream per run: the last pipeline stage, context-parallel rank 0."""
    try:
        from megatron.core import parallel_state as mpu
        return (mpu.is_pipeline_last_stage(ignore_virtual=True)
                and mpu.get_context_parallel_rank() == 0)
    except Exception:
        return True


def _own_tensorboard_writer(log_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:     # tensorboard not installed: log only
        return None
    return SummaryWriter(log_dir=log_dir, filename_suffix=".mm_balance")
