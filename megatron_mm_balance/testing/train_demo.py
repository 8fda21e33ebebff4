"""A tiny LLaVA-style MoE VLM trained with megatron-core on CPU, balancing off vs on.

Model: megatron-core's ``CLIPViTModel`` encodes each image tile; a linear
projector maps the first ``positions_per_tile`` output tokens of every tile into
the LLM's hidden size, and those embeddings replace the first text positions of
the pack before a ``GPTModel`` (MoE layers when ``num_experts`` is set) runs the
whole fixed-length sequence. The vision encoder sits on the first pipeline
stage, as in Megatron-LM's multimodal example. Vision compute is therefore
proportional to the pack's tile count, while the LLM's is constant per pack.

Data: samples from :mod:`megatron_mm_balance.data.mixtures`, packed with
:func:`megatron_mm_balance.data.packing.pack_greedy` at ``pack_seq_len`` tokens;
every pack becomes one micro-batch (micro-batch size 1) whose tile count is its
image-token count over ``tokens_per_tile``. Rank ``r`` of ``D`` gets pack
``step*D*M + m*D + r`` at micro-step ``m``, the order of Megatron's
``MegatronPretrainingSampler``. Pack contents are drawn from a generator
seeded with the pack's index, so every run sees bit-identical data.

Accelerator-time emulation: on a GPU cluster every rank has its own device, so
one rank's long vision pass delays the others only through collectives. Here 4
ranks share 2 CPU cores: a straggler's extra compute is partly absorbed by the
cores its waiting peers leave idle, which hides the effect balancing removes.
``vision_ms_per_tile`` (per tile) and ``llm_ms_per_pack`` (per pack, split over
pipeline stages) add that much sleep to the forward pass and twice that to the
backward pass: time on a private accelerator, which costs no shared CPU. The
real megatron-core computation, collectives and exchange still run; the sleeps
only give each rank a device-time profile proportional to its image tokens.
The demo interleaves the off and on runs step by step in the same processes, so
load from elsewhere on the machine falls on both alike.

Run: ``python -m megatron_mm_balance.testing.train_demo`` (or ``mm-balance demo
--train``). :func:`run_layouts` is what the acceptance tests call.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial

import numpy as np

from megatron_mm_balance.cost.pack import DEFAULT_TOKENS_PER_TILE

# Layouts: name -> (world, tp, pp, ep). "dp4_ep2" is 4 ranks with expert
# parallel 2: dense data parallel 4, expert data parallel 2 (EP is carved out of DP).
LAYOUTS = {
    "dp4": (4, 1, 1, 1),
    "dp4_ep2": (4, 1, 1, 2),
    "pp2_dp2": (4, 1, 2, 1),
    "tp2_dp2": (4, 2, 1, 1),
    "ep4": (4, 1, 1, 4),
    # Negative control: DP=4 x EP=2 with the MoE "global_aux_loss", whose expert-load
    # statistics span data-parallel ranks. The glue refuses it; this layout bypasses
    # that check to show the refusal is needed (off and on runs then differ).
    "dp4_ep2_global_aux": (4, 1, 1, 2),
}
_ROUTER_BALANCING = {"dp4_ep2_global_aux": "global_aux_loss"}


@dataclass
class DemoConfig:
    steps: int = 5
    microbatches: int = 4              # per rank per step (micro-batch size 1: one pack each)
    seq_length: int = 64               # LLM positions per pack
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    vocab: int = 256
    num_experts: int | None = 4        # MoE in the LLM (None: dense)
    vit_hidden: int = 64
    vit_layers: int = 2
    img_size: int = 32
    patch: int = 8
    positions_per_tile: int = 2
    mixture: str = "mixed"
    mixture_samples: int = 6000        # for synthetic mixtures ("mixed" uses the full traces)
    pack_seq_len: int = 8192
    tokens_per_tile: int = DEFAULT_TOKENS_PER_TILE
    max_tiles: int = 32
    vision_ms_per_tile: float = 0.0
    llm_ms_per_pack: float = 0.0
    lr: float = 1e-3
    seed: int = 1234
    overlap: bool = True
    timeout: float = 120.0


# --------------------------------------------------------------------------- data

def pack_tiles(cfg: DemoConfig) -> list[int]:
    """Tile count of every pack of the configured mixture, in stream order."""
    from megatron_mm_balance.data.mixtures import make_mixture
    from megatron_mm_balance.data.packing import pack_greedy

    samples = make_mixture(cfg.mixture, n=cfg.mixture_samples, seed=cfg.seed)
    packs = pack_greedy(samples, cfg.pack_seq_len).packs
    return [min(cfg.max_tiles, int(round(p.image_tokens / cfg.tokens_per_tile))) for p in packs]


def make_batch(cfg: DemoConfig, pack_id: int, tiles: int) -> dict:
    """The micro-batch for one pack; deterministic in ``pack_id``."""
    import torch

    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + pack_id)
    L = cfg.seq_length
    tokens = torch.randint(0, cfg.vocab, (1, L + 1), generator=g)
    n_img = min(tiles * cfg.positions_per_tile, L - 8)
    loss_mask = torch.ones(1, L)
    loss_mask[:, :n_img] = 0.0
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(L).unsqueeze(0),
        "imgs": torch.randn(tiles, 3, cfg.img_size, cfg.img_size, generator=g),
        "num_tiles": torch.tensor([tiles]),
        "image_tokens": torch.tensor([tiles * cfg.tokens_per_tile]),
        "pack_id": torch.tensor([pack_id]),
    }


def pack_index(step: int, micro: int, dp_rank: int, dp_size: int, m: int) -> int:
    """Pack read by ``dp_rank`` at micro-step ``micro`` of ``step`` (``m`` micro-steps a step)."""
    return step * dp_size * m + micro * dp_size + dp_rank


def source_iterator(cfg: DemoConfig, tiles: list[int], dp_rank: int, dp_size: int):
    """Megatron-sampler-ordered micro-batches of one data-parallel rank."""
    step = 0
    while True:
        for m in range(cfg.microbatches):
            pid = pack_index(step, m, dp_rank, dp_size, cfg.microbatches)
            yield make_batch(cfg, pid, tiles[pid % len(tiles)])
        step += 1


# --------------------------------------------------------------------------- model

def _build_model(cfg: DemoConfig, layout: str):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.enums import ModelType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .cpu_megatron import check_config

    _, tp, pp, ep = LAYOUTS[layout]
    moe = ep > 1 and bool(cfg.num_experts)
    common = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                  bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                  masked_softmax_fusion=False, persist_layer_norm=False, params_dtype=torch.float32,
                  pipeline_dtype=torch.float32)
    llm_kw = dict(num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
                  ffn_hidden_size=4 * cfg.hidden, **common)
    if moe:
        llm_kw.update(num_moe_experts=cfg.num_experts, expert_model_parallel_size=ep,
                      moe_router_topk=2, moe_token_dispatcher_type="allgather",
                      moe_ffn_hidden_size=2 * cfg.hidden,
                      # "aux_loss" is computed per micro-batch (reduced over TP/CP only), so it
                      # does not depend on which rank computes a pack; "global_aux_loss" spans
                      # data-parallel ranks and is not invariant to the exchange.
                      moe_router_load_balancing_type=_ROUTER_BALANCING.get(layout, "aux_loss"),
                      moe_aux_loss_coeff=1e-2,
                      moe_grouped_gemm=False)
    llm_config = TransformerConfig(**llm_kw)
    check_config(llm_config)
    vit_config = TransformerConfig(num_layers=cfg.vit_layers, hidden_size=cfg.vit_hidden,
                                   num_attention_heads=cfg.heads, ffn_hidden_size=4 * cfg.vit_hidden,
                                   **{**common, "pipeline_model_parallel_size": 1})
    pre = ps.is_pipeline_first_stage()
    post = ps.is_pipeline_last_stage()

    class TinyVLM(MegatronModule):
        """CLIP ViT -> projector -> (MoE) GPT, one pack per micro-batch."""

        def __init__(self):
            super().__init__(config=llm_config)
            self.pre_process, self.post_process = pre, post
            self.model_type = ModelType.encoder_or_decoder
            self.share_embeddings_and_output_weights = False   # read by finalize_model_grads
            self.vision = None
            if pre:
                self.vision = CLIPViTModel(vit_config, get_vit_layer_with_local_spec(),
                                           ln_pre_impl=WrappedTorchNorm, ln_post_impl=WrappedTorchNorm,
                                           patch_dim=cfg.patch, img_h=cfg.img_size, img_w=cfg.img_size)
                self.projector = torch.nn.Linear(cfg.vit_hidden, cfg.hidden)
            self.language = GPTModel(
                config=llm_config,
                transformer_layer_spec=get_gpt_layer_local_spec(num_experts=cfg.num_experts if moe else None),
                vocab_size=cfg.vocab, max_sequence_length=cfg.seq_length,
                pre_process=pre, post_process=post, position_embedding_type="learned_absolute",
                share_embeddings_and_output_weights=False)

        def set_input_tensor(self, input_tensor):
            self.language.set_input_tensor(input_tensor)

        def forward(self, tokens, position_ids, attention_mask, labels, imgs, num_tiles):
            decoder_input = None
            if self.pre_process:
                text = self.language.embedding(input_ids=tokens, position_ids=position_ids)  # [s, 1, h]
                tiles = int(num_tiles.sum())
                if tiles:
                    feats = self.vision(imgs)[:, : cfg.positions_per_tile]          # [t, k, hv]
                    feats = self.projector(feats.reshape(1, -1, cfg.vit_hidden))     # [1, t*k, h]
                    n_img = min(feats.shape[1], cfg.seq_length - 8)
                    if feats.shape[1] != n_img:
                        feats = torch.nn.functional.adaptive_avg_pool1d(
                            feats.transpose(1, 2), n_img).transpose(1, 2)
                    feats = _DeviceTime.apply(feats, tiles * cfg.vision_ms_per_tile / 1000.0)
                    text = torch.cat([feats.transpose(0, 1), text[n_img:]], dim=0)
                decoder_input = text
            out = self.language(tokens, position_ids, attention_mask,
                                decoder_input=decoder_input, labels=labels)
            # The LLM's accelerator time is the same for every pack (fixed length), split over stages.
            return _DeviceTime.apply(out, cfg.llm_ms_per_pack / 1000.0 / ps.get_pipeline_model_parallel_world_size())

    return TinyVLM(), llm_config


class _DeviceTime:
    """Identity whose forward sleeps ``s`` seconds and backward ``2 s`` (accelerator time)."""

    _fn = None

    @classmethod
    def apply(cls, x, seconds):
        if seconds <= 0:
            return x
        if cls._fn is None:
            import torch

            class Fn(torch.autograd.Function):
                @staticmethod
                def forward(ctx, t, s):
                    ctx.s = s
                    time.sleep(s)
                    return t.view_as(t)

                @staticmethod
                def backward(ctx, g):
                    time.sleep(2 * ctx.s)
                    return g, None

            cls._fn = Fn
        return cls._fn.apply(x, seconds)


# --------------------------------------------------------------------------- one run

def _forward_step(seq_length, data_iterator, model):
    import torch

    batch = _get_batch(data_iterator)
    mask = torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool), diagonal=1)
    out = model(batch["tokens"], batch["position_ids"], mask, batch["labels"],
                batch["imgs"], batch["num_tiles"])
    _forward_step.seen.append((int(batch["pack_id"]), int(batch["image_tokens"])))

    def loss_func(loss_mask, output_tensor):
        losses = output_tensor.float().view(-1)
        lm = loss_mask.view(-1).float()
        loss = torch.sum(losses * lm) / lm.sum()
        return loss, {"lm loss": loss.detach().clone()}

    return out, partial(loss_func, batch["loss_mask"])


_forward_step.seen = []


def _get_batch(data_iterator):
    """Megatron's ``get_batch``: tensor-parallel rank 0 reads, the others receive a broadcast."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return next(data_iterator)
    obj = [next(data_iterator) if ps.get_tensor_model_parallel_rank() == 0 else None]
    dist.broadcast_object_list(obj, src=ps.get_tensor_model_parallel_src_rank(),
                               group=ps.get_tensor_model_parallel_group())
    return obj[0]


