"""The exchange's gloo mesh at scale: lazy connections and the file-descriptor budget.

A gloo process group is a full mesh: every rank holds one TCP socket per peer of the
group plus its listening socket, so an exchange group of ``D`` data-parallel ranks costs
``D`` file descriptors on every rank (1,024 at DP=1,024), on top of what the process already has open (the
training's own gloo groups are full meshes too, NCCL, the loader's workers). A common
``ulimit -n`` is 1,024.

* :func:`lazy_gloo`: where torch offers it (``TORCH_GLOO_LAZY_INIT``, PyTorch 2.8 and
  later), the exchange groups are created with lazy connections: a pair connects when it
  first exchanges, instead of all ``D*(D-1)/2`` pairs at start-up. The ring all-gather
  only talks to its two neighbours and a rank swaps packs with few peers per batch; over
  a long run it may still meet every peer, so the budget below stays ``D`` per group.
  A user's own ``TORCH_GLOO_LAZY_INIT`` wins; only the exchange groups are affected.
* :func:`check_descriptors`, at start-up, before the groups are created, on every rank
  together: the descriptors open now plus ``D - 1`` per exchange group plus a margin must
  fit the soft limit (``D`` per exchange group); the soft limit is raised up to the hard one when that is enough,
  else every rank stops with the same one-line error naming the ranks short, the budget
  and the remedy (``ulimit -n``).

The sockets go over the interface gloo picks: the one the host name resolves to, unless
``GLOO_SOCKET_IFNAME`` names one (docs/how-it-works.md, "The exchange").

``python -m megatron_mm_balance.runtime.mesh 1024 [--groups N]`` prints the budget at that
size against this shell's limits.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
from dataclasses import dataclass
from typing import Optional

#: descriptors kept free beyond the exchange's: checkpoints, logs, loader pipes, NCCL's
DESCRIPTOR_MARGIN = 256
LAZY_ENV = "TORCH_GLOO_LAZY_INIT"

#: sockets and groups promised by the exchange groups created lazily in this process (their
#: pairs connect as they first exchange; counted until the process ends)
_lazy = {"sockets": 0, "groups": 0}


class DescriptorBudgetError(RuntimeError):
    """Not enough file descriptors for the exchange groups (the message says how many)."""


def gloo_lazy_init_supported() -> bool:
    """Whether this torch creates gloo groups with lazy connections on request."""
    import torch.distributed as dist
    gloo = getattr(dist, "ProcessGroupGloo", None)
    doc = getattr(getattr(gloo, "create_default_device", None), "__doc__", None) or ""
    return "lazy_init" in doc


@contextlib.contextmanager
def lazy_gloo():
    """Gloo groups created inside connect their pairs on first use (where torch offers it;
    a ``TORCH_GLOO_LAZY_INIT`` already set wins). Yields whether they are lazy."""
    if LAZY_ENV in os.environ:
        yield os.environ[LAZY_ENV].strip().lower() in ("1", "true", "yes")
        return
    if not gloo_lazy_init_supported():
        yield False
        return
    os.environ[LAZY_ENV] = "1"
    try:
        yield True
    finally:
        os.environ.pop(LAZY_ENV, None)


def open_descriptors() -> int:
    """Descriptors this process has open (``/proc/self/fd``; 0 where it cannot tell)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


@dataclass(frozen=True)
class DescriptorBudget:
    """What one rank needs for its exchange groups, against its limits."""

    group_size: int
    groups: int
    sockets: int              #: exchange sockets still to open: a peer each and a listener per group
    open_now: int
    margin: int
    soft: int
    hard: int

    @property
    def needed(self) -> int:
        return self.open_now + self.sockets + self.margin

    @property
    def fits(self) -> bool:
        return self.needed <= self.soft

    def describe(self) -> str:
        return (f"{self.groups} exchange group(s) (this one of {self.group_size} ranks) need "
                f"{self.sockets} sockets per rank (gloo's full mesh: a socket per peer and a "
                f"listener per group) "
                f"on top of the {self.open_now} descriptors open now, {self.needed} with a margin of "
                f"{self.margin}; the limit is {self.soft} (hard {self.hard})")

    def error(self, rank: Optional[int] = None) -> str:
        who = f"rank {rank}: " if rank is not None else ""
        return (f"mm-balance: {who}not enough file descriptors: {self.describe()}; raise it before "
                f"the launcher with `ulimit -n {self.needed}` or more (the hard limit, or the "
                f"container's / Slurm's, may need raising too)")


