"""Single-process pieces of the glue: costs, schedule, save_state, group lists, telemetry."""
import argparse
import collections

import pytest
import torch

from megatron_mm_balance.megatron.groups import data_holding_rank_lists
from megatron_mm_balance.megatron.iterator import BalancedTrainIterable, wrap_train_data_iterator
from megatron_mm_balance.megatron.schedule import MicrobatchSchedule
from megatron_mm_balance.cost.pack import ImageTokenCost, ModelCost, image_counts
from megatron_mm_balance.megatron.telemetry import Telemetry, format_line, summarize


def _cfg(**args):
    """The config built from a (partial) Megatron namespace."""
    from megatron_mm_balance.megatron.config import MMBalanceConfig
    return MMBalanceConfig.from_args(argparse.Namespace(**args))


def _schedule(args):
    return _cfg(**vars(args)).schedule


# -- costs ---------------------------------------------------------------------------
def stock_batch(tiles):
    """What examples/multimodal's TaskEncoder.encode_batch yields (micro-batch size 1)."""
    return {"tokens": torch.zeros(1, 8, dtype=torch.int64), "num_tiles": torch.tensor(tiles, dtype=torch.int32),
            "cu_lengths": torch.tensor([[0, 3, 8]], dtype=torch.int32)}


def test_image_token_cost_reads_stock_and_recorded_batches():
    cost = ImageTokenCost(tokens_per_tile=256)
    assert cost(stock_batch([2, 1])) == 3 * 256
    assert cost({"image_tokens": torch.tensor([700])}) == 700
    assert cost({"image_token_counts": torch.tensor([100, 50]), "image_tokens": torch.tensor([150])}) == 150
    assert cost({"image_tokens": torch.tensor([3, 4])}) == 7            # micro-batch of two packs
    assert cost({"tokens": torch.zeros(3)}) == 0                        # text only
    with pytest.raises(ValueError, match="tokens_per_tile must be an int > 0"):
        ImageTokenCost(None)                                            # no silent 1 token per tile
    assert "tokens_per_tile=256" in cost.identity


def test_image_counts_rejects_non_dicts():
    with pytest.raises(TypeError, match="expected a dict"):
        image_counts([1, 2])


def test_model_cost_uses_images_and_lengths(tmp_path):
    from megatron_mm_balance.cost.model import CostModel, PackFeatures
    model = CostModel(vision_ms_per_token=1e-3, vision_ms_per_token_sq=1e-6, llm_ms_per_len_sq=1e-5)
    path = tmp_path / "cost.json"
    model.save(str(path))
    cost = ModelCost(str(path), tokens_per_tile=10)
    assert cost(stock_batch([2, 1])) == model.cost(PackFeatures((20, 10), (3, 5)))
    assert cost(stock_batch([2, 1])) > cost(stock_batch([1]))


def test_model_cost_under_expert_parallel_is_two_phase(tmp_path):
    """--mm-balance-cost model: (vision, language) microseconds when ranks meet every
    micro-step (the two-phase solver), one total otherwise; the two add up."""
    from megatron_mm_balance.cost.model import CostModel, PackFeatures
    from megatron_mm_balance.megatron.iterator import make_cost_fn
    model = CostModel(vision_ms_per_token=1e-3, vision_ms_per_token_sq=1e-6,
                      llm_ms_per_len_sq=1e-5, const_ms=2.0)
    path = tmp_path / "cost.json"
    model.save(str(path))
    from megatron_mm_balance.megatron.config import MMBalanceConfig
    ep = argparse.Namespace(mm_balance_cost="model", mm_balance_cost_file=str(path),
                            mm_balance_sync="auto", expert_model_parallel_size=4)
    dp = argparse.Namespace(**{**vars(ep), "expert_model_parallel_size": 1})
    two, one = (make_cost_fn(MMBalanceConfig.from_args(a)) for a in (ep, dp))
    assert (two.components, one.components) == (2, 1) and two.identity != one.identity
    v, l = two(stock_batch([2, 1]))
    f = PackFeatures((512, 256), (3, 5))
    assert (v, l) == model.phase_costs(f)
    assert abs(v + l - model.cost(f)) <= 1 and abs(one(stock_batch([2, 1])) - model.cost(f)) <= 1
    assert v > 0 and l > 0


