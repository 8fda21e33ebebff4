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

:func:`init_exchange_groups` returns the groups as an :class:`ExchangeGroups`
object (in the spirit of Megatron's ``ProcessGroupCollection``), which the
caller passes on explicitly; nothing is cached in this module. Each call creates
new groups (collectively), so build them once per set of iterators.

The same all-gather that collects the layouts collects what names each rank's node
(:func:`~megatron_mm_balance.runtime.groups.node_identity`: torchrun's ``GROUP_RANK``,
else ``SLURM_NODEID``, else the host name), so the node of every rank is found once,
here, and is the same on every rank (:attr:`ExchangeGroups.node_ids`); nothing is
assumed from the rank numbering.

The same gather collects who waits for whom (:mod:`megatron_mm_balance.runtime.meeting`):
each rank's data-parallel position and the groups it runs a collective with every
micro-step (its expert-parallel group and its expert tensor-parallel group, which Megatron-core
carves out of data x context x tensor parallel). An exchange group's ranks that these
collectives link, through ranks of any stage, tensor- or context-parallel rank holding the
same data-parallel position, meet every micro-step; the exchange group itself meets once per
iteration (:attr:`ExchangeGroups.meetings`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from ..runtime.config import DEFAULT_TIMEOUT_S
from ..runtime.meeting import MeetingGroups, step_groups_from_collectives

#: what makes a step group meet, in the telemetry
VIA_EXPERT_PARALLEL = "expert parallel"


@dataclass(frozen=True)
class ExchangeGroups:
    """This rank's exchange groups: one per model chunk (None where this rank reads no
    data), and the data-holding rank lists they were made from (the same on every rank)."""

    #: per model chunk: this rank's gloo group, or None
    chunks: Tuple[object, ...]
    #: the data-parallel rank lists of the data-holding ranks, in canonical order
    rank_lists: Tuple[Tuple[int, ...], ...]
    #: the node id of every global rank (index: global rank), found when the groups were
    #: created; None: not found (groups built by other means)
    node_ids: Optional[Tuple[int, ...]] = None
    #: who meets whom in this rank's exchange group (None: this rank reads no data, or the
    #: layouts did not say which collectives run every micro-step)
    meetings: Optional[MeetingGroups] = None

    def __len__(self) -> int:
        return len(self.chunks)

    def __iter__(self):
        return iter(self.chunks)

    def chunk(self, index: int):
        """Model chunk ``index``'s group on this rank (None: it reads no data)."""
        return self.chunks[index]


@dataclass(frozen=True)
class RankLayout:
    """This rank's place in the data layout: does it read data, its data-parallel ranks, and
    who it waits for every micro-step."""

    holds_data: bool
    dp_ranks: Tuple[int, ...]
    #: this rank's position in its data-parallel group (Megatron's data-parallel rank);
    #: None: its index among the sorted ``dp_ranks``
    dp_position: Optional[int] = None
    #: the rank groups this rank runs a collective with every micro-step (its expert-parallel
    #: and expert tensor-parallel groups); None: not read, so the meeting groups are unknown
    step_collectives: Optional[Tuple[Tuple[int, ...], ...]] = None

    @staticmethod
    def of(layout: Union["RankLayout", dict]) -> "RankLayout":
        """A :class:`RankLayout`, or a dict of its fields (harnesses; ``dp_position`` and
        ``step_collectives`` optional)."""
        if isinstance(layout, RankLayout):
            return layout
        collectives = layout.get("step_collectives")
        position = layout.get("dp_position")
        return RankLayout(bool(layout["holds_data"]), tuple(int(r) for r in layout["dp_ranks"]),
                          None if position is None else int(position),
                          None if collectives is None else tuple(tuple(int(r) for r in g) for g in collectives))

    def position(self, rank: int) -> int:
        """This rank's data-parallel position (``rank`` is its global rank)."""
        if self.dp_position is not None:
            return self.dp_position
        return sorted(self.dp_ranks).index(rank)


def data_holding_rank_lists(layouts: Sequence[Union[RankLayout, dict]]) -> List[List[int]]:
    """Unique data-parallel rank lists of the data-holding ranks, in a canonical order.

    ``layouts[r]`` is rank r's :class:`RankLayout` (or the same as a dict). Pure
    function (tested without processes); raises ``ValueError`` when two ranks
    disagree about a group's members.
    """
    seen = {}
    for rank, lay in enumerate(layouts):
        lay = RankLayout.of(lay)
        if not lay.holds_data:
            continue
        ranks = tuple(sorted(lay.dp_ranks))
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


def megatron_layout(tp_rank0_only: bool = True) -> RankLayout:
    """This rank's layout from Megatron's ``parallel_state`` (must be initialised)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    pp_rank = mpu.get_pipeline_model_parallel_rank()
    pp_size = mpu.get_pipeline_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    holds = pp_rank in (0, pp_size - 1) and (tp_rank == 0 or not tp_rank0_only)
    dp_ranks = dist.get_process_group_ranks(mpu.get_data_parallel_group())
    return RankLayout(bool(holds), tuple(int(r) for r in dp_ranks), int(mpu.get_data_parallel_rank()),
                      megatron_step_collectives())


def megatron_step_collectives() -> Tuple[Tuple[int, ...], ...]:
    """The rank groups this rank runs a collective with every micro-step, from Megatron's
    ``parallel_state``: its expert-parallel group (the MoE layers' token dispatch) and its
    expert tensor-parallel group (the experts' own tensor parallel)."""
    from megatron.core import parallel_state as mpu
    return _ranks_of(mpu.get_expert_model_parallel_group(), mpu.get_expert_tensor_parallel_group())


def process_group_layout(pg_collection, holds_data: bool = True) -> RankLayout:
    """This rank's layout from a megatron-core ``ProcessGroupCollection`` (Megatron-Bridge's
    ``pg_collection``): its data-parallel group (``dp``), its position there, and its
    expert-parallel (``ep``) and expert tensor-parallel (``expt_tp``) groups. A collection
    without an expert-parallel group leaves the meeting groups unknown, not assumed."""
    import torch.distributed as dist
    dp = pg_collection.dp
    ep = getattr(pg_collection, "ep", None)
    collectives = None if ep is None else _ranks_of(ep, getattr(pg_collection, "expt_tp", None))
    return RankLayout(bool(holds_data), tuple(int(r) for r in dist.get_process_group_ranks(dp)),
                      int(dp.rank()), collectives)


def _ranks_of(*groups) -> Tuple[Tuple[int, ...], ...]:
    """The global ranks of each group that exists (a missing group runs no collective)."""
    import torch.distributed as dist
    return tuple(tuple(int(r) for r in dist.get_process_group_ranks(g)) for g in groups if g is not None)


def meeting_groups_of(layouts: Sequence[Union[RankLayout, dict]], rank_lists: Sequence[Sequence[int]],
                      rank: int) -> Optional[MeetingGroups]:
    """Who meets whom in the exchange group holding ``rank``
    (:class:`~megatron_mm_balance.runtime.meeting.MeetingGroups`), from every rank's layout
    (``layouts[r]``, index: global rank) and the exchange groups' rank lists. None when
    ``rank`` is in none, or some rank's layout does not say which collectives it runs every
    micro-step. Pure function: the same answer on every rank."""
    layouts = [RankLayout.of(lay) for lay in layouts]
    mine = next((list(g) for g in rank_lists if rank in g), None)
    if mine is None or any(lay.step_collectives is None for lay in layouts):
        return None
    position = {r: lay.position(r) for r, lay in enumerate(layouts)}
    collectives = sorted({tuple(sorted(g)) for lay in layouts for g in lay.step_collectives})
    steps = step_groups_from_collectives(sorted(mine), position, collectives)
    return MeetingGroups.of(mine, steps, rank=rank, via=VIA_EXPERT_PARALLEL)


def init_exchange_groups(layout: Union[RankLayout, dict, None] = None, *, num_chunks: int = 1,
                         timeout: float = DEFAULT_TIMEOUT_S) -> ExchangeGroups:
    """Create the exchange groups on every rank; return this rank's, one per model chunk.

    Collective over the default (world) group: every rank must call it, in the
    same order relative to other group creations. ``layout`` defaults to
    :func:`megatron_layout`. Each call creates new groups: pass the result to
    ``wrap_train_data_iterator(..., exchange_groups=...)`` rather than calling again.
    """
    import torch.distributed as dist
    from ..runtime.groups import new_exchange_groups, node_identity, node_ids_from_identities

    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    layout = megatron_layout() if layout is None else RankLayout.of(layout)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (layout, node_identity()))
    layouts = [lay for lay, _ in gathered]
    lists = data_holding_rank_lists(layouts)
    chunks = tuple(new_exchange_groups(lists, timeout) for _ in range(num_chunks))
    return ExchangeGroups(chunks, tuple(tuple(g) for g in lists),
                          node_ids_from_identities([name for _, name in gathered]),
                          meeting_groups_of(layouts, lists, dist.get_rank()))