def mm_balance_args(cfg: DemoConfig, layout: str) -> argparse.Namespace:
    """The namespace Megatron's ``get_args()`` would hold for this run with ``--mm-balance``."""
    from megatron_mm_balance.megatron.arguments import add_mm_balance_args

    parser = add_mm_balance_args(argparse.ArgumentParser())
    argv = ["--mm-balance", "--mm-balance-timeout", str(cfg.timeout), "--mm-balance-log-interval", "1000"]
    if not cfg.overlap:
        argv.append("--no-mm-balance-overlap")
    args = parser.parse_args(argv)
    _, tp, pp, ep = LAYOUTS[layout]
    moe = ep > 1 and bool(cfg.num_experts)
    args.__dict__.update(
        micro_batch_size=1, calculate_per_token_loss=False, rampup_batch_size=None, log_interval=1000,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=None, num_experts=cfg.num_experts if moe else None,
        # (the global_aux_loss control layout is reported as aux_loss: it bypasses the glue's check)
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, tensorboard_dir=None)
    return args


def _wrap(source, cfg: DemoConfig, layout: str, balance: bool):
    """Off: Megatron's iterator as is. On: through the glue, as ``pretrain()`` with the patch does.

    Called on every rank (group creation is collective over the world).
    """
    from megatron.core.rerun_state_machine import RerunDataIterator

    it = RerunDataIterator(source) if source is not None else None
    if not balance:
        return it, None
    from megatron_mm_balance.megatron.iterator import balancers, wrap_train_data_iterator

    it = wrap_train_data_iterator(it, args=mm_balance_args(cfg, layout))   # groups for this layout
    found = balancers(it) if it is not None else []
    return it, (found[0] if found else None)


