"""Images mode on the training thread: one micro-step's units encoded where the exchange thread
planned them, with only point-to-point transfers inside the step group.

The exchange thread (:mod:`.frame_ahead`) has already planned the micro-step and delivered,
with its pack, a :class:`~.frame_ahead.StepFrames`: the rows this rank encodes for others
(sent ahead), which of its own units it keeps, and where every output goes. What is left for
the micro-step (:func:`encode_step`):

1. encode the received rows (they are there: no wait) and post their outputs to their owners,
   with the receives of this rank's own moved units' outputs (one flight, every send and
   receive posted at once: no order between peers can deadlock);
2. encode this rank's kept units while that flight travels;
3. land the flight and put every output row in this rank's unit order.

Backward meets the flight in reverse (:class:`_Land`'s backward posts the output gradients to
the encoders and the receives of those of the units this rank encoded, :class:`_Launch`'s
awaits them), so the gradients travel while the kept units' backward runs. Every wait is
bounded by ``timeout`` and a failure names the peer. No collective, no plan, no host read of a
device tensor: sizes and index tensors come ready from the exchange thread.

:class:`FrameSteps` is the glue-facing part: one model chunk's hooks call :meth:`~FrameSteps.begin`
at a training forward, :meth:`~FrameSteps.outputs` where the model calls its encoder,
:meth:`~FrameSteps.take_part` where a rank that holds no unit would have, and
:meth:`~FrameSteps.end` after the forward. Knows nothing of Megatron.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .errors import BalancerError, PeerFailure
from .frame_ahead import FrameRelay, MeasuredRates, StepFrames


@dataclass
class _Posted:
    """A flight in the air: the result being filled, the works with their peers, the send
    tensors (alive until the works complete)."""

    out: torch.Tensor
    works: list
    keep: list


class _Flight:
    """Rows that travel between the step group's ranks while the caller computes: ``send[peer]
    = (start, rows)`` of the launched tensor go to ``peer``; ``recv[peer] = (start, rows)`` of
    the result (``out_rows`` rows) come from it. Backward: the same blocks the other way.
    Peers are global ranks of ``group``; every wait is bounded by ``timeout``."""

    def __init__(self, send: Dict[int, Tuple[int, int]], recv: Dict[int, Tuple[int, int]], out_rows: int,
                 group, *, timeout: float, where: str, what: str = "frame outputs"):
        self.send, self.recv, self.out_rows, self.group = send, recv, int(out_rows), group
        self.timeout, self.where, self.what = float(timeout), where, what
        self.rows = 0
        self.waited_s = 0.0
        self.received_bytes = 0
        #: backward: seconds posting the gradients and waiting for them; called when it is done
        self.backward_s = self.grad_waited_s = 0.0
        self.on_backward: Optional[Callable[["_Flight"], None]] = None
        self._posted: Optional[_Posted] = None

    def launch(self, x: torch.Tensor) -> None:
        self.rows = x.shape[0]
        self._posted = self._post(x.contiguous(), self.send, self.recv, self.out_rows, "")

    def launch_backward(self, grad: torch.Tensor) -> None:
        """The gradients of the rows that arrived go back; those of the rows sent land."""
        started = time.perf_counter()
        self._posted = self._post(grad.contiguous(), self.recv, self.send, self.rows, " gradients")
        self.backward_s += time.perf_counter() - started

    def land_backward(self) -> torch.Tensor:
        started = time.perf_counter()
        out = self.land()
        self.backward_s += time.perf_counter() - started
        self.grad_waited_s = self.waited_s
        if self.on_backward is not None:
            self.on_backward(self)
        return out

    def land(self) -> torch.Tensor:
        posted, self._posted = self._posted, None
        started = time.perf_counter()
        for peer, kind, work in posted.works:
            try:
                work.wait(datetime.timedelta(seconds=self.timeout))
            except Exception as e:
                me = dist.get_rank()
                first = (str(e).splitlines() or [""])[0][:200]
                raise PeerFailure(f"rank {me}: {kind} rank {peer} failed at {self.where} after "
                                  f"{time.perf_counter() - started:.1f}s ({type(e).__name__}: {first})",
                                  peers=(peer,)) from e
        self.waited_s = time.perf_counter() - started
        return posted.out

    def _post(self, x: torch.Tensor, send, recv, out_rows: int, suffix: str) -> _Posted:
        out = x.new_empty((out_rows, *x.shape[1:]))
        ops, peers = [], []
        for peer, (start, n) in sorted(send.items()):
            if n:
                ops.append(dist.P2POp(dist.isend, x.narrow(0, start, n), peer, self.group))
                peers.append((peer, f"sending {self.what}{suffix} to"))
        for peer, (start, n) in sorted(recv.items()):
            if n:
                ops.append(dist.P2POp(dist.irecv, out.narrow(0, start, n), peer, self.group))
                peers.append((peer, f"receiving {self.what}{suffix} from"))
        self.received_bytes = sum(n for _, (_, n) in recv.items()) * (out[0].numel() * out.element_size()
                                                                      if out.shape[0] else 0)
        if not ops:
            return _Posted(out, [], [])
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as e:
            names = ", ".join(str(p) for p, _ in peers)
            raise PeerFailure(f"rank {dist.get_rank()}: posting {self.what}{suffix} to or from rank(s) {names} "
                              f"failed at {self.where} ({type(e).__name__}: {e})",
                              peers=tuple(p for p, _ in peers)) from e
        if len(works) == len(ops):
            tagged = [(p, kind, w) for (p, kind), w in zip(peers, works)]
        else:                                   # one coalesced work (NCCL): every peer of the flight
            names = ", ".join(str(p) for p, _ in peers)
            tagged = [(names, f"{self.what}{suffix} with", w) for w in works]
        return _Posted(out, tagged, [x])


class _Launch(torch.autograd.Function):
    """Posts a flight of ``x``'s rows; returns an empty token that :class:`_Land` takes, so
    that backward reaches ``x`` through the flight."""

    @staticmethod
    def forward(ctx, x, flight):
        ctx.flight = flight
        flight.launch(x)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _token):
        return ctx.flight.land_backward(), None


class _Land(torch.autograd.Function):
    """Waits for a flight and returns the rows that arrived."""

    @staticmethod
    def forward(ctx, token, flight):
        ctx.flight = flight
        return flight.land()

    @staticmethod
    def backward(ctx, grad):
        ctx.flight.launch_backward(grad)
        return grad.new_empty(0), None


def _in_graph(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out`` with ``rows`` (which it does not use) joined to its graph as ``0 * sum``: no
    value changes, and backward reaches ``rows``'s flight where the peers expect it."""
    if rows.requires_grad:
        return out + (rows.sum() * 0).to(out.dtype)
    return out


