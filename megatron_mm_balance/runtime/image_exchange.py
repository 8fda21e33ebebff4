"""Image-level vision balancing at run time: encode a micro-step's images on other ranks.

Per-image encoders compute every image on its own, so a rank may encode another
rank's images and send the embeddings back: the embeddings, the loss and every
gradient are those of the unbalanced run. Per micro-step:

1. :func:`gather_image_costs`: every data-parallel rank all-gathers the integer
   cost of each of its images (e.g. microseconds, or tokens^2 as LoongForge);
2. :class:`ImagePlan`: every rank runs
   :func:`megatron_mm_balance.solver.images.balance_images` on the same numbers and
   gets the same assignment (owner rank -> encoder rank per image);
3. :meth:`ImageExchange.to_encoders` sends the images to their encoder ranks, the
   encoder runs on what arrived, :meth:`ImageExchange.to_owners` sends the
   embeddings back, in the owner's image order. Both are autograd functions: in
   backward the embedding gradients travel to the encoder ranks (and image
   gradients back to their owners, when the images require them).

Images of one micro-step are one tensor ``[n_images, ...]`` per rank with the same
trailing shape on every rank (fixed-size tiles, as InternViT or CLIP crops);
embeddings likewise ``[n_images, ...]``. Transfers are point-to-point
(``isend``/``irecv``) inside ``group``, sizes known from the plan (nothing else is
exchanged). Knows nothing of Megatron; the glue that wires this into a model's
vision forward is separate.
"""
from __future__ import annotations

from dataclasses import dataclass

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
        owner = np.concatenate([np.full(len(c), r, dtype=np.int64)
                                for r, c in enumerate(costs_by_rank)] or [np.zeros(0, np.int64)])
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


def gather_image_costs(local_costs, group=None, device=None) -> list[np.ndarray]:
    """All-gather every rank's per-image integer costs (a 1-D sequence on each rank).
    ``device``: where the collective's tensors live (the group's backend decides: CPU for
    gloo, the rank's GPU for NCCL); CPU by default."""
    c = torch.as_tensor(np.asarray(local_costs, dtype=np.int64).reshape(-1)).to(device)
    world = dist.get_world_size(group)
    n = torch.tensor([c.numel()], dtype=torch.int64, device=c.device)
    counts = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(counts, n, group=group)
    width = max(int(x.item()) for x in counts)
    padded = torch.zeros(max(width, 1), dtype=torch.int64, device=c.device)
    padded[: c.numel()] = c
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [p[: int(k.item())].cpu().numpy().copy() for p, k in zip(parts, counts)]


def _route(x: torch.Tensor, send: dict, recv: dict, out_rows: int, group, ranks) -> torch.Tensor:
    """Rows ``x[send[p]]`` go to peer ``p``; rows from peer ``p`` land at ``recv[p]`` of
    the result (``out_rows`` rows). ``send[me]`` / ``recv[me]``: rows kept locally."""
    me = dist.get_rank(group)
    out = x.new_empty((out_rows, *x.shape[1:]))
    reqs, bufs = [], []
    for p in ranks:
        if p == me:
            continue
        if len(send.get(p, ())):
            reqs.append(dist.isend(x[send[p]].contiguous(), _global(group, p), group=group))
        if len(recv.get(p, ())):
            buf = x.new_empty((len(recv[p]), *x.shape[1:]))
            bufs.append((p, buf))
            reqs.append(dist.irecv(buf, _global(group, p), group=group))
    if len(send.get(me, ())):
        out[recv[me]] = x[send[me]]
    for r in reqs:
        r.wait()
    for p, buf in bufs:
        out[recv[p]] = buf
    return out


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


class ImageExchange:
    """The two autograd-aware moves of one micro-step's plan on this rank."""

    def __init__(self, plan: ImagePlan, group=None):
        self.plan, self.group = plan, group
        self.rank = dist.get_rank(group)
        self.ranks = list(range(plan.num_ranks))
        local, enc = plan.local(self.rank), plan.encoded(self.rank)
        pos_local = {int(g): i for i, g in enumerate(local)}
        pos_enc = {int(g): i for i, g in enumerate(enc)}
        # to the encoders: this rank sends its images by encoder, receives by owner
        self._send = {p: np.array([pos_local[int(g)] for g in local if plan.encoder[g] == p],
                                  dtype=np.int64) for p in self.ranks}
        self._recv = {p: np.array([pos_enc[int(g)] for g in enc if plan.owner[g] == p],
                                  dtype=np.int64) for p in self.ranks}
        self.num_local, self.num_encoded = len(local), len(enc)

    def to_encoders(self, images: torch.Tensor) -> torch.Tensor:
        """This rank's images ``[num_local, ...]`` -> the images it encodes ``[num_encoded, ...]``."""
        if images.shape[0] != self.num_local:
            raise ValueError(f"rank {self.rank} holds {self.num_local} images in the plan, "
                             f"got a tensor of {images.shape[0]}")
        return _Route.apply(images, (self._send, self._recv), (self._recv, self._send),
                            self.num_encoded, self.group, self.ranks)

    def to_owners(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Embeddings of the images this rank encoded -> those of its own images, in order."""
        if embeddings.shape[0] != self.num_encoded:
            raise ValueError(f"rank {self.rank} encodes {self.num_encoded} images in the plan, "
                             f"got {embeddings.shape[0]} embeddings")
        return _Route.apply(embeddings, (self._recv, self._send), (self._send, self._recv),
                            self.num_local, self.group, self.ranks)


def balanced_encode(encoder, images: torch.Tensor, costs, group=None) -> torch.Tensor:
    """``encoder(images)`` computed with this micro-step's images balanced over ``group``:
    gather the costs, plan, send, encode, send back. Collective: every rank calls it."""
    plan = ImagePlan.from_costs(gather_image_costs(costs, group))
    ex = ImageExchange(plan, group)
    return ex.to_owners(encoder(ex.to_encoders(images)))
