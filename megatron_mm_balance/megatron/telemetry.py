"""Balance statistics every ``--mm-balance-log-interval`` iterations: one line, and scalars.

Every global batch leaves one typed
:class:`~megatron_mm_balance.runtime.stats.BatchStats` (the exchange's balancer and
the sampler record them alike). Every interval :func:`summarize` turns the
global batches delivered since the last report into named figures (the fields
below, documented in docs/megatron.md), which are written

* to the log as one line per report, ``[mm-balance] iteration N | field: value | ...``,
  printed like Megatron's own iteration lines (and only printed: not also logged),
  on the lowest rank of each exchange group, chunk 0;
* as ``mm-balance/<field>`` scalars through Megatron's TensorBoard and W&B writers
  when this rank has them (Megatron creates them on the last rank only; with
  tensor parallel > 1 that rank reads no data, so the report rank opens its own
  TensorBoard writer in ``--tensorboard-dir`` with the suffix ``.mm_balance``,
  which TensorBoard shows alongside the run's own events).

Costs are in the cost function's unit (image tokens, or microseconds with
``--mm-balance-cost model``). "before" is the order the packs were drawn in,
"after" the order they were delivered. The imbalances are ratios of sums over
the interval: ``imbalance = cost_step_max / cost_step_mean``, where placement does
not change ``cost_step_mean`` (every pack is computed once per global batch), so
``imbalance_after <= imbalance_before`` exactly when ``cost_step_max_after <=
cost_step_max_before``. In shadow mode nothing is delivered differently: the
"after" figures equal "before" and ``packs_moved`` is 0; what balancing would do
is in the ``*_would_*`` fields. In control mode (``control: 1``) every rank kept its own
packs, permuted across micro-steps in balancing's order: ``packs_moved`` is 0 and
``packs_reordered`` counts the slots whose pack was drawn for another micro-step. Statistics are identical on every rank of a group
(they come from the all-gathered costs), except the ``this rank`` ones.
"""
from __future__ import annotations

import atexit
from typing import Dict, Iterable, Optional

from ..runtime.log_line import emit_line, format_line, read_lines  # noqa: F401  (read_lines: re-exported)

#: the per-rank transfer figures (exchange and shadow mode; nothing travels in sampler mode)
_TRANSFER = ("packs_sent", "packs_received", "bytes_sent", "bytes_received")
#: the node figures, reported only where the nodes are known (found at start-up, or given)
_NODE_FIGURES = ("nodes", "inter_node_packs", "inter_node_bytes_sent")
_TIMES = ("allgather_ms", "solver_ms", "exchange_ms", "exchange_cpu_ms", "consumer_wait_ms",
          "consumer_wait_first_ms")


def _ratio(num: float, den: float) -> float:
    return num / den if den else 1.0


