"""One rank of the ``mm_balance.vision=images`` test (``python vision_images_rank.py RANK WORLD PORT OUTDIR``).

Runs in the Bridge environment with Megatron-Bridge and its Megatron-LM on ``PYTHONPATH`` and
the CPU harness installed. The toy Qwen3-VL model of ``configs/bridge/qwen3_vl_moe_tiny_cpu.py``
(built by Bridge's own provider, experts local, the same weights on every rank) is called
through Bridge's own ``Qwen3VLModel.forward`` (``reorganize_inputs``, the tower, the deepstack
injection, the language model and its loss), as ``qwen3_vl_step`` calls it, all four ranks one
step group (expert parallel = data parallel). Each rank's samples (text, images, a video, or
text only) come as Bridge's packs through the balanced iterator with images mode's exchange-
thread side (``FrameAhead`` with the glue's ``FrameReader``: the frame table gathered at the
batch's meeting, each micro-step planned and its pixel rows sent ahead); the packs stay home
(every pack costs the same), so each rank computes its own samples. Each micro-step runs
unbalanced (Bridge as it is) and with the glue's hooks on that micro-step's frames, each with a
fixed loss of the per-token losses, and the results are compared: the per-token losses, the
vision outputs Bridge receives (main and deepstack) and the model's parameter gradients summed
over the ranks (the data-parallel reduction); then with the model cast to fp64. Also recorded:
each micro-step's plan, its figures, every torch.distributed call of the balanced forward and
backward by stack (``runtime/dist_audit.py``), and of an evaluation forward. Each rank writes
its JSON.
"""
from __future__ import annotations

import json
import os
import sys
import types

if __name__ == "__main__":
    RANK, WORLD, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]

#: per micro-step, each rank's images (t, h, w) and whether they are one video (t > 1 rows);
#: merge units 2 x 2, so every h, w is even. Rank 2 holds no frame at step 0 and is the only
#: rank with room under the target (the largest frame's cost), so it encodes rank 0's second
#: frame; step 1 has a video (rank 3 none); at step 2 the default patch cap (the most patches
#: any rank holds) binds: any light rank taking one of rank 0's large frames as it stands would
#: end above it, and the most even plan without the cap leaves a receiver above it (the tiny
#: tower's alpha, 832, makes rank 0's two frames 1.9x a light rank's ten); step 3 has no frame
#: anywhere.
STEPS = (
    {0: [(1, 32, 32), (1, 16, 16)], 1: [(1, 32, 32)], 2: [], 3: [(1, 32, 32)]},
    {0: [(4, 16, 16)], 1: [(1, 8, 8)], 2: [(1, 2, 2)], 3: []},
    {0: [(1, 20, 20), (1, 20, 20)], 1: [(1, 8, 8)] * 10, 2: [(1, 8, 8)] * 10, 3: [(1, 8, 8)] * 10},
    {0: [], 1: [], 2: [], 3: []},
)
#: context parallel 2 x data parallel 2 (ranks 0, 1: data-parallel rank 0; 2, 3: rank 1; the
#: two context-parallel ranks of a data-parallel rank read the same micro-batch): per
#: micro-step, each data-parallel rank's grids. Step 0: data-parallel rank 1's single frame
#: goes to its first context-parallel rank, the second one's share is empty; step 1: data-
#: parallel rank 0 reads text only, rank 1 a video.
CP_STEPS = (
    {0: [(1, 32, 32), (1, 16, 16), (1, 4, 4)], 1: [(1, 8, 8)]},
    {0: [], 1: [(4, 16, 16), (1, 4, 4)]},
)
VIDEO_STEP = 1
IN_DIM = 3 * 2 * 16 * 16          # channels x temporal patch x patch^2


