"""Floors: the best any placement of whole packs, or of whole frames, can reach on one batch.

"Perfect balance" spreads a global batch's work continuously, ``(sum V + sum L) / D``
per rank. Packs and frames are indivisible, so no placement reaches it in general;
these lower bounds say how close any placement can come, on the objective a placement
decides (a timeline adds exchange and overlap on top). Per global batch of ``N = D * G``
packs, pack ``p`` with vision time ``v[p]`` (forward and backward), language time
``l[p]`` and heaviest frame ``f[p]`` (its vision time alone):

* ``sync="microstep"`` (ranks meet in every micro-step's language phase, as under MoE
  expert parallelism): the objective is ``sum_m (max_r V[r, m] + max_r L[r, m])``, the
  two-phase objective of :mod:`.two_phase`.

  - *Whole packs*: ``max(V* + L*, (V + L)*)``, where ``X*`` is the sorted-grouping
    optimum of ``X`` (sort, cut into groups of ``D``, add the group maxima: the least
    ``sum_m max X`` of any grouping). Exact when one phase is zero everywhere;
    otherwise a certified lower bound (each phase may want another grouping).
  - *Whole frames* (packs placed whole for the language phase, every micro-step's frames
    spread over all ranks): a micro-step's vision maximum is at least its mean and at
    least its heaviest frame, so ``max(sum V / D + L*, F* + L*, (F + L)*)``. A certified
    lower bound.

* ``sync="step"`` (ranks meet only at the gradient all-reduce): the objective is the
  largest rank total ``max_r sum_m (V + L)``, every rank holding ``G`` packs.

  - *Whole packs*: the mean, and for every ``k < G`` the pigeonhole bound: of the
    ``k*D + 1`` heaviest packs some rank holds ``k + 1``, at least the ``k + 1``
    lightest of them, plus ``G - k - 1`` more packs, at least the lightest. Certified.
  - *Whole frames*: the mean, and the same bound on the language time alone (frames
    move the vision work, not the packs). Certified.

* ``sync="microstep"`` with step groups of ``S`` ranks (``ep=S``, ``E = D / S`` groups: ranks
  meet per micro-step inside their group, all of them at the end, :mod:`.step_groups`): the
  objective is the slowest group's ``sum_m (max V + max L)`` over its ranks. Each group's
  is at least its phases' sorted-grouping optima in runs of ``S``, and those summed over
  the groups are at least the batch's (a union of the groups' runs is one grouping of the
  batch), so the slowest group's is at least their mean:

  - *Whole packs*: ``max(perfect, (V*_S + L*_S) / E, (V + L)*_S / E)``, and the step mode's
    bound (a group's objective is at least each of its ranks' totals). Certified.
  - *Whole frames*: ``max(perfect, (sum V / D) + L*_S / E, (F*_S + L*_S) / E,
    (F + L)*_S / E)`` and the step mode's language bound. Certified.

Pure numpy, no state; integer or float times alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SYNC_MODES = ("microstep", "step")


@dataclass(frozen=True)
class Floors:
    """One global batch: the continuous ideal and the two floors (same units as the
    times given); ``packs_exact``: the pack floor is the optimum itself."""

    perfect: float
    packs: float
    frames: float
    packs_exact: bool


def sorted_grouping(x, D: int) -> float:
    """The least ``sum over groups of max x`` of any grouping of ``x`` into groups of ``D``
    (sort descending, cut into groups of ``D``: exact)."""
    x = np.asarray(x).ravel()
    return np.sort(x)[::-1][::int(D)].sum().item() if x.size else 0


def rank_total_floor(t, D: int, G: int) -> float:
    """A lower bound on the largest rank total when ``D`` ranks hold ``G`` of the ``D * G``
    items ``t`` each: the mean, and the pigeonhole bounds of the module docstring."""
    t = np.sort(np.asarray(t).ravel())[::-1]
    if t.size == 0:
        return 0
    best = t.sum().item() / D
    light = np.concatenate([[0], np.cumsum(t[::-1])])           # sums of the j lightest
    for k in range(min(G, (t.size - 1) // D + 1)):
        top = t[: k * D + 1]
        held = top[-(k + 1):].sum().item()                     # k + 1 lightest of the top
        rest = G - k - 1
        if rest < 0:
            break
        best = max(best, held + light[rest].item() if rest <= t.size - top.size else held)
    return best


def batch_floors(v, l, f, D: int, *, sync: str = "microstep", frame_vision=None,
                 ep: int | None = None) -> Floors:
    """:class:`Floors` of one global batch of ``D * G`` packs (flat arrays ``v``, ``l``,
    ``f``: vision, language and heaviest-frame time of every pack; see the module
    docstring). ``frame_vision``: each pack's vision time when its frames are encoded
    apart (default ``v``; less where a pack's vision has a per-pack constant). ``ep``
    (``microstep``): ranks meet per micro-step in groups of ``ep`` (None: all ``D``)."""
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
    v, l, f = (np.asarray(a).ravel() for a in (v, l, f))
    N = v.size
    if l.size != N or f.size != N or D < 1 or N % D:
        raise ValueError(f"floors need D * G packs with three times each, got {v.size}, {l.size}, "
                         f"{f.size} for D={D}")
    fv = v if frame_vision is None else np.asarray(frame_vision).ravel()
    if fv.size != N:
        raise ValueError(f"frame_vision has {fv.size} entries for {N} packs")
    if (v < 0).any() or (l < 0).any() or (f < 0).any() or (f > fv + 1e-9 * np.maximum(fv, 1)).any():
        raise ValueError("floors need times >= 0 and every heaviest frame within its pack's vision")
    G = N // D
    perfect = (v.sum().item() + l.sum().item()) / D
    if sync == "step":
        packs = max(perfect, rank_total_floor(v + l, D, G))
        frames = max((fv.sum().item() + l.sum().item()) / D, rank_total_floor(l, D, G))
        return Floors(perfect, packs, frames, packs_exact=False)
    if ep is not None and ep != D:
        if ep < 1 or D % ep:
            raise ValueError(f"floors: ep must divide D={D}, got {ep}")
        E = D // ep
        vs, ls = sorted_grouping(v, ep) / E, sorted_grouping(l, ep) / E
        packs = max(perfect, vs + ls, sorted_grouping(v + l, ep) / E, rank_total_floor(v + l, D, G))
        frames = max((fv.sum().item() + l.sum().item()) / D, fv.sum().item() / D + ls,
                     sorted_grouping(f, ep) / E + ls, sorted_grouping(f + l, ep) / E,
                     rank_total_floor(l, D, G))
        return Floors(perfect, packs, frames, packs_exact=False)
    vs, ls = sorted_grouping(v, D), sorted_grouping(l, D)
    packs = max(vs + ls, sorted_grouping(v + l, D))
    frames = max(fv.sum().item() / D + ls, sorted_grouping(f, D) + ls, sorted_grouping(f + l, D))
    exact = not v.any() or not l.any()
    return Floors(perfect, packs, frames, packs_exact=exact)