def summarize(entries: Iterable) -> Dict[str, float]:
    """The figures of the global batches ``entries`` (``BatchStats``), in log order.

    Per global batch (means): ``num_microbatches``; ``packs_moved`` (whole group,
    delivered); the transfer figures and times of this rank; where the nodes are known,
    ``nodes`` (the group spans), ``inter_node_packs`` (whole group, delivered packs that
    changed node) and ``inter_node_bytes_sent`` (this rank, to other nodes). Over all the micro-steps of the interval: ``cost_step_max_before/after``
    (mean of the costliest micro-batch of each micro-step), ``cost_step_mean`` and the
    ``imbalance`` and ``rank_imbalance`` ratios (see the module docstring). Where the job's
    per-micro-step meeting groups split the data-parallel group (expert parallel smaller than
    data parallel): ``step_groups`` (how many), ``group_cost_before/after`` (the group
    objective, the slowest group's sum of its per-micro-step maxima, per micro-step) and
    ``inter_group_packs`` (delivered packs that changed step group, whole group).
    ``prefetched``: the share of global batches pulled before the loop asked for them.
    """
    entries = list(entries)
    if not entries:
        return {}
    n = len(entries)
    steps = sum(e.num_microbatches for e in entries)
    plans = [e.plan for e in entries]
    before = sum(p.microstep_cost_before for p in plans)
    solved = sum(p.microstep_cost_after for p in plans)
    mean_total = sum(p.rank_total_mean for p in plans)     # = sum over micro-steps of the step mean
    rank_before = sum(p.rank_total_max_before for p in plans)
    rank_solved = sum(p.rank_total_max_after for p in plans)
    shadow = [e.shadow for e in entries]
    after = sum(p.microstep_cost_before if s else p.microstep_cost_after for p, s in zip(plans, shadow))
    rank_after = sum(p.rank_total_max_before if s else p.rank_total_max_after
                     for p, s in zip(plans, shadow))
    out = {
        "global_batches": float(n),
        "num_microbatches": steps / n,
        "cost_step_max_before": before / steps,
        "cost_step_max_after": after / steps,
        "cost_step_mean": mean_total / steps,
        "imbalance_before": _ratio(before, mean_total),
        "imbalance_after": _ratio(after, mean_total),
        "rank_imbalance_before": _ratio(rank_before, mean_total),
        "rank_imbalance_after": _ratio(rank_after, mean_total),
        "packs_moved": sum(e.packs_moved for e in entries) / n,
    }
    if any(shadow):
        out.update({
            "packs_would_move": sum(e.packs_would_move for e in entries) / n,
            "cost_step_max_would_be": solved / steps,
            "imbalance_would_be": _ratio(solved, mean_total),
            "rank_imbalance_would_be": _ratio(rank_solved, mean_total),
            "gain_would_be": 1.0 - _ratio(solved, before) if before else 0.0,
        })
    grouped = [e for e in entries if e.plan.step_groups > 1]
    if grouped:                    # the job's step groups split the data-parallel group
        g_steps = sum(e.num_microbatches for e in grouped)
        out.update({
            "step_groups": sum(e.plan.step_groups for e in grouped) / len(grouped),
            "group_cost_before": sum(e.plan.group_cost_before for e in grouped) / g_steps,
            "group_cost_after": sum(e.plan.group_cost_before if e.shadow else e.plan.group_cost_after
                                    for e in grouped) / g_steps,
            "inter_group_packs": sum(0 if e.shadow else e.plan.inter_group_moves for e in grouped) / len(grouped),
        })
        if any(e.shadow for e in grouped):
            out["inter_group_packs_would_move"] = sum(e.plan.inter_group_moves for e in grouped) / len(grouped)
    control = [e for e in entries if e.mode == "control"]
    if control:
        out.update({"control": 1.0,
                    "packs_reordered": sum(e.packs_reordered for e in control) / len(control)})
    moving = [e for e in entries if e.mode != "sampler"]
    if moving:
        known = [e for e in moving if e.nodes is not None]
        for name in _NODE_FIGURES if known else ():
            out[name] = sum(getattr(e, name) for e in known) / len(known)
        for name in _TRANSFER:
            out[name] = sum(getattr(e, name) for e in moving) / len(moving)
        for name in _TIMES:
            out[name] = sum(getattr(e, name) for e in moving) / len(moving)
        out["prefetched"] = sum(bool(e.prefetched) for e in moving) / len(moving)
    else:
        out["solver_ms"] = sum(e.solver_ms for e in entries) / n
    return out


def resume_note(loaded_iteration: int) -> str:
    """What the first telemetry line of a job resumed at ``loaded_iteration`` adds: how
    Megatron logs a job's first iterations (its next line after the job's first averages
    both, as in every job), so that a resumed log compared with the uninterrupted run's is
    read right; empty for a fresh job."""
    if loaded_iteration <= 0:
        return ""
    k = loaded_iteration
    return (f" | resumed_from: {k} | note: Megatron logs this job's first iteration ({k + 1}) alone "
            f"and averages it into its next line, so that line differs from the uninterrupted run's; "
            f"mm-balance compare-logs UNINTERRUPTED.log RESUMED.log recomputes it")


def emit(line: str) -> None:
    """Write one log line once, to stdout as Megatron prints its own iteration lines, so it
    reads the same in every log; not also sent through ``logging`` (Megatron installs a root
    handler, which printed every line a second time); the line and its newline in one write
    (:func:`~..runtime.log_line.emit_line`)."""
    emit_line(line)


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
                tb_writer = own_tensorboard_writer(tensorboard_dir)
        self.tb_writer = tb_writer
        self.wandb_writer = wandb_writer
        self.lines = []   # the log lines written, newest last (bounded)
        self._resume_note = resume_note(self.start_iteration)

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
        entries = [s for s in self.stats_source.stats if self._reported <= s.global_batch < upto]
        self._reported = max(self._reported, upto)
        return entries

    def report(self, iteration: int, upto: int) -> Dict[str, float]:
        """Summarise the global batches before ``upto`` not yet reported and write them out."""
        summary = summarize(self._new_entries(upto))
        if not summary:
            return summary
        line = format_line(iteration, summary, self.chunk) + self._resume_note
        self._resume_note = ""                 # on the job's first line only
        emit(line)
        self.lines = (self.lines + [line])[-64:]
        prefix = "mm-balance" if not self.chunk else f"mm-balance/chunk{self.chunk}"
        if self.tb_writer is not None:
            for k, v in summary.items():
                self.tb_writer.add_scalar(f"{prefix}/{k}", v, iteration)
        if self.wandb_writer is not None:
            self.wandb_writer.log({f"{prefix}/{k}": v for k, v in summary.items()}, iteration)
        return summary


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


def own_tensorboard_writer(log_dir: str, suffix: str = ".mm_balance"):
    """A TensorBoard writer of our own beside the run's events (None without tensorboard),
    closed at exit: its writer thread flushes only every two minutes, so a job shorter than
    that would otherwise leave its events unwritten."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:     # tensorboard not installed: log only
        return None
    writer = SummaryWriter(log_dir=log_dir, filename_suffix=suffix)
    atexit.register(writer.close)
    return writer