class Harness:
    """The model, the glue's pieces as ``install_frame_balance`` made them, and a way to run
    packs through the balanced iterator and micro-steps with the hooks on."""

    def __init__(self, model, balance, exchange, step_groups):
        self.model, self.exchange, self.step_groups = model, exchange, step_groups
        self.reader, self.prices = balance.ahead.reader, balance.ahead.prices
        self.group, self.flops = balance.hooks.steps.group, balance.hooks.steps.flops_per_unit
        balance.hooks.remove()                           # on only for the balanced runs

    def frames(self, packs, G, *, prices=None, rates=None, config=None, first_iteration=None):
        """``(pack, StepFrames)`` of every micro-step of ``packs`` (``G`` per global batch), one
        global batch at a time (a generator: the next batch's meeting comes after the caller's
        work on this one), from the balanced iterator with images mode's exchange-thread side."""
        from megatron_mm_balance.runtime.config import BalancerConfig
        from megatron_mm_balance.runtime.frame_ahead import FrameAhead, MeasuredRates
        from megatron_mm_balance.runtime.iterator import BalancedDataIterator
        ahead = FrameAhead(self.reader, self.step_groups, prices=self.prices if prices is None else prices,
                           rates=rates if rates is not None else MeasuredRates())
        it = BalancedDataIterator(iter(packs), num_microbatches=G, group=self.exchange, exchange_group=self.exchange,
                                  cost_fn=lambda pack: 0, config=config or BalancerConfig(overlap=False, timeout=60),
                                  first_iteration=first_iteration, frames=ahead)
        with it:
            for _ in range(len(packs)):
                pack = next(it)
                yield pack, ahead.relay.take()

    def hooked(self, frames, *, overlap=True, detail=None, rates=None, dtype=None):
        """The glue's hooks on the model with ``frames`` (cast to ``dtype``) for its next
        training forward."""
        from megatron_mm_balance.bridge.vision import BalancedFrames
        from megatron_mm_balance.runtime.frame_ahead import FrameRelay
        from megatron_mm_balance.runtime.image_exchange import FrameSteps
        if dtype is not None and frames.received is not None:
            import dataclasses
            frames = dataclasses.replace(frames, received=frames.received.to(dtype))
        relay, hooks = FrameRelay(), []
        relay.put(frames)
        steps = FrameSteps(relay, self.group, encode=lambda rows, a: hooks[0].encode(rows, a),
                           empty=lambda: hooks[0].empty(), timeout=60.0, rates=rates, flops_per_unit=self.flops,
                           detail=detail, overlap=overlap)
        hooks.append(BalancedFrames(self.model, steps))
        return hooks[0]


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
    from megatron_mm_balance.testing import cpu_bridge
    cpu_bridge.install()
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=RANK, world_size=WORLD)
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    ps.initialize_model_parallel()
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)

    provider = _provider()
    model = provider.provide(pre_process=True, post_process=True)
    for p in model.parameters():                         # the same weights on every rank
        dist.broadcast(p.data, src=0)
    model.train()

    from megatron_mm_balance.bridge.config import MMBalanceBridgeConfig
    from megatron_mm_balance.bridge.model_spec import ModelSpec
    from megatron_mm_balance.bridge.vision import install_frame_balance
    from megatron_mm_balance.runtime.meeting import MeetingGroups
    mm, spec = MMBalanceBridgeConfig(enabled=True, vision="images"), ModelSpec.read(provider)
    spec = _with_expert_parallelism(spec)
    core = types.SimpleNamespace(timeout=120.0, log_interval=1, tensorboard_dir=None)
    args = types.SimpleNamespace(curr_iteration=0)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    exchange = dist.new_group(list(range(WORLD)), backend="gloo")
    meetings = MeetingGroups.everyone_meets(range(WORLD), rank=RANK)
    balance = install_frame_balance(model, mm, spec, core, args, pg, types.SimpleNamespace(meetings=meetings))
    assert balance is not None and balance.chunk == 0
    h = Harness(model, balance, exchange, meetings.steps)

    ids = provider.image_token_id, provider.video_token_id, provider.vision_start_token_id, \
        provider.vision_end_token_id
    result = dict(rank=RANK, steps=[], rates=list(h.prices.rates((0.0, 0.0))))
    packs = [_pack(STEPS[step][RANK], step, ids, video=(step == VIDEO_STEP)) for step in range(len(STEPS))]
    for step, (pack, frames) in enumerate(h.frames(packs, len(STEPS))):
        entry = dict(step=step, plan=frames.plan, figures=None if frames.figures is None else frames.figures.__dict__)
        for dtype, key in ((torch.float32, "fp32"), (torch.float64, "fp64")):
            model.to(dtype)
            ref = _run(model, pack, dtype, step)
            details = {}
            note = lambda name, value: details.__setitem__(name, details.get(name, 0.0) + value)  # noqa: E731
            balanced = h.hooked(frames, detail=note, dtype=dtype)
            audit = _audit()
            got = _run(model, pack, dtype, step)
            calls = audit.stop()
            balanced.remove()
            entry[key] = _diffs(ref, got)
            if key == "fp32":                             # the same frames, one tower call
                sync_details = {}
                synchronous = h.hooked(frames, overlap=False, detail=lambda name, value: sync_details.__setitem__(
                    name, sync_details.get(name, 0.0) + value))
                entry["fp32_sync"] = _diffs(ref, _run(model, pack, dtype, step))
                synchronous.remove()
                entry.update(calls=calls, details=details, details_sync=sync_details, balanced=frames.balanced,
                             vision_calls=dict(ref=ref["vision_calls"], balanced=got["vision_calls"]))
        result["steps"].append(entry)
    model.to(torch.float32)
    result["slow_link"] = _slow_link(h, ids)
    result["measured"] = _measured_rates(h, ids)
    result["eval"] = _evaluation(h, _pack(STEPS[0][RANK], 0, ids, video=False))
    result["crossover"] = _crossover(h, ids)
    result["per_frame"] = _per_frame_claim(model.vision_model)
    result["cp"] = _context_parallel(model, provider, mm, core, args)
    json.dump(result, open(os.path.join(OUT, f"rank{RANK}.json"), "w"))