def descriptor_budget(group_size: int, groups: int = 1, *, open_now: Optional[int] = None,
                      limits: Optional[tuple] = None, margin: int = DESCRIPTOR_MARGIN) -> DescriptorBudget:
    """The budget of ``groups`` exchange groups of ``group_size`` ranks for this process (pure
    with ``open_now`` and ``limits`` = ``(soft, hard)`` given)."""
    if group_size < 1 or groups < 0:
        raise ValueError(f"group_size must be >= 1 and groups >= 0, got {group_size}, {groups}")
    soft, hard = limits if limits is not None else resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    soft = (1 << 62) if soft == unlimited else int(soft)
    hard = (1 << 62) if hard == unlimited else int(hard)
    per_group = group_size if group_size > 1 else 0
    return DescriptorBudget(group_size=group_size, groups=groups, sockets=groups * per_group,
                            open_now=open_descriptors() if open_now is None else open_now,
                            margin=margin, soft=soft, hard=hard)


def fit_descriptor_limit(budget: DescriptorBudget) -> DescriptorBudget:
    """Raise the soft limit to what ``budget`` needs when the hard limit allows; the budget
    against the limits then in force."""
    if budget.fits or budget.needed > budget.hard:
        return budget
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (budget.needed, budget.hard))
    except (ValueError, OSError):
        return budget
    return descriptor_budget(budget.group_size, budget.groups, open_now=budget.open_now,
                             margin=budget.margin)


def check_descriptors(group_size: int, *, lazy: bool) -> DescriptorBudget:
    """Before creating one exchange group of ``group_size`` ranks, on every world rank (it
    gathers over the world, as creating the group does): every rank that cannot fit the
    group's sockets (after raising its soft limit where it can) makes every rank raise the
    same :class:`DescriptorBudgetError` naming it. With ``lazy`` connections, the sockets of
    the lazy groups made before are not open yet and are counted too."""
    import torch.distributed as dist

    budget = descriptor_budget(group_size, 1)
    if lazy:
        budget = DescriptorBudget(**{**budget.__dict__, "sockets": budget.sockets + _lazy["sockets"],
                                     "groups": 1 + _lazy["groups"]})
    budget = fit_descriptor_limit(budget)
    problem = None if budget.fits else budget.error(dist.get_rank() if dist.is_initialized() else None)
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    short = [p for p in problems if p]
    if short:
        more = f" (and {len(short) - 1} more rank(s) short)" if len(short) > 1 else ""
        raise DescriptorBudgetError(short[0] + more)
    if lazy and group_size > 1:
        _lazy["sockets"] += group_size
        _lazy["groups"] += 1
    return budget


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_mm_balance.runtime.mesh",
                                 description="File descriptors the exchange's gloo mesh needs per rank")
    ap.add_argument("ranks", type=int, help="data-parallel ranks in one exchange group")
    ap.add_argument("--groups", type=int, default=1, help="exchange groups per rank (model chunks)")
    ap.add_argument("--open", type=int, default=None, help="descriptors open besides (default: this process's)")
    a = ap.parse_args(argv)
    b = descriptor_budget(a.ranks, a.groups, open_now=a.open)
    print(f"DP={a.ranks}: {b.describe()}: {'fits' if b.fits else 'does NOT fit'}"
          + ("" if b.fits else f"; `ulimit -n {b.needed}`"))
    return 0 if b.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
