"""One rank of the ``mm_balance.vision=images`` test (``python vision_images_rank.py RANK WORLD PORT OUTDIR``).

Runs in the Bridge environment with Megatron-Bridge and its Megatron-LM on ``PYTHONPATH`` and
the CPU harness installed. The toy Qwen3-VL model of ``configs/bridge/qwen3_vl_moe_tiny_cpu.py``
(built by Bridge's own provider, experts local, the same weights on every rank) is called
through Bridge's own ``Qwen3VLModel.forward`` (``reorganize_inputs``, the tower, the deepstack
injection, the language model and its loss), as ``qwen3_vl_step`` calls it, on a data-parallel
group of all the ranks. Per micro-step each rank holds its own sample (text, images, a video,
or text only); the same micro-step runs twice: unbalanced (Bridge as it is) and with the
glue's hooks (``install_frame_balance``, installed as ``wrap_train_data_iterator`` does),
each with a fixed loss of the per-token losses, and the results are compared: the per-token
losses, the vision outputs Bridge receives (main and deepstack), the pixel gradients and the
model's parameter gradients summed over the ranks (the data-parallel reduction). Then again
with the model cast to fp64. Also recorded: each micro-step's plan (the same on every rank),
its figures, the collectives of a micro-step with no frame anywhere and of an evaluation
forward. Each rank writes its JSON.
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
    from megatron_mm_balance.bridge.vision import BalancedFrames, install_frame_balance
    cfg = types.SimpleNamespace(mm_balance=MMBalanceBridgeConfig(enabled=True, vision="images"), model=provider)
    core = types.SimpleNamespace(timeout=120.0, log_interval=1, tensorboard_dir=None)
    args = types.SimpleNamespace(curr_iteration=0)
    pg = ProcessGroupCollection.use_mpu_process_groups()
    hooks = install_frame_balance(model, cfg.mm_balance, ModelSpec.read(provider), core, args, pg)
    assert len(hooks) == 1
    first = hooks[0]
    first.remove()                                       # on only for the balanced runs

    def hooked(rates=first.rates, measured=False, overlap=True, detail=None, balanced_now=None):
        return BalancedFrames(model, first.group, frame_cost=first.frame_cost, report=first.report,
                              rates=rates, flops_per_unit=first.flops_per_unit, measured_rates=measured,
                              overlap=overlap, detail=detail, balanced_now=balanced_now)

    ids = provider.image_token_id, provider.video_token_id, provider.vision_start_token_id, \
        provider.vision_end_token_id
    result = dict(rank=RANK, steps=[])
    for step, grids_by_rank in enumerate(STEPS):
        batch = _batch(grids_by_rank[RANK], step, ids, video=(step == VIDEO_STEP))
        args.curr_iteration = step
        entry = dict(step=step)
        for dtype, key in ((torch.float32, "fp32"), (torch.float64, "fp64")):
            model.to(dtype)
            ref = _run(model, batch, dtype, step)
            details = {}
            balanced = hooked(detail=lambda name, value: details.__setitem__(name, details.get(name, 0.0) + value))
            calls = _count_collectives()
            got = _run(model, batch, dtype, step)
            counts = calls.stop()
            balanced.remove()
            entry[key] = _diffs(ref, got)
            if key == "fp32":                             # the same plan, each exchange completed first
                sync_details = {}
                synchronous = hooked(overlap=False, detail=lambda name, value: sync_details.__setitem__(
                    name, sync_details.get(name, 0.0) + value))
                entry["fp32_sync"] = _diffs(ref, _run(model, batch, dtype, step))
                entry["details_sync"] = sync_details
                synchronous.remove()
                assert str(synchronous.last_plan) == str(balanced.last_plan)
                figures = balanced.last_figures
                entry.update(
                    collectives=counts, details=details,
                    plan=None if figures is None else {k: [int(x) for x in v]
                                                       for k, v in balanced.last_plan.items()},
                    figures=None if figures is None else figures.__dict__,
                    vision_calls=dict(ref=ref["vision_calls"], balanced=got["vision_calls"]))
        result["steps"].append(entry)
    model.to(torch.float32)
    result["rates"] = list(first.rates)
    result["slow_link"] = _slow_link(model, hooked, first.rates, ids)
    result["measured"] = _measured_rates(model, hooked, first.rates, ids)
    result["eval"] = _evaluation(model, hooked, _batch(STEPS[0][RANK], 0, ids, video=False))
    result["crossover"] = _crossover(model, hooked, ids, args)
    result["report_lines"] = first.report.lines
    result["per_frame"] = _per_frame_claim(model.vision_model)
    result["cp"] = _context_parallel(model, provider, cfg, core, args)
    json.dump(result, open(os.path.join(OUT, f"rank{RANK}.json"), "w"))


def _slow_link(model, hooked, rates, ids):
    """The video step over a link a millionth as fast: every move would cost more than it
    saves, so no frame moves, and the outputs are the unbalanced tower's."""
    import torch
    batch = _batch(STEPS[VIDEO_STEP][RANK], VIDEO_STEP, ids, video=True)
    ref = _run(model, batch, torch.float32, VIDEO_STEP)
    balanced = hooked(rates=(rates[0] * 1e-6, rates[1]))
    got = _run(model, batch, torch.float32, VIDEO_STEP)
    balanced.remove()
    return dict(figures=balanced.last_figures.__dict__, diffs=_diffs(ref, got),
                plan={k: [int(x) for x in v] for k, v in balanced.last_plan.items()})