class Trainer:
    """One training run on this rank: model, DDP, optimizer, data iterator (parallel state
    already initialised). ``step()`` runs one optimizer step; ``result()`` reports."""

    def __init__(self, cfg: DemoConfig, layout: str, balance: bool, tiles: list[int]):
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.cfg = cfg
        torch.manual_seed(cfg.seed)           # identical initial weights in every run
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.model, config = _build_model(cfg, layout)
        self.ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                           self.model)
        self.opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=cfg.lr, clip_grad=1.0,
                                                          params_dtype=torch.float32), [self.ddp],
                                          use_gloo_process_groups=False)
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = self.ddp.no_sync
        config.grad_scale_func = self.opt.scale_loss
        self.has_data = ((ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage())
                         and ps.get_tensor_model_parallel_rank() == 0)
        source = source_iterator(cfg, tiles, self.dp_rank, self.dp) if self.has_data else None
        self.it, self.balanced = _wrap(source, cfg, layout, balance)
        self.fb = get_forward_backward_func()
        self.losses, self.times, self.seen = [], [], []

    def step(self) -> None:
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        cfg = self.cfg
        _forward_step.seen = []
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        out = self.fb(forward_step_func=partial(_forward_step, cfg.seq_length), data_iterator=self.it,
                      model=[self.ddp], num_microbatches=cfg.microbatches, seq_length=cfg.seq_length,
                      micro_batch_size=1, forward_only=False)
        ok, _, _ = self.opt.step()
        self.times.append(time.perf_counter() - t0)
        if not ok:
            raise RuntimeError("optimizer step skipped")
        self.seen.append(list(_forward_step.seen))
        # Megatron's reported loss: mean over micro-batches, averaged over data-parallel ranks.
        loss = torch.zeros(1, dtype=torch.float64)
        if ps.is_pipeline_last_stage():
            loss[0] = sum(float(o["lm loss"]) for o in out) / cfg.microbatches
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        self.losses.append(float(loss) / self.dp)

    def result(self) -> dict:
        import torch
        from megatron.core import parallel_state as ps

        stats = list(self.balanced.stats)[: len(self.losses)] if self.balanced is not None else []
        if self.balanced is not None:
            self.balanced.close()
        params = torch.cat([p.detach().float().reshape(-1) for p in self.model.parameters()])
        return {"losses": self.losses, "times": self.times, "seen": self.seen, "stats": stats,
                "params": params.numpy().astype(np.float64),
                "consumed_samples": len(self.losses) * self.cfg.microbatches * self.dp,
                "dp_rank": self.dp_rank, "dp": self.dp, "has_data": self.has_data,
                "pp_rank": ps.get_pipeline_model_parallel_rank(),
                "tp_rank": ps.get_tensor_model_parallel_rank(), "last_stage": ps.is_pipeline_last_stage()}