def encode_step(frames: StepFrames, inputs: Optional[torch.Tensor], encode: Callable, empty: Callable[[], torch.Tensor],
                group, *, timeout: float, on_land: Optional[Callable[[_Flight], None]] = None,
                overlap: bool = True) -> torch.Tensor:
    """This rank's outputs of micro-step ``frames`` in its unit order (see the module
    docstring). ``inputs``: its units' input rows (None: it holds none); ``encode(rows,
    args, cost)``: the encoder's output rows of those input rows (``args``: the units' encoder
    arguments from the exchange thread, ``cost``: their integer cost); ``empty()``: an output tensor of no row (the right
    width and dtype, needing gradients when the encoder trains). ``overlap`` False: one
    encoder call on the received and the kept rows together, then the flight, landed at once
    (fewer encoder calls, nothing in flight while it computes)."""
    rows = 0 if inputs is None else int(inputs.shape[0])
    if rows != frames.local_rows:
        raise BalancerError(f"images mode: the encoder got {rows} input rows at {frames.where}, the exchange "
                            f"thread planned {frames.local_rows} from this rank's pack")
    if frames.sends_away and inputs.requires_grad:
        raise BalancerError(f"images mode: this rank's encoder inputs need gradients at {frames.where}, and rows "
                            "encoded on another rank return none; balance only inputs that are data")
    mine = None
    if frames.kept_units:
        mine = inputs if frames.kept_rows is None else inputs.index_select(0, frames.kept_rows)
    flight = _Flight(frames.send_out, frames.recv_out, frames.arrived_rows, group, timeout=timeout,
                     where=frames.where)
    if not overlap and mine is not None and frames.received is not None:
        both = encode(torch.cat([frames.received.to(mine.dtype), mine]),
                      tuple(torch.cat(pair) for pair in zip(frames.received_args, frames.kept_args)),
                      frames.received_cost + frames.kept_cost)
        theirs, kept = both.split([both.shape[0] - _rows_out(frames), _rows_out(frames)])
        token = _Launch.apply(theirs, flight)
    else:
        theirs = encode(frames.received, frames.received_args, frames.received_cost) \
            if frames.received is not None else empty()
        token = _Launch.apply(theirs, flight)
        kept = encode(mine, frames.kept_args, frames.kept_cost) if mine is not None else None
    arrived = _Land.apply(token, flight)
    if on_land is not None:
        on_land(flight)
    out = arrived if kept is None else torch.cat([kept, arrived]) if frames.arrived_rows else kept
    if frames.order is not None:
        out = out.index_select(0, frames.order)
    if kept is not None and not frames.arrived_rows:
        out = _in_graph(out, arrived)       # backward must still reach the flight's other way
    return out


def _rows_out(frames: StepFrames) -> int:
    """Output rows of this rank's kept units."""
    return int(frames.kept_out_rows)