def _measured_rates(model, hooked, rates, ids, runs=3):
    """``mm_balance.image_rates=measured`` from a tower rate a million times too fast (a
    move's transfer then costs more than any frame: nothing moves): the video step, ``runs``
    times with the same hooks. The first plan charges the wrong prior; from the second on,
    the rates are the group's measured ones (the same on every rank) and frames move; the
    outputs stay the unbalanced tower's."""
    import torch
    batch = _batch(STEPS[VIDEO_STEP][RANK], VIDEO_STEP, ids, video=True)
    ref = _run(model, batch, torch.float32, VIDEO_STEP)
    balanced = hooked(rates=(rates[0], rates[1] * 1e6), measured=True)
    runs_out = []
    try:
        for _ in range(runs):
            got = _run(model, batch, torch.float32, VIDEO_STEP)
            runs_out.append(dict(used=list(balanced.last_rates["used"]),
                                 measured=list(balanced.last_rates["measured"]),
                                 frames_moved=balanced.last_figures.frames_moved,
                                 link_samples=len(balanced._link.samples), diffs=_diffs(ref, got)))
    finally:
        balanced.remove()
    return dict(prior=[rates[0], rates[1] * 1e6], runs=runs_out)


def _crossover(model, hooked, ids, args):
    """``mm_balance.mode=crossover-even`` with images: the video step at training iterations 3
    and 4 (``args.curr_iteration`` 2 and 3, as the loop sets it). At 3 the plain tower runs
    (no collective, the unbalanced run bit for bit); at 4 the frames are balanced as in every
    iteration of ``exchange`` mode."""
    import torch
    from megatron_mm_balance.bridge.vision import balanced_iterations
    from megatron_mm_balance.megatron.config import live_iteration
    batch = _batch(STEPS[VIDEO_STEP][RANK], VIDEO_STEP, ids, video=True)
    ref = _run(model, batch, torch.float32, VIDEO_STEP)
    balanced = hooked(balanced_now=balanced_iterations("crossover-even", live_iteration(args)))
    out = {}
    try:
        for iteration in (3, 4):
            args.curr_iteration = iteration - 1
            balanced.last_figures = None
            calls = _count_collectives()
            got = _run(model, batch, torch.float32, VIDEO_STEP)
            counts = calls.stop()
            exact = all(a.equal(b) for a, b in zip(ref["vision"], got["vision"])) and \
                len(ref["vision"]) == len(got["vision"]) and \
                (ref["pixel_grad"] is None or ref["pixel_grad"].equal(got["pixel_grad"]))
            figures = balanced.last_figures
            out[str(iteration)] = dict(collectives=counts, diffs=_diffs(ref, got), vision_bit_equal=bool(exact),
                                       frames_moved=None if figures is None else int(figures.frames_moved))
    finally:
        balanced.remove()
    return out


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
    pixels = None if batch["pixels"] is None else batch["pixels"].detach().to(dtype).clone().requires_grad_(True)
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
    return dict(losses=losses.detach().clone(), vision=vision, grads=grads, vision_calls=len(seen),
                pixel_grad=None if pixels is None else pixels.grad.detach().clone())


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