# -- micro-batch schedule ---------------------------------------------------------------
RAMP_BASE = dict(global_batch_size=16, micro_batch_size=1, data_parallel_size=2,
                 decrease_batch_size_if_needed=False)


def ramp_args(fn) -> dict:
    """The variable-batch-size arguments that ``fn`` (Megatron's calculator builder or
    ``init_num_microbatches_calculator``) takes in this release, ramping 4 -> 16 samples:
    ``rampup_batch_size`` up to core_v0.17.1, ``step_batch_size_schedule`` (in samples)
    from core_v0.18.2. Branches on the parameters, not on a version."""
    import inspect
    if "step_batch_size_schedule" in inspect.signature(fn).parameters:
        return dict(step_batch_size_schedule="0:4 8:8 24:12 60:16", seq_length=None)
    return dict(rampup_batch_size=[4, 4, 40])


def test_predicted_schedule_matches_megatrons_rampup():
    """The sampler's look-ahead count equals Megatron's own calculator step by step, under
    the variable batch size this release has: --rampup-batch-size (up to core_v0.17.1) or
    --step-batch-size-schedule (from core_v0.18.2). Branches on the builder's parameters."""
    from megatron.core.num_microbatches_calculator import _build_num_microbatches_calculator as build
    base, var = RAMP_BASE, ramp_args(build)
    args = argparse.Namespace(**base, **var, consumed_train_samples=0)
    schedule = MicrobatchSchedule(_schedule(args), predict=True)
    # What the training loop does: update with consumed samples, run a step, add its batch.
    calc = build(rank=1, **base, **var)
    consumed, got, want = 0, [], []
    for _ in range(12):
        calc.update(consumed, False)
        want.append(calc.get())
        got.append(schedule())
        consumed += calc.get_current_global_batch_size()
    assert got == want and len(set(want)) > 2


def test_default_schedule_reads_get_num_microbatches():
    from megatron.core import num_microbatches_calculator as nmc
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, None, 12, 1, 4)
    try:
        assert MicrobatchSchedule(_schedule(argparse.Namespace(rampup_batch_size=None)))() == 3
    finally:
        nmc.destroy_num_microbatches_calculator()


# -- save_state and pass-through ---------------------------------------------------------
class Loader:
    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        return {"image_tokens": self.n}

    def save_state(self):
        return {"read": self.n}


class FakeBalancer:
    def __init__(self, src):
        self.src, self.stats = src, collections.deque([{"packs_moved": 1}])

    def __next__(self):
        return next(self.src)

    def close(self):
        pass


def _iterable(items, source):
    return BalancedTrainIterable(items, source, global_batch_of=lambda: 0, stats=items)


def test_save_state_is_the_loaders_and_absent_when_it_has_none():
    loader = Loader()
    it = _iterable(FakeBalancer(loader), loader)
    next(it), next(it)
    assert it.save_state() == {"read": 2} and it.delivered == 2
    plain = iter([{"a": 1}])
    assert not hasattr(_iterable(FakeBalancer(plain), plain), "save_state")


class SavableLoader:
    """An energon-like loader: ``__next__``, ``__iter__`` (a generator, as EnergonDataloader's
    cyclic iterator) and ``save_state``."""

    def __init__(self):
        self.n = 0

    def _gen(self):
        while True:
            self.n += 1
            yield {"image_tokens": torch.tensor([self.n % 5])}

    def __iter__(self):
        self._it = getattr(self, "_it", None) or self._gen()
        return self._it

    def __next__(self):
        return next(iter(self))

    def save_state(self):
        return {"read": self.n}


