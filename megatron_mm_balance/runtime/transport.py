"""Moving data between the ranks of one exchange group: the transport under the exchange.

:class:`PackTransport` is everything of the exchange that touches the network or
a device, and nothing that decides what moves: the fixed-size all-gather of the
agreement records and costs, the point-to-point transfer of a pack (gloo
``isend``/``irecv`` in the :mod:`.wire` format), and placing a received (or
local) pack on the target device (through :class:`~.device.CudaMover`'s side
stream). Every wait is bounded by ``timeout``; a failure names the global batch,
the micro-step and the peer, with what the :class:`~.groups.ProgressBoard` knows
about the peers.

A moved pack is three kinds of messages from its owner to its computer, matched
in order: a 3-int64 record (header bytes, data bytes, tensor count), the pickled
header, then each non-empty tensor's bytes.
"""
from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import wire
from .device import DEFAULT_PINNED_BYTES, CudaMover, PinnedPool, cuda_api
from .errors import PeerFailure, batch_name

#: bytes of the per-pack record (3 int64) that precedes every moved pack
PACK_RECORD_BYTES = 24


@dataclass
class Item:
    """One delivered micro-batch, plus what the consumer must wait on."""

    pack: object
    event: object = None
    buffers: tuple = ()
    #: on the global batch's last micro-batch: the engine's plan of the batch, from which the
    #: consumer completes the batch's statistics (and takes the source state paired with it)
    batch: object = None
    num_microbatches: int = 0          # the global batch's G, as the thread ran it
    #: what ``describe`` read from the pack while it was on the host (None without one)
    info: object = None
    #: False: exchanged but still where it arrived (a received pack as its ``(header, data)``
    #: host buffers in ``staged``, a local one as drawn); :meth:`PackTransport.placed`
    #: puts it on the target device when it is delivered
    placed: bool = True
    staged: tuple = ()
    #: images mode: the micro-step's units on this rank (``frame_ahead.StepFrames``), made by
    #: the exchange thread with the pack
    frames: object = None

    @property
    def last(self) -> bool:
        return self.batch is not None


@dataclass
class PendingSend:
    """A posted send: wait on ``works``; ``buffers`` stay alive until then."""

    peer: int
    works: list
    buffers: tuple
    nbytes: int


