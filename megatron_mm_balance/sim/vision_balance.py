"""Image-level vision balancing on top of pack placement (``redistribute-images`` and
``redistribute-frames``).

Per-image encoders (CLIP/SigLIP/InternViT tiles, Qwen-VL images) compute every
image on its own, so the images of one micro-step may be encoded on any
data-parallel rank and the embeddings sent back to the rank that computes the
pack: the result is the same. The packs are placed for the language phase only
(:func:`megatron_mm_balance.solver.placement.plan_placement` on the language-model
cost, so the micro-step's language maxima sit at their sorted-grouping optimum),
and every micro-step's images are then spread over the ranks for the encoder.

**Image assignment**, per micro-step (:func:`megatron_mm_balance.solver.images.balance_images`
on integer microseconds, what the runtime runs on the gathered image costs): the target load is ``T = max(mean rank vision time,
heaviest image)``; every rank keeps its own images, heaviest first, while its load
stays within ``T``; the rest (the *surplus*), heaviest first, go one by one to the
rank with the lightest load at that moment (longest processing time first; ties
by rank). A rank's vision time is
``a * n + b * n^2`` summed over the images it encodes, plus ``f`` (the per-pack
constant of the timing model) if it encodes any.

``redistribute-frames`` plans the same with
:func:`megatron_mm_balance.solver.frames.plan_frames` instead (:data:`VISION_PLANNERS`): the
cost of a unit is its vision forward and backward, the embedding and its gradient over the
link are the transfer time charged to the rank that encodes it, and no receiving rank ends
above the most image tokens any rank held. On the ``native-res`` mixture every "image" is
one frame (a temporal patch of a Qwen-VL grid, :mod:`megatron_mm_balance.data.native_res`),
so a video's frames are units of their own.

**Traffic** (the timing model's ``exchange`` section; one link per rank):

* images to the encoder rank: ``bytes_per_image_token`` per token, sent from the
  pack's source rank with the pack exchange of that micro-step, so it hides behind
  the previous micro-step exactly as the pack exchange does (overlapped timeline);
* embeddings back to the pack's rank after the encoder forward, and their
  gradients to the encoder rank after the language backward:
  ``bytes_per_embedding_token`` per token each way. Both are all-to-alls between
  two phases that need their result: nothing hides them. The forward one starts
  when the slowest rank has encoded (every receiver waits for every encoder) and
  takes the slowest rank's ``latency + max(bytes in, bytes out) / link``; the
  backward one likewise after the slowest language backward. The images
  themselves need no gradient, and the encoder keeps its activations, so backward
  sends nothing else.

**Timeline**: as :func:`megatron_mm_balance.sim.timeline.simulate_timeline` with the
overlapped exchange, plus the two all-to-alls. They are meetings, so under
``sync="step"`` (pure data parallelism) balancing images adds two meetings per
micro-step that the unbalanced run does not have.
"""
from __future__ import annotations

import numpy as np

from ..solver.frames import default_patch_cap, plan_frames
from ..solver.images import balance_images
from .pool import PackPool
from .timeline import group_max
from .timing import TimingModel


def image_costs(pool: PackPool, t: TimingModel) -> np.ndarray:
    """Vision forward ms of every image (frame) of the pool (``pool.image_sizes`` order),
    each encoded on its own: the project's cost estimator
    (:meth:`~megatron_mm_balance.cost.model.CostModel.unit_forward_ms`)."""
    return t.cost_model().unit_forward_ms(pool.image_sizes)


def micro_step_images(pool: PackPool, packs: np.ndarray):
    """Images of the packs ``packs[r]`` (pool indices, one per rank): (owner rank,
    image index into ``pool.image_sizes``) for each image."""
    off = pool.image_offsets
    counts = off[packs + 1] - off[packs]
    owner = np.repeat(np.arange(len(packs)), counts)
    first = np.repeat(off[packs] - np.concatenate([[0], np.cumsum(counts)])[:-1], counts)
    return owner, first + np.arange(int(counts.sum()))