def _with_expert_parallelism(spec):
    """The spec as a job with expert parallelism has it (the test's model keeps its experts
    local; images mode balances only where ranks meet every micro-step)."""
    import dataclasses
    return dataclasses.replace(spec, expert_model_parallel_size=2)


def _video(h, ids):
    """The video step's pack."""
    return _pack(STEPS[VIDEO_STEP][RANK], VIDEO_STEP, ids, video=True)


def _slow_link(h, ids):
    """The video step over a link a millionth as fast: every move would cost more than it
    saves, so no frame moves, and the outputs are the unbalanced tower's."""
    import dataclasses

    import torch
    pack = _video(h, ids)
    slow = dataclasses.replace(h.prices, link_gbps=h.prices.link_gbps * 1e-6)
    (pack, frames), = h.frames([pack], 1, prices=slow)
    ref = _run(h.model, pack, torch.float32, VIDEO_STEP)
    balanced = h.hooked(frames)
    got = _run(h.model, pack, torch.float32, VIDEO_STEP)
    balanced.remove()
    return dict(figures=frames.figures.__dict__, diffs=_diffs(ref, got), plan=frames.plan)


def _measured_rates(h, ids, runs=3):
    """``mm_balance.image_rates=measured`` from a tower rate a million times too fast (a
    move's transfer then costs more than any frame: nothing moves): the video step as
    ``runs`` global batches. The first batch's plan charges the wrong prior; every rank times
    its tower on its frames, and the next batch's meeting agrees on the group's measured rate
    (the same on every rank), which the plan then charges: frames move; the outputs stay the
    unbalanced tower's."""
    import dataclasses

    import torch
    from megatron_mm_balance.runtime.frame_ahead import MeasuredRates
    prior = dataclasses.replace(h.prices, tower_tflops=h.prices.tower_tflops * 1e6, measured=True)
    rates = MeasuredRates()
    packs = [_video(h, ids) for _ in range(runs)]
    out = []
    for pack, frames in h.frames(packs, 1, prices=prior, rates=rates):
        ref = _run(h.model, pack, torch.float32, VIDEO_STEP)
        balanced = h.hooked(frames, rates=rates)
        got = _run(h.model, pack, torch.float32, VIDEO_STEP)
        balanced.remove()
        f = frames.figures
        out.append(dict(used=[f.link_gbps, f.tower_tflops], measured=[f.link_gbps_measured, f.tower_tflops_measured],
                        frames_moved=f.frames_moved, diffs=_diffs(ref, got)))
    return dict(prior=list(prior.rates((0.0, 0.0))), runs=out)


