"""Run Megatron-Bridge's own ``pretrain()`` on CPU over gloo (tests, the tiny CPU config).

    python -m torch.distributed.run --nproc-per-node 4 \\
        -m megatron_mm_balance.testing.cpu_bridge -m megatron_mm_balance.bridge.run [args...]

``scripts/pretrain_bridge_vlm.sh`` starts ranks this way when its config asks for the
CPU harness (``CPU_HARNESS=auto``) and the machine has no CUDA device; the GPU path
never imports this module. Each rank installs the stand-ins below and then runs the
entry module with :mod:`runpy`, so Bridge's config container, ``pretrain()``, its
training loop, checkpointing and energon data loading are the user's, unchanged.

What comes from the Megatron-LM harness, reused as is:
:func:`megatron_mm_balance.testing.cpu_megatron.install` (CUDA device arguments to CPU,
streams and events, the CUDA RNG tracker, ``te_general_gemm``) and, from
:mod:`~megatron_mm_balance.testing.cpu_pretrain`, the inert ``triton`` stand-in (only
if triton is absent), the empty CUDA RNG state, the split-size ``all_to_all_single``
over gloo and the per-sample attention over a packed (THD) sequence.

Each stand-in added here, with the CUDA-only (or GPU-stack-only) assumption it replaces:

* **optional packages imported at module load**: ``transformer_engine`` (the LoRA
  layers of ``megatron.bridge.peft``), ``modelopt`` (``training/train.py``,
  ``checkpointing.py``, ``gpt_step.py``), ``nvidia_resiliency_ext``
  (``training/pretrain.py``), ``datasets`` (``data/sources/hf.py``) and ``diffusers``
  (the FLUX recipes, imported by ``megatron.bridge.recipes``): inert modules handed
  *only* to importers inside ``megatron.bridge`` (an ``__import__`` hook; nothing enters
  ``sys.modules``), so megatron-core still sees those packages as absent and takes its
  local paths. Anything that calls into them raises a clear error.
* **modelopt calls on the training path** that do nothing for a model modelopt never
  converted: the distillation tensor-shape adjuster the training step asks for every step
  (None), and saving / restoring modelopt's state in checkpoints (nothing to save).
* **``initialize_megatron``** asserts ``torch.cuda.is_available()`` ("Megatron requires
  CUDA"): called with ``allow_no_cuda=True``; ``torch_dist_init`` builds the
  model-parallel groups with a device count of 1 (with 0 it refuses unless gloo, and it
  seeds the CUDA RNG tracker only with devices: the CPU tracker of ``cpu_megatron``
  serves, with one placeholder state, because checkpoints hold the tracker's states and
  loading refuses an empty set, and its seeds (ints) pass the loader's CUDA-state conversion); the ``barrier(device_ids=[local rank])`` after ``init_process_group`` drops
  ``device_ids`` on gloo (gloo has no devices); the dataset index helpers (``make`` +
  pybind11) that start-up compiles are skipped (the energon path never uses them).
* **transformer-engine's classes without it**: megatron-core defines its ``TE*`` classes on a
  ``MagicMock`` when transformer-engine is absent, so they are mock instances; Bridge main's
  Qwen3-VL attention passes ``TEDotProductAttention`` to ``isinstance``: those names become
  inert classes (``_te_classes_without_te``).
* **layer specs**: the Qwen3-VL providers hard-code transformer-engine specs for the
  language model (and grouped GEMM for MoE) and the vision tower and its patch merger
  (``TENorm``, ``TEColumnParallelLinear``, ``TERowParallelLinear``): megatron-core's
  local specs (``get_gpt_layer_local_spec`` with the same experts / qk-layernorm
  switches, sequential experts; ``get_vit_layer_with_local_spec``; ``WrappedTorchNorm``,
  ``ColumnParallelLinear``, ``RowParallelLinear``) are built instead.
* **packed vision attention**: Bridge's Qwen3-VL vision tower always passes packed
  (THD) parameters, which megatron-core's local ``DotProductAttention`` refuses:
  attention restricted to each packed segment (``cpu_pretrain.install_packed_attention``).
* **torch AdamW under the distributed optimizer** (no apex/TE): resuming a
  ``torch_dist`` checkpoint first builds the optimizer's sharded state dict from the
  fresh optimizer, which needs per-parameter state that torch's AdamW creates only at its
  first step (TE/apex Adam keep ``step`` in the param groups, not per parameter): a zero
  state with ``step`` 0 that the load overwrites; the restored ``step`` gets one copy per
  parameter (``cpu_pretrain._torch_adam_resume``). The load restores ``step`` from the
  saved param groups, and then copies each parameter's tensors from the ``dp_reshardable``
  state (Bridge's default ``torch_dist`` layout), where ``step`` is not saved but carried
  as the *template's* tensor (``LocalNonpersistentObject``, value 0): that copy would set
  every parameter's ``step`` back to 0, and the next update would use the bias correction
  of step 1 (the resumed run then drifts from the uninterrupted one by about 7e-3 after
  one update, with ``exp_avg``, ``exp_avg_sq`` and the weights restored bit for bit).
  The copy skips ``step``; the restored one stays.
* **gradient-accumulation fusion** (``gradient_accumulation_fusion``, Bridge's default on
  GPU, where transformer-engine's linears accumulate each weight gradient into the fp32
  ``main_grad`` inside the GEMM; megatron-core's local linears call apex's
  ``fused_weight_gradient_mlp_cuda`` for it, a CUDA extension): the same accumulation on
  CPU, ``main_grad += grad_output^T @ input`` computed in fp32 from the bf16 operands
  (``wgrad_gemm_accum_fp32``; ``_fp16`` rounds the fp32 sum to ``main_grad``'s dtype).
  It matters for exactness, not speed: without it each micro-step's weight gradient is a
  bf16 GEMM output before it reaches ``main_grad``, and under expert parallelism an
  expert's GEMM covers the tokens of every micro-batch that met in it, so moving
  micro-batches between ranks changed that bf16 rounding (docs/bridge.md section 5).
  Given to ``megatron.core.tensor_parallel.layers`` only (nothing enters ``sys.modules``,
  so Bridge's own probe still finds no apex).
* **uneven all-gathers on gloo**: Qwen3-VL under context parallelism with
  ``vision_dp_when_cp`` gathers each rank's vision embeddings with
  ``torch.distributed.all_gather`` into outputs of *different* sizes (the ranks encode
  different frames, by count or by cost alike); NCCL's all-gather takes uneven outputs
  (torch runs it as one broadcast per rank), gloo refuses them ("invalid tensor size").
  On gloo, and only for uneven outputs, each rank's tensor is zero-padded to the largest,
  gathered, and cut back to its size: the same values NCCL delivers
  (``install_gloo_uneven_all_gather``; even all-gathers go to gloo untouched).
* **the checkpoint writer's results queue**: megatron-core's ``torch_dist`` writer
  collects its results through a multiprocessing ``Manager`` queue that it starts at a
  job's first save by *spawn*; a spawned manager is a fresh interpreter that imports torch
  before it serves, 4-16 s of every job's first save with four ranks on two cores. The
  harness starts that queue by *fork* when it is installed, as Megatron-LM's own async
  checkpointing does at start-up (``get_write_results_queue(mp_mode="fork")``,
  ``megatron/training/async_utils.py``): before the rank joins the process group, so the
  manager holds none of its sockets (forked at the first save, a killed rank's manager
  kept that rank's gloo connections open, and its peers waited on them instead of
  failing), and the manager exits when the rank does, even a killed one (a spawned one
  outlived a killed rank, holding the launcher's output open).
* **the data workers' cores** (only with ``MM_BALANCE_CPU_PREDRAW``, a benchmark setting:
  ``mm-balance bench-realpath --bridge --host gpu-node``): on a GPU node the loader's
  workers decode and process images on host cores the training loop does not need; on 2
  cores they take the ranks' cores, and more of them the less the ranks wait for each
  other. With it, each rank's train loader gives up the job's micro-batches at setup
  (``host_side.PredrawnBatches``: the same batches in the same order), so the measured iterations
  carry no data work under any mode. The loader's checkpoint state is not carried through.
* **the allocator's warm pool** (only with ``MM_BALANCE_CPU_HEAP_MB``, the same benchmark
  setting): CUDA's caching allocator holds a job's peak after its first iterations; glibc,
  even told to keep what it frees, faults in every page beyond the heap's peak so far, and
  on native-resolution data a new largest frame stalls its rank for hundreds of
  milliseconds in the measured iterations. With it, each rank faults in that much heap at
  setup, after its loader's workers are forked, and hands it back to the allocator.
* **other fused kernels Bridge's providers ask for by default on GPU** (Qwen3-VL rope
  fusion, ``persist_layer_norm``, bias-activation / bias-dropout fusion,
  ``moe_permute_fusion``, grouped GEMM) are switched off by the config
  (``configs/bridge/qwen3_vl_moe_tiny_cpu.py``), not here; ``dist.distributed_backend=gloo``
  is the launcher config's ``CPU_OVERRIDES``.
"""
from __future__ import annotations