#: Who decides which rank encodes which image: ``images`` (:func:`balance_images`: each rank
#: keeps its heaviest images within the target, the rest longest first to the least
#: loaded) or ``frames`` (:func:`megatron_mm_balance.solver.frames.plan_frames`: planned from
#: where they are, the embeddings' transfer time in the plan, a patch cap).
VISION_PLANNERS = ("images", "frames")


def frame_terms(pool: PackPool, t: TimingModel) -> tuple[np.ndarray, np.ndarray]:
    """Per pack of the pool: the vision forward ms of its images (frames) encoded apart,
    and that of its heaviest one (0 for a pack without images)."""
    icost = image_costs(pool, t)
    off = pool.image_offsets
    total = np.concatenate([[0.0], np.cumsum(icost)])
    heaviest = np.zeros(len(pool))
    has = pool.num_images > 0
    if icost.size:
        heaviest[has] = np.maximum.reduceat(icost, off[:-1][has])
    return total[off[1:]] - total[off[:-1]], heaviest


def _encoders(owner, img, cost_ms, pool, t, D, planner):
    """Encoder rank of each image of one micro-step, and the plan's moved vision cost."""
    if planner == "images":
        return balance_images(owner, np.rint(cost_ms * 1000.0).astype(np.int64), D)
    tokens = pool.image_sizes[img].astype(np.int64)
    # the unit's time on the rank that encodes it: forward and backward (integer us), and
    # the embedding back and its gradient over the link
    cost = np.rint(cost_ms * (1.0 + t.vision_bwd_fwd_ratio) * 1000.0).astype(np.int64)
    transfer = np.rint(2.0 * tokens * t.bytes_per_embedding_token / (t.link_gbps * 1e6) * 1000.0).astype(np.int64)
    return plan_frames(owner, cost, D, patches=tokens, transfer=transfer,
                       patch_cap=default_patch_cap(owner, tokens, D)).encoder


def balanced_vision(pool: PackPool, t: TimingModel, placed: np.ndarray, planner: str = "images",
                    *, ep: int | None = None):
    """For packs ``placed[b, r, m]`` (pool indices in compute order): per-rank vision
    forward ms after image balancing ``[B, D, G]``, the tokens each rank sends and
    receives: images (encoder-bound) and embeddings (pack-bound), ``[B, D, G]`` each, and
    what the planner did: ``{"moved_ms", "vision_ms", "max_ms", "floor_ms"}`` summed over
    micro-steps (forward ms moved; encoded; each micro-step's largest rank load; and its
    floor, ``max(mean, heaviest image)``). ``ep``: the images of a micro-step are balanced
    inside each group of ``ep`` consecutive ranks (the ranks that meet per micro-step; the
    figures then per group and micro-step); None: over all ranks.
    """
    if planner not in VISION_PLANNERS:
        raise ValueError(f"vision planner must be one of {VISION_PLANNERS}, got {planner!r}")
    B, D, G = placed.shape
    S = D if ep is None else int(ep)
    icost = image_costs(pool, t)
    vf = np.zeros((B, D, G))
    img_out, img_in = np.zeros((B, D, G)), np.zeros((B, D, G))
    stats = {"moved_ms": 0.0, "vision_ms": 0.0, "max_ms": 0.0, "floor_ms": 0.0}
    for b in range(B):
        for m in range(G):
            for lo in range(0, D, S):
                ranks = slice(lo, lo + S)
                owner, img = micro_step_images(pool, placed[b, ranks, m])
                if len(img) == 0:
                    continue
                cost = icost[img]
                enc = _encoders(owner, img, cost, pool, t, S, planner)
                load = np.bincount(enc, weights=cost, minlength=S)
                vf[b, ranks, m] = load
                if t.vision_ms_per_pack:
                    vf[b, ranks, m] += t.vision_ms_per_pack * (np.bincount(enc, minlength=S) > 0)
                away = enc != owner
                tok = pool.image_sizes[img[away]].astype(np.float64)
                img_out[b, ranks, m] = np.bincount(owner[away], weights=tok, minlength=S)
                img_in[b, ranks, m] = np.bincount(enc[away], weights=tok, minlength=S)
                stats["moved_ms"] += float(cost[away].sum())
                stats["vision_ms"] += float(cost.sum())
                stats["max_ms"] += float(load.max())
                stats["floor_ms"] += max(float(cost.sum()) / S, float(cost.max()))
    return vf, img_out, img_in, stats