def rank_worker(rank: int, world: int, cfg: DemoConfig, layouts: list[str], modes: list[bool],
                interleave: bool = False) -> dict:
    """Per-process entry of :func:`run_layouts`: every layout, each mode, same processes.

    ``interleave``: build every mode's run first, then alternate their steps (off step 1,
    on step 1, off step 2, ...) so that load from elsewhere on the machine falls on both
    alike; otherwise the runs go one after the other.
    """
    import torch.distributed as dist
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator, init_num_microbatches_calculator)

    from .cpu_megatron import initialize

    tiles = pack_tiles(cfg)
    out = {}
    for layout in layouts:
        w, tp, pp, ep = LAYOUTS[layout]
        if w != world:
            raise ValueError(f"layout {layout} needs {w} ranks, launched {world}")
        initialize(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                   expert_model_parallel_size=ep, seed=cfg.seed)
        dp = world // (tp * pp)
        destroy_num_microbatches_calculator()
        init_num_microbatches_calculator(dist.get_rank(), None, cfg.microbatches * dp, 1, dp)
        if interleave:
            runs = {b: Trainer(cfg, layout, b, tiles) for b in modes}
            for _ in range(cfg.steps):
                for b in modes:
                    runs[b].step()
            for b in modes:
                out[(layout, b)] = runs[b].result()
        else:
            for b in modes:
                run = Trainer(cfg, layout, b, tiles)
                for _ in range(cfg.steps):
                    run.step()
                out[(layout, b)] = run.result()
    return out


