"""Unit-level vision balancing at run time: encode a micro-step's images (or frames) on
other ranks.

Encoders that compute every image (or frame) on its own let a rank encode another
rank's units and send the outputs back: the outputs, the loss and every gradient are
those of the unbalanced run. Per micro-step:

1. every data-parallel rank all-gathers the integer cost of each of its units
   (:func:`gather_image_costs`, or :func:`gather_unit_table` for several integers per
   unit, e.g. a frame's cost and size);
2. every rank plans on the same numbers and gets the same assignment (owner rank ->
   encoder rank per unit; :class:`ImagePlan` for images);
3. :meth:`UnitExchange.to_encoders` sends the units' input rows to their encoder ranks,
   the encoder runs on what arrived, :meth:`UnitExchange.to_owners` sends the output
   rows back, in the owner's unit order. Both are autograd functions: in backward the
   output gradients travel to the encoder ranks, and input gradients back to their
   owners (when the inputs require them).

   :meth:`UnitExchange.encode_overlapped` does the same with the transfers in flight while the
   encoder runs on the units that stay (each route posted, the encoder called, then awaited;
   in backward the reverse), for a caller that can encode its units in groups.

A unit is a contiguous range of rows of a rank's input tensor ``[rows, ...]`` (and of
its output tensor): ``in_rows[u]`` input rows and ``out_rows[u]`` output rows, which may
differ per unit (a Qwen-VL frame of ``h x w`` patches: ``h*w`` pixel rows in,
``h*w/merge^2`` embedding rows out). Fixed-size images (tiles of InternViT or CLIP
crops, ``[n_images, ...]``) are units of one row each: :class:`ImageExchange`, the same
mechanism. Transfers are point-to-point (``batch_isend_irecv``: every send and receive
of a move posted at once, so no order between peers can deadlock) inside ``group``,
sizes known from the plan (nothing else is exchanged). Knows nothing of Megatron; the
glue that wires this into a model's vision forward is separate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..solver.images import balance_images


@dataclass(frozen=True)
class ImagePlan:
    """``owner[g]``, ``encoder[g]``: the rank holding and the rank encoding global image
    ``g`` (global order: rank 0's images in its order, then rank 1's, ...)."""

    owner: np.ndarray
    encoder: np.ndarray
    num_ranks: int

    @classmethod
    def from_costs(cls, costs_by_rank) -> "ImagePlan":
        """The balanced plan for each rank's image costs (integers, per image)."""
        owner = owners_of([len(c) for c in costs_by_rank])
        cost = np.concatenate([np.asarray(c, dtype=np.int64).reshape(-1)
                               for c in costs_by_rank] or [np.zeros(0, np.int64)])
        return cls(owner, balance_images(owner, cost, len(costs_by_rank)), len(costs_by_rank))

    def local(self, rank: int) -> np.ndarray:
        """Global indices of the images rank ``rank`` holds, in its order."""
        return np.flatnonzero(self.owner == rank)

    def encoded(self, rank: int) -> np.ndarray:
        """Global indices of the images rank ``rank`` encodes, in global order."""
        return np.flatnonzero(self.encoder == rank)

    def moved(self) -> int:
        return int((self.owner != self.encoder).sum())


def owners_of(counts: Sequence[int]) -> np.ndarray:
    """The owner rank of every unit in global order, from each rank's unit count."""
    return np.repeat(np.arange(len(counts), dtype=np.int64), np.asarray(counts, dtype=np.int64))


def gather_image_costs(local_costs, group=None, device=None) -> list[np.ndarray]:
    """All-gather every rank's per-image integer costs (a 1-D sequence on each rank).
    ``device``: where the collective's tensors live (the group's backend decides: CPU for
    gloo, the rank's GPU for NCCL); CPU by default."""
    table = gather_unit_table(np.asarray(local_costs, dtype=np.int64).reshape(-1, 1), (), group,
                              device=device, stop_when_empty=False)
    return [table.columns[table.owner == r, 0].copy() for r in range(table.num_ranks)]


@dataclass(frozen=True)
class UnitTable:
    """What every rank of a group learns about one micro-step's units, identical on all.

    ``owner[u]``: the rank holding unit ``u`` (global order: rank 0's units in its order,
    then rank 1's, ...); ``columns[u]``: the owner's integers for it (e.g. cost, height,
    width); ``headers[r]``: rank ``r``'s own integers for the micro-step (e.g. the input
    row width and dtype, which a rank holding no unit cannot know)."""

    owner: np.ndarray
    columns: np.ndarray
    headers: np.ndarray

    @property
    def num_ranks(self) -> int:
        return int(self.headers.shape[0])

    @property
    def num_units(self) -> int:
        return int(self.owner.size)


