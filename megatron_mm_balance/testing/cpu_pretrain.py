"""Run Megatron-LM's own training script (``pretrain()``) on CPU over gloo.

    torchrun --nproc-per-node 4 -m megatron_mm_balance.testing.cpu_pretrain \\
        examples/multimodal/train.py [Megatron flags...]

``scripts/pretrain_vlm_moe.sh`` starts ranks this way when the config asks for
the CPU harness (``CPU_HARNESS=auto`` in ``configs/megatron/tiny_cpu.sh``) and
the machine has no CUDA device; the GPU path never imports this module. Each
rank installs the shims below and then runs the script with :mod:`runpy`, so
the script, Megatron's ``pretrain()``, its arguments, checkpointing and data
loading are the user's, unchanged.

Every shim answers one CUDA assumption that has nothing to do with the maths
(the megatron-core ones from :func:`cpu_megatron.install` come first: device
rewriting, streams/events, the RNG tracker, ``te_general_gemm``):

* ``initialize_megatron`` asserts ``torch.cuda.is_available()`` ("Megatron
  requires CUDA"): the harness calls it with ``allow_no_cuda=True`` instead
  of reporting CUDA globally (a global ``is_available()`` would also send
  ``torch.compile`` to the CUDA RNG).
* ``_initialize_distributed`` builds the model-parallel groups only when
  ``torch.cuda.device_count() > 0``: it runs with a device count of 1.
* ``validate_args`` asks the GPU's architecture (``get_device_arch_version``)
  when TP or CP > 1: answered as Hopper (9), the settings the GPU configs are
  validated for.
* the legacy fused kernels are compiled with nvcc at start-up
  (``megatron.legacy.fused_kernels.load``): a no-op (the config turns the
  fusions off).
* the rerun state machine saves and restores the CUDA RNG state every
  iteration, and checkpoints hold it (``torch.cuda.get_rng_state``/
  ``set_rng_state``): an empty state. Checkpoints also hold the CUDA RNG
  tracker's states and loading refuses an empty set: the CPU tracker (whose
  ``fork()`` does nothing; ranks seed the CPU generator, which checkpoints
  save as ``torch_rng_state``) carries one placeholder state.
* ``triton`` is imported when megatron-core's inference contexts and batch
  invariant kernels load, even for training: a stub module whose attributes
  raise if anything ever calls them (nothing does during training).
* the example hard-codes CLIP ViT-L/14 (24 layers, hidden 1024) for
  ``--vision-model-type clip`` (``examples/multimodal/config.py``): the
  harness shrinks it to :data:`TINY_VIT` after the example builds its config,
  so two CPU cores can train it, or to the size the launch config chooses
  in ``MM_BALANCE_CPU_VIT`` (:func:`vit_size`; ``configs/megatron/vision_heavy_cpu.sh``
  exports one); a CPU-only concern, so it lives here and not in ``patches/``. Likewise the vision projection's FFN
  (:data:`TINY_PROJECTION_FFN`) and the language model's dense FFN
  (:data:`TINY_LM_FFN`; the example hard-codes 18944 for ``qwen2.5_7B``).
* without transformer-engine the example's no-TE specs need what only TE
  provides: CLIP's ``ln_pre`` defaults to ``torch.nn.LayerNorm`` (rejects the
  ``config`` argument) -> megatron's ``WrappedTorchNorm``; the vision
  projection's norm spec is TE-only -> the local norm spec; the example's
  ``layer_specs.HAVE_TE`` is True without TE (megatron's TE wrapper module
  imports) and gives the dense LM ``TENorm`` for RMSNorm -> False (and the
  ``TORCH_VERSION``/``HAVE_APEX`` its no-TE branch reads but never defines); local
  ``DotProductAttention`` refuses packed sequences -> attention restricted
  to each packed sample by a block-diagonal causal mask built from
  ``cu_seqlens`` (the same result TE's THD attention computes); and the
  local THD rotary embedding splits the pack by ``cu_seqlens``, which fails
  when pipeline parallelism pads the pack to the fixed sequence length: the
  padding tail (no real token attends to it) is left unrotated.
* gloo has no ``all_to_all_single`` with split sizes (the ``alltoall`` MoE
  token dispatcher needs it: packs differ in length, so the token counts per
  expert rank differ): one built from point-to-point sends and receives.
* without apex/TE the distributed optimizer wraps ``torch.optim.AdamW``, whose
  ``step`` lives in per-parameter state that ``--ckpt-format torch``'s
  parameter-state file does not hold: loading keeps the restored ``step``
  instead of failing with ``KeyError: 'step'``; and ``load_state_dict`` gives
  every parameter one shared ``step`` tensor, which AdamW's in-place increment
  would advance once per parameter: each parameter gets its own copy.
* releases differ (checked by capability, not version): the fused-kernel
  compile step exists only up to core_v0.18.2 (shimmed only where it exists);
  on main (0.20) the example's ``get_vision_model_config`` takes the config
  alone and its MLP specs are partials of ``MLP.as_mlp_submodule`` (the local
  stand-in takes that form where the example's own local spec has it); and the
  example builds its MoE language model only with transformer-engine (asking
  ``get_layer_spec`` for a dense one without it): megatron-core's local MoE
  spec there, the one patch 0004 adds for the earlier releases (on GPU main's
  own MoE spec serves, so main's patch set needs no MoE hunk).
* Megatron compiles its dataset index helpers with ``make`` at start-up;
  the energon data path never calls them: skipped.

One benchmark setting, off unless its variables are set (``mm-balance bench-realpath --host
gpu-node``): the host side of a GPU node (:mod:`.host_side`, as in Bridge's harness), the train
loader's micro-batches drawn before the first iteration and the heap grown.
"""
from __future__ import annotations