def run_layouts(cfg: DemoConfig, layouts: list[str], modes=(False, True), *, interleave: bool = False,
                timeout: float = 600.0) -> dict:
    """Launch 4 gloo ranks once, train every layout off and on; ``{(layout, on): [rank results]}``."""
    from .cpu_megatron import launch

    per_rank = launch(rank_worker, 4, (cfg, list(layouts), list(modes), interleave), timeout=timeout)
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


# --------------------------------------------------------------------------- analysis

def seen_stats(seen_by_rank: list[list[tuple[int, int]]], dp_ranks: list[int]):
    """:class:`~megatron_mm_balance.solver.placement.PlanStats` of one step as the ranks computed it
    (rank r's m-th delivered micro-batch's image tokens; one row per data-parallel rank)."""
    from ..solver.placement import Placement, PlanStats
    by_dp = {}
    for seen, d in zip(seen_by_rank, dp_ranks):
        by_dp.setdefault(d, seen)
    rows = np.array([[c for _, c in by_dp[d]] for d in sorted(by_dp)], dtype=np.int64)
    return PlanStats.of(rows, Placement.identity(*rows.shape))


def imbalance(seen_by_rank: list[list[tuple[int, int]]], dp_ranks: list[int]) -> float:
    """Image-token imbalance of one step: sum over micro-steps of the max over data-parallel
    ranks, over the sum of the means (1.0 = balanced). The micro-step objective the balancer
    minimises, normalised."""
    return seen_stats(seen_by_rank, dp_ranks).baseline_microstep_ratio


