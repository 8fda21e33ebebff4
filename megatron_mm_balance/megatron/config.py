"""The ``--mm-balance`` settings as one typed object, built once from Megatron's ``args``.

:class:`MMBalanceConfig` holds every flag's value with ``auto`` resolved (the
sync mode from ``--expert-model-parallel-size``, the log interval from
``--log-interval``); its field defaults are the flags' defaults, written here
once (:mod:`.arguments` registers the flags with them). Build it with
:func:`megatron_mm_balance.megatron.checks.checked_config`, which validates the
arguments first; :meth:`MMBalanceConfig.from_args` alone does not validate.

Imports nothing from Megatron or torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ..runtime.config import DEFAULT_TIMEOUT_S, BalancerConfig
from ..solver.topology import ranks_per_node_from_env

SYNC_CHOICES = ("auto", "microstep", "step")
COST_CHOICES = ("image-tokens", "model", "auto")
DEFAULT_CALIBRATION_ITERS = 10
MODE_CHOICES = ("auto", "exchange", "sampler", "shadow")
DEFAULT_LOG_INTERVAL = 100


@dataclass(frozen=True)
class MMBalanceConfig:
    """What ``--mm-balance*`` asks for (one field per flag, ``auto`` resolved)."""

    #: ``--mm-balance``: balance at all.
    enabled: bool = False
    #: ``--mm-balance-mode``: ``exchange`` moves packed tensors between ranks;
    #: ``sampler`` reassigns sample indices before loading; ``auto`` the sampler
    #: when it applies, else the exchange; ``shadow`` gathers costs and solves like
    #: the exchange, logs the predicted gain, and moves nothing.
    mode: Literal["auto", "exchange", "sampler", "shadow"] = "auto"
    #: ``--mm-balance-sync``, resolved: ``microstep`` under expert parallel, else ``step``.
    sync: Literal["microstep", "step"] = "step"
    #: ``--mm-balance-overlap``: exchange on a background thread.
    overlap: bool = True
    #: ``--mm-balance-cost``: image tokens, a calibrated cost model (file), or ``auto``:
    #: fitted online from the job's own per-pack timings.
    cost: Literal["image-tokens", "model", "auto"] = "image-tokens"
    #: ``--mm-balance-calibration-iters``: iterations ``auto`` calibrates on.
    calibration_iters: int = DEFAULT_CALIBRATION_ITERS
    #: ``--mm-balance-timing`` (or ``--mm-balance-timing-dir``, or ``--mm-balance-cost
    #: auto``): per-pack timing hooks on the model.
    timing: bool = False
    #: ``--mm-balance-timing-dir``: JSON Lines of the per-pack timings, one file per rank.
    timing_dir: Optional[str] = None
    #: ``--mm-balance-cost-file``: the cost model of ``--mm-balance-cost model``.
    cost_file: Optional[str] = None
    #: ``--mm-balance-log-interval``, resolved (default ``--log-interval``, else 100).
    log_interval: int = DEFAULT_LOG_INTERVAL
    #: ``--mm-balance-tolerance``: the solver's knob (None: the solver's default).
    tolerance: Optional[float] = None
    #: ``--mm-balance-timeout``: seconds any exchange wait may take.
    timeout: float = DEFAULT_TIMEOUT_S
    #: ``--mm-balance-ranks-per-node``, resolved (default ``LOCAL_WORLD_SIZE``, else None).
    ranks_per_node: Optional[int] = None

    @classmethod
    def from_args(cls, args) -> "MMBalanceConfig":
        """Read ``args`` (a partial namespace is fine: absent flags take their defaults)."""
        d = cls()

        def flag(name, default):
            value = getattr(args, f"mm_balance_{name}", default)
            return default if value is None and default is not None else value

        return cls(
            enabled=bool(getattr(args, "mm_balance", False)),
            mode=flag("mode", d.mode),
            sync=resolve_sync(args),
            overlap=bool(flag("overlap", d.overlap)),
            cost=flag("cost", d.cost),
            cost_file=flag("cost_file", None),
            calibration_iters=int(flag("calibration_iters", d.calibration_iters)),
            timing=wants_timing(args),
            timing_dir=flag("timing_dir", None),
            log_interval=log_interval(args),
            tolerance=flag("tolerance", None),
            timeout=float(flag("timeout", d.timeout)),
            ranks_per_node=resolve_ranks_per_node(args),
        )

    def runtime(self) -> BalancerConfig:
        """The balanced iterator's settings (packs stay where the loader put them)."""
        return BalancerConfig(sync=self.sync, overlap=self.overlap, timeout=self.timeout,
                              device=None, balance_tolerance=self.tolerance,
                              shadow=self.mode == "shadow", ranks_per_node=self.ranks_per_node)


def wants_timing(args) -> bool:
    """Whether the per-pack timing hooks are asked for (they run with ``--mm-balance`` off too)."""
    return bool(getattr(args, "mm_balance_timing", False) or getattr(args, "mm_balance_timing_dir", None)
                or (getattr(args, "mm_balance", False) and getattr(args, "mm_balance_cost", None) == "auto"))


def resolve_sync(args) -> str:
    """``--mm-balance-sync`` with ``auto`` resolved: microstep under expert parallel."""
    sync = getattr(args, "mm_balance_sync", "auto") or "auto"
    if sync != "auto":
        return sync
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    return "microstep" if ep > 1 else "step"


def resolve_ranks_per_node(args) -> Optional[int]:
    """``--mm-balance-ranks-per-node``, defaulting to the launcher's ``LOCAL_WORLD_SIZE``."""
    value = getattr(args, "mm_balance_ranks_per_node", None)
    if value is not None:
        return int(value)
    return ranks_per_node_from_env(default=None)


def log_interval(args) -> int:
    """``--mm-balance-log-interval``, defaulting to Megatron's ``--log-interval`` (or 100)."""
    value = getattr(args, "mm_balance_log_interval", None)
    if value is None:
        value = getattr(args, "log_interval", None) or DEFAULT_LOG_INTERVAL
    return int(value)
