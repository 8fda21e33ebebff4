"""Thin Megatron-LM glue for image-token load balancing (``--mm-balance``).

Modules, each importable without Megatron, megatron-energon,
transformer-engine or apex (those are imported inside functions):

* :mod:`.arguments` — the ``--mm-balance-*`` flags (``add_mm_balance_args``,
  usable as or chained with Megatron's ``extra_args_provider``);
* :mod:`.config` — the flag table (``MMBalanceConfig``: one field per flag, its one
  default) and ``MegatronArgs``, the one reader of Megatron's ``args``;
* :mod:`.checks` — ``checked_config(args)``, the one builder: the config, refusing
  settings under which balancing would change the loss;
* :mod:`.groups` — the exchange's own process groups (``ExchangeGroups``), created on all ranks;
* :mod:`.iterator` — ``wrap_train_data_iterator``: the hook the training.py patch calls,
  and the exchange / sampler coordinators behind it;
* :mod:`.schedule` — ``MicrobatchSchedule``: micro-batches per global batch;
* :mod:`.sampler` — index-reassigning batch sampler (no tensor exchange, the same
  planner) for datasets that report a sample's image tokens by index;
* :mod:`.energon` — a megatron-energon ``TaskEncoder`` mixin that packs with our
  best-fit packer and carries per-pack ``image_tokens`` in declared batch fields;
* :mod:`.telemetry` — balance statistics to the log and TensorBoard/W&B;
* :mod:`.samples` — ``--mm-balance-record-samples``: what each rank consumed, per iteration;
* :mod:`.logs` — Megatron's training log read back (a job's first-iteration averaging
  undone) and two runs compared: ``mm-balance compare-logs``;
* :mod:`.band` — off vs on judged against a control run's arithmetic-order band
  (``mm-balance compare-logs OFF ON --control CONTROL``).
"""