def summarize(results: dict, layout: str, cfg: DemoConfig | None = None) -> dict:
    """Compare the off and on runs of one layout (lists of per-rank results)."""
    off, on = results[(layout, False)], results[(layout, True)]
    last = next(i for i, r in enumerate(off) if r["last_stage"])
    # Data-holding ranks of the first stage: one per data-parallel rank.
    readers = sorted((i for i, r in enumerate(off) if r["has_data"] and r["pp_rank"] == 0),
                     key=lambda i: off[i]["dp_rank"])
    steps = len(off[last]["losses"])
    loss_rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(off[last]["losses"], on[last]["losses"]))
    param_rel = max(float(np.linalg.norm(a["params"] - b["params"]) / max(np.linalg.norm(a["params"]), 1e-30))
                    for a, b in zip(off, on))
    moved, same_packs, consumed = 0, True, {False: 0, True: 0}
    for s in range(steps):
        where = {}
        for mode, res in ((False, off), (True, on)):
            ids = [p for i in readers for p, _ in res[i]["seen"][s]]
            consumed[mode] += len(ids)
            where[mode] = {p: res[i]["dp_rank"] for i in readers for p, _ in res[i]["seen"][s]}
        same_packs &= sorted(where[False]) == sorted(where[True]) and len(where[False]) == consumed[False] // (s + 1)
        moved += sum(1 for p, r in where[True].items() if where[False].get(p) != r)

    def imb(res):
        return statistics.mean(imbalance([res[i]["seen"][s] for i in readers],
                                          [res[i]["dp_rank"] for i in readers]) for s in range(steps))

    def total_imb(res):
        ratios = []
        for s in range(steps):
            st = seen_stats([res[i]["seen"][s] for i in readers], list(range(len(readers))))
            if st.rank_total_mean:
                ratios.append(st.baseline_rank_ratio)
        return statistics.mean(ratios) if ratios else 1.0

    ep = LAYOUTS[layout][3]

    cfg = cfg or DemoConfig()

    def device_path_steps(res):
        # Emulated accelerator time (fwd + 2x bwd) on a step's critical path, no CPU: expert-
        # parallel groups (consecutive data-parallel ranks) wait for their slowest member every
        # micro-step and all ranks meet at the gradient all-reduce, so it is the max over EP
        # groups of the sum over micro-steps of (the group's max vision time + LLM time).
        per_step = []
        for s in range(steps):
            rows = [[3 * cfg.vision_ms_per_tile * c / cfg.tokens_per_tile for _, c in res[i]["seen"][s]]
                    for i in readers]
            groups = [rows[g:g + ep] for g in range(0, len(rows), ep)]
            worst = max(sum(max(col) + 3 * cfg.llm_ms_per_pack for col in zip(*grp)) for grp in groups)
            per_step.append(worst / 1e3)
        return per_step

    timed = range(1, steps) if steps > 1 else range(steps)      # step 1 warms up

    def step_time(res):
        return statistics.median(max(r["times"][s] for r in res) for s in timed)

    # Every data-holding rank of a data-parallel rank (first and last stage) ran the same packs.
    stages_agree = all(
        [[p for p, _ in st] for st in res[i]["seen"]] == [[p for p, _ in st] for st in res[j]["seen"]]
        for res in (off, on) for i in range(len(off)) for j in range(len(off))
        if res[i]["has_data"] and res[j]["has_data"] and res[i]["dp_rank"] == res[j]["dp_rank"])
    def slowest(res, s):
        return max(r["times"][s] for r in res)

    paired = statistics.median(slowest(off, s) / slowest(on, s) for s in timed)
    waits = [max(on[i]["stats"][s].consumer_wait_ms for i in readers)
             for s in range(steps) if all(len(on[i]["stats"]) > s for i in readers)]
    runtime_moved = sum(st.packs_moved for st in on[readers[0]]["stats"])
    return {"layout": layout, "steps": steps, "loss_rel": loss_rel, "param_rel": param_rel,
            "consumed_off": consumed[False], "consumed_on": consumed[True], "same_packs": same_packs,
            "stages_agree": stages_agree,
            "packs_moved": moved, "runtime_packs_moved": runtime_moved,
            "imbalance_off": imb(off), "imbalance_on": imb(on),
            "rank_total_imbalance_off": total_imb(off), "rank_total_imbalance_on": total_imb(on),
            "step_s_off": step_time(off), "step_s_on": step_time(on),
            "device_path_off": device_path_steps(off), "device_path_on": device_path_steps(on),
            "device_path_s_off": statistics.mean(device_path_steps(off)),
            "device_path_s_on": statistics.mean(device_path_steps(on)),
            "paired_speedup": paired, "exposed_wait_ms": statistics.mean(waits) if waits else float("nan"),
            "step_times_off": [slowest(off, s) for s in range(steps)],
            "step_times_on": [slowest(on, s) for s in range(steps)],
            "losses_off": off[last]["losses"], "losses_on": on[last]["losses"]}


