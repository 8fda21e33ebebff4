"""Per-pack timings in the running job: the vision encoder's and the language model's
forward and backward time for every micro-batch on every rank (``--mm-balance-timing``).

Module hooks on a vision-language model with a ``vision_model`` and a
``language_model`` (the example's ``LLaVAModel``; Megatron-Bridge's ``Qwen3VLModel``
through :mod:`megatron_mm_balance.bridge.timing`), found inside Megatron's DDP and
``Float16Module`` wrappers by following ``.module``, no change to the maths:

* the model's forward pre-hook: a new record, with the pack's features. They are read
  from the micro-batch's host copy as the train iterator hands it over
  (:meth:`TimingRecorder.expect`, by a ``host_features`` function, default
  :func:`llava_pack_features`: the pack's ``num_tiles`` x the model's tokens per tile:
  per-image tokens; ``cu_lengths``: sample lengths), so no hook reads a device tensor
  (which would make the host wait for the GPU at every micro-batch). A forward with no
  features handed over (a harness calling the model without the wrapped iterator, a
  replayed micro-batch) reads them from the call instead, by a ``features`` function
  (default :func:`llava_features`: ``num_image_tiles``, ``packed_seq_params.cu_seqlens_q``;
  Qwen-VL's adds the ``(t, h, w)`` grids, ``grids``); evaluation (no grad, or
  ``eval()``) is not recorded;
* ``vision_model`` forward pre-hook and ``vision_projection`` (else ``vision_model``)
  forward hook: vision forward;
* ``language_model`` forward pre-hook and forward hook: language-model forward; a
  gradient hook on its output marks the start of its backward, one on its
  ``decoder_input`` (the combined embeddings) the end;
* gradient hooks on the vision encoder's parameters: the last one to fire ends the
  vision backward (the encoder's first layer is the last the backward reaches).

Under pipeline parallelism only the first stage has the vision encoder (its records
then have vision times; later stages record their share of the language model). A
text-only pack never calls the vision encoder: its vision times are 0.

Clock: ``time.perf_counter`` on CPU; on GPU CUDA events (recorded on the current
stream, read when they have completed, so nothing synchronises). On CPU the
language-model times include waiting for peers inside the MoE all-to-alls; the
analysis (``bench/realpath.py``, :mod:`megatron_mm_balance.cost.calibration`) takes
each micro-step's fastest rank as the compute.

A record may carry ``details``: figures a component inside the model adds to the
micro-batch whose forward is running (:meth:`TimingRecorder.add_detail`; Bridge's
``mm_balance.vision=images`` splits its exchange's forward with them).

Records (one per micro-batch per rank) go to ``DIR/timing-rank<R>.jsonl`` when a
directory is given (``--mm-balance-timing-dir``; or one file per node, and every N-th
iteration only: :mod:`megatron_mm_balance.cost.timing_files`), are averaged per log interval into
``mm-balance-timing/*`` TensorBoard/W&B scalars and one log line, and feed the
online calibration of ``--mm-balance-cost auto`` (:meth:`TimingRecorder.records`).
"""
from __future__ import annotations

import atexit
import collections
import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from ..cost.timing_files import TimingFileWriter
from ..runtime.log_line import emit_line

logger = logging.getLogger("megatron_mm_balance")

PHASES = ("vision_forward_ms", "vision_backward_ms", "lm_forward_ms", "lm_backward_ms")
#: handed-over features kept per chunk before the oldest is dropped (a forward reads one each;
#: a schedule holds at most a few micro-batches between its get_batch and their forward)
_EXPECTED_MAX = 64


def unwrap(module):
    """The model inside Megatron's wrappers (DDP, ``Float16Module``): follow ``.module``."""
    seen = 0
    while hasattr(module, "module") and seen < 8 and not hasattr(module, "language_model"):
        module = module.module
        seen += 1
    return module


