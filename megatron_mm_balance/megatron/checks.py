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
    if cost == "auto":
        iters = getattr(args, "mm_balance_calibration_iters", MMBalanceConfig.calibration_iters)
        if iters is None or iters < 2:
            fail(f"--mm-balance-calibration-iters must be >= 2, got {iters}")
        for flag, name in (("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
                           ("--context-parallel-size", "context_parallel_size")):
            if (getattr(args, name, 1) or 1) > 1:
                fail(f"--mm-balance-cost auto needs {flag} 1 (every data-holding rank must fit "
                     "the same costs; with several exchange groups they would fit their own)")
    if cost != "image-tokens" and mode == "sampler":
        fail(f"--mm-balance-mode sampler balances the dataset's image tokens; it cannot honour "
             f"--mm-balance-cost {cost} (use --mm-balance-mode exchange)")
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

    if getattr(args, "hybrid_context_parallel", False):
        fail("--mm-balance does not support --hybrid-context-parallel (it builds its own "
             "variable micro-batches)")
    dl_type = getattr(args, "dataloader_type", None)
    if mode == "sampler" and dl_type not in (None, "single"):
        fail(f"--mm-balance-mode sampler needs --dataloader-type single (got {dl_type}); "
             "use --mm-balance-mode exchange")


def checked_config(args) -> MMBalanceConfig:
    """:func:`check_args`, then the run's :class:`~.config.MMBalanceConfig` (built once)."""
    check_args(args)
    return MMBalanceConfig.from_args(args)
