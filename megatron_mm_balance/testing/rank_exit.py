"""How a CPU-harness rank ends once its job has returned: the shutdown Python does, less the
interpreter's teardown.

After ``pretrain()`` returns, a rank's interpreter would tear down every module and object of
the job (Megatron or Bridge, torch, the model and optimizer): about 3 seconds of a CPU job's
half minute, measured on the tiny Bridge config, for nothing the job needs. :func:`finish`
does what normal shutdown does that matters, in the same order (non-daemon threads joined,
then the ``atexit`` handlers: TensorBoard and timing files closed, ``multiprocessing``'s
children and managers stopped), flushes the standard streams and ends the process with exit
status 0. Only on a normal return: a job that raises or calls ``sys.exit`` ends as before;
``MM_BALANCE_FULL_TEARDOWN=1`` keeps the teardown (:func:`finish` then returns). The GPU
path never imports this module.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading


def finish() -> None:
    """End this process now, as a normal exit would minus the interpreter's teardown; return
    (and let the interpreter end as usual) with ``MM_BALANCE_FULL_TEARDOWN=1``."""
    if os.environ.get("MM_BALANCE_FULL_TEARDOWN") == "1":
        return
    shutdown = getattr(threading, "_shutdown", None)      # what Py_Finalize calls first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:                                 # a closed stream: nothing to flush
            pass
    os._exit(0)
