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

plus those that keep a mode from silently not doing what it was asked:

* Megatron-LM's own data rebalancing (``--hybrid-context-parallel``, and after
  core_v0.19.0 ``--dynamic-context-parallel`` and ``--sequence-packing-scheduler``):
  its schedulers reroute the balanced packs by text length, so two balancers would
  place one global batch;
* ``--mm-balance-mode sampler`` without ``--dataloader-type single`` (the sampler
  replaces Megatron's own batch sampler), or with a ``--mm-balance-cost`` other
  than ``image-tokens`` (the dataset reports only a sample's image tokens by index,
  so no other cost can be honoured there; ``auto`` then uses the exchange);
* ``--mm-balance-cost auto`` with pipeline or context parallelism (several exchange
  groups would each fit their own costs);
* ``--mm-balance-vision images`` without ``--mm-balance``, in shadow mode (which promises
  to move nothing), with ``--mm-balance-cost auto`` (the per-pack vision timings it fits
  would time other ranks' tiles), with context or tensor parallelism (CP ranks share tiles;
  TP ranks other than 0 read no data, so the tiles sent ahead would not reach them) or in
  sampler mode (the exchange thread plans the tiles).

The checks read the typed :class:`~.config.MegatronArgs` of a built
:class:`~.config.MMBalanceConfig`, never ``args``: :func:`checked_config` is the
one builder the glue and the ``validate_args`` patch (:func:`check_args`) use.
"""
from __future__ import annotations

from .config import MEASURING_MODES, UPSTREAM_BALANCERS, MegatronArgs, MMBalanceConfig, MMBalanceConfigError

__all__ = ["MMBalanceConfigError", "check_args", "checked_config", "global_aux_loss_coeff",
           "refuse_loss_changing", "refuse_upstream_balancers", "refuse_vision_images"]


def global_aux_loss_coeff(megatron: MegatronArgs) -> float:
    """The coefficient of ``global_aux_loss`` in Megatron's router settings (0 if unused)."""
    types, coeffs = megatron.moe_router_load_balancing_type, megatron.moe_aux_loss_coeff
    if "global_aux_loss" not in types:
        return 0.0
    if len(coeffs) == 1:
        return float(coeffs[0])
    i = types.index("global_aux_loss")
    return float(coeffs[i]) if i < len(coeffs) else 0.0


def refuse_loss_changing(cfg: MMBalanceConfig) -> None:
    """Raise :class:`~.config.MMBalanceConfigError` on the first refused combination."""
    m = cfg.megatron
    if m.micro_batch_size > 1 and not m.calculate_per_token_loss:
        raise MMBalanceConfigError(
            f"--mm-balance with --micro-batch-size {m.micro_batch_size} > 1 needs "
            "--calculate-per-token-loss (a per-micro-batch loss mean is only exact while packs stay "
            "grouped as loaded); or use --micro-batch-size 1, one pack per micro-batch")
    if (m.num_experts or 0) > 0 and global_aux_loss_coeff(m) > 0:
        raise MMBalanceConfigError(
            "--mm-balance cannot be combined with --moe-router-load-balancing-type "
            "global_aux_loss (--moe-aux-loss-coeff > 0): its expert-load statistics span "
            "the packs of all data-parallel ranks per micro-step, so moving packs changes "
            "the loss; use aux_loss or seq_aux_loss")
    refuse_upstream_balancers(m)
    if cfg.mode == "sampler" and m.dataloader_type not in (None, "single"):
        raise MMBalanceConfigError(f"--mm-balance-mode sampler needs --dataloader-type single (got "
                                   f"{m.dataloader_type}); use --mm-balance-mode exchange")
    if cfg.cost == "auto":
        for flag, size in (("--pipeline-model-parallel-size", m.pipeline_model_parallel_size),
                           ("--context-parallel-size", m.context_parallel_size)):
            if size > 1:
                raise MMBalanceConfigError(
                    f"--mm-balance-cost auto needs {flag} 1 (every data-holding rank must fit the "
                    "same costs; with several exchange groups they would fit their own)")
    if cfg.mode == "sampler" and cfg.cost != "image-tokens":
        raise MMBalanceConfigError(f"--mm-balance-mode sampler cannot honour --mm-balance-cost "
                                   f"{cfg.cost}: the dataset reports only a sample's image tokens "
                                   "(mm_balance_image_tokens(idx)); use --mm-balance-mode exchange "
                                   "or --mm-balance-cost image-tokens")


def refuse_vision_images(cfg: MMBalanceConfig) -> None:
    """The combinations ``--mm-balance-vision images`` does not support (see above)."""
    if cfg.vision != "images":
        return
    if not cfg.enabled:
        raise MMBalanceConfigError("--mm-balance-vision images needs --mm-balance")
    if cfg.mode in MEASURING_MODES:
        raise MMBalanceConfigError(f"--mm-balance-vision images moves tiles, --mm-balance-mode {cfg.mode} "
                                   "moves nothing between ranks at some or all iterations: use one of them")
    if cfg.cost == "auto":
        raise MMBalanceConfigError("--mm-balance-vision images cannot be combined with --mm-balance-cost "
                                   "auto: a pack's vision timing would be that of other ranks' tiles; "
                                   "use --mm-balance-cost image-tokens or model")
    if cfg.megatron.context_parallel_size > 1:
        raise MMBalanceConfigError("--mm-balance-vision images needs --context-parallel-size 1")
    if cfg.megatron.tensor_model_parallel_size > 1:
        raise MMBalanceConfigError("--mm-balance-vision images needs --tensor-model-parallel-size 1: the "
                                   "tiles are planned and sent ahead on the rank that reads the data "
                                   "(tensor-parallel rank 0), which its tensor-parallel peers' encoders "
                                   "would also need")
    if cfg.mode == "sampler":
        raise MMBalanceConfigError("--mm-balance-vision images needs the exchange (--mm-balance-mode exchange "
                                   "or auto): its thread plans the tiles and sends them ahead; the sampler "
                                   "mode has none")


def refuse_upstream_balancers(megatron: MegatronArgs) -> None:
    """Refuse Megatron-LM's own data rebalancing together with ``--mm-balance``.

    Both would place the same global batch: Megatron's schedulers run on the iterator our
    wrapper returns, take the balanced micro-batches apart and reroute their sequences by
    text length, so the image-token placement is undone after its exchange was paid for,
    and the micro-batch counts per rank become theirs. One balancer per run."""
    for dest, value in megatron.upstream_balancers:
        flag, what = UPSTREAM_BALANCERS[dest]
        shown = flag if value is True else f"{flag} {value}"
        raise MMBalanceConfigError(
            f"--mm-balance cannot be combined with {shown}: {what}, which undoes the image-token "
            "placement (two balancers for one global batch); use one of them")


def checked_config(args) -> MMBalanceConfig:
    """The run's :class:`~.config.MMBalanceConfig`, built from ``args`` and checked: every
    value (:meth:`~.config.MMBalanceConfig.from_args`) and, with ``--mm-balance``, the
    combinations above. The one builder: what the glue passes down."""
    cfg = MMBalanceConfig.from_args(args)
    if cfg.enabled:
        refuse_loss_changing(cfg)
    refuse_vision_images(cfg)
    return cfg


def check_args(args) -> None:
    """``validate_args``'s hook (the arguments.py patch): :func:`checked_config`, for its errors."""
    checked_config(args)
