"""The placement solver: pure algorithms on integer cost matrices (no torch, no torch.distributed).

* :mod:`.placement` — :func:`~.placement.plan_placement` (the one entry point, with
  :class:`~.placement.SolverOptions`), the placement of one global
  batch's packs onto (rank, micro-step) slots, and :class:`~.placement.PlanStats`;
* :mod:`.two_phase` — the two-phase (vision, language) micro-step objective;
* :mod:`.step_groups` — per-micro-step meeting groups (expert-parallel groups inside data
  parallelism): the labels, the group objective, the packs crossing groups;
* :mod:`.group_placement` — the placement for several step groups: which packs each group
  computes (:mod:`.group_exchange`: few swaps between groups), then each group's own
  micro-steps, never worse than today's placement;
* :mod:`.rank_balance` — evening rank (and node) totals with level-preserving swaps;
* :mod:`.topology` — node-aware moves (ranks per node, inter-node traffic);
* :mod:`.node_choice` — a node-aware plan never worse than the flat one (balance, then
  packs crossing nodes);
* :mod:`.sorting` — fast stable integer sorts the solver relies on for determinism;
* :mod:`.images` — which rank encodes which image (image-level vision balancing on the
  Megatron-LM path, equal tiles);
* :mod:`.frames` — which rank encodes which frame, planned from where the frames are
  (native-resolution frames: moves little, transfer time and a patch cap in the plan);
* :mod:`.exact` — the exact two-phase grouping (MILP, scipy) for small instances:
  a benchmark and test reference, not a runtime path;
* :mod:`.frames_exact` — the exact least moved cost and lowest level of a micro-step's
  frames (MILP, scipy) for small instances, the frame planner's reference.
"""
