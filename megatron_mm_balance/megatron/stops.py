"""When a balanced job stops: one line on every rank saying where it stood.

A job launched with ``torch.distributed.run`` ends when its first rank exits: the agent
then SIGTERMs the other ranks within its monitor interval (0.1 s by default), usually
before they reach an error of their own, and prints its failure report naming the rank
that exited first. So that every rank says what stopped it and where, with
``--mm-balance`` each rank prints, to stderr at once (ahead of any traceback):

* on an error out of the balanced train iterator (a peer lost during the exchange, a data
  source that raised, a pack refused as bad input, the data that ran out), one line
  ``[mm-balance] rank R: training stops at iteration I: Type: message [| where]``; ``where``
  is what the runtime attached to an error it re-raises unchanged (the rank, global batch
  and micro-step of a data source's or a pack check's error);
* on SIGTERM, one line ``[mm-balance] rank R: stopped by SIGTERM at iteration I: <where
  each balanced iterator stood: global batch, micro-steps delivered, the exchange's
  phase>``, then the signal's previous disposition (Python's default ends the process as
  before; a handler Megatron installed later, ``--exit-signal-handler``, replaces this one);
* on any other uncaught exception (a collective of the model's that lost its peer, say),
  the same line ``stopped by Type: message at iteration I: ...``, then the previous
  ``sys.excepthook`` (the traceback, as before).

Nothing here changes what is raised or how the process ends.
"""
from __future__ import annotations

import os
import signal
import sys
import weakref
from typing import Callable, Optional

from ..runtime.log_line import emit_line

#: the balanced train iterables of this process whose position a SIGTERM report gives
_LIVE: "weakref.WeakSet" = weakref.WeakSet()
_INSTALLED_PID: Optional[int] = None


def _rank() -> int:
    try:
        import torch.distributed as dist
        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    except Exception:
        return int(os.environ.get("RANK", 0))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:1500] if text else ""


def error_line(exc: BaseException, rank: int, iteration: Optional[int]) -> str:
    """The one line an error out of the balanced train iterator is reported with."""
    at = f"at iteration {iteration}" if iteration is not None else "before the first iteration"
    line = f"[mm-balance] rank {rank}: training stops {at}: {type(exc).__name__}: {_first_line(exc)}"
    context = getattr(exc, "mm_balance_context", None)
    return line + (f" | {context}" if context else "")


class StopReporter:
    """Reports how one rank's balanced train iterator(s) stopped (see the module docstring).

    ``iteration_fn``: the iteration Megatron's loop is in (:func:`~.config.live_iteration`)."""

    def __init__(self, iteration_fn: Callable[[], Optional[int]], rank: Optional[int] = None):
        self.iteration_fn = iteration_fn
        self.rank = _rank() if rank is None else int(rank)

    def error(self, exc: BaseException) -> None:
        """Print ``exc``'s line once (the same error may pass several iterators)."""
        if getattr(exc, "_mm_balance_reported", False):
            return
        try:
            exc._mm_balance_reported = True
        except AttributeError:
            pass
        emit_line(error_line(exc, self.rank, self.iteration_fn()), sys.stderr)

    def watch(self, iterable) -> None:
        """Include ``iterable`` (``.position() -> str``) in this process's stop reports."""
        _LIVE.add(iterable)
        install_reports(self)

    def stopped(self, cause: str) -> None:
        """Print where every watched iterator stood when ``cause`` stopped the process."""
        try:
            positions = [it.position() for it in list(_LIVE)]
            emit_line(stopped_line(self.rank, cause, self.iteration_fn(), positions), sys.stderr)
        except Exception:
            pass


def stopped_line(rank: int, cause: str, iteration: Optional[int], positions) -> str:
    at = f"at iteration {iteration}" if iteration is not None else "before the first iteration"
    where = "; ".join(p for p in positions if p) or "no balanced iterator"
    return f"[mm-balance] rank {rank}: stopped by {cause} {at}: {where}"


def install_reports(reporter: StopReporter) -> None:
    """Install the SIGTERM and the uncaught-exception reports once per process (the SIGTERM
    one from the main thread only)."""
    global _INSTALLED_PID
    if _INSTALLED_PID == os.getpid():
        return
    _INSTALLED_PID = pid = os.getpid()
    previous_hook = sys.excepthook

    def on_uncaught(tp, value, tb):
        if os.getpid() == pid and not getattr(value, "_mm_balance_reported", False):
            reporter.stopped(f"{tp.__name__}: {_first_line(value)[:300]}")
        previous_hook(tp, value, tb)

    sys.excepthook = on_uncaught
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except (ValueError, AttributeError):
        return

    def on_sigterm(signum, frame):
        if os.getpid() == pid:                  # not in a forked data-loader worker
            reporter.stopped("SIGTERM")
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:                          # not the main thread
        pass