import builtins
import os
import runpy
import sys
import types

from .host_side import host_side_settings, predraw_count, prepare

#: Packages Bridge imports at module load that its CPU path never calls.
STUBBED_FOR_BRIDGE = ("transformer_engine", "modelopt", "nvidia_resiliency_ext", "datasets", "diffusers")

_DONE = False
_STUBS: dict = {}


class _Inert(types.ModuleType):
    """A stand-in module: every attribute is an inert class that fails when used."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        sub = f"{self.__name__}.{name}"
        if sub in _STUBS:
            return _STUBS[sub]
        value = _inert_class(sub)
        setattr(self, name, value)
        return value


def _inert_class(qual: str):
    """A class usable in annotations, ``isinstance`` checks and subclassing; calling it fails."""

    def __init__(self, *a, **k):
        raise RuntimeError(f"{qual} is not installed (CPU harness stand-in); this path needs it")

    meta = type("InertMeta", (type,), {"__getattr__": lambda cls, name: _inert_class(f"{qual}.{name}")})
    return meta(qual.rsplit(".", 1)[-1], (), {"__init__": __init__, "__module__": qual.rsplit(".", 1)[0]})


def _stub(name: str) -> types.ModuleType:
    """The stand-in module for ``name`` and its parents (kept here, never in ``sys.modules``)."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        qual = ".".join(parts[:i])
        if qual not in _STUBS:
            mod = _Inert(qual)
            mod.__path__ = []
            _STUBS[qual] = mod
            if i > 1:
                setattr(_STUBS[".".join(parts[:i - 1])], parts[i - 1], mod)
    return _STUBS[name]