import os
import sys
import types

TINY_VIT = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                kv_channels=16, ffn_hidden_size=128)
"""The CPU vision encoder: CLIP's architecture (LayerNorm, quick-GELU, biases), 2 small layers."""
VIT_ENV = "MM_BALANCE_CPU_VIT"
"""Environment variable a launch config exports to size the CPU vision encoder:
``LAYERS,HIDDEN,HEADS,FFN`` (e.g. ``6,384,6,1536``); unset: :data:`TINY_VIT`."""
TINY_PROJECTION_FFN = 256
"""Hidden size of the vision projection MLP on CPU (the example sizes it for a 7B LM)."""
TINY_LM_FFN = 512
"""Dense FFN size of the language model on CPU (the example hard-codes 18944 for qwen2.5_7B;
MoE layers use --moe-ffn-hidden-size)."""

_DONE = False


def _stub_triton() -> None:
    """Register an inert ``triton`` package so import-time references resolve."""
    if "triton" in sys.modules:
        return
    try:
        import triton  # noqa: F401
        return
    except ImportError:
        pass

    class _Inert(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _inert_callable(f"{self.__name__}.{name}")

    def _inert_callable(qual):
        class _F:
            def __init__(self, *a, **k):
                pass

            def __call__(self, *a, **k):
                if a and callable(a[0]) and len(a) == 1 and not k:
                    return a[0]            # used as a decorator: @triton.jit
                return _F()

            def __getattr__(self, name):
                return _F()

            def __getitem__(self, item):
                raise RuntimeError(f"{qual}: triton is not available on this CPU run")

        return _F()

    for name in ("triton", "triton.language", "triton.runtime", "triton.language.extra",
                 "triton.language.extra.libdevice"):
        mod = _Inert(name)
        mod.__path__ = []  # a package, so submodule imports resolve to these stubs
        sys.modules[name] = mod
    sys.modules["triton"].language = sys.modules["triton.language"]


def _all_to_all_single_p2p(output, input, output_split_sizes=None, input_split_sizes=None,
                           group=None, async_op=False):
    """``all_to_all_single`` from isend/irecv (gloo has no split-size all-to-all)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    if input_split_sizes is None or len(input_split_sizes) == 0:
        input_split_sizes = [input.shape[0] // n] * n
    if output_split_sizes is None or len(output_split_sizes) == 0:
        output_split_sizes = [output.shape[0] // n] * n
    ins = list(torch.split(input, list(input_split_sizes)))
    outs = list(torch.split(output, list(output_split_sizes)))
    ops = []
    for peer in range(n):
        if peer == me:
            outs[peer].copy_(ins[peer])
            continue
        gpeer = dist.get_global_rank(group, peer) if group is not None else peer
        if ins[peer].numel():
            ops.append(dist.P2POp(dist.isend, ins[peer].contiguous(), gpeer, group))
        if outs[peer].numel():
            ops.append(dist.P2POp(dist.irecv, outs[peer], gpeer, group))
    # receive into contiguous views only (split along dim 0 of a contiguous tensor)
    reqs = dist.batch_isend_irecv(ops) if ops else []
    for r in reqs:
        r.wait()
    if async_op:
        return _DoneWork()
    return None


def install_gloo_all_to_all() -> None:
    """``dist.all_to_all_single`` on gloo groups from point-to-point ops (idempotent)."""
    import torch.distributed as dist
    if getattr(dist.all_to_all_single, "_mm_balance_gloo", False):
        return
    _orig_a2a = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        if dist.get_backend(group) == "gloo":
            return _all_to_all_single_p2p(output, input, output_split_sizes, input_split_sizes,
                                          group, async_op)
        return _orig_a2a(output, input, output_split_sizes, input_split_sizes, group, async_op)

    all_to_all_single._mm_balance_gloo = True
    dist.all_to_all_single = all_to_all_single


def install_cuda_rng_state() -> None:
    """``torch.cuda.get_rng_state``/``set_rng_state``: an empty state, nothing restored."""
    import torch
    torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None


class _DoneWork:
    def wait(self, *a, **k):
        return True

    def is_completed(self):
        return True


def _host_side_at_setup(mtrain, get_args=None) -> None:
    """With ``MM_BALANCE_CPU_PREDRAW`` set (``mm-balance bench-realpath --host gpu-node``), the
    train loader's micro-batches are drawn when ``pretrain()`` has built its iterators, before
    ``--mm-balance`` wraps them; with ``MM_BALANCE_CPU_HEAP_MB`` the heap is grown after that
    (:mod:`.host_side`, the same settings as Bridge's harness). The job then saves no data
    position in its checkpoints (``--dataloader-save`` cleared), as on Bridge: a benchmark
    setting, not a training one. Unset: nothing changes. ``get_args``: where the job's arguments come from (default: Megatron's ``get_args``)."""
    from .host_side import host_side_settings, predraw_count, prepare
    value, mb = host_side_settings()
    if not value:
        return
    original = mtrain.build_train_valid_test_data_iterators

    def build_train_valid_test_data_iterators(*a, **k):
        train, valid, test = original(*a, **k)
        if get_args is not None:
            args = get_args()
        else:
            from megatron.training import get_args as megatron_args
            args = megatron_args()
        if args.train_iters is None:
            raise ValueError("MM_BALANCE_CPU_PREDRAW needs --train-iters (the micro-batches to draw)")
        count = predraw_count(value, train_iters=args.train_iters, global_batch_size=args.global_batch_size,
                              micro_batch_size=args.micro_batch_size, dp_size=args.data_parallel_size)
        # The loader will have read ahead: its state is no data position to resume from, so the
        # job saves none (Megatron skips the loader's state without --dataloader-save).
        args.dataloader_save = None
        prepare(train, count, value, mb)
        return train, valid, test

    mtrain.build_train_valid_test_data_iterators = build_train_valid_test_data_iterators


def install() -> None:
    """Install every shim listed in the module docstring (idempotent)."""
    global _DONE
    if _DONE:
        return
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    _stub_triton()

    import torch

    from . import cpu_megatron
    cpu_megatron.install()

    cuda = torch.cuda
    install_cuda_rng_state()

    install_gloo_all_to_all()

    from megatron.training import initialize as minit
    from megatron.training import training as mtrain

    _orig_init = minit.initialize_megatron

    def initialize_megatron(*a, **k):
        k["allow_no_cuda"] = True
        return _orig_init(*a, **k)

    minit.initialize_megatron = initialize_megatron
    mtrain.initialize_megatron = initialize_megatron

    _orig_dist = minit._initialize_distributed

    def _initialize_distributed(*a, **k):
        real = cuda.device_count
        cuda.device_count = lambda: 1
        try:
            return _orig_dist(*a, **k)
        finally:
            cuda.device_count = real

    minit._initialize_distributed = _initialize_distributed

    _orig_seed = minit._set_random_seed

    def _set_random_seed(*a, **k):
        _orig_seed(*a, **k)
        from megatron.core.tensor_parallel import random as mrandom
        # A placeholder state: checkpoints must hold one, or resuming refuses the rng state.
        mrandom.get_cuda_rng_tracker().states_.setdefault(
            "model-parallel-rng", torch.zeros(1, dtype=torch.uint8))

    minit._set_random_seed = _set_random_seed
    if hasattr(minit, "fused_kernels"):      # core_v0.19.0 no longer compiles them
        minit.fused_kernels.load = lambda args: None

    from megatron.training import arguments as margs
    margs.get_device_arch_version = lambda: 9   # validate_args asks the GPU's arch under TP/CP > 1
    _host_side_at_setup(mtrain)

    from megatron.core.datasets import utils as dutils
    dutils.compile_helpers = lambda: None

    _shrink_clip()
    _local_specs()
    _torch_adam_resume()
    _DONE = True


def vit_size(spec: str | None = None) -> dict:
    """The CPU vision encoder's size: :data:`TINY_VIT`, or ``LAYERS,HIDDEN,HEADS,FFN`` from
    ``spec`` (default: the ``MM_BALANCE_CPU_VIT`` environment variable); one-line errors."""
    spec = os.environ.get(VIT_ENV) if spec is None else spec
    if not spec:
        return dict(TINY_VIT)
    parts = spec.replace(" ", "").split(",")
    try:
        layers, hidden, heads, ffn = (int(p) for p in parts)
    except ValueError:
        raise SystemExit(f"{VIT_ENV}={spec!r}: expected LAYERS,HIDDEN,HEADS,FFN (four integers)") from None
    if min(layers, hidden, heads, ffn) < 1 or hidden % heads:
        raise SystemExit(f"{VIT_ENV}={spec!r}: sizes must be >= 1 and HIDDEN a multiple of HEADS")
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_query_groups=heads, kv_channels=hidden // heads, ffn_hidden_size=ffn)


def _shrink_clip() -> None:
    import config as mm_config  # examples/multimodal/config.py (on PYTHONPATH via the launcher)
    import model as mm_model

    orig = mm_config.get_vision_model_config
    orig_proj = mm_config.get_vision_projection_config
    vit = vit_size()

    def get_vision_model_config(config, *args, **kwargs):     # (config[, apply_query_key_layer_scaling])
        config = orig(config, *args, **kwargs)
        if config.vision_model_type == "clip":
            for k, v in vit.items():
                setattr(config, k, v)
        return config

    def get_vision_projection_config(config, hidden_size):
        config = orig_proj(config, hidden_size)
        config.ffn_hidden_size = TINY_PROJECTION_FFN
        return config

    orig_lm = mm_config.get_language_model_config

    def get_language_model_config(config):
        config = orig_lm(config)
        config.ffn_hidden_size = TINY_LM_FFN
        return config

    mm_config.get_language_model_config = get_language_model_config
    mm_model.get_language_model_config = get_language_model_config
    mm_config.get_vision_model_config = get_vision_model_config
    mm_model.get_vision_model_config = get_vision_model_config
    mm_config.get_vision_projection_config = get_vision_projection_config
    mm_model.get_vision_projection_config = get_vision_projection_config


def _local_specs() -> None:
    """The three TE-only pieces of the example, in Megatron's local implementations."""
    import functools

    import torch
    import model as mm_model
    from megatron.core.models.multimodal import llava_model
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.tensor_parallel import RowParallelLinear

    class CPUCLIPViTModel(CLIPViTModel):
        """CLIP with ``ln_pre`` as megatron's WrappedTorchNorm (the default rejects ``config``)."""

        def __init__(self, *a, **k):
            k.setdefault("ln_pre_impl", WrappedTorchNorm)
            super().__init__(*a, **k)

    llava_model.CLIPViTModel = CPUCLIPViTModel

    class NormColumnParallelLinear(ColumnParallelLinear):
        """Local stand-in for TE's LayerNormColumnParallelLinear: the config's norm, then fc1."""

        def __init__(self, input_size, output_size, *, config, **k):
            super().__init__(input_size, output_size, config=config, **k)
            self.norm = WrappedTorchNorm(config=config, hidden_size=input_size,
                                         eps=config.layernorm_epsilon)

        def forward(self, input_, *a, **k):
            return super().forward(self.norm(input_), *a, **k)

    import layer_specs as mm_specs  # examples/multimodal/layer_specs.py

    def get_norm_mlp_module_spec_local():
        # in the form the release's own local MLP spec has: a ModuleSpec, or (main, 0.20) a
        # partial of MLP.as_mlp_submodule whose ``submodules`` keyword the example reads
        subs = MLPSubmodules(linear_fc1=NormColumnParallelLinear, linear_fc2=RowParallelLinear)
        shape = mm_specs.get_mlp_module_spec(use_te=False)
        if isinstance(shape, functools.partial):
            return functools.partial(shape.func, *shape.args, **{**shape.keywords, "submodules": subs})
        return ModuleSpec(module=MLP, submodules=subs)

    mm_model.get_norm_mlp_module_spec_te = get_norm_mlp_module_spec_local

    if hasattr(mm_model, "get_gpt_decoder_block_spec"):
        # main (0.20): the example builds an MoE language model itself, with transformer-engine
        # only; without it it asks get_layer_spec for a dense one: the same local MoE spec the
        # earlier releases' patch (0004) adds, here, since only a machine without TE needs it
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.training import get_args
        example_layer_spec = mm_model.get_layer_spec

        def get_layer_spec(is_vit, normalization):
            args = get_args()
            if is_vit or not args.num_experts:
                return example_layer_spec(is_vit, normalization)
            return get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                            normalization=normalization)

        mm_model.get_layer_spec = get_layer_spec
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        mm_specs.HAVE_TE = False    # it imports megatron's TE wrappers, which exist without TE
        # its no-TE RMSNorm branch reads a TORCH_VERSION it never defines
        mm_specs.TORCH_VERSION = getattr(mm_specs, "TORCH_VERSION", torch.__version__.split("."))
        mm_specs.HAVE_APEX = getattr(mm_specs, "HAVE_APEX", False)    # and HAVE_APEX

    install_packed_attention()

    from megatron.core.models.common.embeddings import rope_utils
    orig_rope_thd = rope_utils._apply_rotary_pos_emb_thd

    def _apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, *a, **k):
        n = int(cu_seqlens[-1])
        if n >= t.shape[0]:
            return orig_rope_thd(t, cu_seqlens, freqs, *a, **k)
        # Padded pack (pipeline parallel pads to the fixed sequence length): the real
        # sequences as usual; the padding tail, which no real token attends to, unrotated.
        return torch.cat([orig_rope_thd(t[:n], cu_seqlens, freqs, *a, **k), t[n:]], dim=0)

    rope_utils._apply_rotary_pos_emb_thd = _apply_rotary_pos_emb_thd


