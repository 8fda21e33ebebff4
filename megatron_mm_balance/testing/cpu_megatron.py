"""Run megatron-core 0.16.1 on CPU over gloo, for tests and the CPU demo.

megatron-core assumes CUDA in a handful of places that have nothing to do with
the maths: tensors are created with ``device=torch.cuda.current_device()`` or
moved with ``.cuda()``, communication overlaps on side streams, dropout forks
the CUDA RNG, and 0.16.1's MoE router references ``te_general_gemm`` that is
only defined when transformer-engine is installed. :func:`install` patches
exactly those places, nothing else:

* a ``TorchFunctionMode`` that rewrites ``device="cuda"`` / integer devices to
  CPU in every torch call made while it is active and turns ``Tensor.cuda()``
  into a no-op (the model's forward and construction run inside it);
* ``torch.cuda.current_device()`` returns ``"cpu"``: autograd's backward pass
  runs outside any Python mode, and megatron-core code reached from backward
  hooks (gradient buffers, MoE dispatch) passes this value straight to torch;
* no-op stand-ins for ``torch.cuda.Stream``, ``Event``, ``current_stream``,
  ``stream``, ``synchronize`` and friends (CPU ops are synchronous);
* an RNG tracker whose ``fork()`` does nothing: every rank seeds the CPU
  generator identically, and the models used here have no dropout;
* ``moe_utils.te_general_gemm = None`` so the router uses ``torch`` matmul.

What does not work on CPU and is therefore refused by :func:`initialize`:
sequence parallel (needs transformer-engine's LayerNorm) and the ``alltoall``
MoE token dispatcher (gloo has no ``all_to_all_single`` with split sizes; use
``moe_token_dispatcher_type="allgather"``).

:func:`launch` starts ``world_size`` real processes with gloo on a free
127.0.0.1 port and collects their return values, with a hard timeout: nothing
can hang a test run.

This module is opt-in (``megatron_mm_balance.testing``); the package never
imports it on its normal path.
"""
from __future__ import annotations

import contextlib
import logging
import os
import traceback
import warnings

import torch
from torch.overrides import TorchFunctionMode

from ..bench.runtime import free_port

_CPU = torch.device("cpu")
_INSTALLED = False
_MODE = None


def _to_cpu_device(dev):
    if dev is None:
        return None
    if isinstance(dev, int):
        return _CPU
    if isinstance(dev, str):
        return _CPU if dev.startswith("cuda") else dev
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return _CPU
    return dev


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU in every torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron asserts grads are 'torch.cuda.FloatTensor' (grad clipping)
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            a1 = args[1]
            if isinstance(a1, (int, str, torch.device)) and not isinstance(a1, bool):
                args = (args[0], _to_cpu_device(a1), *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    """Stand-in for ``torch.cuda.Event``."""

    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _NullRNGTracker:
    """Stand-in for megatron's ``CudaRNGStatesTracker``: ``fork()`` is a no-op."""

    def __init__(self):
        self.states_ = {}

    def reset(self):
        self.states_ = {}

    def add(self, name, seed):
        self.states_[name] = seed

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self.states_ = dict(states)

    def is_initialized(self):
        return True

    @contextlib.contextmanager
    def fork(self, name=None):
        yield


@contextlib.contextmanager
def _null_ctx(*a, **k):
    yield


def install() -> None:
    """Apply the CPU stand-ins (idempotent). Call before building any model."""
    global _INSTALLED, _MODE
    if _INSTALLED:
        return
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed.*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    logging.getLogger("megatron.core.rerun_state_machine").setLevel(logging.ERROR)
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = _null_ctx
    cuda.synchronize = lambda *a, **k: None
    cuda.set_device = lambda *a, **k: None
    cuda.manual_seed = lambda *a, **k: None
    cuda.manual_seed_all = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None

    from megatron.core.tensor_parallel import random as mrandom
    mrandom._CUDA_RNG_STATE_TRACKER = _NullRNGTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    from megatron.core.transformer.moe import moe_utils
    moe_utils.te_general_gemm = None

    _MODE = CudaToCpuMode()
    _MODE.__enter__()          # active for the rest of the process
    _INSTALLED = True


def initialize(*, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
               expert_model_parallel_size: int = 1, seed: int = 1234) -> None:
    """(Re)build megatron's parallel state on the already-initialised gloo world.

    The equivalent of ``initialize_model_parallel`` + ``model_parallel_cuda_manual_seed``
    on CPU: every rank seeds the CPU generator with ``seed`` so that data-parallel
    replicas start identical (megatron's DDP does not broadcast parameters).
    """
    install()
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    destroy_num_microbatches_calculator()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        create_gloo_process_groups=False,
    )
    from megatron.core.tensor_parallel import random as mrandom
    mrandom._CUDA_RNG_STATE_TRACKER = _NullRNGTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)


def check_config(config) -> None:
    """Refuse settings this CPU harness cannot run, with a one-line reason."""
    if getattr(config, "sequence_parallel", False):
        raise ValueError("sequence_parallel needs transformer-engine's LayerNorm; the CPU harness runs without it")
    if getattr(config, "num_moe_experts", None) and config.moe_token_dispatcher_type != "allgather":
        raise ValueError("moe_token_dispatcher_type must be 'allgather' on gloo "
                         f"(got {config.moe_token_dispatcher_type!r}: gloo lacks all_to_all_single with splits)")


# --------------------------------------------------------------------------- launcher

def _worker(rank, world_size, port, fn, args, queue, threads):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        torch.set_num_threads(threads)
        install()
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:
            pass


class LaunchError(RuntimeError):
    """A rank failed or the run passed its timeout."""


def launch(fn, world_size: int, args: tuple = (), *, timeout: float = 300.0, threads: int = 1) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes.

    ``fn`` must be importable (module level). Returns the per-rank return values
    in rank order. Raises :class:`LaunchError` with the failing rank's traceback,
    or after ``timeout`` seconds, having killed every process it started.
    """
    import queue as _queue
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, q, threads), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"timeout: {world_size}-rank run passed {timeout:.0f} s "
                                  f"(ranks done: {sorted(results)})")
            try:
                rank, status, out = q.get(timeout=min(left, 1.0))
            except _queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in results and not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise LaunchError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if status == "error":
                raise LaunchError(f"rank {rank} failed:\n{out}")
            results[rank] = out
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [results[r] for r in range(world_size)]