def _really_missing(top: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(top) is None
    except (ImportError, ValueError):
        return True


def _install_bridge_import_stubs() -> None:
    missing = {top for top in STUBBED_FOR_BRIDGE if _really_missing(top)}
    if not missing:
        return
    real_import = builtins.__import__

    def bridge_import(name, globals=None, locals=None, fromlist=(), level=0):
        top = name.partition(".")[0]
        importer = (globals or {}).get("__name__", "") or ""
        if level == 0 and top in missing and importer.startswith("megatron.bridge"):
            mod = _stub(name)
            if fromlist:
                for attr in fromlist:         # from x.y import z: z a submodule or a class
                    if attr != "*":
                        getattr(mod, attr)
                return mod
            return _STUBS[top]
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = bridge_import


def _no_cuda_initialize() -> None:
    """Bridge's ``initialize_megatron`` with ``allow_no_cuda=True``, and a device count of 1
    while it builds the process groups (it skips them with 0 devices)."""
    import torch

    from megatron.bridge.training import initialize as binit
    from megatron.bridge.training import setup as bsetup

    orig = binit.initialize_megatron

    def initialize_megatron(*a, **k):
        k["allow_no_cuda"] = True
        return orig(*a, **k)

    binit.initialize_megatron = bsetup.initialize_megatron = initialize_megatron

    orig_dist = binit.torch_dist_init

    def torch_dist_init(*a, **k):
        real = torch.cuda.device_count
        torch.cuda.device_count = lambda: 1
        try:
            return orig_dist(*a, **k)
        finally:
            torch.cuda.device_count = real

    binit.torch_dist_init = torch_dist_init

    orig_seed = binit._set_random_seed

    def _set_random_seed(*a, **k):
        orig_seed(*a, **k)
        from megatron.core.tensor_parallel import random as mrandom
        # One placeholder state: checkpoints hold the tracker's states, and loading refuses
        # an empty set ("Unable to load rng state", exit) although the CPU tracker forks nothing.
        mrandom.get_cuda_rng_tracker().states_.setdefault("model-parallel-rng",
                                                          torch.zeros(1, dtype=torch.uint8))

    binit._set_random_seed = _set_random_seed
    # The CPU tracker records seeds (ints) where CUDA's holds generator states; loading a
    # checkpoint converts each state as a CUDA one and rejects ints: they pass through.
    from megatron.core import tensor_parallel
    orig_convert = tensor_parallel.convert_cuda_rng_state

    def convert_cuda_rng_state(state, to_graphable=False):
        return state if isinstance(state, int) else orig_convert(state, to_graphable=to_graphable)

    tensor_parallel.convert_cuda_rng_state = convert_cuda_rng_state
    # The dataset index helpers (make + pybind11) are compiled at start-up; energon never uses them.
    binit.compile_helpers = lambda: None
    # barrier(device_ids=[local rank]) right after init_process_group: gloo has no devices.
    import torch.distributed as dist
    orig_barrier = dist.barrier

    def barrier(group=None, async_op=False, device_ids=None):
        if device_ids is not None and dist.get_backend(group) == "gloo":
            device_ids = None
        return orig_barrier(group=group, async_op=async_op, device_ids=device_ids)

    dist.barrier = barrier


def _te_classes_without_te() -> None:
    """Without transformer-engine, megatron-core's ``extensions.transformer_engine`` binds ``te``
    to a ``MagicMock`` and still defines its ``TE*`` classes on it, which makes each of them a
    mock *instance*, not a class. Bridge main's Qwen3-VL attention asks
    ``isinstance(core_attention, TEDotProductAttention)`` at every forward ("isinstance() arg 2
    must be a type"): each such name becomes an inert class (no object is an instance of it;
    calling it fails), which is what it is on a machine without transformer-engine."""
    import unittest.mock

    from megatron.core.extensions import transformer_engine as te_ext
    if getattr(te_ext, "HAVE_TE", True):
        return
    for name, value in list(vars(te_ext).items()):
        if name.startswith("TE") and isinstance(value, unittest.mock.NonCallableMock):
            setattr(te_ext, name, _inert_class(f"{te_ext.__name__}.{name}"))


def _local_layer_specs() -> None:
    """megatron-core's local specs where Bridge's Qwen3-VL code hard-codes transformer-engine ones."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron.bridge.models.qwen_vl import qwen3_vl_provider
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as qmodel

    def gpt_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False, fp8=False, **_):
        return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                        qk_layernorm=qk_layernorm, normalization="RMSNorm")

    qwen3_vl_provider.get_gpt_layer_with_transformer_engine_spec = gpt_local_spec
    qmodel.get_vit_layer_with_transformer_engine_spec = get_vit_layer_with_local_spec
    qmodel.TENorm = WrappedTorchNorm
    qmodel.TEColumnParallelLinear = ColumnParallelLinear
    qmodel.TERowParallelLinear = RowParallelLinear


def _no_distillation() -> None:
    """The training step asks modelopt for a distillation tensor-shape adjuster every step;
    without distillation modelopt answers None, which is what the stand-in answers."""
    from megatron.bridge.training import train as btrain
    btrain.get_tensor_shapes_adjust_fn_for_distillation = lambda *a, **k: None


def _no_modelopt_state() -> None:
    """Checkpoints save and restore modelopt's state (quantisation/distillation modes); a model
    modelopt never converted has none, and modelopt's functions then do nothing: so do these."""
    from megatron.bridge.training import checkpointing as bckpt
    bckpt.save_sharded_modelopt_state = lambda *a, **k: None
    bckpt.save_modelopt_state = lambda *a, **k: None
    bckpt.restore_modelopt_state = lambda *a, **k: None


def _torch_adam_load_template() -> None:
    """Resuming a ``torch_dist`` checkpoint builds the optimizer's sharded state dict from the
    fresh optimizer first. Without apex/TE the distributed optimizer wraps ``torch.optim.AdamW``,
    whose state (and its per-parameter ``step``, which ``state_dict`` requires) exists only after
    a first step; TE's and apex's Adam have an ``init_state_fn`` for this. The template gets the
    same zero state (``exp_avg``, ``exp_avg_sq``, ``step`` 0) that the load then overwrites.

    ``step`` is restored from the saved param groups (``load_state_dict``); the per-parameter
    copy that follows (``_set_main_param_and_optimizer_states``, from the ``dp_reshardable``
    state) carries the template's ``step`` (0, not saved), so it must not be copied."""
    import torch
    from megatron.core.optimizer import distrib_optimizer as dopt

    orig = dopt.DistributedOptimizer.sharded_state_dict

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, *a, **k):
        if is_loading and not getattr(dopt, "HAVE_APEX_OR_TE", True):
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    st = self.optimizer.state[p]
                    if not st:
                        st.update(exp_avg=torch.zeros_like(p.data), exp_avg_sq=torch.zeros_like(p.data),
                                  step=torch.tensor(0.0))
        return orig(self, model_sharded_state_dict, is_loading, *a, **k)

    dopt.DistributedOptimizer.sharded_state_dict = sharded_state_dict

    # The per-parameter copy of a load keeps the restored step (the incoming one is the
    # template's 0, see above); cpu_pretrain's wrapper then keeps the state's own entry.
    orig_set = dopt.DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not getattr(dopt, "HAVE_APEX_OR_TE", True):
            tensors = {k: v for k, v in tensors.items() if k != "step"}
        return orig_set(self, model_param, tensors)

    dopt.DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def _wgrad_accumulation() -> None:
    """apex's ``fused_weight_gradient_mlp_cuda`` for megatron-core's local linears:
    ``main_grad += grad_output^T @ input``, the product in fp32 from the (bf16) operands, as
    the CUDA kernel's fp32-accumulating GEMM does; the weight gradient is never rounded to
    the parameters' dtype on its way to ``main_grad``."""
    import torch
    from megatron.core.tensor_parallel import layers

    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.add_(torch.matmul(grad_output.t().float(), total_input.float()))

    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        acc = main_grad.float() + torch.matmul(grad_output.t().float(), total_input.float())
        main_grad.copy_(acc)

    layers.fused_weight_gradient_mlp_cuda = types.SimpleNamespace(
        wgrad_gemm_accum_fp32=wgrad_gemm_accum_fp32, wgrad_gemm_accum_fp16=wgrad_gemm_accum_fp16)
    layers._grad_accum_fusion_available = True