class _CpuClock:
    def mark(self):
        return time.perf_counter()

    @staticmethod
    def ready(mark) -> bool:
        return True

    @staticmethod
    def ms(a, b) -> float:
        return (b - a) * 1e3


class _CudaClock:
    def __init__(self):
        import torch
        self.torch = torch

    def mark(self):
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @staticmethod
    def ready(mark) -> bool:
        return mark.query()

    @staticmethod
    def ms(a, b) -> float:
        return float(a.elapsed_time(b))


@dataclass
class _Open:
    """One micro-batch being timed: its features and the clock marks seen so far."""

    iteration: int
    microbatch: int
    images: List[int]
    lengths: List[int]
    start_s: float
    grids: Optional[List[List[int]]] = None
    marks: Dict[str, object] = field(default_factory=dict)
    end_s: float = 0.0
    in_backward: bool = False
    #: figures other components add to this micro-batch's record (:meth:`TimingRecorder.add_detail`)
    details: Dict[str, float] = field(default_factory=dict)

    def mark(self, clock, name: str, *, last: bool = False) -> None:
        if last or name not in self.marks:
            self.marks[name] = clock.mark()
        self.end_s = time.perf_counter()


class TimingRecorder:
    """The records of one rank: written by the hooks (training thread), read by the
    calibration (the exchange thread) under a lock."""

    def __init__(self, *, rank: int = 0, clock=None, out_dir: Optional[str] = None,
                 iteration_fn=None, interval: int = 1, report: bool = False,
                 tb_writer=None, wandb_writer=None, keep: int = 100_000,
                 files: str = "rank", every: int = 1, node: Optional[str] = None):
        self.rank = rank
        self.clock = clock or _CpuClock()
        self.iteration_fn = iteration_fn
        self.interval = max(1, int(interval))
        self.report_lines = report
        self.tb_writer = tb_writer
        self.wandb_writer = wandb_writer
        self.keep = keep
        self._records: List[dict] = []
        self._cond = threading.Condition()
        self._pending: List[_Open] = []
        #: per model chunk, the features of micro-batches handed over and not yet recorded
        self._expected: Dict[int, collections.deque] = {}
        #: ``pack -> features`` on a micro-batch's host copy (:meth:`expect`); None: each
        #: forward reads its call
        self.host_features: Optional[Callable] = None
        #: ``(args, kwargs) -> lengths`` from the call's shapes, where host features have None
        self.call_lengths: Optional[Callable] = None
        self._current: Optional[_Open] = None
        self._backward: Optional[_Open] = None
        self._iteration = None
        self._microbatch = 0
        self._latest_iteration = 0            # highest iteration a forward was seen for
        self.manual_iteration = 1
        self._interval_records: List[dict] = []
        self._last_report = None
        self.lines: List[str] = []
        self.t0 = time.perf_counter()
        #: the records' file (``out_dir``): ``files`` per rank or per node, every ``every``-th
        #: iteration, each line with ``node`` when given (:class:`~megatron_mm_balance.cost.
        #: timing_files.TimingFileWriter`)
        self._file = (TimingFileWriter(out_dir, rank=rank, layout=files, node=node, every=every)
                      if out_dir else None)
        self.path = self._file.path if self._file is not None else None
        atexit.register(self.close)

    # -- hooks ---------------------------------------------------------------------
    def begin(self, images: List[int], lengths: List[int], grids: Optional[List[List[int]]] = None) -> _Open:
        """A training micro-batch's forward starts (records older backward passes first).
        ``grids``: Qwen-VL's ``(t, h, w)`` per image/video, recorded when given."""
        self._finish_ready()
        it = self._next_iteration()
        if it != self._iteration:
            self._iteration, self._microbatch = it, 0
            self._maybe_report(it)
        rec = _Open(it, self._microbatch, images, lengths, time.perf_counter() - self.t0, grids)
        rec.mark(self.clock, "start")
        self._microbatch += 1
        self._current = rec
        self._pending.append(rec)
        with self._cond:
            self._latest_iteration = max(self._latest_iteration, it)
            self._cond.notify_all()
        return rec

    def add_detail(self, name: str, value: float) -> None:
        """Add ``value`` to the figure ``name`` of the micro-batch whose forward is running
        (summed when added more than once); written as the record's ``details``. How a
        component inside the model (the image-level vision exchange) splits its share of a
        phase. Nothing when no training forward is running."""
        rec = self._current
        if rec is not None:
            rec.details[name] = rec.details.get(name, 0.0) + float(value)

    def expect(self, features: Optional[tuple], chunk: int = 0) -> None:
        """The features (``(images, lengths)`` or ``(images, lengths, grids)``) of the
        micro-batch the training loop has just been handed for model ``chunk``, read from its
        host copy; the chunk's next training forward records them (in hand-over order). None:
        nothing read (that forward reads its call)."""
        queue = self._expected.setdefault(chunk, collections.deque(maxlen=_EXPECTED_MAX))
        queue.append(features)

    def features_for(self, chunk: int, read_call: Callable[[], tuple]) -> tuple:
        """The next handed-over features of ``chunk``, else ``read_call()`` (the model's call)."""
        queue = self._expected.get(chunk)
        features = queue.popleft() if queue else None
        return features if features is not None else read_call()

    def add_backward_detail(self, name: str, value: float) -> None:
        """:meth:`add_detail` for the micro-batch whose backward is running (what a component
        inside the model does in backward, e.g. the vision exchange's gradient transfers)."""
        rec = self._backward
        if rec is not None:
            rec.details[name] = rec.details.get(name, 0.0) + float(value)

    def skip(self) -> None:
        """A forward that is not a training micro-batch (evaluation): nothing recorded."""
        self._current = None

    def backward_started(self, rec: _Open) -> None:
        rec.in_backward = True
        rec.mark(self.clock, "lm_backward_start")
        self._backward = rec

    def set_iteration(self, iteration: int) -> None:
        """The iteration the next micro-batches belong to, for loops without Megatron's
        ``args.curr_iteration`` (``iteration_fn`` wins when it answers)."""
        self.manual_iteration = int(iteration)

    def _next_iteration(self) -> int:
        it = self.iteration_fn() if self.iteration_fn is not None else None
        return int(it) if it is not None else self.manual_iteration

    # -- records -------------------------------------------------------------------
    def _finish_ready(self, force: bool = False) -> None:
        """Close the records whose backward has run (every backward started before this
        forward has completed on the host) and whose clock marks are readable."""
        keep = []
        for rec in self._pending:
            if (rec.in_backward or force) and (force or all(self.clock.ready(m) for m in rec.marks.values())):
                self._close(rec)
            else:
                keep.append(rec)
        self._pending = keep

    def _close(self, rec: _Open) -> None:
        m, ms = rec.marks, self.clock.ms

        def span(a, b):
            return round(ms(m[a], m[b]), 4) if a in m and b in m else 0.0

        vf_end = "vision_projection_end" if "vision_projection_end" in m else "vision_end"
        lm_bwd_end = "lm_backward_end" if "lm_backward_end" in m else None
        out = {
            "iteration": rec.iteration, "microbatch": rec.microbatch, "rank": self.rank,
            "images": rec.images, "lengths": rec.lengths,
            "vision_forward_ms": span("vision_start", vf_end),
            "vision_backward_ms": span(lm_bwd_end, "vision_grad") if lm_bwd_end else 0.0,
            "lm_forward_ms": span("lm_start", "lm_end"),
            "lm_backward_ms": span("lm_backward_start", lm_bwd_end) if lm_bwd_end else 0.0,
            "start_s": round(rec.start_s, 6), "end_s": round(rec.end_s - self.t0, 6),
        }
        if rec.grids is not None:
            out["grids"] = rec.grids
        if rec.details:
            out["details"] = {k: round(v, 4) for k, v in sorted(rec.details.items())}
        with self._cond:
            self._records.append(out)
            if len(self._records) > self.keep:
                del self._records[: len(self._records) - self.keep]
            self._interval_records.append(out)
            self._cond.notify_all()
        if self._file is not None:
            self._file.write(out)

    def records(self, first_iteration: int, last_iteration: int) -> List[dict]:
        """The closed records of iterations ``first..last`` (inclusive), in recording order."""
        with self._cond:
            return [r for r in self._records if first_iteration <= r["iteration"] <= last_iteration]

    def wait_until_done(self, iteration: int, timeout: float) -> bool:
        """Block until iteration ``iteration`` is over on this rank (a later one's forward has
        started, so its backward passes have run); False after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._latest_iteration <= iteration:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 1.0))
        # Records close at the next forward; the one that ended the wait has run it.
        return True

    # -- reporting -----------------------------------------------------------------
    def _maybe_report(self, iteration: int) -> None:
        """At the first forward of ``iteration``: report the previous interval when due."""
        done = iteration - 1
        if done < 1 or done % self.interval or done == self._last_report:
            return
        self._last_report = done
        with self._cond:
            recs, self._interval_records = self._interval_records, []
        if self._file is not None:
            self._file.flush()
        summary = summarize_timings(recs)
        if not summary:
            return
        if self.tb_writer is not None:
            for k, v in summary.items():
                self.tb_writer.add_scalar(f"mm-balance-timing/{k}", v, done)
        if self.wandb_writer is not None:
            self.wandb_writer.log({f"mm-balance-timing/{k}": v for k, v in summary.items()}, done)
        if self.report_lines:
            line = f"[mm-balance-timing] iteration {done} | " + " | ".join(
                f"{k}: {v:.6g}" for k, v in summary.items())
            emit_line(line)
            self.lines = (self.lines + [line])[-64:]

    def close(self) -> None:
        """Close what is still open (the job's last micro-batches) and the file."""
        try:
            self._finish_ready(force=True)
        except Exception:                    # an unreadable CUDA event at exit: drop it
            self._pending = []
        if self._file is not None:
            self._file.close()
            self._file = None


def summarize_timings(records: List[dict]) -> Dict[str, float]:
    """Per-micro-batch means of the four phases over ``records``, their count, and the
    vision encoder's share of the micro-batch's timed compute."""
    if not records:
        return {}
    n = len(records)
    out = {k: sum(r[k] for r in records) / n for k in PHASES}
    vision = out["vision_forward_ms"] + out["vision_backward_ms"]
    total = vision + out["lm_forward_ms"] + out["lm_backward_ms"]
    out["vision_share"] = vision / total if total > 0 else 0.0
    out["image_tokens"] = sum(sum(r["images"]) for r in records) / n
    out["microbatches"] = float(n)
    return out


# -- installing the hooks ------------------------------------------------------------

def llava_features(llava, args, kwargs) -> tuple:
    """Per-image tokens and per-sample lengths of the micro-batch ``llava`` is called with."""
    tiles = kwargs.get("num_image_tiles")
    images = args[0] if args else kwargs.get("images")
    per_tile = int(getattr(llava, "img_seq_len", 0) or 0)
    counts = []
    if tiles is not None and hasattr(tiles, "tolist"):
        counts = [int(t) * per_tile for t in tiles.reshape(-1).tolist()]
    elif images is not None and getattr(images, "ndim", 0) >= 1 and images.shape[0] > 0:
        counts = [per_tile] * int(images.shape[0])          # one tile per image
    if images is not None and getattr(images, "numel", lambda: 1)() == 0:
        counts = []
    psp = kwargs.get("packed_seq_params")
    cu = getattr(psp, "cu_seqlens_q", None) if psp is not None else None
    if cu is not None:
        c = [int(x) for x in cu.reshape(-1).tolist()]
        lengths = [b - a for a, b in zip(c, c[1:]) if b > a]
    else:
        tokens = args[1] if len(args) > 1 else kwargs.get("input_ids")
        lengths = [int(tokens.shape[-1])] if tokens is not None and hasattr(tokens, "shape") else []
    return counts, lengths


def llava_pack_features(pack, tokens_per_tile: int) -> Optional[tuple]:
    """:func:`llava_features` read from an examples/multimodal micro-batch on the host, as
    ``get_batch`` will hand it to the model: per-image tokens from ``num_tiles`` (none for
    the text-only dummy image ``imgs`` of shape ``[1, 1]``), sample lengths from
    ``cu_lengths`` (else the ``tokens`` row length, when ``cu_lengths`` is the ``[1, 1]``
    dummy). None when the micro-batch is not such a dict (the forward reads its call)."""
    from ..cost.pack import flatten_ints

    if not isinstance(pack, dict) or ("num_tiles" not in pack and "imgs" not in pack):
        return None
    imgs, tiles = pack.get("imgs"), pack.get("num_tiles")
    shape = tuple(getattr(imgs, "shape", ()))
    if imgs is not None and (shape == (1, 1) or getattr(imgs, "numel", lambda: 1)() == 0):
        counts = []
    elif tiles is not None:
        counts = [t * tokens_per_tile for t in flatten_ints(tiles, "num_tiles")]
    else:
        counts = [tokens_per_tile] * (shape[0] if shape else 0)
    cu = pack.get("cu_lengths")
    if cu is not None and tuple(getattr(cu, "shape", ())) != (1, 1):
        c = flatten_ints(cu, "cu_lengths")
        lengths = [b - a for a, b in zip(c, c[1:]) if b > a]
    else:
        tokens = pack.get("tokens")
        lengths = [int(tokens.shape[-1])] if tokens is not None and hasattr(tokens, "shape") else []
    return counts, lengths


def _grad_hook(tensor, fn) -> None:
    import torch
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        tensor.register_hook(fn)


def _first_tensor(output):
    if isinstance(output, (tuple, list)):
        return output[0] if output else None
    return output


def install_hooks(model_chunks, recorder: TimingRecorder, features: Callable = None) -> List:
    """Install the timing hooks on every model chunk; returns the hook handles.

    ``features(model, args, kwargs)``: the micro-batch's ``(images, lengths)`` or
    ``(images, lengths, grids)`` from the call of the model (inside its wrappers),
    default :func:`llava_features`."""
    import torch

    features = features or llava_features
    handles = []
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    for index, chunk in enumerate(chunks):
        llava = unwrap(chunk)
        vision = getattr(llava, "vision_model", None)
        projection = getattr(llava, "vision_projection", None)
        lm = getattr(llava, "language_model", None)
        top = llava if lm is not None or vision is not None else chunk
        clock = recorder.clock

        def top_pre(module, args, kwargs, index=index):
            if not (torch.is_grad_enabled() and module.training):
                recorder.skip()
                return None
            feats = recorder.features_for(index, lambda: features(module, args, kwargs))
            if feats[1] is None:                 # rows the host copy cannot know: the call's shapes
                feats = (feats[0], recorder.call_lengths(args, kwargs), *feats[2:])
            recorder.begin(*feats)
            return None

        handles.append(top.register_forward_pre_hook(top_pre, with_kwargs=True))

        def mark(name, *, last=False):
            def hook(*_):
                rec = recorder._current
                if rec is not None:
                    rec.mark(clock, name, last=last)
            return hook

        if vision is not None:
            handles.append(vision.register_forward_pre_hook(mark("vision_start")))
            handles.append(vision.register_forward_hook(mark("vision_end", last=True)))
            if projection is not None:
                handles.append(projection.register_forward_hook(mark("vision_projection_end", last=True)))

            def vision_grad(_grad):
                rec = recorder._backward
                if rec is not None:
                    rec.mark(clock, "vision_grad", last=True)

            for p in list(vision.parameters()) + (list(projection.parameters()) if projection else []):
                if p.requires_grad:
                    handles.append(p.register_hook(vision_grad))

        body = lm if lm is not None else (top if vision is None else None)
        if body is not None:
            def lm_pre(module, args, kwargs):
                rec = recorder._current
                if rec is None:
                    return None
                rec.mark(clock, "lm_start")
                _grad_hook(kwargs.get("decoder_input"),
                           lambda g, r=rec: r.mark(clock, "lm_backward_end", last=True))
                return None

            def lm_post(module, args, output):
                rec = recorder._current
                if rec is None:
                    return None
                rec.mark(clock, "lm_end", last=True)
                _grad_hook(_first_tensor(output), lambda g, r=rec: recorder.backward_started(r))
                return None

            handles.append(body.register_forward_pre_hook(lm_pre, with_kwargs=True))
            handles.append(body.register_forward_hook(lm_post))
    return handles


def install_timing(model_chunks, *, out_dir: Optional[str], interval: int,
                   iteration_fn: Optional[Callable[[], Optional[int]]] = None,
                   features: Optional[Callable] = None, writers: Optional[tuple] = None,
                   files: str = "rank", every: int = 1,
                   host_features: Optional[Callable] = None,
                   call_lengths: Optional[Callable] = None) -> TimingRecorder:
    """``--mm-balance-timing``: a :class:`TimingRecorder` for this rank and its hooks on
    ``model_chunks`` (what ``setup_model_and_optimizer`` returned). Called on every rank
    by :func:`~.iterator.wrap_train_data_iterator` (and by Bridge's glue, with the Qwen-VL
    ``features`` and its ``writers``: ``(tensorboard, wandb)``; default Megatron's).
    ``files`` and ``every``: ``--mm-balance-timing-files`` and ``--mm-balance-timing-every``
    (the written lines name this rank's node either way). ``host_features``: ``pack ->
    features`` on a micro-batch's host copy (:meth:`TimingRecorder.expect`; default, with
    the default ``features``, :func:`llava_pack_features` at the model's tokens per tile);
    ``call_lengths(args, kwargs)``: the rows, from the call's shapes, where the host features
    leave them None (Bridge's step pads the rows after the hand-over)."""
    import torch
    import torch.distributed as dist

    from ..runtime.groups import node_identity

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    clock = _CudaClock() if torch.cuda.is_available() and _on_cuda(model_chunks) else _CpuClock()
    tb, wandb = writers if writers is not None else _megatron_writers()

    recorder = TimingRecorder(rank=rank, clock=clock, out_dir=out_dir, iteration_fn=iteration_fn,
                              interval=interval, report=rank == 0, tb_writer=tb, wandb_writer=wandb,
                              files=files, every=every, node=node_identity())
    recorder.handles = install_hooks(model_chunks, recorder, features)
    if host_features is None and features is None:      # Megatron-LM's examples/multimodal
        host_features = functools.partial(llava_pack_features, tokens_per_tile=_tokens_per_tile(model_chunks))
    recorder.host_features = host_features
    recorder.call_lengths = call_lengths
    return recorder


def _tokens_per_tile(model_chunks) -> int:
    """LLaVA's ``img_seq_len`` (image embeddings per tile) of the first chunk that has one."""
    for chunk in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]):
        per_tile = getattr(unwrap(chunk), "img_seq_len", None)
        if per_tile:
            return int(per_tile)
    return 0


