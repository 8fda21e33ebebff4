"""The meeting groups read from the job, on real gloo processes: Megatron's own
``parallel_state`` initialised on CPU in five layouts (DP=4 x EP=2, DP=4, PP=2 x DP=2, the
same with EP=2, CP=2 x DP=2 x EP=2), read through the Megatron-LM glue
(``init_exchange_groups`` from ``parallel_state``) and through the Bridge glue's reading of a
``ProcessGroupCollection``; then the wiring: ``auto`` sync follows the groups, the planner
places by them, the statistics and the log name them. One launch of four processes for all.
"""
import argparse

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed")

from megatron_mm_balance.testing.cpu_megatron import launch  # noqa: E402

#: slow: multi-process runs of megatron-core's own parallel state
pytestmark = pytest.mark.realpath

#: name: (pipeline, context, expert parallel) on four ranks, tensor parallel 1
LAYOUTS = {"dp4_ep2": (1, 1, 2), "dp4": (1, 1, 1), "pp2_dp2": (2, 1, 1), "pp2_dp2_ep2": (2, 1, 2),
           "cp2_dp2_ep2": (1, 2, 2)}
G, STEPS = 4, 2


def _read(pp, cp, ep):
    """This rank's exchange groups and meeting groups, read by both glues."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_mm_balance.megatron.config import MegatronArgs, MMBalanceConfig
    from megatron_mm_balance.megatron.groups import init_exchange_groups, process_group_layout
    from megatron_mm_balance.testing.cpu_megatron import install

    install()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp, context_parallel_size=cp,
                                 expert_model_parallel_size=ep, create_gloo_process_groups=False)
    mlm = init_exchange_groups(timeout=60)                    # from parallel_state
    bridge = init_exchange_groups(process_group_layout(ProcessGroupCollection.use_mpu_process_groups()),
                                  timeout=60)                 # from Bridge's pg_collection
    cfg = MMBalanceConfig(enabled=True, megatron=MegatronArgs(expert_model_parallel_size=ep))
    auto, forced = cfg.with_meetings(mlm.meetings), MMBalanceConfig(
        enabled=True, sync="microstep").with_meetings(mlm.meetings)
    seen = lambda m: None if m is None else m.as_dict() | {"labels": list(m.labels())}  # noqa: E731
    return {"lists": [list(g) for g in mlm.rank_lists], "bridge_lists": [list(g) for g in bridge.rank_lists],
            "meetings": seen(mlm.meetings), "bridge_meetings": seen(bridge.meetings),
            "holds": mlm.chunk(0) is not None,
            "sync": auto.sync, "placed": auto.runtime().step_groups, "judged": auto.runtime().job_step_groups,
            "line": auto.meeting_line(), "forced": (forced.sync, forced.runtime().step_groups,
                                                    forced.runtime().job_step_groups)}


class Loader:
    """Rank r's packs: ranks 0 and 1 draw the image-heavy ones, so balancing must move some."""

    def __init__(self, rank):
        self.rank, self.n = rank, 0

    def __next__(self):
        import torch
        k = self.n
        self.n += 1
        heavy = (4000 + 500 * (k % 3)) if self.rank < 2 else 10 + k
        return {"image_tokens": torch.tensor([heavy]), "id": torch.tensor([self.rank * 1000 + k])}


def _exchange(sync, mode="exchange"):
    """DP=4 x EP=2 through ``wrap_train_data_iterator``: what the planner placed by and what the
    statistics and the log say."""
    import contextlib
    import io

    from megatron.core.rerun_state_machine import RerunDataIterator

    from megatron_mm_balance.megatron.arguments import add_mm_balance_args
    from megatron_mm_balance.megatron.iterator import balancers, wrap_train_data_iterator
    args = add_mm_balance_args(argparse.ArgumentParser()).parse_args(
        ["--mm-balance", "--mm-balance-timeout", "60", "--mm-balance-log-interval", "1",
         "--mm-balance-sync", sync, "--mm-balance-mode", mode, "--no-mm-balance-overlap"])
    args.__dict__.update(micro_batch_size=1, calculate_per_token_loss=False, expert_model_parallel_size=2,
                         num_experts=None, tensorboard_dir=None)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        it = wrap_train_data_iterator(RerunDataIterator(Loader(_rank())), args, num_microbatches=G)
        ids = [[int(next(it)["id"]) for _ in range(G)] for _ in range(STEPS + 1)]
    bal = balancers(it)[0]
    stats, settings = [s.plan for s in bal.stats][:STEPS], bal._engine.settings   # what the ranks agreed on
    bal.close()
    return {"ids": ids[:STEPS], "log": log.getvalue(), "settings": settings,
            "plans": [(p.step_groups, p.inter_group_moves, p.packs_moved, p.group_cost_before,
                       p.group_cost_after, p.microstep_cost_after) for p in stats]}


def _rank():
    import torch.distributed as dist
    return dist.get_rank()


def meeting_worker(rank, world):
    out = {name: _read(*sizes) for name, sizes in LAYOUTS.items()}
    _read(*LAYOUTS["dp4_ep2"])
    out["exchange"] = {sync: _exchange(sync) for sync in ("auto", "microstep")}
    out["exchange"]["groups-crossover-odd"] = _exchange("auto", "groups-crossover-odd")
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(meeting_worker, 4, timeout=300)