class PackTransport:
    """Collectives and point-to-point transfers on one exchange group (see module docstring).

    ``ranks``: the group's global ranks in group order; ``me``: this rank's index in
    them. ``device``: where delivered packs go (None: each tensor keeps its device
    type). ``board``: the progress board that names the peer behind a failure (or None).
    ``name_batch``: how errors name a global batch (default :func:`~.errors.batch_name`).
    """

    def __init__(self, group, ranks: Sequence[int], me: int, *, timeout: float,
                 device: Optional[torch.device] = None, board=None,
                 name_batch: Callable[[int], str] = batch_name, pinned_bytes: int = DEFAULT_PINNED_BYTES,
                 describe: Optional[Callable] = None):
        self.group = group
        self.ranks = list(ranks)
        self.me = me
        self.world = len(self.ranks)
        self.timeout = float(timeout)
        self.device = device
        self.board = board
        self.name_batch = name_batch
        #: ``pack -> object`` read from each delivered pack on the host, before it goes to the
        #: device (what the timing hooks record, so they never read a device tensor)
        self.describe = describe
        self.cuda_mover = CudaMover(device) if device is not None and device.type == "cuda" else None
        #: pinned host memory for packs on a GPU job (received ones, and local ones staged for
        #: the device), capped and reused; None without CUDA or with ``pinned_bytes=0``
        self.pool = PinnedPool(pinned_bytes) if pinned_bytes > 0 and cuda_api().is_available() else None

    @property
    def my_rank(self) -> int:
        return self.ranks[self.me]

    # -- bounded waits ------------------------------------------------------------
    def wait(self, work, what: str, gb: int, peers=(), step=None) -> None:
        """Wait for ``work`` at most ``timeout``; on failure raise :class:`PeerFailure`
        naming the global batch, the micro-step and the peers, and post it on the board."""
        t0 = time.monotonic()
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as e:
            raise self._failure(e, what, gb, peers, step, time.monotonic() - t0) from e

    def post(self, start: Callable[[], object], what: str, gb: int, peers=(), step=None):
        """``start()``: post an asynchronous operation and return its work. A peer that is
        already gone makes gloo refuse the post itself (\"Connection closed by peer\"), not
        the wait; that too is a :class:`PeerFailure` naming the peer and the micro-step."""
        try:
            return start()
        except Exception as e:
            raise self._failure(e, what, gb, peers, step, 0.0) from e

    def _failure(self, e: Exception, what: str, gb: int, peers, step, waited: float) -> PeerFailure:
        where = self.name_batch(gb) + (f", micro-step {step}" if step is not None else "")
        peer_txt = (" with rank " + ", ".join(str(p) for p in peers)) if peers else ""
        me = self.my_rank
        diag = self.board.diagnose(me, gb) if self.board else ""
        first = (str(e).splitlines() or [""])[0][:300]
        msg = (f"rank {me}: {what}{peer_txt} failed at {where} after "
               f"{waited:.1f}s ({type(e).__name__}: {first}); {diag}")
        if self.board:                               # lets peers name the root cause
            self.board.post_error(me, f"{what}{peer_txt} failed at {where}")
        return PeerFailure(msg, global_batch=gb, peers=peers)

    # -- collectives ----------------------------------------------------------------
    def all_gather(self, t: torch.Tensor, what: str, gb: int) -> torch.Tensor:
        """``[world, t.numel()]``: every rank's ``t`` (same size on every rank)."""
        out = torch.empty(self.world * t.numel(), dtype=t.dtype)
        outs = list(out.view(self.world, -1).unbind(0))
        work = self.post(lambda: dist.all_gather(outs, t, group=self.group, async_op=True), what, gb)
        self.wait(work, what, gb)
        return out.view(self.world, -1)

    # -- point to point ---------------------------------------------------------------
    def send(self, pack, peer: int, gb: int, step: int) -> PendingSend:
        """Post the messages of ``pack`` to group rank ``peer`` at micro-step ``step`` of
        global batch ``gb`` (see module docstring)."""
        sp = wire.split(pack)
        parts = [p.cpu() if p.is_cuda else p for p in sp.parts if p.numel()]
        header = torch.frombuffer(bytearray(sp.header), dtype=torch.uint8)
        meta = torch.tensor([len(sp.header), sp.data_nbytes, len(parts)], dtype=torch.int64)
        dst = self.ranks[peer]
        works = [self.post(lambda t=t: dist.isend(t, dst=dst, group=self.group), "sending a pack",
                           gb, (dst,), step)
                 for t in [meta, header] + parts]
        nbytes = PACK_RECORD_BYTES + len(sp.header) + sum(p.numel() for p in parts)
        return PendingSend(dst, works, (meta, header, parts), nbytes)

    def finish(self, pending: PendingSend, gb: int, step: int) -> None:
        for w in pending.works:
            self.wait(w, "sending a pack", gb, (pending.peer,), step)

    def receive(self, peer: int, gb: int, step: int, *, place: bool = True):
        """``(item, nbytes)``: the pack group rank ``peer`` sends at micro-step ``step``,
        placed on the target device (``place=False``: left in its host buffers, see
        :meth:`placed`)."""
        src = self.ranks[peer]

        def recv(t, what):
            work = self.post(lambda: dist.irecv(t, src=src, group=self.group), what, gb, (src,), step)
            self.wait(work, what, gb, (src,), step)

        meta = torch.empty(3, dtype=torch.int64)
        recv(meta, "receiving a pack record")
        hlen, nbytes, nparts = (int(x) for x in meta)
        if hlen <= 0 or nbytes < 0:
            raise PeerFailure(f"rank {self.my_rank}: corrupt pack record {meta.tolist()} from "
                              f"rank {src} at {self.name_batch(gb)}, micro-step {step}",
                              global_batch=gb, peers=(src,))
        raw = torch.empty(hlen, dtype=torch.uint8)
        recv(raw, "receiving a pack header")
        header = wire.read_header(raw)
        refs = [r for r in wire.refs_of(header) if r.nbytes]
        if len(refs) != nparts or (refs and refs[-1].offset + refs[-1].nbytes > nbytes):
            raise PeerFailure(f"rank {self.my_rank}: pack header from rank {src} does not match "
                              f"its record at {self.name_batch(gb)}, micro-step {step}",
                              global_batch=gb, peers=(src,))
        data = self.host_buffer(nbytes)
        works = [self.post(lambda r=r: dist.irecv(data[r.offset: r.offset + r.nbytes], src=src,
                                                  group=self.group),
                           "receiving a pack", gb, (src,), step)
                 for r in refs]
        for w in works:
            self.wait(w, "receiving a pack", gb, (src,), step)
        item = self.place(header, data) if place else Item(None, placed=False, staged=(header, data))
        return item, PACK_RECORD_BYTES + hlen + sum(r.nbytes for r in refs)

    # -- device placement ----------------------------------------------------------------
    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Host memory for a pack's bytes: from the pinned pool on a GPU job (pageable when it
        is full), else a new pageable buffer."""
        if self.pool is not None:
            return self.pool.take(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    def local(self, pack, *, place: bool = True) -> Item:
        """A pack this rank drew and computes itself, on the target device (``place=False``:
        as drawn, see :meth:`placed`). On the host it stays as drawn (the source's pinned
        memory with it); to a GPU its tensors go straight from their pinned memory when they
        all have some, else through one pinned buffer of the pool (one host copy)."""
        if not place:
            return Item(pack, placed=False)
        info = self._info(pack)
        if self.device is None or _all_on(pack, self.device):
            return Item(pack, info=info)
        if self.device.type == "cuda":
            direct = self._pinned_parts(pack)
            if direct is not None:
                direct.info = info
                return direct
        header, data = wire.encode(pack, alloc=self.host_buffer)
        return self.place(header, data, info=info)

    def _info(self, pack):
        return self.describe(pack) if self.describe is not None else None

    def _pinned_parts(self, pack):
        """``pack`` on the device copied tensor by tensor from the source's pinned memory
        (None unless every tensor is on the host, pinned and needs no reshaping copy)."""
        api = cuda_api()
        sp = wire.split(pack)
        if not sp.parts or not all(p.device.type == "cpu" and api.is_pinned(p) for p in sp.parts):
            return None
        header = pickle.loads(sp.header)
        refs = wire.refs_of(header)
        mover = self._cuda()
        dev, event = mover.parts_to_device(sp.parts, [r.offset for r in refs], sp.data_nbytes)
        if self.pool is not None:                  # the source's buffers live until the copy is done
            self.pool.release_after(dev, event, keep=sp.parts)
        return Item(wire.decode(header, lambda ref: dev), event, (dev,))

    def placed(self, item: Item) -> Item:
        """``item`` on the target device: what :meth:`receive` or :meth:`local` return, placed
        now when they were asked not to place it (a whole global batch exchanged ahead holds its
        packs on the host and moves each to the device only when it is delivered)."""
        if item.placed:
            return item
        out = self.place(*item.staged) if item.staged else self.local(item.pack)
        out.batch, out.num_microbatches, out.frames = item.batch, item.num_microbatches, item.frames
        return out

    def place(self, header, data, info=None) -> Item:
        """Decode a host data buffer onto the target device(s) (``info``: the pack's
        description when the caller has it; else read here from the host bytes)."""
        if info is None and self.describe is not None:
            info = self._info(wire.decode(header, lambda ref: data))
        item = self._place(header, data)
        item.info = info
        return item

    def _place(self, header, data) -> Item:
        if self.device is not None:
            target_cuda = self.device.type == "cuda"
        else:                                        # keep each tensor's device type
            target_cuda = "cuda" in wire.device_types(header)
        if not target_cuda:
            return Item(wire.decode(header, lambda ref: data))
        dev, event = self._cuda().to_device(data)
        if self.pool is not None:
            self.pool.release_after(data, event)   # reusable once the copy is done
        if self.device is not None:
            return Item(wire.decode(header, lambda ref: dev), event, (dev,))
        return Item(wire.decode(header, lambda ref: dev if ref.device_type == "cuda" else data),
                    event, (dev,))

    def hand_over(self, item: Item) -> None:
        """Consumer side, as ``item`` is delivered: its compute stream waits for the item's
        copy (and the allocator learns of the use); host buffers given back since the last
        delivery wait for what that stream has been given so far (:meth:`PinnedPool.fence`)."""
        if item.event is not None:
            self.cuda_mover.ready(item.event, item.buffers)
        if self.pool is not None:
            device = self.cuda_mover.device if self.cuda_mover is not None else None
            self.pool.fence(cuda_api().current_stream(device))

    def _cuda(self) -> CudaMover:
        if self.cuda_mover is None:
            if not cuda_api().is_available():
                raise RuntimeError("a peer sent CUDA tensors but CUDA is not available on this rank; "
                                   "pass device='cpu' to receive them on the host")
            # the thread's current device: the iterator's, set first thing in the thread
            self.cuda_mover = CudaMover(torch.device("cuda", cuda_api().current_device()))
        return self.cuda_mover


def _all_on(pack, device: torch.device) -> bool:
    return all(d.type == device.type and (device.index is None or d.index == device.index)
               for d in wire.tensor_devices(pack))