def _megatron_writers() -> tuple:
    """Megatron-LM's TensorBoard and W&B writers (None, None with megatron-core only)."""
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
        return get_tensorboard_writer(), get_wandb_writer()
    except Exception:          # megatron-core only (tests): log and file only
        return None, None


def _on_cuda(model_chunks) -> bool:
    for chunk in (model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]):
        for p in chunk.parameters():
            return p.is_cuda
    return False


# -- --mm-balance-cost auto ------------------------------------------------------------

def auto_cost_fn(cfg, recorder: Optional[TimingRecorder], group, *, features=None):
    """The :class:`~megatron_mm_balance.cost.calibration.AutoCost` of one exchange group.

    Its calibration runs on the exchange group from the thread that drives the balancer:
    every rank's records of the calibration iterations are all-gathered, the group's
    first rank replays them (:func:`~megatron_mm_balance.cost.calibration.choose_by_replay`,
    with the balancer's sync mode, tolerance and nodes) and broadcasts the choice (float64
    coefficients, pickled), so every rank computes bit-identical integer costs. The fit is logged by that rank and
    saved beside the checkpoints (``--save``/``mm_balance_cost_fit.json``); a job that
    loaded a checkpoint (``args.iteration > 0``) restores it from ``--load``. ``cfg``: the
    run's :class:`~.config.MMBalanceConfig` (its tokens per tile, sync, timeout, and
    Megatron's start iteration, ``--load`` and ``--save``). ``features``: what the fit and
    the costs read, and the candidates the replay weighs
    (:class:`~megatron_mm_balance.cost.features.TileFeatures` by default, ``QwenVLFeatures``,
    one unit per frame, on Bridge's Qwen-VL models).
    """
    import torch.distributed as dist
    from ..cost.calibration import FIT_FILE, AutoCost, CalibrationConfig, read_fit, write_fit

    if recorder is None:
        raise RuntimeError("--mm-balance-cost auto needs the per-pack timing hooks: pass the model "
                           "to wrap_train_data_iterator(..., model=model)")
    ranks = dist.get_process_group_ranks(group) if group is not None else [0]
    first = min(ranks)
    me = dist.get_rank() if dist.is_initialized() else 0
    start = cfg.megatron.start_iteration
    saved = None
    load = cfg.megatron.load
    if start > 0 and load and os.path.isfile(os.path.join(load, FIT_FILE)):
        saved = read_fit(os.path.join(load, FIT_FILE))
        if me == first:
            emit_line(f"[mm-balance] cost auto: restored the fit of iterations {saved.first_iteration}-"
                      f"{saved.last_iteration} from {os.path.join(load, FIT_FILE)} (effective from "
                      f"iteration {saved.effective_iteration}; {'ok' if saved.ok else 'refused'})")
    config = CalibrationConfig(iterations=cfg.calibration_iters, phases=cfg.sync == "microstep",
                               tokens_per_tile=cfg.tokens_per_tile, wait_s=cfg.timeout,
                               balance_tolerance=cfg.tolerance, ranks_per_node=cfg.ranks_per_node,
                               group_ranks=tuple(ranks) if group is not None else None)

    def collect(first_it, last_it):
        if not recorder.wait_until_done(last_it, config.wait_s):
            logger.warning("mm-balance: cost auto: iteration %d's timings still incomplete after "
                           "%.0f s; fitting what is there", last_it, config.wait_s)
        return recorder.records(first_it, last_it)

    def agree(local, fit):
        if group is None or len(ranks) == 1:
            return fit(local)
        gathered = [None] * len(ranks)
        dist.all_gather_object(gathered, local, group=group)
        result = [fit([r for recs in gathered for r in recs]) if me == first else None]
        dist.broadcast_object_list(result, src=first, group=group)
        return result[0]

    def on_fit(result):
        if me != first:
            return
        emit_line("\n".join(result.lines()))
        save = cfg.megatron.save
        if save:
            os.makedirs(save, exist_ok=True)
            write_fit(result, os.path.join(save, FIT_FILE))

    return AutoCost(config, start_iteration=start, collect=collect, agree=agree, on_fit=on_fit,
                    saved=saved, features=features)