def _crossover(h, ids):
    """``mm_balance.mode=crossover-even`` with images: the video step as the global batches of
    training iterations 3 and 4. At 3 the exchange thread plans nothing and the plain tower
    runs (no transfer at all, the unbalanced run bit for bit); at 4 the frames are balanced as
    in every iteration of ``exchange`` mode."""
    import torch
    from megatron_mm_balance.runtime.config import BalancerConfig
    config = BalancerConfig(overlap=False, timeout=60, crossover="even")
    packs = [_video(h, ids) for _ in range(2)]
    out = {}
    for iteration, (pack, frames) in zip((3, 4), h.frames(packs, 1, config=config, first_iteration=3)):
        ref = _run(h.model, pack, torch.float32, VIDEO_STEP)
        balanced = h.hooked(frames)
        audit = _audit()
        got = _run(h.model, pack, torch.float32, VIDEO_STEP)
        calls = audit.stop()
        balanced.remove()
        exact = all(a.equal(b) for a, b in zip(ref["vision"], got["vision"])) and len(ref["vision"]) == len(got["vision"])
        out[str(iteration)] = dict(calls=calls, diffs=_diffs(ref, got), vision_bit_equal=bool(exact),
                                   planned=frames.planned,
                                   frames_moved=None if frames.figures is None else int(frames.figures.frames_moved))
    return out


def _pack(grids, step, ids, *, video):
    """A Bridge pack of one sample (``tokens`` and ``visual_inputs`` as Bridge's collate gives
    them) with what the test's loss needs (labels, weights)."""
    batch = _batch(grids, step, ids, video=video)
    visual = {}
    if batch["pixels"] is not None:
        keys = ("pixel_values_videos", "video_grid_thw") if video else ("pixel_values", "image_grid_thw")
        visual = {keys[0]: batch["pixels"], keys[1]: batch["grid"]}
    return dict(tokens=batch["input_ids"], visual_inputs=visual, **batch)


class _Audit:
    def __init__(self):
        from megatron_mm_balance.runtime.dist_audit import DistAudit
        self.audit = DistAudit().install()
        self.audit.training()

    def stop(self) -> dict:
        """``{"call from": n}`` of the calls of our code on the training thread."""
        self.audit.uninstall()
        out = {}
        for row in self.audit.summary()["rows"]:
            if row["ours"] and row["thread"] == "training":
                key = f"{row['call']} from {row['ours']}"
                out[key] = out.get(key, 0) + row["n"]
        return out


def _audit():
    """Every torch.distributed call from now until ``stop()``, by stack."""
    return _Audit()


