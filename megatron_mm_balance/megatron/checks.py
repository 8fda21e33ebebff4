"""Refuse settings under which ``--mm-balance`` could change training results.

Balancing moves whole micro-batches between data-parallel ranks and micro-steps
of the same global batch. The gradient is then unchanged exactly when every
loss term depends only on the micro-batch it is computed from, or on sums over
the whole global batch. We refuse, with an error naming the flag, the setting
that breaks this and one kept out conservatively:

* ``--micro-batch-size`` > 1 without ``--calculate-per-token-loss``. Both modes
  move whole micro-batches, which keeps Megatron's default loss (a token mean
  per micro-batch, micro-batches weighted equally) exact at any micro-batch
  size; the check is deliberately conservative so that the guarantee does not
  hinge on that: with several packs per micro-batch only the per-token loss
  (a global token sum over a global token count) is invariant to any regrouping
  of packs. Relax it here if you rely on whole-micro-batch moves only.
* ``--moe-router-load-balancing-type global_aux_loss`` with a non-zero
  ``--moe-aux-loss-coeff``: its expert-load statistics are all-reduced over the
  data-parallel group every micro-step and accumulated over the step, so the loss
  depends on which packs meet at which micro-step. ``aux_loss`` and
  ``seq_aux_loss`` (per micro-batch / per sequence, reduced over TP x CP only),
  ``sinkhorn`` and the aux-loss-free expert bias (a sum over the whole step)
  are invariant and allowed.

Every check reads attributes with defaults, so a partial namespace (tests, a
custom harness) is accepted.
"""
from __future__ import annotations

import os

from .config import COST_CHOICES, MODE_CHOICES, SYNC_CHOICES, MMBalanceConfig


class MMBalanceConfigError(ValueError):
    """An ``--mm-balance`` setting that is invalid or unsupported; the message names the flag."""


def _as_list(value):
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def global_aux_loss_coeff(args) -> float:
    """The coefficient of ``global_aux_loss`` in Megatron 0.16.1's router settings (0 if unused)."""
    types = _as_list(getattr(args, "moe_router_load_balancing_type", None))
    coeffs = _as_list(getattr(args, "moe_aux_loss_coeff", 0.0))
    if "global_aux_loss" not in types:
        return 0.0
    if len(coeffs) == 1:
        return float(coeffs[0])
    i = types.index("global_aux_loss")
    return float(coeffs[i]) if i < len(coeffs) else 0.0