class _Collectives:
    def __init__(self):
        import torch.distributed as dist
        self.dist, self.counts = dist, {"all_gather": 0, "batch_isend_irecv": 0}
        self.saved = {name: getattr(dist, name) for name in self.counts}
        for name, fn in self.saved.items():
            setattr(dist, name, self._counting(name, fn))

    def _counting(self, name, fn):
        def call(*a, **k):
            self.counts[name] += 1
            return fn(*a, **k)
        return call

    def stop(self):
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)
        return dict(self.counts)


def _count_collectives():
    """Counts the vision exchange's collectives (all-gathers, batched point-to-point) until stopped."""
    return _Collectives()


def _evaluation(model, hooked, batch):
    """An evaluation forward (eval(), no grad) with the hooks on: nothing collective, and the
    unbalanced outputs."""
    import torch
    model.eval()
    with torch.no_grad():
        kwargs = dict(input_ids=batch["input_ids"], labels=batch["labels"], loss_mask=None,
                      attention_mask=None, position_ids=None)
        if batch["pixels"] is not None:
            kwargs.update(pixel_values=batch["pixels"], image_grid_thw=batch["grid"])
        ref = model(**kwargs)
        balanced = hooked()
        calls = _count_collectives()
        got = model(**kwargs)
        counts = calls.stop()
        balanced.remove()
    model.train()
    return dict(collectives=counts, bit_equal=bool(ref.equal(got)))


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


def _context_parallel(model, provider, cfg, core, args):
    """Context parallel 2 x data parallel 2: Bridge's vision block under ``vision_dp_when_cp``
    (model.py after ``reorganize_inputs``: ``qwen3vl_cp_split`` (by cost, as
    ``mm_balance.cp_split=cost`` installs it), ``get_vision_cp_data``, ``collapse_thw``, the
    tower or the empty placeholders, ``ensure_requires_grad_for_cp_collective``,
    ``AllGatherVisionEmbeddings`` per output, then ``language_model.embedding``), by the names
    Bridge's model module holds, unbalanced and with the glue's hooks, a fixed linear loss of
    the gathered outputs and the text embeddings; the language model is not run (megatron-core's
    context-parallel attention needs transformer-engine)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as qmodel
    from megatron_mm_balance.bridge.cp_split import install_cp_split
    from megatron_mm_balance.bridge.model_spec import ModelSpec
    from megatron_mm_balance.bridge.vision import install_frame_balance

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(context_parallel_size=2)
    cp_group, pg = ps.get_context_parallel_group(), ProcessGroupCollection.use_mpu_process_groups()
    provider.context_parallel_size, provider.vision_dp_when_cp = 2, True
    spec = ModelSpec.read(provider)
    assert install_cp_split(cfg.mm_balance, spec)
    hooks = install_frame_balance(model, cfg.mm_balance, spec, core, args, pg)
    assert len(hooks) == 1 and qmodel.AllGatherVisionEmbeddings.mm_balance_wraps is not None
    balanced = hooks[0]
    balanced.remove()
    dp_rank, cp_rank = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
    out = dict(dp_rank=dp_rank, cp_rank=cp_rank, steps=[])
    for step, grids_by_dp in enumerate(CP_STEPS):
        grids = grids_by_dp[dp_rank]
        gen = torch.Generator().manual_seed(500 + 10 * step + dp_rank)  # the same on both CP ranks
        rows = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(rows, IN_DIM, generator=gen) if rows else None
        input_ids = torch.randint(16, 256, (1, 40), generator=gen)
        entry = dict(step=step)
        for dtype, key in ((torch.float32, "fp32"), (torch.float64, "fp64")):
            model.to(dtype)
            ref = _cp_block(model, qmodel, pixels, grids, input_ids, cp_group, dtype, None, step)
            balanced = type(balanced)(model, balanced.group, frame_cost=balanced.frame_cost, report=None)
            got = _cp_block(model, qmodel, pixels, grids, input_ids, cp_group, dtype, balanced, step)
            balanced.remove()
            entry[key] = _diffs(ref, got)
            if key == "fp32":
                entry.update(shares=got["shares"], vision_calls=got["vision_calls"],
                             plan=None if balanced.last_plan is None else
                             {k: [int(x) for x in v] for k, v in balanced.last_plan.items()})
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
        share = data = data.detach().clone().requires_grad_(True)       # this rank's pixel gradients
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