def gather_unit_table(columns: np.ndarray, header: Sequence[int], group=None, device=None, *,
                      stop_when_empty: bool = True, rows_in_first: int = 0) -> Optional[UnitTable]:
    """All-gather ``columns`` (``[units, k]`` int64 on each rank, ``k`` the same everywhere)
    and ``header`` (the same length everywhere).

    The first collective carries each rank's unit count, its header and its first
    ``rows_in_first`` rows (zero-padded to that many); a second one, the rows beyond, padded
    to the largest remainder, runs only where some rank holds more (every rank knows from the
    counts, so all run it or none). A caller that passes the most units a rank has held so far
    (the same on every rank: read from the tables) pays one collective per micro-step, and
    one host copy of its result (on NCCL a synchronisation with the GPU). With
    ``stop_when_empty``, a micro-step with no unit on any rank gives None after the first.
    ``device``: where the collectives' tensors live (CPU for gloo, the GPU for NCCL)."""
    columns = np.asarray(columns, dtype=np.int64)
    if columns.ndim != 2 or columns.shape[1] < 1:
        raise ValueError(f"unit columns must be [units, k >= 1], got shape {columns.shape}")
    if isinstance(rows_in_first, bool) or not isinstance(rows_in_first, (int, np.integer)) or rows_in_first < 0:
        raise ValueError(f"rows_in_first must be a non-negative integer, got {rows_in_first!r}")
    world = dist.get_world_size(group)
    n, k, head_len = columns.shape[0], columns.shape[1], 1 + len(header)
    rows_in_first = int(rows_in_first)
    first_rows = min(n, rows_in_first)
    first = np.zeros(head_len + rows_in_first * k, dtype=np.int64)
    first[:head_len] = [n, *header]
    first[head_len: head_len + first_rows * k] = columns[:first_rows].reshape(-1)
    first_t = torch.from_numpy(first).to(device)
    firsts = [torch.empty_like(first_t) for _ in range(world)]
    dist.all_gather(firsts, first_t, group=group)
    gathered = torch.stack(firsts).cpu().numpy()
    heads_np, counts = gathered[:, 1:head_len], gathered[:, 0]
    if int(counts.sum()) == 0 and stop_when_empty:
        return None
    in_first = np.minimum(counts, rows_in_first)
    pieces = [gathered[r, head_len: head_len + int(in_first[r]) * k].reshape(-1, k) for r in range(world)]
    rest = int((counts - in_first).max())
    if rest > 0:
        padded = torch.zeros((rest, k), dtype=torch.int64, device=device)
        padded[: n - first_rows] = torch.from_numpy(columns[first_rows:]).to(device)
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        more = torch.stack(parts).cpu().numpy()
        pieces = [np.concatenate([pieces[r], more[r, : int(counts[r] - in_first[r])]]) for r in range(world)]
    return UnitTable(owners_of(counts), np.concatenate(pieces, axis=0), heads_np)


def _row_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated ``arange(s, s + n)`` of every (start, length) pair, vectorised."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(np.asarray(starts, dtype=np.int64) - np.cumsum(lengths) + lengths, lengths)
    return offsets + np.arange(total, dtype=np.int64)


def _routes(units_here: np.ndarray, rows: np.ndarray, peer_of: np.ndarray, num_ranks: int) -> Dict[int, np.ndarray]:
    """Rows of a tensor that holds ``units_here`` (in that order, ``rows[u]`` each) grouped
    by ``peer_of[u]``, every group in the tensor's order (which is global order)."""
    lengths = rows[units_here]
    starts = np.cumsum(lengths) - lengths
    peers = peer_of[units_here]
    return {p: _row_ranges(starts[peers == p], lengths[peers == p]) for p in range(num_ranks)}


def _route(x: torch.Tensor, send: dict, recv: dict, out_rows: int, group, ranks) -> torch.Tensor:
    """Rows ``x[send[p]]`` go to peer ``p``; rows from peer ``p`` land at ``recv[p]`` of
    the result (``out_rows`` rows). ``send[me]`` / ``recv[me]``: rows kept locally."""
    return _complete(_post(x, send, recv, out_rows, group, ranks))