def test_save_state_is_the_balancers_paired_state_while_the_thread_reads_ahead():
    """A savable loader gets the free-running thread; ``save_state`` is the consumed position."""
    import time
    from megatron_mm_balance.runtime import BalancedDataIterator
    loader = SavableLoader()
    bal = BalancedDataIterator(iter(loader), num_microbatches=3, timeout=10,
                               state_fn=loader.save_state)
    it = _iterable(bal, loader)
    try:
        assert it.save_state() == {"read": 0}
        for _ in range(6):
            next(it)
        deadline = time.monotonic() + 10
        while loader.n <= 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loader.n > 6                                   # read ahead into the next batch
        assert it.save_state() == {"read": 6}                 # but the state is the consumed one
        assert all(s.prefetched for s in list(bal.stats)[1:])
        next(it)
        with pytest.raises(RuntimeError, match=r"inside global batch 2, after micro-step 0"):
            it.save_state()
    finally:
        bal.close()


def test_schedule_is_an_int_for_a_fixed_batch_size_even_with_save_state():
    """Fixed batch size: an int (free-running prefetch; energon stays exact through the
    balancer's paired state); ramp-up: the callable; explicit values pass through."""
    from megatron.core import num_microbatches_calculator as nmc
    from megatron_mm_balance.megatron.iterator import _schedule_for
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, None, 12, 1, 4)
    try:
        got = _schedule_for(_cfg(rampup_batch_size=None), None)
        assert got == 3 and type(got) is int
        ramp = _schedule_for(_cfg(rampup_batch_size=[4, 4, 40]), None)
        assert isinstance(ramp, MicrobatchSchedule) and ramp() == 3
    finally:
        nmc.destroy_num_microbatches_calculator()
    assert _schedule_for(_cfg(), 5) == 5
    fn = lambda: 2  # noqa: E731
    assert _schedule_for(_cfg(), fn) is fn


def test_ramp_up_gets_a_predicting_schedule_for_the_thread():
    """Ramp-up: the thread runs ahead on Megatron's calculator run privately from the consumed
    samples at wrap time (a resumed run predicts from there); fixed or explicit counts: none."""
    from megatron.core.num_microbatches_calculator import _build_num_microbatches_calculator as build
    from megatron_mm_balance.megatron.iterator import _predictor_for
    base, var = RAMP_BASE, ramp_args(build)
    pred = _predictor_for(_cfg(**base, **var, consumed_train_samples=12), None)
    calc = build(rank=1, **base, **var)
    consumed, want = 12, []
    for _ in range(6):
        calc.update(consumed, False)
        want.append(calc.get())
        consumed += calc.get_current_global_batch_size()
    assert [pred() for _ in range(6)] == want
    assert _predictor_for(_cfg(**base, rampup_batch_size=None), None) is None
    assert _predictor_for(_cfg(**base, **var), 4) is None


def test_the_glue_hands_the_loaders_save_state_to_the_balancer():
    """ExchangeCoordinator.wrap: the loader's save_state becomes the balancer's state_fn and
    ``iterable.save_state`` is the paired one."""
    from megatron_mm_balance.megatron.iterator import ExchangeCoordinator, balancers
    from megatron_mm_balance.megatron.arguments import add_mm_balance_args
    from megatron_mm_balance.megatron.checks import checked_config
    args = add_mm_balance_args(argparse.ArgumentParser()).parse_args(["--mm-balance"])
    args.__dict__.update(micro_batch_size=1, tensorboard_dir=None, rampup_batch_size=None)
    loader = SavableLoader()
    coord = ExchangeCoordinator(checked_config(args), cost_fn=lambda p: int(p["image_tokens"]),
                                num_microbatches=2)
    wrapped = coord.wrap(loader, None, 0)
    [bal] = balancers(wrapped)
    try:
        assert bal.savable and wrapped.iterable.save_state == bal.save_state
        for _ in range(4):
            next(wrapped)
        assert wrapped.iterable.save_state() == {"read": 4}
    finally:
        bal.close()


def test_wrap_is_identity_when_flag_off():
    marker = object()
    args = argparse.Namespace(mm_balance=False)
    assert wrap_train_data_iterator(marker, args) is marker
    assert wrap_train_data_iterator([marker, None], args) == [marker, None]
    assert wrap_train_data_iterator(None, args) is None