def format_table(rows: list[dict]) -> str:
    head = (f"{'layout':<9} {'step s off':>10} {'step s on':>10} {'speedup':>8} {'img max/mean off':>17} "
            f"{'on':>6} {'packs moved':>11} {'max loss rel diff':>17} {'param rel diff':>14}")
    lines = [head, "-" * len(head)]
    for r in rows:
        sp = r["step_s_off"] / r["step_s_on"] if r["step_s_on"] else float("nan")
        lines.append(f"{r['layout']:<9} {r['step_s_off']:>10.3f} {r['step_s_on']:>10.3f} {sp:>7.2f}x "
                     f"{r['imbalance_off']:>17.3f} {r['imbalance_on']:>6.3f} {r['packs_moved']:>11d} "
                     f"{r['loss_rel']:>17.2e} {r['param_rel']:>14.2e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from megatron_mm_balance.data.mixtures import MIXTURES

    p = argparse.ArgumentParser(prog="mm-balance demo --train",
                                description="Train a tiny CLIP-ViT + MoE GPT with megatron-core on CPU "
                                            "(4 gloo ranks, expert parallel 2), balancing off vs on.")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per rank per step")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="dp4_ep2")
    p.add_argument("--mixture", default="mixed", choices=MIXTURES)
    p.add_argument("--vision-ms-per-tile", type=float, default=9.0,
                   help="emulated accelerator time of the vision encoder per image tile, forward "
                        "(backward: twice that); 0: real CPU compute only")
    p.add_argument("--llm-ms-per-pack", type=float, default=300.0,
                   help="emulated accelerator time of the LLM per pack, forward (backward: twice that)")
    p.add_argument("--img-size", type=int, default=32,
                   help="tile side in pixels (patch 8): raises the real ViT compute per tile")
    p.add_argument("--no-overlap", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=900.0, help="hard limit for the whole run, seconds")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the off-vs-on figures as JSON (mm-balance demo's summary reads it)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:          # `mm-balance demo --train -- --steps 3` passes the separator on
        argv = argv[1:]
    a = p.parse_args(argv)
    if a.steps < 2 or a.microbatches < 1:
        p.error("--steps must be >= 2 and --microbatches >= 1")
    if a.img_size < 8 or a.img_size % 8:
        p.error(f"--img-size must be a positive multiple of the patch size 8, got {a.img_size}")
    if a.vision_ms_per_tile < 0 or a.llm_ms_per_pack < 0:
        p.error("--vision-ms-per-tile and --llm-ms-per-pack must be >= 0")
    cfg = DemoConfig(steps=a.steps, microbatches=a.microbatches, mixture=a.mixture,
                     vision_ms_per_tile=a.vision_ms_per_tile, llm_ms_per_pack=a.llm_ms_per_pack,
                     overlap=not a.no_overlap, seed=a.seed, img_size=a.img_size)
    t0 = time.perf_counter()
    res = run_layouts(cfg, [a.layout], interleave=True, timeout=a.timeout)
    ok = report(cfg, a.layout, res)
    wall = time.perf_counter() - t0
    print(f"wall {wall:.0f} s")
    if a.json:
        write_summary(a.json, cfg, a.layout, res, wall)
    return 0 if ok else 1


def write_summary(path: str, cfg: DemoConfig, layout: str, results: dict, wall_s: float) -> dict:
    """The figures of :func:`report` as JSON: the emulated speed-up (median per-step off/on
    ratio and the emulated accelerator critical path), and whether training was unchanged."""
    import json

    row = summarize(results, layout, cfg)
    out = {"layout": layout, "steps": cfg.steps, "microbatches": cfg.microbatches,
           "vision_ms_per_tile": cfg.vision_ms_per_tile, "llm_ms_per_pack": cfg.llm_ms_per_pack,
           "paired_speedup": row["paired_speedup"], "step_s_off": row["step_s_off"],
           "step_s_on": row["step_s_on"], "device_path_s_off": row["device_path_s_off"],
           "device_path_s_on": row["device_path_s_on"], "imbalance_off": row["imbalance_off"],
           "imbalance_on": row["imbalance_on"], "packs_moved": row["packs_moved"],
           "loss_rel": row["loss_rel"], "param_rel": row["param_rel"],
           "equal": row["loss_rel"] <= 1e-5 and row["param_rel"] <= 1e-5
           and row["consumed_off"] == row["consumed_on"], "wall_s": wall_s}
    out["summary"] = (
        f"EMULATED (megatron-core on 4 gloo ranks, accelerator time emulated by sleeps of "
        f"{cfg.vision_ms_per_tile:g} ms per tile and {cfg.llm_ms_per_pack:g} ms per pack): median per-step "
        f"off/on {out['paired_speedup']:.2f}x; emulated accelerator critical path "
        + (f"{out['device_path_s_off'] / out['device_path_s_on']:.2f}x" if out["device_path_s_on"] else "-")
        + "; losses and parameters equal: "
        f"{'yes' if out['equal'] else 'NO'}")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    return out


def report(cfg: DemoConfig, layout: str, results: dict, out=None) -> bool:
    """Print the off-vs-on table for one layout; True when losses, parameters and consumed
    samples match (1e-5 relative)."""
    out = out or sys.stdout
    p = partial(print, file=out)
    row = summarize(results, layout, cfg)
    p(f"megatron-core {_mcore_version()} on CPU/gloo, 4 ranks, layout {layout}, {cfg.steps} steps x "
      f"{cfg.microbatches} micro-batches/rank, mixture {cfg.mixture}; emulated accelerator time: "
      f"vision {cfg.vision_ms_per_tile} ms/tile, LLM {cfg.llm_ms_per_pack} ms/pack (forward; backward 2x)")
    p(format_table([row]))
    p("step s: median over steps 2.. of the slowest rank; img max/mean: per micro-step image tokens, "
      "max over data-parallel ranks / mean, summed over micro-steps")
    if cfg.vision_ms_per_tile > 0 or cfg.llm_ms_per_pack > 0:
        off_s, on_s = row["device_path_s_off"], row["device_path_s_on"]
        p(f"emulated accelerator critical path (no CPU): {off_s:.3f} s/step off, {on_s:.3f} s/step on "
          f"({off_s / on_s:.2f}x); per step off: " + " ".join(f"{x:.3f}" for x in row["device_path_off"])
          + "; on: " + " ".join(f"{x:.3f}" for x in row["device_path_on"]))
        extra = [statistics.median(t - d for t, d in zip(row[f"step_times_{m}"][1:], row[f"device_path_{m}"][1:])
                                   or [0.0]) for m in ("off", "on")]
        p(f"measured minus modelled (shared-CPU work, exchange): {extra[0]:.3f} s/step off, "
          f"{extra[1]:.3f} s/step on (median over steps 2..)")
    p("step s off:", " ".join(f"{x:.3f}" for x in row["step_times_off"]))
    p("step s on: ", " ".join(f"{x:.3f}" for x in row["step_times_on"]))
    p(f"median per-step off/on ratio: {row['paired_speedup']:.2f}x; "
      f"balancer's exposed wait: {row['exposed_wait_ms']:.1f} ms/step (slowest rank)")
    p("losses off:", " ".join(f"{x:.6f}" for x in row["losses_off"]))
    p("losses on: ", " ".join(f"{x:.6f}" for x in row["losses_on"]))
    same = row["loss_rel"] <= 1e-5 and row["param_rel"] <= 1e-5 and row["consumed_off"] == row["consumed_on"]
    p(f"loss/parameters equal within 1e-5: {'yes' if same else 'NO'}; consumed samples "
      f"{row['consumed_off']} / {row['consumed_on']}")
    return same


def _mcore_version() -> str:
    try:
        from importlib.metadata import version
        return version("megatron-core")
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