def test_dp4_ep2_two_step_groups_of_two_in_one_data_parallel_group(ranks):
    for rank, r in enumerate(ranks):
        got = r["dp4_ep2"]
        assert got["lists"] == got["bridge_lists"] == [[0, 1, 2, 3]]
        assert got["meetings"]["steps"] == [[0, 1], [2, 3]] and got["meetings"]["labels"] == [0, 0, 1, 1]
        assert got["bridge_meetings"] == got["meetings"]
        assert got["sync"] == "microstep" and got["placed"] == got["judged"] == (0, 0, 1, 1)
        assert got["forced"] == ("microstep", None, (0, 0, 1, 1))   # set by hand: all ranks, judged by the job's
    assert ranks[0]["dp4_ep2"]["line"] == (
        "[mm-balance] meeting groups: per iteration: data parallel of 4 [0, 1, 2, 3]; per micro-step: "
        "2 groups of 2 (expert parallel) [0, 1] [2, 3] | sync: microstep inside each step group, rank "
        "totals across them, from the job")


def test_without_expert_parallel_nobody_meets_within_an_iteration(ranks):
    for name, lists in (("dp4", [[0, 1, 2, 3]]), ("pp2_dp2", [[0, 1], [2, 3]])):
        for rank, r in enumerate(ranks):
            got = r[name]
            assert got["lists"] == got["bridge_lists"] == lists, name
            mine = next(g for g in lists if rank in g)
            assert got["meetings"]["steps"] == [[x] for x in mine], name
            assert got["bridge_meetings"] == got["meetings"]
            assert got["sync"] == "step" and got["placed"] is None, name
            assert "per micro-step: none (each rank alone) | sync: step" in got["line"], name


def test_pipeline_stages_each_meet_whole_when_expert_parallel_spans_data_parallel(ranks):
    for rank, r in enumerate(ranks):
        got = r["pp2_dp2_ep2"]
        assert got["lists"] == got["bridge_lists"] == [[0, 1], [2, 3]]   # one group per stage
        assert got["meetings"]["steps"] == ([[0, 1]] if rank < 2 else [[2, 3]])
        assert got["bridge_meetings"] == got["meetings"]
        assert got["sync"] == "microstep" and got["placed"] == (0, 0)
        assert "(all ranks meet every micro-step)" in got["line"]


def test_expert_parallel_inside_the_context_parallel_ranks_links_no_data_parallel_rank(ranks):
    """CP=2 x DP=2 x EP=2: Megatron-core's expert-parallel groups are the two
    context-parallel ranks of one data-parallel position, so the data-parallel group of each
    context-parallel rank (its exchange group) has no rank that waits for another."""
    for rank, r in enumerate(ranks):
        got = r["cp2_dp2_ep2"]
        assert got["lists"] == got["bridge_lists"] == [[0, 2], [1, 3]]
        assert got["meetings"]["steps"] == ([[0], [2]] if rank % 2 == 0 else [[1], [3]])
        assert got["bridge_meetings"] == got["meetings"]
        assert got["sync"] == "step" and got["placed"] is None


def test_the_planner_places_by_the_job_groups_and_the_log_names_them(ranks):
    auto = [r["exchange"]["auto"] for r in ranks]
    today = [r["exchange"]["microstep"] for r in ranks]
    assert len({r["settings"] for r in auto}) == 1 and auto[0]["settings"].endswith(" step_groups=0,0,1,1")
    assert "step_groups" not in today[0]["settings"]
    for runs in (auto, today):
        for s in range(STEPS):                                   # each pack delivered once
            got = sorted(i for r in runs for i in r["ids"][s])
            assert got == sorted(rank * 1000 + s * G + k for rank in range(4) for k in range(G))
    for plans in ([r["plans"] for r in auto], [r["plans"] for r in today]):
        assert all(p == plans[0] for p in plans)                 # every rank: the same figures
    for (groups, inter, moved, before, after, _), (_, t_inter, t_moved, t_before, t_after, _) in zip(
            auto[0]["plans"], today[0]["plans"]):
        assert groups == 2 and before == t_before                # both judged by the job's groups
        assert after <= t_after and moved <= t_moved and inter <= t_inter
    lines = [line for line in auto[0]["log"].splitlines() if line.startswith("[mm-balance] meeting groups")]
    assert lines == [ranks[0]["dp4_ep2"]["line"]]
    assert "step_groups: 2" in auto[0]["log"] and "inter_group_packs:" in auto[0]["log"]
    assert "as set (the job: microstep)" in today[0]["log"]
    assert all("meeting groups" not in r["log"] for r in auto[1:])   # the group's lowest rank writes it


def test_groups_crossover_places_by_the_groups_at_one_parity_and_as_today_at_the_other(ranks):
    """``--mm-balance-mode groups-crossover-odd``: iteration 1 (global batch 0) placed by the
    meeting groups, iteration 2 as if all ranks met every micro-step, on the same data."""
    cross, auto, today = (ranks[0]["exchange"][k] for k in ("groups-crossover-odd", "auto", "microstep"))
    assert cross["settings"].endswith(" step_groups=0,0,1,1 step_groups_parity=odd")
    assert cross["plans"][0] == auto["plans"][0] and cross["plans"][1] == today["plans"][1]
    assert "by these groups at odd iterations only" in cross["log"]
