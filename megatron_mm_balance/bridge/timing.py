"""Per-micro-batch timings on Megatron-Bridge's Qwen3-VL model (``mm_balance.timing``,
``mm_balance.timing_dir``, and ``mm_balance.cost=auto``, which fits them).

Bridge's ``Qwen3VLModel`` (``megatron.bridge.models.qwen_vl.modelling_qwen3_vl.model``)
has the shape the core package's hooks time (:mod:`megatron_mm_balance.megatron.timing`):
a ``vision_model`` (``Qwen3VLVisionModel``: patch embedding, blocks and merger, returning
the embeddings and the deepstack features) and a ``language_model`` (``Qwen3VLGPTModel``,
called with ``decoder_input=`` the combined embeddings), inside Megatron's DDP and
``Float16Module`` wrappers. ``qwen3_vl_step.forward_step`` calls it with keyword
arguments only: ``input_ids`` (``[B, S]``, after the step's padding), ``image_grid_thw``
/ ``video_grid_thw`` (``(t, h, w)`` per image/video), ``attention_mask`` and, with
in-batch packing, ``packed_seq_params``. :func:`qwen_vl_pack_features` reads a record's
grids from the micro-batch's host copy as the train iterator hands it over, and
:func:`call_lengths` its rows from the call's shapes, so no hook reads a device tensor;
:func:`qwen_vl_features` reads them all from the call (a forward with nothing handed over); the recorder, the hooks and the clock (CUDA events on GPU,
``perf_counter`` on CPU) are the core package's, unchanged.

A record's ``images`` are the encoder's tokens ``t*h*w`` per image/video, ``grids`` the
``(t, h, w)`` themselves (so per-frame features, ``h*w`` per frame, can be derived),
``lengths`` the language model's rows as it computes them (``cu_seqlens_q`` segments
when packed, else ``attention_mask`` row sums when it is ``[B, S]``, else ``S`` per row:
the step pads every row to the sequence length under pipeline or expert parallelism).
"""
from __future__ import annotations

from typing import Optional

from ..cost.pack import QWEN_VL_GRID_KEYS, QwenVLBatchError, QwenVLGridFeatures, _grid_rows


def qwen_vl_pack_features(pack) -> Optional[tuple]:
    """``(images, None, grids)`` of a Bridge micro-batch read from its host copy, as the train
    iterator hands it over (the grids of its ``visual_inputs``), so the hooks read no device
    tensor; the lengths are left to the forward, which reads them from its call's shapes
    (:func:`call_lengths`: the step pads the rows first). None when the grids cannot be read
    (that forward reads its call instead)."""
    try:
        grids = QwenVLGridFeatures().grids(pack)
    except QwenVLBatchError:
        return None
    return [t * h * w for t, h, w in grids], None, grids


def call_lengths(args, kwargs) -> list:
    """The language model's rows as Bridge 0.6's Qwen3-VL step calls it, from shapes only: the
    step pads every row to one length and packs them with ``cu_seqlens`` of that length, so
    each row is ``input_ids``' width (reading ``cu_seqlens_q`` itself would copy it from the
    device and wait for the GPU)."""
    ids = args[0] if args else kwargs.get("input_ids")
    shape = getattr(ids, "shape", None)
    return [int(shape[-1])] * int(shape[0]) if shape is not None and len(shape) == 2 else []


def qwen_vl_features(model, args, kwargs) -> tuple:
    """``(images, lengths, grids)`` of the micro-batch Bridge's Qwen3-VL model is called with."""
    grids = []
    for key in QWEN_VL_GRID_KEYS:
        grids.extend(_grid_rows(kwargs.get(key), key))
    images = [t * h * w for t, h, w in grids]
    return images, _lengths(args, kwargs), grids


def _lengths(args, kwargs) -> list:
    """Per-sample token counts the language model computes (see the module docstring)."""
    psp = kwargs.get("packed_seq_params")
    cu = getattr(psp, "cu_seqlens_q", None) if psp is not None else None
    if cu is not None:
        c = [int(x) for x in cu.reshape(-1).tolist()]
        return [b - a for a, b in zip(c, c[1:]) if b > a]
    mask = kwargs.get("attention_mask")
    if mask is not None and getattr(mask, "dim", lambda: 0)() == 2:
        return [int(v) for v in mask.sum(-1).tolist()]
    ids = args[0] if args else kwargs.get("input_ids")
    shape = getattr(ids, "shape", None)
    return [int(shape[-1])] * int(shape[0]) if shape is not None and len(shape) == 2 else []


def install_bridge_timing(model, core_cfg, args, state=None):
    """The timing hooks on Bridge's model chunks, on every rank (None when not asked for).

    ``core_cfg``: the checked :class:`~megatron_mm_balance.megatron.config.MMBalanceConfig`
    (``timing``, ``timing_dir``, ``log_interval``); ``args``: its namespace from
    :func:`~.config.as_args`, whose live ``curr_iteration`` (Bridge's ``train_state.step``)
    labels each micro-batch; ``state``: Bridge's ``GlobalState`` (TensorBoard / W&B writers)."""
    if not core_cfg.timing:
        return None
    if model is None:
        raise ValueError("mm_balance.timing (and mm_balance.cost=auto) need the model: the setup.py "
                         "patch passes model=model to wrap_train_data_iterator (re-apply "
                         "scripts/apply_patches.sh)")
    from ..megatron.config import live_iteration
    from ..megatron.timing import install_timing
    return install_timing(model, out_dir=core_cfg.timing_dir, interval=core_cfg.log_interval,
                          iteration_fn=live_iteration(args), features=qwen_vl_features,
                          host_features=qwen_vl_pack_features, call_lengths=call_lengths,
                          writers=_writers(state), files=core_cfg.timing_files, every=core_cfg.timing_every)


def _writers(state) -> tuple:
    """Bridge's TensorBoard and W&B writers (on the rank that has them; else None)."""
    if state is None:
        return None, None
    return getattr(state, "tensorboard_logger", None), getattr(state, "wandb_logger", None)