def all_to_all_ms(tok_a: np.ndarray, tok_b: np.ndarray, bytes_per_token: float,
                  t: TimingModel, *, ep: int | None = None) -> np.ndarray:
    """``[B, G]``: one all-to-all per micro-step, rank r sending ``tok_a`` and
    receiving ``tok_b`` tokens of ``bytes_per_token``: the slowest rank's time. ``ep``:
    one all-to-all per group of ``ep`` consecutive ranks, each rank's group's time
    ``[B, D, G]``."""
    busiest = np.maximum(tok_a, tok_b) * bytes_per_token
    x = np.where(busiest > 0, t.latency_ms + busiest / (t.link_gbps * 1e6), 0.0)
    if ep is None:
        return x.max(axis=1)
    B, D, G = x.shape
    return np.repeat(x.reshape(B, D // ep, ep, G).max(axis=2), ep, axis=1)


def simulate_images_timeline(vf, lm, vb, *, x, a2a_fwd, a2a_bwd, sync: str = "microstep",
                             bubble=0.0, overhead: float = 0.0, ep: int | None = None) -> dict:
    """The overlapped timeline with the two all-to-alls of image balancing.

    ``vf``, ``lm``, ``vb``, ``x`` ``[B, D, G]`` as in :func:`.timeline.simulate_timeline`
    (``x``: each rank's pack and image exchange, hidden behind the previous
    micro-step where it can be); ``a2a_fwd``, ``a2a_bwd`` ``[B, G]`` (ms), or ``[B, D,
    G]`` with ``ep``: images are balanced, and ranks meet per micro-step, inside groups of
    ``ep`` consecutive ranks (all of them meet once, at the end).
    Same keys as :func:`.timeline.simulate_timeline`."""
    vf, lm, vb, x = (np.asarray(a, dtype=np.float64) for a in (vf, lm, vb, x))
    B, D, G = vf.shape
    bubble = np.broadcast_to(np.asarray(bubble, dtype=np.float64), (B,))
    a2a_fwd, a2a_bwd = (np.asarray(a, dtype=np.float64) for a in (a2a_fwd, a2a_bwd))
    if a2a_fwd.ndim == 2:
        a2a_fwd, a2a_bwd = a2a_fwd[:, None, :], a2a_bwd[:, None, :]
    prev_start = np.zeros((B, D))
    prev_end = np.zeros((B, D))
    exch = np.zeros((B, D))
    for m in range(G):
        start = np.maximum(prev_end, prev_start + x[:, :, m])
        exch += start - prev_end
        arrive = group_max(start + vf[:, :, m], ep)                   # every encoder done
        lm_start = arrive + a2a_fwd[:, :, m]
        exch += a2a_fwd[:, :, m]
        if sync == "microstep":
            lm_end = lm_start + group_max(lm[:, :, m], ep)
        else:
            lm_end = lm_start + lm[:, :, m]
        grads = group_max(lm_end, ep) + a2a_bwd[:, :, m]
        exch += a2a_bwd[:, :, m]
        end = grads + vb[:, :, m]
        prev_start, prev_end = start, end
    compute_end = prev_end.max(axis=1)
    busy = (vf + lm + vb).sum(axis=2)
    wait = compute_end[:, None] - busy - exch
    return {"time": compute_end + bubble + overhead, "compute_end": compute_end, "busy": busy,
            "exchange": exch, "wait": np.maximum(wait, 0.0), "bubble": np.array(bubble)}