@dataclass
class _Posted:
    """A route whose transfers are in flight: the result being filled, the requests, the
    receive buffers (by peer) and the send tensors (alive until the requests complete)."""

    out: torch.Tensor
    reqs: list
    bufs: list
    ops: list
    recv: dict


def _post(x: torch.Tensor, send: dict, recv: dict, out_rows: int, group, ranks, *, zeros: bool = False) -> _Posted:
    """Posts :func:`_route`'s transfers (every send and receive at once) and copies the rows
    kept locally; :func:`_complete` waits and places what arrived. ``zeros``: the result's
    rows nothing lands on are zero (else they must all be covered)."""
    me = dist.get_rank(group)
    out = (x.new_zeros if zeros else x.new_empty)((out_rows, *x.shape[1:]))
    ops, bufs = [], []
    for p in ranks:
        if p == me:
            continue
        if len(send.get(p, ())):
            rows = torch.as_tensor(send[p], device=x.device)
            ops.append(dist.P2POp(dist.isend, x.index_select(0, rows).contiguous(), _global(group, p), group))
        if len(recv.get(p, ())):
            buf = x.new_empty((len(recv[p]), *x.shape[1:]))
            bufs.append((p, buf))
            ops.append(dist.P2POp(dist.irecv, buf, _global(group, p), group))
    reqs = dist.batch_isend_irecv(ops) if ops else []
    if len(send.get(me, ())):
        out.index_copy_(0, torch.as_tensor(recv[me], device=x.device),
                        x.index_select(0, torch.as_tensor(send[me], device=x.device)))
    return _Posted(out, reqs, bufs, ops, recv)


def _complete(posted: _Posted) -> torch.Tensor:
    for r in posted.reqs:
        r.wait()
    for p, buf in posted.bufs:
        posted.out.index_copy_(0, torch.as_tensor(posted.recv[p], device=buf.device), buf)
    return posted.out


def _global(group, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd, bwd, out_rows, group, ranks):
        ctx.bwd, ctx.rows, ctx.group, ctx.ranks = bwd, x.shape[0], group, ranks
        return _route(x, *fwd, out_rows, group, ranks)

    @staticmethod
    def backward(ctx, grad):
        return _route(grad.contiguous(), *ctx.bwd, ctx.rows, ctx.group, ctx.ranks), None, None, None, None, None


class _Flight:
    """One route between peers (no rows kept locally) whose transfers run while the caller
    computes: :class:`_Launch` posts it, :class:`_Land` waits for it; in backward the
    gradients travel the other way, posted by ``_Land``'s backward and awaited by
    ``_Launch``'s, so the engine may run other backward work in between."""

    def __init__(self, send: dict, recv: dict, out_rows: int, group, ranks):
        self.send, self.recv, self.out_rows, self.group, self.ranks = send, recv, int(out_rows), group, ranks
        self.rows = 0
        self._posted: Optional[_Posted] = None

    def launch(self, x: torch.Tensor) -> None:
        self.rows = x.shape[0]
        self._posted = _post(x, self.send, self.recv, self.out_rows, self.group, self.ranks)

    def launch_backward(self, grad: torch.Tensor) -> None:
        """The gradients of the rows that arrived go back; those of the rows sent land (the
        rows that stayed get zero here: their gradients reach them by another path)."""
        self._posted = _post(grad.contiguous(), self.recv, self.send, self.rows, self.group, self.ranks,
                             zeros=True)

    def land(self) -> torch.Tensor:
        posted, self._posted = self._posted, None
        return _complete(posted)


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
        return ctx.flight.land(), None


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
    """``out`` with empty ``rows`` joined to its graph (``0 * sum``, no value changes): a rank
    that receives no unit still meets its flight's backward, where its peers do."""
    if rows.requires_grad and rows.shape[0] == 0:
        return out + (rows.sum() * 0).to(out.dtype)
    return out


def kept_before_arrivals(kept_cost, hide) -> int:
    """How many of a rank's kept units (their costs in its order) to encode while the units it
    receives are on the way: the shortest prefix whose cost reaches ``hide`` (the received
    units' transfer, in the same unit); the rest are encoded while the outputs travel back."""
    cost = np.cumsum(np.asarray(kept_cost, dtype=np.int64))
    if hide <= 0 or cost.size == 0:
        return 0
    return int(min(cost.size, np.searchsorted(cost, hide) + 1))