def _provider():
    import importlib.util

    import torch
    spec = importlib.util.spec_from_file_location(
        "tiny_cfg", os.path.join(os.path.dirname(__file__), "..", "..", "configs", "bridge",
                                 "qwen3_vl_moe_tiny_cpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    provider = mod.model_provider()
    provider.expert_model_parallel_size = 1
    provider.bf16, provider.params_dtype = False, torch.float32
    provider.vocab_size = 256
    provider.finalize()
    return provider


def _batch(grids, step, ids, *, video):
    """Bridge's model inputs for one sample: text, one vision block per image (per frame of
    a video, as Qwen3-VL's processor writes them), text; labels and a loss mask."""
    import torch
    image_id, video_id, start_id, end_id = ids
    gen = torch.Generator().manual_seed(1000 * step + RANK)
    text = lambda n: torch.randint(16, 256, (n,), generator=gen).tolist()  # noqa: E731
    tokens = text(12)
    for t, h, w in grids:
        for _ in range(t):
            tokens += [start_id] + [video_id if video else image_id] * (h * w // 4) + [end_id]
    tokens += text(12)
    input_ids = torch.tensor([tokens])
    rows = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(rows, IN_DIM, generator=gen) if rows else None
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    labels = torch.roll(input_ids, -1, dims=1)
    weights = torch.rand(input_ids.shape, generator=gen)
    return dict(input_ids=input_ids, labels=labels, pixels=pixels, grid=grid, video=video, weights=weights)


def _run(model, batch, dtype, step):
    """One training forward and backward of the sample: losses, vision outputs, gradients."""
    import torch
    import torch.distributed as dist
    model.zero_grad(set_to_none=True)
    pixels = None if batch["pixels"] is None else batch["pixels"].detach().to(dtype).clone()
    kwargs = dict(input_ids=batch["input_ids"], labels=batch["labels"], loss_mask=None, attention_mask=None,
                  position_ids=None)
    if pixels is not None:
        if batch["video"]:
            kwargs.update(pixel_values_videos=pixels, video_grid_thw=batch["grid"])
        else:
            kwargs.update(pixel_values=pixels, image_grid_thw=batch["grid"])
    seen = []                                             # every call's outputs, the outermost last
    handle = model.vision_model.register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        losses = model(**kwargs)
    finally:
        handle.remove()
    (losses * batch["weights"].to(losses.dtype)).sum().backward()
    grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                       for p in model.parameters()])
    dist.all_reduce(grads)                                # the data-parallel gradient sum
    vision = []
    if seen:                                              # the outermost call: what Bridge received
        embeddings, deepstack = seen[-1]
        vision = [embeddings.detach().clone()] + [d.detach().clone() for d in deepstack]
    return dict(losses=losses.detach().clone(), vision=vision, grads=grads, vision_calls=len(seen), pixel_grad=None)


def _diffs(ref, got):
    """Largest difference relative to the reference's largest entry, per compared quantity."""
    def rel(a, b):
        if a is None or a.numel() == 0:
            return 0.0
        return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
    out = {"losses": rel(ref["losses"], got["losses"]), "param_grads": rel(ref["grads"], got["grads"]),
           "losses_bit_equal": bool(ref["losses"].equal(got["losses"])),
           "param_grads_bit_equal": bool(ref["grads"].equal(got["grads"]))}
    if ref["pixel_grad"] is not None:
        out["pixel_grad"] = rel(ref["pixel_grad"], got["pixel_grad"])
    for i, (a, b) in enumerate(zip(ref["vision"], got["vision"])):
        out["embeddings" if i == 0 else f"deepstack{i - 1}"] = rel(a, b)
    out["vision_outputs"] = len(got["vision"])
    return out


def _evaluation(h, batch):
    """An evaluation forward (eval(), no grad) with the hooks on: no call of ours to
    torch.distributed, and the unbalanced outputs."""
    import torch
    from megatron_mm_balance.runtime.frame_ahead import StepFrames
    model = h.model
    model.eval()
    with torch.no_grad():
        kwargs = dict(input_ids=batch["input_ids"], labels=batch["labels"], loss_mask=None,
                      attention_mask=None, position_ids=None)
        if batch["pixels"] is not None:
            kwargs.update(pixel_values=batch["pixels"], image_grid_thw=batch["grid"])
        ref = model(**kwargs)
        balanced = h.hooked(StepFrames("unused"))
        audit = _audit()
        got = model(**kwargs)
        calls = audit.stop()
        left = len(balanced.steps.relay)
        balanced.remove()
    model.train()
    return dict(calls=calls, bit_equal=bool(ref.equal(got)), frames_left=left)


def _per_frame_claim(tower):
    """A video (4, 16, 16) encoded as one grid, as four (1, 16, 16) rows of one call, and frame
    by frame in four calls: the outputs (main and deepstack) of each frame."""
    import torch
    gen = torch.Generator().manual_seed(31)
    pixels = torch.randn(4 * 16 * 16, IN_DIM, generator=gen)
    with torch.no_grad():
        video = tower(hidden_states=pixels, grid_thw=torch.tensor([[4, 16, 16]]))
        rows = tower(hidden_states=pixels, grid_thw=torch.tensor([[1, 16, 16]] * 4))
        alone = [tower(hidden_states=frame, grid_thw=torch.tensor([[1, 16, 16]])) for frame in pixels.split(256)]
    flat = lambda out: [out[0], *out[1]]  # noqa: E731
    joined = [torch.cat(parts) for parts in zip(*[flat(o) for o in alone])]
    rel = lambda a, b: float((a - b).abs().max() / a.abs().max())  # noqa: E731
    return dict(rows_bit_equal=all(a.equal(b) for a, b in zip(flat(video), flat(rows))),
                alone_max_rel=max(rel(a, b) for a, b in zip(flat(video), joined)),
                outputs=len(flat(video)))


def _context_parallel(model, provider, mm, core, args):
    """Context parallel 2 x data parallel 2: Bridge's vision block under ``vision_dp_when_cp``
    (model.py after ``reorganize_inputs``: ``qwen3vl_cp_split`` (by cost, as
    ``mm_balance.cp_split=cost`` installs it), ``get_vision_cp_data``, ``collapse_thw``, the
    tower or the empty placeholders, ``ensure_requires_grad_for_cp_collective``,
    ``AllGatherVisionEmbeddings`` per output, then ``language_model.embedding``), by the names
    Bridge's model module holds, unbalanced and with the glue's hooks, a fixed linear loss of
    the gathered outputs and the text embeddings; the language model is not run (megatron-core's
    context-parallel attention needs transformer-engine). The exchange thread reads each pack's
    share of this context-parallel rank with the same split and plans it in the data-parallel
    group of that rank."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as qmodel
    from megatron_mm_balance.bridge.cp_split import install_cp_split
    from megatron_mm_balance.bridge.model_spec import ModelSpec
    from megatron_mm_balance.bridge.vision import install_frame_balance
    from megatron_mm_balance.runtime.meeting import MeetingGroups

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2)
    cp_group, pg = ps.get_context_parallel_group(), ProcessGroupCollection.use_mpu_process_groups()
    provider.context_parallel_size, provider.vision_dp_when_cp = 2, True
    spec = _with_expert_parallelism(ModelSpec.read(provider))
    assert install_cp_split(mm, spec)
    dp_ranks = dist.get_process_group_ranks(ps.get_data_parallel_group())
    every = [None] * WORLD
    dist.all_gather_object(every, sorted(dp_ranks))
    exchange = None
    for ranks in sorted({tuple(r) for r in every}):                # collective over the world
        group = dist.new_group(list(ranks), backend="gloo")
        exchange = group if RANK in ranks else exchange
    meetings = MeetingGroups.everyone_meets(dp_ranks, rank=RANK)
    balance = install_frame_balance(model, mm, spec, core, args, pg, types.SimpleNamespace(meetings=meetings))
    assert balance is not None and qmodel.AllGatherVisionEmbeddings.mm_balance_wraps is not None
    h = Harness(model, balance, exchange, meetings.steps)
    dp_rank, cp_rank = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
    out = dict(dp_rank=dp_rank, cp_rank=cp_rank, steps=[])
    packs = []
    for step, grids_by_dp in enumerate(CP_STEPS):
        grids = grids_by_dp[dp_rank]
        gen = torch.Generator().manual_seed(500 + 10 * step + dp_rank)  # the same on both CP ranks
        rows = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(rows, IN_DIM, generator=gen) if rows else None
        input_ids = torch.randint(16, 256, (1, 40), generator=gen)
        visual = {} if pixels is None else dict(pixel_values=pixels, image_grid_thw=torch.tensor(grids))
        packs.append(dict(tokens=input_ids, visual_inputs=visual, pixels=pixels, grids=grids))
    for step, (pack, frames) in enumerate(h.frames(packs, len(packs))):
        entry = dict(step=step, plan=frames.plan)
        for dtype, key in ((torch.float32, "fp32"), (torch.float64, "fp64")):
            model.to(dtype)
            ref = _cp_block(model, qmodel, pack["pixels"], pack["grids"], pack["tokens"], cp_group, dtype, None, step)
            balanced = h.hooked(frames, dtype=dtype)
            got = _cp_block(model, qmodel, pack["pixels"], pack["grids"], pack["tokens"], cp_group, dtype, balanced,
                            step)
            balanced.remove()
            entry[key] = _diffs(ref, got)
            if key == "fp32":
                entry.update(shares=got["shares"], vision_calls=got["vision_calls"])
        out["steps"].append(entry)
    model.to(torch.float32)
    dist.barrier()
    return out


def _cp_block(model, qmodel, pixels, grids, input_ids, cp_group, dtype, balanced, step):
    import torch
    import torch.distributed as dist
    model.zero_grad(set_to_none=True)
    cp_rank, cp_size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    width, merge2 = int(model.config.hidden_size), model.square_merge_size
    if balanced is not None:
        balanced._before_model(model, ())
    px = None if pixels is None else pixels.detach().to(dtype).clone()   # Bridge's split: no grad
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    share = None
    seen = []
    handle = model.vision_model.register_forward_hook(lambda m, a, o: seen.append(o))
    vision, shares = [], None
    if grid is not None:
        data, thw, cp_img_num, padded = qmodel.qwen3vl_cp_split(cp_size, px, grid)
        data, thw, seqlens = qmodel.get_vision_cp_data(data, thw, merge2, cp_img_num, padded, cp_rank, cp_size)
        thw = qmodel.collapse_thw(thw)
        shares = list(cp_img_num)
        share = data = data.detach().clone()                            # data: no pixel gradients
        if data.shape[0] > 0:
            embeds, deepstack = model.vision_model(hidden_states=data, grid_thw=thw)
        else:                                              # Bridge's empty-share placeholders
            embeds = torch.zeros((0, width), dtype=dtype)
            deepstack = [torch.zeros((0, width), dtype=dtype)
                         for _ in model.vision_transformer_config.deepstack_visual_indexes]
        qmodel.ensure_requires_grad_for_cp_collective((embeds, *deepstack))
        vision = [qmodel.AllGatherVisionEmbeddings.apply(t, seqlens, cp_group) for t in (embeds, *deepstack)]
    text = model.language_model.embedding(input_ids=input_ids, position_ids=None)
    handle.remove()
    if balanced is not None:
        balanced._after_model(model, (), None)
    gen = torch.Generator().manual_seed(77 + step)
    loss = (text * torch.randn(text.shape, generator=gen).to(dtype)).sum()
    for v in vision:
        loss = loss + (v * torch.randn(v.shape, generator=gen).to(dtype)).sum()
    loss.backward()
    grads = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                       for p in model.parameters()])
    dist.all_reduce(grads)                                # the DP x CP gradient reduction's sum
    return dict(losses=text.detach().clone(), vision=[v.detach().clone() for v in vision], grads=grads,
                pixel_grad=None if share is None or share.grad is None else share.grad.detach().clone(),
                shares=shares,
                vision_calls=len(seen))


if __name__ == "__main__":
    main()
