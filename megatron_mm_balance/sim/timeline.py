"""The step timeline: when each rank computes, and where it waits for the others.

Every rank runs each micro-step's pack as vision forward (VF), language-model
forward and backward (LM), vision backward (VB). Arrays are ``[B, D, G]``:
B global batches, D data-parallel ranks, G micro-steps, in compute order (after
any reordering or redistribution). All batches and ranks advance together; the
only Python loop is over the G micro-steps.

Where ranks meet (``sync``):

* ``step`` (pure data parallelism): only at the gradient all-reduce at the end of
  the step. A rank runs its G packs back to back; the step ends when the slowest
  rank ends: ``max_r sum_m (VF + LM + VB)``.
* ``microstep`` (MoE expert parallelism: the token all-to-alls of every MoE layer
  span the expert-parallel group): the LM phase runs in lockstep inside each
  group of ``ep`` consecutive data-parallel ranks (``ep=None``: one group of all
  of them). It starts when the group's last rank has finished its vision
  forward, and lasts as long as the group's slowest LM part. Vision backward of
  micro-step m and vision forward of m+1 therefore fall between two meetings, so
  a heavy pack delays its group twice, as the seed describes. Groups meet each
  other only at the step's end (the gradient all-reduce over data parallelism).

Pack exchange (``exchange``), with ``x[b, r, m]`` the time rank r needs to send
and receive its packs for micro-step m:

* ``sync``: before micro-step m, all ranks meet and exchange; the exchange takes
  ``max_r x[:, m]`` (only if any pack moves in that micro-step);
* ``overlap``: the exchange for micro-step m runs in the background from the
  start of micro-step m-1 on that rank; only the part that outlasts micro-step
  m-1 is exposed. Micro-step 0's exchange has nothing to hide behind, unless
  ``prefetch``: the runtime may run across global batches (a fixed micro-batch
  count), so micro-step 0's exchange starts with the previous global batch's
  last micro-step on that rank and hides behind it and the step's tail (waiting
  for the slowest rank, bubble, overhead). Batches are exchangeable draws, so the
  previous batch's tail is taken to be this batch's own (a first pass).

``bubble`` (pipeline fill and drain) and ``overhead`` (optimizer step, exposed
all-reduce) are added once per global batch and are the same on every rank.
Waiting time per rank = end of compute - its busy time - its exposed exchange.
"""
from __future__ import annotations

import numpy as np

SYNC_MODES = ("microstep", "step")
EXCHANGE_MODES = (None, "sync", "overlap")


def group_max(x: np.ndarray, ep: int | None) -> np.ndarray:
    """``x`` ``[B, D]``: each rank's group maximum (groups of ``ep`` consecutive ranks),
    ``[B, D]``; ``ep=None``: the maximum over all ranks, ``[B, 1]``."""
    if ep is None:
        return x.max(axis=1, keepdims=True)
    B, D = x.shape
    return np.repeat(x.reshape(B, D // ep, ep).max(axis=2), ep, axis=1)


def check_ep(ep, num_ranks: int) -> int | None:
    """``ep`` as the timeline takes it: None, or a divisor of ``num_ranks`` (``num_ranks``
    itself becomes None: one group); a clear error otherwise."""
    if ep is None:
        return None
    if isinstance(ep, bool) or not isinstance(ep, (int, np.integer)) or ep < 1 or num_ranks % ep:
        raise ValueError(f"ep must be a positive divisor of the {num_ranks} data-parallel ranks, "
                         f"got {ep!r}")
    return None if ep == num_ranks else int(ep)


def simulate_timeline(vf, lm, vb, *, sync: str = "microstep", exchange: str | None = None,
                      x=None, bubble=0.0, overhead: float = 0.0, prefetch: bool = False,
                      ep: int | None = None) -> dict:
    """Simulate ``[B, D, G]`` phase times; returns per-batch and per-rank totals (ms).

    Keys: ``time`` [B] (step time incl. bubble and overhead), ``compute_end`` [B],
    ``busy`` [B, D], ``exchange`` [B, D] (exposed exchange), ``wait`` [B, D].
    ``prefetch`` (``overlap`` only): micro-step 0's exchange hides behind the
    previous global batch's last micro-step and tail (see the module docstring).
    ``ep`` (``microstep`` only): ranks meet per micro-step in groups of ``ep``
    consecutive ranks (None: all ranks).
    """
    if sync not in SYNC_MODES:
        raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
    if exchange not in EXCHANGE_MODES:
        raise ValueError(f"exchange must be one of {EXCHANGE_MODES}, got {exchange!r}")
    vf, lm, vb = (np.asarray(a, dtype=np.float64) for a in (vf, lm, vb))
    if vf.ndim != 3 or vf.shape != lm.shape or vf.shape != vb.shape:
        raise ValueError(f"phase arrays must share a [B, D, G] shape, got {vf.shape}, "
                         f"{lm.shape}, {vb.shape}")
    B, D, G = vf.shape
    ep = check_ep(ep, D)
    if ep is not None and sync != "microstep":
        raise ValueError(f"ep (expert-parallel groups) needs sync='microstep', got {sync!r}")
    if exchange is not None:
        if x is None:
            raise ValueError("an exchange mode needs the exchange times x")
        x = np.asarray(x, dtype=np.float64)
        if x.shape != vf.shape:
            raise ValueError(f"x must have shape {vf.shape}, got {x.shape}")
    if prefetch and exchange != "overlap":
        raise ValueError(f"prefetch needs the overlap exchange, got exchange={exchange!r}")
    bubble = np.broadcast_to(np.asarray(bubble, dtype=np.float64), (B,))

    head_start = np.zeros((B, D))
    if prefetch:
        # The previous batch's last micro-step and tail, per rank: this batch's own.
        first = _run(vf, lm, vb, sync, exchange, x, head_start, ep)
        step_end = first[0].max(axis=1) + bubble + overhead
        head_start = first[2] - step_end[:, None]
    prev_end, exch, _ = _run(vf, lm, vb, sync, exchange, x, head_start, ep)

    compute_end = prev_end.max(axis=1)
    busy = (vf + lm + vb).sum(axis=2)
    wait = compute_end[:, None] - busy - exch
    return {
        "time": compute_end + bubble + overhead,
        "compute_end": compute_end,
        "busy": busy,
        "exchange": exch,
        "wait": np.maximum(wait, 0.0),
        "bubble": np.array(bubble),
    }


def _run(vf, lm, vb, sync, exchange, x, head_start, ep=None):
    """The micro-step loop. ``head_start`` [B, D]: when micro-step 0's background
    exchange started (0, or before the batch with prefetch). Returns each rank's
    compute end, exposed exchange and the start of its last micro-step."""
    B, D, G = vf.shape
    prev_start = head_start
    prev_end = np.zeros((B, D))
    exch = np.zeros((B, D))
    for m in range(G):
        if exchange == "sync":
            X = x[:, :, m].max(axis=1)                       # [B]
            meet = prev_end.max(axis=1)
            has = X > 0
            start = np.where(has[:, None], (meet + X)[:, None], prev_end)
            exch += np.where(has, X, 0.0)[:, None]
        elif exchange == "overlap":
            start = np.maximum(prev_end, prev_start + x[:, :, m])
            exch += start - prev_end
        else:
            start = prev_end
        arrive = start + vf[:, :, m]
        if sync == "microstep":
            lm_end = group_max(arrive, ep) + group_max(lm[:, :, m], ep)
        else:
            lm_end = arrive + lm[:, :, m]
        end = lm_end + vb[:, :, m]
        prev_start, prev_end = start, end
    return prev_end, exch, prev_start
