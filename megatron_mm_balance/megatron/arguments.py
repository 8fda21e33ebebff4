"""The ``--mm-balance`` command-line flags, in Megatron-LM style.

Registered two ways, both ending in :func:`add_mm_balance_args`:

* the ``patches/`` diff to ``megatron/training/arguments.py`` calls it from
  ``add_megatron_arguments``, so every Megatron entry point knows the flags;
* on an unpatched checkout a training script passes it (or
  :func:`with_mm_balance_args` chaining the script's own provider) as
  ``pretrain(..., extra_args_provider=...)``.

Registering twice is harmless: the second call sees ``--mm-balance`` and returns.
The flags' choices and defaults live in :mod:`.config` (one typed
:class:`~.config.MMBalanceConfig` per run); they are validated by :mod:`.checks`.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

from .config import COST_CHOICES, MODE_CHOICES, SYNC_CHOICES, MMBalanceConfig

_DEFAULTS = MMBalanceConfig()


def add_mm_balance_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``mm-balance`` argument group to ``parser`` and return the parser."""
    if "--mm-balance" in parser._option_string_actions:  # already registered (patch + provider)
        return parser
    group = parser.add_argument_group(title="mm-balance (image-token load balancing)")
    group.add_argument("--mm-balance", action="store_true",
                       help="Balance image tokens across data-parallel ranks every global batch "
                            "by moving whole micro-batches (packs) between ranks.")
    group.add_argument("--mm-balance-overlap", dest="mm_balance_overlap", action="store_true",
                       default=_DEFAULTS.overlap,
                       help="Gather costs and exchange packs for the next global batch on a "
                            "background thread, overlapped with compute (default).")
    group.add_argument("--no-mm-balance-overlap", dest="mm_balance_overlap", action="store_false",
                       help="Balance synchronously when the global batch is first read.")
    group.add_argument("--mm-balance-sync", choices=SYNC_CHOICES, default="auto",
                       help="Objective: 'microstep' balances every micro-step (needed when "
                            "expert-parallel all-to-alls synchronise ranks each micro-step), "
                            "'step' balances per-rank totals (pure data parallel). 'auto' picks "
                            "microstep when --expert-model-parallel-size > 1, else step.")
    group.add_argument("--mm-balance-cost", choices=COST_CHOICES, default=_DEFAULTS.cost,
                       help="Cost of a pack: its image tokens, a calibrated cost model read "
                            "from --mm-balance-cost-file, or 'auto': a cost model fitted from the "
                            "job's own per-pack timings of its first --mm-balance-calibration-iters "
                            "iterations (image tokens until then; saved beside the checkpoints).")
    group.add_argument("--mm-balance-calibration-iters", type=int, default=_DEFAULTS.calibration_iters,
                       help="Iterations --mm-balance-cost auto calibrates on (the first is dropped).")
    group.add_argument("--mm-balance-timing", action="store_true",
                       help="Time the vision encoder and the language model, forward and backward, "
                            "for every micro-batch (module hooks; works with --mm-balance off); "
                            "logged per --log-interval.")
    group.add_argument("--mm-balance-timing-dir", type=str, default=None,
                       help="Also write the per-pack timings as JSON Lines, one file per rank, "
                            "into this directory (implies --mm-balance-timing).")
    group.add_argument("--mm-balance-cost-file", type=str, default=None,
                       help="Cost file (JSON, format mm-balance-cost/v1) for --mm-balance-cost model.")
    group.add_argument("--mm-balance-mode", choices=MODE_CHOICES, default=_DEFAULTS.mode,
                       help="'exchange' moves packed tensors between ranks; 'sampler' reassigns "
                            "sample indices before loading (needs --dataloader-type single and a "
                            "dataset with mm_balance_image_tokens(idx)); 'auto' uses the sampler "
                            "when it applies, else the exchange; 'shadow' gathers costs and solves "
                            "like the exchange and logs the predicted gain, but moves nothing.")
    group.add_argument("--mm-balance-log-interval", type=int, default=None,
                       help="Write balance statistics every this many iterations "
                            "(default: --log-interval).")
    group.add_argument("--mm-balance-tolerance", type=float, default=None,
                       help="How far above the mean (fraction) a rank's total may end; larger keeps more "
                            "packs home (solver default 0.002 if unset).")
    group.add_argument("--mm-balance-ranks-per-node", type=int, default=None,
                       help="GPUs per node (global rank r on node r // N): packs move between "
                            "node-mates where balance allows (default: the launcher's "
                            "LOCAL_WORLD_SIZE; unset: every rank its own node).")
    group.add_argument("--mm-balance-timeout", type=float, default=_DEFAULTS.timeout,
                       help="Seconds the exchange waits on its collectives before failing.")
    group.add_argument("--mm-balance-task-encoder", action="store_true",
                       help="examples/multimodal: build the example's TaskEncoder with "
                            "BalancedPackingMixin (per-pack image tokens in the batch; with "
                            "--packing-buffer-size, best-fit packing of whole samples into "
                            "--packing-seq-length). Works with or without --mm-balance.")
    return parser


def with_mm_balance_args(provider: Optional[Callable] = None) -> Callable:
    """Chain ``provider`` (a script's own ``extra_args_provider``) with ours.

    ``pretrain(..., extra_args_provider=with_mm_balance_args(add_multimodal_extra_args))``.
    """
    def _provider(parser):
        if provider is not None:
            parser = provider(parser)
        return add_mm_balance_args(parser)
    _provider.__name__ = f"with_mm_balance_args({getattr(provider, '__name__', provider)})"
    return _provider
