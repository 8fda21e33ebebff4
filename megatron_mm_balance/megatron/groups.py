"""The exchange's own process groups, created collectively on every rank.

The balancer's background thread runs its collectives (cost all-gather, pack
send/recv) concurrently with Megatron's, so it needs communicators of its own:
two threads issuing collectives on one communicator can interleave them
differently on different ranks and hang. ``torch.distributed.new_group`` is
collective over the whole world, so every rank — with or without data — calls
:func:`init_exchange_groups` at the same point (the training.py patch does it
where the train iterators are built, which every rank reaches).

One group per data-parallel group of *data-holding* ranks: ranks on the first
and last pipeline stage with tensor-parallel rank 0 (Megatron's ``get_batch``
functions read on TP rank 0 and broadcast to the other TP ranks; the
multimodal example builds loaders only there). Context-parallel ranks each read
the same micro-batch and keep their own group. Under virtual pipeline
parallelism each model chunk has its own iterator, so each chunk gets its own
set of groups. The first and last stages balance independently; they see the
same costs and run the same deterministic solver, so they reach the same
placement.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from ..runtime.config import DEFAULT_TIMEOUT_S

_GROUPS: Optional[List] = None      # per model chunk: this rank's exchange group or None
_GROUP_RANKS: Optional[List[List[int]]] = None


def data_holding_rank_lists(layouts: Sequence[dict]) -> List[List[int]]:
    """Unique data-parallel rank lists of the data-holding ranks, in a canonical order.

    ``layouts[r]`` is rank r's ``{"holds_data": bool, "dp_ranks": [...]}``. Pure
    function (tested without processes); raises ``ValueError`` when two ranks
    disagree about a group's members.
    """
    seen = {}
    for rank, lay in enumerate(layouts):
        if not lay["holds_data"]:
            continue
        ranks = tuple(sorted(int(r) for r in lay["dp_ranks"]))
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in its own data-parallel group {list(ranks)}")
        seen[ranks] = True
    lists = sorted(seen)
    members = {}
    for g in lists:
        for r in g:
            if r in members:
                raise ValueError(f"rank {r} is in two data-parallel groups: {list(members[r])} and {list(g)}")
            members[r] = g
    return [list(g) for g in lists]


def megatron_layout(tp_rank0_only: bool = True) -> dict:
    """This rank's layout from Megatron's ``parallel_state`` (must be initialised)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    pp_rank = mpu.get_pipeline_model_parallel_rank()
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    holds = pp_rank in (0, pp_size - 1) and (tp_rank == 0 or not tp_rank0_only)
    dp_ranks = dist.get_process_group_ranks(mpu.get_data_parallel_group())
    return {"holds_data": bool(holds), "dp_ranks": list(dp_ranks)}


def init_exchange_groups(layout: Optional[dict] = None, *, num_chunks: int = 1,
                         timeout: float = DEFAULT_TIMEOUT_S) -> List:
    """Create the exchange groups on every rank; return this rank's group per model chunk.

    Collective over the default (world) group: every rank must call it, in the
    same order relative to other group creations. ``layout`` defaults to
    :func:`megatron_layout`. Idempotent: later calls return the groups made by
    the first (``reset_exchange_groups`` forgets them, for tests).
    """
    global _GROUPS, _GROUP_RANKS
    if _GROUPS is not None:
        if len(_GROUPS) != num_chunks:
            raise RuntimeError(f"exchange groups were created for {len(_GROUPS)} model chunks, "
                               f"now asked for {num_chunks}")
        return list(_GROUPS)
    import torch.distributed as dist
    from ..runtime import new_exchange_groups

    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if layout is None:
        layout = megatron_layout()
    layouts = [None] * dist.get_world_size()
    dist.all_gather_object(layouts, layout)
    lists = data_holding_rank_lists(layouts)
    _GROUPS = [new_exchange_groups(lists, timeout) for _ in range(num_chunks)]
    _GROUP_RANKS = lists
    return list(_GROUPS)


def exchange_group_ranks() -> Optional[List[List[int]]]:
    """The rank lists of the groups created (None before :func:`init_exchange_groups`)."""
    return None if _GROUP_RANKS is None else [list(g) for g in _GROUP_RANKS]


def reset_exchange_groups() -> None:
    """Forget the cached groups (they are not destroyed; for tests and re-initialisation)."""
    global _GROUPS, _GROUP_RANKS
    _GROUPS = None
    _GROUP_RANKS = None
