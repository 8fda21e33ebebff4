"""Who issues which ``torch.distributed`` call, from where: a count by call stack.

:class:`DistAudit` wraps every collective and point-to-point function of ``torch.distributed``
(the module attributes, so every caller that looks them up at call time goes through it, on
any process group) and records each call under four keys:

* the call (``all_gather``, ``isend``, ...) and whether it is a collective;
* the thread (``training`` for the main thread, else the thread's name, e.g.
  ``mm-balance-exchange``);
* ``ours``: the frame that issued the call (the innermost frame outside torch itself: a
  module's ``__call__``, autograd, ``torch.distributed`` and torch function modes are passed
  through) when it is
  this package's (``module:function``), else ``""``: the framework's own calls, even those
  made inside code of ours that calls the framework (a tower called from our hook, a training
  loop started by our harness), are not ours;
* where the training thread stands: ``setup`` before :meth:`DistAudit.training` is called,
  ``next`` inside a data iterator's ``__next__`` of ours (a global batch's meeting without
  the exchange thread runs there, before the micro-step's forward), else ``step``.

So "collectives issued by our code inside a micro-step" is the count of records with
``collective``, an ``ours`` frame, thread ``training`` and place ``step``: attributed by stack,
not by watching one group. ``MM_BALANCE_DIST_AUDIT=DIR`` (read by :func:`install_from_env`)
installs it in a training process and writes ``DIR/dist-audit-rank<R>.json`` at exit.
"""
from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import threading
from typing import Dict, Optional

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
               "all_to_all_single", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
               "scatter_object_list", "new_group")
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
ENV = "MM_BALANCE_DIST_AUDIT"
PACKAGE = "megatron_mm_balance"
#: frames of ours that mark the training thread as inside a data iterator's next()
NEXT_FRAMES = ("megatron_mm_balance/runtime/iterator.py:__next__", "megatron_mm_balance/megatron/iterator.py:__next__")
_SELF = os.path.abspath(__file__)


def _torch_dir() -> str:
    import torch
    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


_TORCH = _torch_dir()
#: torch function / dispatch modes a call passes through (a CPU harness's): not its issuer
_MODES = ("__torch_function__", "__torch_dispatch__")


class DistAudit:
    """See the module docstring. ``install()`` wraps, ``uninstall()`` restores, ``counts()``
    returns the records as ``{(call, collective, thread, ours, place): n}``."""

    def __init__(self, package_dir: Optional[str] = None):
        self.package_dir = os.path.join(package_dir or os.path.dirname(os.path.dirname(_SELF)), "")
        self.records: Dict[tuple, int] = collections.Counter()
        self.in_training = False
        self._saved: Dict[tuple, object] = {}
        self._lock = threading.Lock()

    def install(self) -> "DistAudit":
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        for name in COLLECTIVES + POINT_TO_POINT:
            fn = getattr(c10d, name, None) or getattr(dist, name, None)
            if fn is None or getattr(fn, "_dist_audit", False):
                continue
            wrapped = self._wrap(name, fn)       # one object in both modules: P2POp checks isend by identity
            for module in (dist, c10d):
                if getattr(module, name, None) is not None:
                    self._saved[(module, name)] = getattr(module, name)
                    setattr(module, name, wrapped)
        return self

    def uninstall(self) -> None:
        for (module, name), fn in self._saved.items():
            setattr(module, name, fn)
        self._saved.clear()

    def training(self) -> None:
        """From now on the training thread's calls count as ``next`` or ``step``."""
        self.in_training = True

    def _wrap(self, name: str, fn):
        collective = name in COLLECTIVES

        def call(*args, **kwargs):
            self._record(name, collective)
            return fn(*args, **kwargs)
        call._dist_audit = True
        call.__wrapped__ = fn
        return call

    def _record(self, name: str, collective: bool) -> None:
        ours, in_next, caller = "", False, None
        frame = sys._getframe(2)
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            passing = path.startswith(_TORCH) or path == _SELF or frame.f_code.co_name in _MODES
            if caller is None and not passing:
                caller = path                               # the code that issued the call
                if path.startswith(self.package_dir):
                    ours = f"{PACKAGE}/{os.path.relpath(path, self.package_dir)}:{frame.f_code.co_name}"
                    ours = ours.replace("/", ".").replace(".py:", ":")
            if path.startswith(self.package_dir):
                where = f"{PACKAGE}/{os.path.relpath(path, self.package_dir)}:{frame.f_code.co_name}"
                in_next = in_next or where in NEXT_FRAMES
            frame = frame.f_back
        thread = threading.current_thread()
        main = thread is threading.main_thread()
        place = "setup" if not self.in_training else "next" if in_next else "step"
        key = (name, collective, "training" if main else thread.name, ours, place if main else "thread")
        with self._lock:
            self.records[key] += 1

    def counts(self) -> Dict[tuple, int]:
        with self._lock:
            return dict(self.records)

    def summary(self) -> dict:
        """What a report needs: every record as a row, and the count that must be 0 (our
        collectives on the training thread inside a micro-step)."""
        rows = [dict(call=k[0], collective=k[1], thread=k[2], ours=k[3], place=k[4], n=n)
                for k, n in sorted(self.counts().items(), key=lambda kv: kv[0])]
        in_step = sum(r["n"] for r in rows if r["collective"] and r["ours"] and r["thread"] == "training"
                      and r["place"] == "step")
        return dict(rows=rows, our_collectives_in_step=in_step)


def install_from_env() -> Optional[DistAudit]:
    """With ``MM_BALANCE_DIST_AUDIT=DIR``: an installed audit that writes its summary to
    ``DIR/dist-audit-rank<R>.json`` at exit (R: the global rank, read then); else None."""
    out = os.environ.get(ENV)
    if not out:
        return None
    audit = DistAudit().install()

    def write():
        import torch.distributed as dist
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"dist-audit-rank{rank}.json"), "w") as f:
            json.dump(audit.summary(), f, indent=1)
    atexit.register(write)
    return audit