def test_exchange_groups_are_an_explicit_object_one_group_per_chunk():
    """init_exchange_groups returns ExchangeGroups (no module state); the wrapper takes it and
    checks it has one group per model chunk."""
    import megatron_mm_balance.megatron.groups as groups_mod
    from megatron_mm_balance.megatron.groups import ExchangeGroups
    groups = ExchangeGroups(chunks=(None, None), rank_lists=((0, 1),))
    assert len(groups) == 2 and groups.chunk(1) is None and list(groups) == [None, None]
    assert not [n for n in vars(groups_mod) if n.startswith("_") and n.isupper()]
    args = argparse.Namespace(mm_balance=True)
    with pytest.raises(ValueError, match="exchange_groups has 2 model chunks, the train iterators 1"):
        wrap_train_data_iterator(object(), args, exchange_groups=groups)
    # No group on this rank (it reads no data): its iterators come back as they are.
    marker = [object(), object()]
    assert wrap_train_data_iterator(marker, args, exchange_groups=groups) == marker


# -- group lists -------------------------------------------------------------------------
def test_data_holding_rank_lists():
    # PP=2, TP=2, DP=2 in Megatron's default order (tp fastest): ranks 0..7.
    layouts = []
    for r in range(8):
        tp, dp, pp = r % 2, (r // 2) % 2, r // 4
        dp_ranks = [pp * 4 + d * 2 + tp for d in range(2)]
        layouts.append({"holds_data": tp == 0, "dp_ranks": dp_ranks})
    assert data_holding_rank_lists(layouts) == [[0, 2], [4, 6]]
    layouts[2] = {"holds_data": True, "dp_ranks": [2, 3]}
    with pytest.raises(ValueError, match="two data-parallel groups"):
        data_holding_rank_lists(layouts)
    with pytest.raises(ValueError, match="not in its own"):
        data_holding_rank_lists([{"holds_data": True, "dp_ranks": [1]}, {"holds_data": False, "dp_ranks": [1]}])


# -- telemetry ---------------------------------------------------------------------------
class Writer:
    def __init__(self):
        self.scalars, self.logged = [], []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def log(self, values, step):
        self.logged.append((values, step))


def _batch(costs, sync="microstep", gb=0, mode="exchange", **fields):
    """The BatchStats a mode records for a cost matrix (the planner's plan)."""
    import numpy as np
    from megatron_mm_balance.runtime.config import BalancerConfig
    from megatron_mm_balance.runtime.planner import plan_batch
    from megatron_mm_balance.runtime.stats import BatchStats
    c = np.asarray(costs, dtype=np.int64)
    _, plan = plan_batch(c, BalancerConfig(sync=sync))
    return BatchStats(global_batch=gb, num_microbatches=c.shape[1], plan=plan, mode=mode, **fields)


def test_imbalance_reads_right_when_the_step_maximum_drops():
    """The case the old per-step ratio got wrong: the placement lowers the step maxima (576 ->
    320 in total) but dividing each delivered step's maximum by the drawn step's mean said the
    imbalance rose (2.0 -> 2.83). Ratio of sums: 576/288 -> 320/288."""
    s = summarize([_batch([[0, 0, 0], [256, 64, 256]])])
    assert s["cost_step_max_before"] == 192 and s["cost_step_max_after"] == pytest.approx(320 / 3)
    assert s["cost_step_mean"] == 96
    assert s["imbalance_before"] == pytest.approx(2.0) and s["imbalance_after"] == pytest.approx(320 / 288)
    assert s["packs_moved"] > 0 and s["global_batches"] == 1


@pytest.mark.parametrize("sync", ["microstep", "step"])
def test_imbalance_after_is_at_most_before_exactly_when_the_step_maximum_does_not_rise(sync):
    import numpy as np
    rng = np.random.default_rng(7)
    rose = 0
    for trial in range(200):
        D, G = int(rng.integers(2, 5)), int(rng.integers(2, 6))
        batches = [_batch(rng.choice([0, 16, 64, 256, 2048], size=(D, G)), sync, gb=i)
                   for i in range(int(rng.integers(1, 4)))]
        s = summarize(batches)
        assert (s["imbalance_after"] <= s["imbalance_before"]) == \
            (s["cost_step_max_after"] <= s["cost_step_max_before"])
        assert s["imbalance_after"] == pytest.approx(s["cost_step_max_after"] / s["cost_step_mean"])
        rose += s["cost_step_max_after"] > s["cost_step_max_before"]
        if sync == "microstep":                     # optimal per micro-step: never worse
            assert s["imbalance_after"] <= s["imbalance_before"] + 1e-12
        else:                                       # step mode evens rank totals
            assert s["rank_imbalance_after"] <= s["rank_imbalance_before"] + 1e-12
    assert sync == "microstep" or rose > 0         # step mode may raise the micro-step maxima


def test_shadow_reports_what_was_delivered_and_what_would_be():
    b = _batch([[0, 0, 0], [256, 64, 256]], mode="shadow")
    s = summarize([b])
    assert s["packs_moved"] == 0 and s["packs_would_move"] == b.plan.packs_moved > 0
    assert s["cost_step_max_after"] == s["cost_step_max_before"]        # delivered as drawn
    assert s["imbalance_after"] == s["imbalance_before"]
    assert s["imbalance_would_be"] == pytest.approx(320 / 288)
    assert s["gain_would_be"] == pytest.approx(1 - 320 / 576)
    assert "packs_would_move" not in summarize([_batch([[0, 0, 0], [256, 64, 256]])])


def test_control_reports_the_permutation_delivered():
    """Control mode's line: ``control: 1``, nothing moved, the reordered slots counted, and
    the "after" figures those of the permuted order delivered (rank totals unchanged)."""
    import numpy as np
    from megatron_mm_balance.runtime.stats import BatchStats
    from megatron_mm_balance.solver.placement import PlanStats, control_placement, plan_placement, reordered_packs
    c = np.array([[900, 10, 10, 10], [10, 700, 10, 600]])
    delivered = control_placement(plan_placement(c))
    b = BatchStats(global_batch=0, num_microbatches=4, plan=PlanStats.of(c, delivered), mode="control",
                   packs_reordered=reordered_packs(delivered))
    s = summarize([b])
    assert s["control"] == 1.0 and s["packs_moved"] == 0 and s["packs_reordered"] == reordered_packs(delivered) > 0
    assert s["rank_imbalance_after"] == s["rank_imbalance_before"]
    assert "control" not in summarize([_batch([[0, 0, 0], [256, 64, 256]])])


def test_node_figures_only_where_the_nodes_are_known():
    """Without node information (nothing found, no --mm-balance-ranks-per-node) no node field
    is reported, rather than every moved pack counted as crossing; with nodes (one or more)
    the group's nodes, its packs that changed node and this rank's bytes sent across."""
    unknown = summarize([_batch([[0, 0, 0], [256, 64, 256]], packs_sent=2, bytes_sent=100)])
    assert unknown["packs_moved"] > 0 and unknown["bytes_sent"] == 100
    assert not {"nodes", "inter_node_packs", "inter_node_bytes_sent"} & set(unknown)
    one = summarize([_batch([[0, 0, 0], [256, 64, 256]], nodes=1, inter_node_packs=0,
                            inter_node_bytes_sent=0)])
    assert (one["nodes"], one["inter_node_packs"], one["inter_node_bytes_sent"]) == (1, 0, 0)
    two = summarize([_batch([[0, 0, 0], [256, 64, 256]], gb=i, nodes=2, inter_node_packs=i,
                            inter_node_bytes_sent=10 * i) for i in (1, 2)])
    assert (two["nodes"], two["inter_node_packs"], two["inter_node_bytes_sent"]) == (2, 1.5, 15)
    assert "inter_node_packs: 1.5" in format_line(3, two)


def test_sampler_batches_report_no_transfer():
    s = summarize([_batch([[0, 5], [9, 1]], mode="sampler", solver_ms=0.5)])
    assert "bytes_sent" not in s and "prefetched" not in s and s["solver_ms"] == 0.5
    assert summarize([]) == {}
    assert "iteration 5" in format_line(5, {"a": 1.0})


class Source:
    def __init__(self):
        self.stats = collections.deque()


def test_telemetry_writes_every_interval_to_writers_and_log(capsys):
    source = Source()
    tb, wb = Writer(), Writer()
    tel = Telemetry(source, interval=2, tb_writer=tb, wandb_writer=wb, reporter=True)
    tel.on_batch(0)
    for it in range(1, 7):
        source.stats.append(_batch([[it, 0], [0, 0]], gb=it - 1, packs_sent=it))
        tel.on_batch(it)      # global batch `it` starts at iteration `it`
    steps = [s for tag, _, s in tb.scalars if tag == "mm-balance/packs_sent"]
    assert steps == [2, 4, 6]
    # Iteration 4 averages the global batches since iteration 2: 3 and 4.
    assert ("mm-balance/packs_sent", 3.5, 4) in tb.scalars
    assert [s for _, s in wb.logged] == [2, 4, 6]
    assert capsys.readouterr().out.count("[mm-balance] iteration") == 3


def test_first_line_of_a_resumed_job_says_how_megatron_logs_it(capsys):
    source = Source()
    source.stats.extend(_batch([[1, 0], [0, 0]], gb=i) for i in range(3))
    tel = Telemetry(source, interval=1, start_iteration=3, reporter=True, tb_writer=Writer())
    for gb in (1, 2, 3):                              # loaded the iteration-3 checkpoint
        tel.on_batch(gb)
    first, *rest = tel.lines
    assert "| resumed_from: 3 | note: Megatron logs this job's first iteration (4) alone" in first
    assert "mm-balance compare-logs" in first and rest and not any("resumed_from" in l for l in rest)
    fresh = Telemetry(source, interval=1, reporter=True, tb_writer=Writer())
    fresh.on_batch(1)
    assert fresh.lines and "resumed_from" not in fresh.lines[0]


def test_a_resumed_run_counts_iterations_from_its_checkpoint(capsys):
    source = Source()
    tel = Telemetry(source, interval=5, start_iteration=8, reporter=True, tb_writer=Writer())
    source.stats.extend(_batch([[1, 0], [0, 0]], gb=i) for i in range(3))
    for gb in range(3):
        tel.on_batch(gb)                            # iterations 8, 9, 10: one report, at 10
    assert [line.split(" | ")[0] for line in tel.lines] == ["[mm-balance] iteration 10"]
    assert "global_batches: 2 " in tel.lines[0] + " "     # batches 0 and 1, not 2 (in progress)


def test_one_line_per_report_even_with_logging_set_up(capsys):
    """Megatron's training.py installs a root logging handler at INFO; the report used to go
    through logging and print, so every line appeared twice. It is printed once, not logged."""
    import io
    import logging
    source = Source()
    source.stats.append(_batch([[1, 0], [0, 0]]))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        Telemetry(source, interval=1, reporter=True, tb_writer=Writer()).on_batch(1)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert capsys.readouterr().out.count("[mm-balance] iteration 1") == 1
    assert "[mm-balance]" not in stream.getvalue()


def test_non_reporting_rank_writes_nothing():
    source = Source()
    source.stats.append(_batch([[1, 0], [0, 0]]))
    tb = Writer()
    tel = Telemetry(source, interval=1, start_iteration=4, tb_writer=tb, reporter=False)
    tel.on_batch(1)
    assert tb.scalars == []


def test_make_cost_fn_knows_multimodal_tile_size():
    from megatron_mm_balance.megatron.iterator import make_cost_fn
    args = argparse.Namespace(mm_balance_cost="image-tokens", img_h=336, img_w=336, patch_dim=14,
                              vision_model_type="clip", disable_vision_class_token=True,
                              pixel_shuffle=False, use_tile_tags=False, max_num_tiles=1,
                              tokenizer_prompt_format="qwen2p5")
    assert make_cost_fn(_cfg(**vars(args)))(stock_batch([2])) == 2 * 576   # (336/14)^2 patches per tile
    args.pixel_shuffle = True
    assert make_cost_fn(_cfg(**vars(args)))(stock_batch([2])) == 2 * 144
    # Not a multimodal run: the runtime's default tokens per tile.
    assert make_cost_fn(_cfg(mm_balance_cost="image-tokens"))(stock_batch([2])) == 2 * 256


def test_importing_the_glue_pulls_in_no_megatron_energon_te_or_apex():
    import subprocess
    import sys
    code = ("import sys, megatron_mm_balance\n"
            "from megatron_mm_balance.megatron import arguments, checks, groups, iterator, sampler, "
            "telemetry, energon\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('megatron', 'transformer_engine', 'apex'))\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


class _Writes:
    """A text stream that keeps every ``write`` call apart."""

    def __init__(self):
        self.calls = []

    def write(self, text):
        self.calls.append(text)
        return len(text)

    def flush(self):
        pass


def test_a_telemetry_line_goes_out_in_one_write(monkeypatch):
    """The line and its newline in one write: with unbuffered output another rank's line
    could otherwise land between them (a Bridge log once read ``prefetched: 1 [date] iteration
    5/ 6``)."""
    import sys

    from megatron_mm_balance.megatron import telemetry

    rec = _Writes()
    monkeypatch.setattr(sys, "stdout", rec)
    telemetry.emit("[mm-balance] iteration 5 | packs_moved: 4 | prefetched: 1")
    assert rec.calls == ["[mm-balance] iteration 5 | packs_moved: 4 | prefetched: 1\n"]


def test_telemetry_lines_read_back_as_written():
    """read_lines, the one reader of format_line's lines: every figure as written (6
    significant digits), the chunk, numberless fields (the resume note) left out, a figure
    with another rank's output glued on read by its leading number, a line behind another
    rank's unfinished one still read, other lines ignored."""
    from megatron_mm_balance.megatron.telemetry import resume_note
    from megatron_mm_balance.runtime.log_line import format_line, read_lines
    summary = {"packs_moved": 3.0, "imbalance_before": 1.234567891, "bytes_sent": 1.5e9, "cost_after": -2.0}
    text = "\n".join([
        "[2026-12-03 03:01:19] iteration        5/       6 | lm loss: 6.305675E+00 |",
        format_line(5, summary) + resume_note(4),
        format_line(5, {"packs_moved": 1.0}, chunk=1),
        format_line(6, {"prefetched": 1.0}) + " [2026-12-03 03:01:20] iteration 6/ 6 | lm loss: 6.2E+00 |",
        "WARNING: another rank's unfinished line" + format_line(7, {"packs_moved": 2.0}),
    ])
    lines = list(read_lines(text))
    assert [(it, chunk) for it, chunk, _ in lines] == [(5, 0), (5, 1), (6, 0), (7, 0)]
    assert lines[3][2] == {"packs_moved": 2.0}
    first = lines[0][2]
    assert first == {"packs_moved": 3.0, "imbalance_before": 1.23457, "bytes_sent": 1.5e9, "cost_after": -2.0,
                     "resumed_from": 4.0}
    assert lines[1][2] == {"packs_moved": 1.0}
    assert lines[2][2]["prefetched"] == 1.0


def test_each_line_of_ours_goes_out_in_one_write(monkeypatch):
    """The ranks of a job share the launcher's stdout and stderr: a stop line, a telemetry
    line or a fault's line written in two pieces (``print``: the text, then the newline) can
    have another rank's whole line land between them, and a reader looking for our lines
    at the start of a line misses one. Each goes out as one write ending in its newline."""
    from megatron_mm_balance.megatron.stops import StopReporter
    from megatron_mm_balance.megatron.telemetry import emit
    out, err = _Writes(), _Writes()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    reporter = StopReporter(lambda: 4, rank=2)
    reporter.error(ValueError("a pack of samples [a, b] was refused"))
    reporter.stopped("SIGTERM")
    emit(format_line(4, {"packs_moved": 3.0}))
    assert [c.split(":")[0] for c in err.calls] == ["[mm-balance] rank 2", "[mm-balance] rank 2"]
    assert "training stops at iteration 4: ValueError: a pack of samples [a, b] was refused" in err.calls[0]
    assert "stopped by SIGTERM at iteration 4" in err.calls[1]
    assert out.calls == ["[mm-balance] iteration 4 | packs_moved: 3\n"]
    for call in err.calls + out.calls:
        assert call.endswith("\n") and call.count("\n") == 1, repr(call)