class FrameSteps:
    """One model chunk's encoder, balanced micro-step by micro-step (see the module docstring).

    ``relay``: where the data iterator hands each micro-step's :class:`StepFrames`; ``group``:
    a process group over the step groups' ranks for the training thread's transfers (its own
    communicator: never the exchange thread's); ``encode(rows, args)``: the encoder on rows;
    ``empty()``: an output of no row; ``rates``: where the tower's and the link's measured
    rates go (read by the exchange thread at the next meeting); ``flops_per_unit``: the
    forward FLOPs of one unit of cost (None: the tower is not timed); ``detail(name, ms)``: the
    timing records' sink (``detail_backward``: the same for the micro-batch whose backward runs:
    ``vision_grad_exchange_ms``, the gradients' transfers, of which ``vision_grad_wait_ms``
    waiting); ``overlap`` False: one encoder call per micro-step
    (:func:`encode_step`); ``report(frames)``: each micro-step's :class:`StepFrames` (its
    ``figures`` and ``group``), at its forward."""

    def __init__(self, relay: FrameRelay, group, *, encode: Callable, empty: Callable[[], torch.Tensor],
                 timeout: float, rates: Optional[MeasuredRates] = None, flops_per_unit: Optional[float] = None,
                 detail: Optional[Callable[[str, float], None]] = None,
                 detail_backward: Optional[Callable[[str, float], None]] = None, report: Optional[Callable] = None,
                 device_type: str = "cpu", overlap: bool = True):
        from .rates import RateMeter
        self.relay, self.group, self._encode, self.empty = relay, group, encode, empty
        self.timeout, self.rates, self.detail, self.report = timeout, rates, detail, report
        self.detail_backward = detail_backward
        self.flops_per_unit = flops_per_unit
        self._meter = RateMeter(device_type)
        self.overlap = overlap
        self.current: Optional[StepFrames] = None
        self.done = False
        self.last: Optional[StepFrames] = None      # the latest micro-step's frames (tests, telemetry)
        self.tower_calls = 0

    def begin(self) -> None:
        """A training forward starts: take its micro-step's frames."""
        self.current, self.done = self.relay.take(), False
        self.last = self.current
        self._meter.poll()
        if self.report is not None and self.current.planned:
            self.report(self.current)

    def balanced(self) -> bool:
        """Whether this forward's units cross this rank (else its encoder runs as it is)."""
        return self.current is not None and self.current.balanced and not self.done

    def outputs(self, inputs: Optional[torch.Tensor]) -> torch.Tensor:
        """Where the model calls its encoder on ``inputs``: the outputs of this rank's units."""
        frames, self.done = self.current, True
        began = time.perf_counter()
        out = encode_step(frames, inputs, self._timed_encode, self.empty, self.group, timeout=self.timeout,
                          on_land=self._landed, overlap=self.overlap)
        self._note("vision_exchange_ms", (time.perf_counter() - began) * 1e3)
        return out

    def plain(self, run: Callable[[], object]):
        """The encoder run as it is (nothing crosses this rank at this micro-step): ``run()``,
        timed for the tower's measured rate when the micro-step was planned."""
        frames = self.current
        if frames is None or not frames.planned or self.flops_per_unit is None or self.rates is None:
            return run()
        started = self._meter.start()
        out = run()
        self._meter.stop(started, self.flops_per_unit * frames.local_cost, self.rates.tower)
        return out

    def take_part(self) -> Optional[torch.Tensor]:
        """Where a rank whose encoder is not called would have called it: its (empty) outputs,
        for the caller to join to the graph, or None when nothing crosses this rank."""
        if not self.balanced():
            return None
        return self.outputs(None)

    def end(self) -> None:
        """The forward is over: a micro-step that crosses this rank must have reached it."""
        frames, done = self.current, self.done
        self.current = None
        if frames is not None and frames.balanced and not done:
            raise BalancerError(f"images mode: a training forward ended without reaching the encoder's exchange "
                                f"at {frames.where} (the other ranks of its step group are waiting)")

    def _timed_encode(self, rows, args, cost: int):
        started, wall = self._meter.start(), time.perf_counter()
        out = self._encode(rows, args)
        self._note("vision_tower_ms", (time.perf_counter() - wall) * 1e3)
        self._note("vision_tower_calls", 1)
        self.tower_calls += 1
        if self.flops_per_unit is not None and self.rates is not None:
            self._meter.stop(started, self.flops_per_unit * cost, self.rates.tower)
        return out

    def _landed(self, flight: _Flight) -> None:
        self._note("vision_wait_ms", flight.waited_s * 1e3)
        if self.rates is not None and flight.waited_s > 0:
            self.rates.link.add(flight.received_bytes, flight.waited_s)
        flight.on_backward = self._backward_done

    def _backward_done(self, flight: _Flight) -> None:
        if self.detail_backward is not None:
            self.detail_backward("vision_grad_exchange_ms", flight.backward_s * 1e3)
            self.detail_backward("vision_grad_wait_ms", flight.grad_waited_s * 1e3)

    def _note(self, name: str, value: float) -> None:
        if self.detail is not None:
            self.detail(name, value)