def check_args(args) -> None:
    """Raise :class:`MMBalanceConfigError` on the first invalid or unsupported setting."""
    if not getattr(args, "mm_balance", False):
        return

    def fail(msg):
        raise MMBalanceConfigError(msg)

    sync = getattr(args, "mm_balance_sync", "auto")
    if sync not in SYNC_CHOICES:
        fail(f"--mm-balance-sync must be one of {', '.join(SYNC_CHOICES)}, got {sync!r}")
    mode = getattr(args, "mm_balance_mode", "auto")
    if mode not in MODE_CHOICES:
        fail(f"--mm-balance-mode must be one of {', '.join(MODE_CHOICES)}, got {mode!r}")
    cost = getattr(args, "mm_balance_cost", "image-tokens")
    if cost not in COST_CHOICES:
        fail(f"--mm-balance-cost must be one of {', '.join(COST_CHOICES)}, got {cost!r}")
    cost_file = getattr(args, "mm_balance_cost_file", None)
    if cost == "model":
        if not cost_file:
            fail("--mm-balance-cost model needs --mm-balance-cost-file PATH (a calibrated cost file)")
        if not os.path.isfile(cost_file):
            fail(f"--mm-balance-cost-file {cost_file}: no such file")
        from ..cost.model import load_cost_file
        try:
            load_cost_file(cost_file)
        except ValueError as exc:
            fail(f"--mm-balance-cost-file: {exc}")
    elif cost_file:
        fail("--mm-balance-cost-file is only read with --mm-balance-cost model")
    interval = getattr(args, "mm_balance_log_interval", None)
    if interval is not None and interval < 1:
        fail(f"--mm-balance-log-interval must be >= 1, got {interval}")
    timeout = getattr(args, "mm_balance_timeout", MMBalanceConfig.timeout)
    if timeout is None or not timeout > 0:
        fail(f"--mm-balance-timeout must be > 0 seconds, got {timeout}")
    tol = getattr(args, "mm_balance_tolerance", None)
    if tol is not None and not (0.0 <= tol < 1.0):
        fail(f"--mm-balance-tolerance must be in [0, 1), got {tol}")
    rpn = getattr(args, "mm_balance_ranks_per_node", None)
    if rpn is not None and rpn < 1:
        fail(f"--mm-balance-ranks-per-node must be >= 1, got {rpn}")

    mbs = getattr(args, "micro_batch_size", 1) or 1
    if mbs > 1 and not getattr(args, "calculate_per_token_loss", False):
        fail(f"--mm-balance with --micro-batch-size {mbs} > 1 needs --calculate-per-token-loss "
             "(a per-micro-batch loss mean is only exact while packs stay grouped as loaded); "
             "or use --micro-batch-size 1, one pack per micro-batch")

    coeff = global_aux_loss_coeff(args)
    if (getattr(args, "num_experts", None) or 0) > 0 and coeff > 0:
        fail("--mm-balance cannot be combined with --moe-router-load-balancing-type "
             "global_aux_loss (--moe-aux-loss-coeff > 0): its expert-load statistics span "
             "the packs of all data-parallel ranks per micro-step, so moving packs changes "
             "the loss; use aux_loss or seq_aux_loss")

    check_upstream_balancers(args)
    dl_type = getattr(args, "dataloader_type", None)
    if mode == "sampler" and dl_type not in (None, "single"):
        fail(f"--mm-balance-mode sampler needs --dataloader-type single (got {dl_type}); "
             "use --mm-balance-mode exchange")


#: Megatron-LM's own data rebalancing, by the argument that turns it on: (flag, what it does).
#: core_v0.16.1 to core_v0.19.0 (and the Megatron-LM that Megatron-Bridge v0.6.0 pins) have
#: hybrid context parallel; the dynamic context parallel and sequence-packing schedulers that
#: replace it came after core_v0.19.0 (a newer line, apply_patches.sh --force).
UPSTREAM_BALANCERS = (
    ("hybrid_context_parallel", "--hybrid-context-parallel",
     "HybridCPDataLoaderWrapper splits every global batch's packs into sub-samples and reroutes "
     "them over the data- and context-parallel ranks by sequence length"),
    ("dynamic_context_parallel", "--dynamic-context-parallel",
     "it regroups every global batch's sequences over the data- and context-parallel ranks by "
     "sequence length"),
    ("sequence_packing_scheduler", "--sequence-packing-scheduler",
     "its scheduler re-packs and reroutes every global batch's sequences between data-parallel "
     "ranks by sequence length"),
)


def check_upstream_balancers(args) -> None:
    """Refuse Megatron-LM's own data rebalancing together with ``--mm-balance``.

    Both would place the same global batch: Megatron's schedulers run on the iterator our
    wrapper returns, take the balanced micro-batches apart and reroute their sequences by
    text length, so the image-token placement is undone after its exchange was paid for,
    and the micro-batch counts per rank become theirs. One balancer per run."""
    for dest, flag, what in UPSTREAM_BALANCERS:
        value = getattr(args, dest, None)
        if value in (None, False):
            continue
        shown = flag if value is True else f"{flag} {value}"
        raise MMBalanceConfigError(
            f"--mm-balance cannot be combined with {shown}: {what}, which undoes the image-token "
            "placement (two balancers for one global batch); use one of them")


def checked_config(args) -> MMBalanceConfig:
    """:func:`check_args`, then the run's :class:`~.config.MMBalanceConfig` (built once)."""
    check_args(args)
    return MMBalanceConfig.from_args(args)