def install_packed_attention() -> None:
    """Local ``DotProductAttention`` over a packed (THD) sequence: each sample attends only
    within itself (:func:`_packed_attention`); unpacked calls are unchanged (idempotent)."""
    from megatron.core.transformer import dot_product_attention as dpa
    if getattr(dpa.DotProductAttention.forward, "_mm_balance_packed", False):
        return
    orig_forward = dpa.DotProductAttention.forward

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return orig_forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                attention_bias=attention_bias, packed_seq_params=None)
        return _packed_attention(self, query, key, value, attn_mask_type, packed_seq_params)

    forward._mm_balance_packed = True
    dpa.DotProductAttention.forward = forward


def _torch_adam_resume() -> None:
    """Resume megatron's distributed optimizer when it wraps ``torch.optim.AdamW``.

    Without apex/TE, megatron keeps Adam's ``step`` in torch's per-parameter state:
    ``state_dict()`` saves it with the optimizer's common state, and
    ``load_state_dict`` puts it back per parameter, but the per-parameter tensors
    saved by ``save_parameter_state`` (``--ckpt-format torch``) hold only
    ``param``/``exp_avg``/``exp_avg_sq``, so loading them fails on ``'step'``:
    entries the file lacks keep the value ``load_state_dict`` restored. That value is
    one tensor shared by all parameters, which AdamW would increment once per
    parameter per step: each parameter gets its own copy.
    """
    import torch
    from megatron.core.optimizer import distrib_optimizer as dopt

    orig = dopt.DistributedOptimizer._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not getattr(dopt, "HAVE_APEX_OR_TE", True):
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            kept = {k: v for k, v in self.optimizer.state[main_param].items() if k not in tensors}
            tensors = {**tensors, **kept}
        return orig(self, model_param, tensors)

    dopt.DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states

    orig_load = dopt.DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        orig_load(self, state_dict)
        if not getattr(dopt, "HAVE_APEX_OR_TE", True):
            for st in self.optimizer.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()

    dopt.DistributedOptimizer.load_state_dict = load_state_dict