class UnitExchange:
    """The two autograd-aware moves of one micro-step's assignment on this rank.

    ``owner[u]``, ``encoder[u]``: the rank holding and the rank encoding unit ``u`` (global
    order: rank 0's units, then rank 1's, ...; the same arrays on every rank);
    ``in_rows[u]`` / ``out_rows[u]``: its rows in the inputs and in the outputs (default one
    each). This rank's input tensor is its units' rows in its order; the tensor it encodes
    holds the rows of the units it encodes in global order, as does what it returns."""

    def __init__(self, owner, encoder, in_rows=None, out_rows=None, group=None, num_ranks: Optional[int] = None):
        owner = np.asarray(owner, dtype=np.int64)
        encoder = np.asarray(encoder, dtype=np.int64)
        ones = np.ones(owner.size, dtype=np.int64)
        in_rows = ones if in_rows is None else np.asarray(in_rows, dtype=np.int64)
        out_rows = ones if out_rows is None else np.asarray(out_rows, dtype=np.int64)
        if not (owner.shape == encoder.shape == in_rows.shape == out_rows.shape):
            raise ValueError("owner, encoder, in_rows and out_rows need one entry per unit")
        self.group = group
        self.owner, self.encoder, self.in_rows, self.out_rows = owner, encoder, in_rows, out_rows
        self.rank = dist.get_rank(group)
        self.num_ranks = int(num_ranks if num_ranks is not None else dist.get_world_size(group))
        self.ranks = list(range(self.num_ranks))
        local, enc = np.flatnonzero(owner == self.rank), np.flatnonzero(encoder == self.rank)
        self.local_units, self.encoded_units = local, enc
        # to the encoders: this rank sends its units' input rows by encoder, receives by owner
        self._send_in = _routes(local, in_rows, encoder, self.num_ranks)
        self._recv_in = _routes(enc, in_rows, owner, self.num_ranks)
        # back to the owners: sends the encoded output rows by owner, receives by encoder
        self._send_out = _routes(enc, out_rows, owner, self.num_ranks)
        self._recv_out = _routes(local, out_rows, encoder, self.num_ranks)
        self.local_in_rows, self.encoded_in_rows = int(in_rows[local].sum()), int(in_rows[enc].sum())
        self.local_out_rows, self.encoded_out_rows = int(out_rows[local].sum()), int(out_rows[enc].sum())

    def to_encoders(self, inputs: torch.Tensor) -> torch.Tensor:
        """This rank's input rows ``[local_in_rows, ...]`` -> the rows it encodes ``[encoded_in_rows, ...]``."""
        if inputs.shape[0] != self.local_in_rows:
            raise ValueError(f"rank {self.rank} holds {self.local_in_rows} input rows in the plan, "
                             f"got a tensor of {inputs.shape[0]}")
        return _Route.apply(inputs, (self._send_in, self._recv_in), (self._recv_in, self._send_in),
                            self.encoded_in_rows, self.group, self.ranks)

    def to_owners(self, outputs: torch.Tensor) -> torch.Tensor:
        """Output rows of the units this rank encoded -> those of its own units, in its order."""
        if outputs.shape[0] != self.encoded_out_rows:
            raise ValueError(f"rank {self.rank} encodes {self.encoded_out_rows} output rows in the plan, "
                             f"got {outputs.shape[0]}")
        return _Route.apply(outputs, (self._send_out, self._recv_out), (self._recv_out, self._send_out),
                            self.local_out_rows, self.group, self.ranks)


    def encode_overlapped(self, inputs: torch.Tensor, encode, first_kept: int = 0, timer=None) -> torch.Tensor:
        """What ``to_owners(encode(to_encoders(inputs), encoded_units))`` returns, with the
        transfers running while the encoder works:

        1. this rank's moved units' input rows leave, the units it receives are posted;
        2. it encodes its first ``first_kept`` kept units (:func:`kept_before_arrivals`);
        3. it waits for what it receives (``timer``: ``(start, stop)`` around that wait, the
           time the overlap did not hide) and encodes it;
        4. those outputs leave for their owners, the outputs of its own moved units are posted;
        5. it encodes the rest of its kept units, then waits for its outputs.

        In backward the engine meets the flights in reverse: the output gradients leave before
        the last kept units' backward runs, and are awaited after it. ``encode(rows, units)``:
        the encoder's output rows of ``units`` (global indices, in global order) from their
        input rows, called once per non-empty group and always for the received units (empty
        or not: it must then return an empty tensor with gradients where backward needs them).
        Returns this rank's output rows in its own order. Exact: every unit is encoded on its
        own, by the rank the plan names."""
        if inputs.shape[0] != self.local_in_rows:
            raise ValueError(f"rank {self.rank} holds {self.local_in_rows} input rows in the plan, "
                             f"got a tensor of {inputs.shape[0]}")
        me, local = self.rank, self.local_units
        stays = self.encoder[local] == me
        kept, away = local[stays], local[~stays]
        received = self.encoded_units[self.owner[self.encoded_units] != me]
        peers = lambda routes: {p: rows for p, rows in routes.items() if p != me}  # noqa: E731
        pixels = _Flight(peers(_routes(local, self.in_rows, self.encoder, self.num_ranks)),
                         peers(_routes(received, self.in_rows, self.owner, self.num_ranks)),
                         self.in_rows[received].sum(), self.group, self.ranks)
        token = _Launch.apply(inputs, pixels)
        starts = np.cumsum(self.in_rows[local]) - self.in_rows[local]
        rows_of = lambda mask: inputs.index_select(0, torch.as_tensor(  # noqa: E731
            _row_ranges(starts[mask], self.in_rows[local][mask]), device=inputs.device))
        first = np.zeros(local.size, dtype=bool)
        first[np.flatnonzero(stays)[:max(0, int(first_kept))]] = True
        pieces = []                                   # (units, outputs), concatenated below
        if first.any():
            pieces.append((local[first], encode(rows_of(first), local[first])))
        started = timer[0]() if timer else None
        arrived = _Land.apply(token, pixels)
        if timer:
            timer[1](started)
        encoded = _in_graph(encode(arrived, received), arrived)
        outputs = _Flight(peers(_routes(received, self.out_rows, self.owner, self.num_ranks)),
                          peers(_routes(away, self.out_rows, self.encoder, self.num_ranks)),
                          self.out_rows[away].sum(), self.group, self.ranks)
        token = _Launch.apply(encoded, outputs)
        rest = stays & ~first
        if rest.any():
            pieces.append((local[rest], encode(rows_of(rest), local[rest])))
        pieces.append((away, _Land.apply(token, outputs)))
        return self._in_owner_order(pieces)

    def _in_owner_order(self, pieces) -> torch.Tensor:
        """The pieces' output rows (each ``(units, rows)``, units in global order) as one tensor
        in this rank's unit order."""
        units = np.concatenate([u for u, _ in pieces])
        lengths = self.out_rows[units]
        starts = np.cumsum(lengths) - lengths
        order = np.argsort(units, kind="stable")        # this rank's units are in global order
        joined = torch.cat([rows for _, rows in pieces])
        return joined.index_select(0, torch.as_tensor(_row_ranges(starts[order], lengths[order]),
                                                      device=joined.device))