def _exit_with(parent: int) -> None:
    """In the manager: end it when ``parent`` (the rank) is gone, however the rank ended."""
    import threading
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _write_results_queue_by_fork() -> None:
    """megatron-core's checkpoint writer's results queue, a ``Manager`` queue started now by
    fork (module docstring): its ``get_write_results_queue()`` finds it in the module's
    ``_results_queue``. Call before the process group exists."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from multiprocessing.managers import SyncManager

    if dist.is_initialized():
        raise RuntimeError("the results queue must be forked before the process group exists")
    if getattr(filesystem_async, "_results_queue", False) is None:   # absent: nothing to start
        manager = SyncManager(ctx=mp.get_context("fork"))
        manager.start(initializer=_exit_with, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()


def install_gloo_uneven_all_gather() -> None:
    """``torch.distributed.all_gather`` into outputs of different sizes on gloo (module docstring)."""
    import torch
    import torch.distributed as dist
    if getattr(dist.all_gather, "mm_balance_uneven", False):
        return
    orig = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in tensor_list}
        uneven_rows = len(shapes) > 1 and all(s[1:] == tuple(tensor.shape[1:]) for s in shapes)
        if not uneven_rows or async_op or dist.get_backend(group) != "gloo":
            return orig(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = torch.zeros((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[:tensor.shape[0]] = tensor
        gathered = [torch.empty_like(padded) for _ in tensor_list]
        orig(gathered, padded, group=group)
        for out, full in zip(tensor_list, gathered):
            out.copy_(full[:out.shape[0]])
        return None

    all_gather.mm_balance_uneven = True
    dist.all_gather = all_gather


def _host_side_at_setup() -> None:
    """With ``MM_BALANCE_CPU_PREDRAW`` set, the train loader's micro-batches are drawn at
    setup, before the first iteration; with ``MM_BALANCE_CPU_HEAP_MB`` set as well, the
    rank's heap is grown after that (:mod:`.host_side`). Off by default;
    ``mm-balance bench-realpath --bridge --host gpu-node`` (the default) sets both."""
    value, mb = host_side_settings()
    if not value:
        return
    import torch
    from megatron.bridge.training import setup as bsetup
    original = bsetup.setup_data_iterators

    def setup_data_iterators(cfg, *a, **k):
        train, valid, test = original(cfg, *a, **k)
        dp_group = k["dp_group"] if "dp_group" in k else a[3]    # (train_state, model_length, provider, dp_group)
        count = predraw_count(value, train_iters=cfg.train.train_iters,
                              global_batch_size=cfg.train.global_batch_size,
                              micro_batch_size=cfg.train.micro_batch_size,
                              dp_size=torch.distributed.get_world_size(dp_group))
        prepare(train, count, value, mb)
        return train, valid, test

    bsetup.setup_data_iterators = setup_data_iterators


def install() -> None:
    """Install every stand-in listed in the module docstring (idempotent)."""
    global _DONE
    if _DONE:
        return
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    _install_bridge_import_stubs()
    from . import cpu_megatron, cpu_pretrain
    cpu_pretrain._stub_triton()
    cpu_megatron.install()
    _te_classes_without_te()
    cpu_pretrain.install_cuda_rng_state()
    cpu_pretrain.install_gloo_all_to_all()
    cpu_pretrain.install_packed_attention()
    _no_cuda_initialize()
    _local_layer_specs()
    _no_distillation()
    _no_modelopt_state()
    cpu_pretrain._torch_adam_resume()
    _torch_adam_load_template()
    _wgrad_accumulation()
    install_gloo_uneven_all_gather()
    _host_side_at_setup()
    _DONE = True


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "-m":
        sys.exit("usage: python -m megatron_mm_balance.testing.cpu_bridge -m MODULE [args...]")
    from ..patching.overlay import install_if_requested
    install_if_requested("megatron-bridge")  # MM_BALANCE_OVERLAY=1: before the stand-ins import Bridge
    install()
    _write_results_queue_by_fork()          # the launched job only: it saves checkpoints
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    from .rank_exit import finish
    finish()                                # the job returned: end without the interpreter's teardown


if __name__ == "__main__":
    main()