def _packed_attention(self, query, key, value, attn_mask_type, params):
    """Attention over a THD pack ``[t, heads, dim]``: each sample attends only within itself.

    Computed segment by segment (one attention per packed sample, or per vision frame), so
    its cost follows each segment's length squared, as a GPU's varlen attention does: a
    dense masked attention over the whole pack would cost the pack's length squared and
    misrepresent native-resolution vision (many small frames against one large one)."""
    import torch

    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
    bounds = [int(x) for x in cu.to(torch.long).cpu().tolist()]
    t = query.shape[0]
    if bounds[-1] < t:                 # rows after the last segment attend among themselves
        bounds.append(t)
    mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
    causal = "causal" in getattr(mask_type, "name", str(mask_type))
    rep = query.shape[1] // key.shape[1]
    if rep > 1:
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    q, k, v = (x.float().transpose(0, 1) for x in (query, key, value))  # [h, t, d]
    out = q.new_zeros(q.shape[0], t, v.shape[2])
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        scores = torch.matmul(q[:, start:end], k[:, start:end].transpose(1, 2)) * self.softmax_scale
        if causal:
            n = end - start
            upper = torch.ones(n, n, dtype=torch.bool).triu(1)
            scores = scores.masked_fill(upper, float("-inf"))
        out[:, start:end] = torch.matmul(torch.softmax(scores, dim=-1), v[:, start:end])
    return out.to(query.dtype).transpose(0, 1).reshape(t, 1, -1)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not argv[0].endswith(".py"):
        sys.exit("usage: python -m megatron_mm_balance.testing.cpu_pretrain SCRIPT.py [flags...]")
    script = argv[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    from ..patching.overlay import install_if_requested, run_main
    install_if_requested("megatron-lm")     # MM_BALANCE_OVERLAY=1: before the shims import Megatron
    install()
    sys.argv = argv
    run_main(script)                        # runpy.run_path, or the overlay's patched train.py
    from .rank_exit import finish
    finish()                                # the job returned: end without the interpreter's teardown


if __name__ == "__main__":
    main()