class ImageExchange(UnitExchange):
    """:class:`UnitExchange` of fixed-size images: ``[n_images, ...]``, one row per image."""

    def __init__(self, plan: ImagePlan, group=None):
        super().__init__(plan.owner, plan.encoder, group=group, num_ranks=plan.num_ranks)
        self.plan = plan
        self.num_local, self.num_encoded = self.local_in_rows, self.encoded_in_rows

    def to_encoders(self, images: torch.Tensor) -> torch.Tensor:
        """This rank's images ``[num_local, ...]`` -> the images it encodes ``[num_encoded, ...]``."""
        if images.shape[0] != self.num_local:
            raise ValueError(f"rank {self.rank} holds {self.num_local} images in the plan, "
                             f"got a tensor of {images.shape[0]}")
        return super().to_encoders(images)

    def to_owners(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Embeddings of the images this rank encoded -> those of its own images, in order."""
        if embeddings.shape[0] != self.num_encoded:
            raise ValueError(f"rank {self.rank} encodes {self.num_encoded} images in the plan, "
                             f"got {embeddings.shape[0]} embeddings")
        return super().to_owners(embeddings)


def collective_device(group, like: torch.Tensor) -> torch.device:
    """Where a collective's tensors must live on ``group``: ``like``'s device on an NCCL
    group (NCCL takes no host tensors), the host otherwise (gloo)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return like.device
    return torch.device("cpu")


def balanced_encode(encoder, images: torch.Tensor, costs, group=None) -> torch.Tensor:
    """``encoder(images)`` computed with this micro-step's images balanced over ``group``:
    gather the costs (on the device :func:`collective_device` gives the group's backend),
    plan, send, encode, send back. Collective: every rank calls it."""
    plan = ImagePlan.from_costs(gather_image_costs(costs, group, device=collective_device(group, images)))
    ex = ImageExchange(plan, group)
    return ex.to_owners(encoder(ex.to_encoders(images)))
