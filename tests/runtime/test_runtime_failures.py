"""Peers that raise, die or stall; inconsistent configuration; exhaustion;
num_microbatches ramp-up; errors in the background thread. Real processes, real
gloo; every launch has a hard timeout, so a hang fails the test instead of CI."""
import importlib.util
import os
import re
from collections import Counter

import pytest

_spec = importlib.util.spec_from_file_location(
    "rt_harness", os.path.join(os.path.dirname(__file__), "rt_harness.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


@pytest.fixture(scope="module")
def misc():
    res = harness.launch(3, "misc", hard_timeout=120)
    for r, x in enumerate(res):
        assert "raise" in x, f"rank {r}: {x.get('error') or x}\n{x.get('log', '')}"
    return res


def test_peer_source_raises(misc):
    """The rank whose source raised gets its own error, unchanged, with where it happened
    attached (``mm_balance_context``); its peers a PeerFailure naming it and the micro-step."""
    assert misc[1]["raise"] == {"type": "ValueError", "msg": "boom in the data source of rank 1",
                                "context": "rank 1, global batch 2, micro-step 1: the data source raised"}
    for r in (0, 2):
        out = misc[r]["raise"]
        assert out["type"] == "PeerFailure"
        assert "global batch 2" in out["msg"] and "rank 1's data source raised: micro-step 1: " in out["msg"]
        assert "boom" in out["msg"]
    for r in range(3):                               # the iterator stays failed
        assert misc[r]["raise_again"]["type"] == "BalancerError"


def test_store_keys_do_not_depend_on_the_order_iterators_are_built_in(misc):
    """Rank 0 built an extra iterator on the shared group first; its peers' diagnosis still
    reads rank 1's posted error (keys: group name + the caller's name)."""
    assert misc[1]["keys_by_name"]["type"] == "ValueError"
    for r in (0, 2):
        out = misc[r]["keys_by_name"]
        assert out["type"] == "PeerFailure" and "boom in the data source of rank 1" in out["msg"], out


def test_board_prefix_is_the_group_name_and_the_callers_name():
    from megatron_mm_balance.runtime.iterator import board_prefix

    class Group:
        group_name = "7"
    assert board_prefix(Group(), [0, 1], "chunk1") == "mm_balance/7/chunk1"
    assert board_prefix(None, [2, 3]) == "mm_balance/2,3"


def test_inconsistent_num_microbatches(misc):
    for r in range(3):
        out = misc[r]["mismatch_G"]
        assert out["type"] == "InconsistentConfig" and "num_microbatches" in out["msg"]
        assert "{0: 2, 1: 2, 2: 3}" in out["msg"]


def test_inconsistent_solver_settings(misc):
    for r in range(3):
        out = misc[r]["mismatch_settings"]
        assert out["type"] == "InconsistentConfig" and "solver settings" in out["msg"]


def test_rampup_callable(misc):
    pulled = [x["ramp"]["pulled"] for x in misc]
    delivered = [x["ramp"]["delivered"] for x in misc]
    for x in misc:
        assert x["ramp"]["per_batch"] == [1, 2, 3, 3, 5]           # then the source ran out
        assert x["ramp"]["calls"] == 6                          # read once per global batch
        assert Counter(gb for gb, *_ in x["ramp"]["delivered"]) == {0: 1, 1: 2, 2: 3, 3: 3, 4: 5}
    want = Counter((pid, ck) for p in pulled for pid, _, ck in p)
    got = Counter((pid, ck) for d in delivered for _, _, pid, ck in d)
    assert got == want


def test_background_thread_error_surfaces(misc):
    assert misc[0]["thread_error"] == {"type": "KeyError", "msg": "'cost of r0-p3'",
                                       "context": "rank 0, global batch 1, micro-step 1: the cost_fn raised"}
    for r in (1, 2):
        out = misc[r]["thread_error"]
        assert out["type"] == "PeerFailure" and "rank 0" in out["msg"] and "global batch 1" in out["msg"]


def test_exhaustion_same_boundary(misc):
    for x in misc:
        out = x["short"]
        assert out["type"] == "StopIteration" and out["delivered"] == 4      # 2 full batches of G=2
        assert out["stats"]["global_batch"] == 2 and out["stats"]["packs_pulled"] == [2, 1, 2]
        assert out["stats"]["not_delivered"] == 5


def test_an_unreadable_qwen_vl_batch_stops_every_rank_with_its_message():
    """QwenVLCost raises for pixels without grids (never a silent 0): the rank that read the
    batch re-raises it, its peers a PeerFailure quoting it, all at global batch 1 and before
    any of that batch is delivered, with and without overlap; no rank hangs."""
    res = harness.launch(3, "unreadable_qwen_vl", hard_timeout=120)
    for r, x in enumerate(res):
        assert not x.get("killed") and "error" not in x, f"rank {r}: {x}"
        for mode in ("overlap=True", "overlap=False"):
            out = x[mode]
            assert out["delivered"] == 2, (r, mode, out)              # batch 0 only
            assert "pixel_values without image_grid_thw" in out["msg"], (r, mode, out)
            assert "Megatron-Bridge 0.6.x" in out["msg"], (r, mode, out)
            if r == 1:
                assert out["type"] == "QwenVLBatchError", out
            else:
                assert out["type"] == "PeerFailure" and "rank 1" in out["msg"], out
                assert "global batch 1" in out["msg"], out


def _assert_named(res, victim, timeout):
    for r, x in enumerate(res):
        assert not x.get("killed"), f"rank {r} hung:\n{x.get('log')}"
        if r == victim:
            continue
        assert x["type"] == "PeerFailure", x
        assert re.search(r"global batch \d", x["msg"]) and f"rank {victim}" in x["msg"], x["msg"]


def test_peer_dies():
    res = harness.launch(3, "die", hard_timeout=60, timeout=5.0)
    assert res[2]["exitcode"] == 3
    _assert_named(res, 2, 5.0)


def test_a_post_to_a_dead_peer_is_a_peer_failure():
    """gloo refuses to post a send or a receive to a peer whose process is gone (before any
    wait): the transport turns that into a PeerFailure naming the peer, the global batch and
    the micro-step too, not a bare RuntimeError from gloo."""
    res = harness.launch(2, "post_to_a_dead_peer", hard_timeout=60)
    x = res[0]
    assert not x.get("killed") and "error" not in x, x
    for what, text in (("send", "sending a pack with rank 1 failed at global batch 3, micro-step 1"),
                       ("receive", "with rank 1 failed at global batch 3, micro-step 1"),
                       ("all_gather", "all-gather of pack costs failed at global batch 3")):
        out = x[what]
        assert out["type"] == "PeerFailure", (what, out)
        assert text in out["msg"] and "Connection closed by peer" in out["msg"], (what, out)


def test_peer_stalls():
    res = harness.launch(3, "stall", hard_timeout=60, timeout=3.0, stall=6.0)
    _assert_named(res, 2, 3.0)
    assert "Operation timed out" in res[0]["msg"] or "behind" in res[0]["msg"]


BAD_INPUT = {"tiles": (1, "num_tiles [3, 1] sums to 4 tiles but imgs holds 3"),
             "placeholders": (2, "tokens hold 3 image placeholders (token 7) but num_tiles lists 2 images"),
             "too_long": (0, "5000 positions long"),
             "nan_cost": (1, "costs must be finite and >= 0"),
             "negative_cost": (2, "costs must be finite and >= 0")}


@pytest.fixture(scope="module")
def bad_input():
    res = harness.launch(3, "bad_input", hard_timeout=120)
    for r, x in enumerate(res):
        assert not x.get("killed") and "error" not in x, f"rank {r}: {x}"
    return res


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_stops_every_rank_before_anything_moves(bad_input, case):
    """A pack whose metadata contradicts its tensors, one longer than the sequence, a NaN or
    negative cost, on one rank at global batch 1 (iteration 6), micro-step 1: every rank stops
    there having delivered batch 0 only, the rank that read it with its own error naming the
    sample, its peers with a PeerFailure naming that rank, the sample and the micro-step."""
    victim, problem = BAD_INPUT[case]
    key = f"r{victim}-s3a"
    for r, x in enumerate(bad_input):
        out = x[case]
        assert out["delivered"] == 2, (r, out)                         # batch 0 only
        if r == victim:
            assert out["type"] in ("BadPack", "ValueError"), out
            assert problem in out["msg"] and key in out["msg"], out
            assert out["context"].startswith(f"rank {victim}, global batch 1 (iteration 6), micro-step 1 "), out
        else:
            assert out["type"] == "PeerFailure", out
            for part in (f"rank {victim}'s", "global batch 1 (iteration 6)", "micro-step 1", key, problem):
                assert part in out["msg"], (part, out)


def test_injected_faults_name_the_rank_the_iteration_and_the_micro_step(bad_input):
    """MM_BALANCE_FAULT (the test hook): rank 1's source raising, ending, or giving a pack with
    contradicting metadata at iteration 6, micro-step 1 stops every rank at that global batch
    (batch 0 delivered, nothing of batch 1), each error naming rank 1, the iteration and the
    micro-step; the ended source is an exhaustion (StopIteration) naming how much was read.
    (Run in the bad-input launch.)"""
    for r, x in enumerate(bad_input):
        for kind in ("raise", "end", "corrupt"):
            assert x[kind]["delivered"] == 2, (r, kind, x[kind])
        end = x["end"]
        assert end["type"] == "StopIteration", end
        assert ("data source exhausted at global batch 1 (iteration 6): the source of rank 1 after 1 of 2 "
                "packs ended; 5 packs pulled for this global batch (per rank [2, 1, 2])") in end["msg"], end
        if r == 1:
            assert x["raise"]["type"] == "InjectedFault" and "micro-step 1" in x["raise"]["msg"], x["raise"]
            assert x["raise"]["context"] == ("rank 1, global batch 1 (iteration 6), micro-step 1: the data "
                                             "source raised"), x["raise"]
            assert x["corrupt"]["type"] == "BadPack" and "num_tiles [3, 1] sums to 4" in x["corrupt"]["msg"]
        else:
            for kind in ("raise", "corrupt"):
                out = x[kind]
                assert out["type"] == "PeerFailure", out
                for part in ("rank 1's", "global batch 1 (iteration 6)", "micro-step 1"):
                    assert part in out["msg"], (kind, part, out)


def test_injected_kill_during_the_exchange():
    """MM_BALANCE_FAULT=kill:rank=2:iteration=2:microstep=1: rank 2 prints where it dies and
    is SIGKILLed; its peers raise a PeerFailure naming it within the timeout."""
    res = harness.launch(3, "fault_kill", hard_timeout=60, timeout=5.0)
    assert res[2]["exitcode"] == -9, res[2]
    assert ("rank 2: MM_BALANCE_FAULT=kill:rank=2:iteration=2:microstep=1: SIGKILL during the exchange "
            "of micro-step 1 at global batch 1") in res[2]["log"], res[2]["log"]
    _assert_named(res, 2, 5.0)
    for r in (0, 1):
        assert res[r]["elapsed"] < 5.0 + 10.0, res[r]
