"""Checkpoints under prefetch: a savable source (``save_state()``) keeps full
cross-batch prefetch, and ``BalancedDataIterator.save_state()`` at a global-batch
boundary returns the state that matches what was consumed, not what the exchange
thread has read ahead. Restoring it into fresh sources and fresh iterators
(real gloo processes) continues exactly like the uninterrupted run.
"""
import importlib.util
import os

import pytest

_spec = importlib.util.spec_from_file_location(
    "rt_harness", os.path.join(os.path.dirname(__file__), "rt_harness.py"))
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

# [num_microbatches, overlap, pass num_microbatches as a callable]
CONFIGS = [[3, True, False], [3, False, False], [2, True, True]]
BEFORE, TOTAL, SOAK = 3, 6, 30


@pytest.mark.parametrize("world", [2, 4])
def test_resume_from_save_state_under_prefetch(world):
    results = harness.launch(world, "save_state", hard_timeout=150, configs=CONFIGS,
                             before=BEFORE, total=TOTAL, soak=SOAK)
    for r, res in enumerate(results):
        assert "configs" in res, f"rank {r}: {res.get('error') or res}\n{res.get('log', '')}"
    for ci, (G, overlap, as_callable) in enumerate(CONFIGS):
        label = f"G={G} overlap={overlap} callable={as_callable}"
        assert sum(res["configs"][ci]["moved"] for res in results) > 0, f"{label}: nothing moved"
        for rank, res in enumerate(results):
            c = res["configs"][ci]
            assert c["state_initial"] == 0
            # Prefetch happened: the thread had pulled the next global batch when the state was
            # saved, and the state is still the consumed position.
            if overlap and not as_callable:
                assert c["pulled_at_save"] >= (BEFORE + 1) * G, f"{label} rank {rank}: {c['pulled_at_save']}"
                assert all(c["prefetched"][1:]), f"{label} rank {rank}: {c['prefetched']}"
            else:
                assert not any(c["prefetched"]), f"{label} rank {rank}: {c['prefetched']}"
            assert c["state_saved"] == BEFORE * G, f"{label} rank {rank}: {c['state_saved']}"
            # The first job equals the uninterrupted run's first batches; the resumed job its rest.
            assert c["first"] == c["full"][: BEFORE * G]
            cont = [[gb - BEFORE, k, pid, ck] for gb, k, pid, ck in c["full"][BEFORE * G:]]
            assert c["resumed"] == cont, f"{label} rank {rank}: resumed run differs"
            assert len(c["resumed"]) == (TOTAL - BEFORE) * G
            # Mid-batch: a clear error naming the batch and the micro-step.
            assert c["mid_batch"].startswith("BalancerError: save_state() inside global batch 3, "
                                             "after micro-step 0"), c["mid_batch"]
            # Exhausted: the state before the batch that could not be filled.
            assert c["after_end"] == "StopIteration"
            assert c["state_exhausted"] == TOTAL * G


@pytest.mark.parametrize("world", [2])
def test_states_of_consumed_batches_are_dropped(world):
    results = harness.launch(world, "save_state", hard_timeout=150, configs=[CONFIGS[0]],
                             before=BEFORE, total=TOTAL, soak=SOAK)
    G = CONFIGS[0][0]
    for r, res in enumerate(results):
        assert "alive" in res, f"rank {r}: {res.get('error') or res}\n{res.get('log', '')}"
        assert res["handed"] == SOAK * G
        # One held by the consumer plus one per global batch in flight in the thread.
        assert max(res["alive"]) <= 4, res["alive"]
        assert res["alive"][-1] <= 4


SCHEDULE = [1, 2, 3, 3, 5]


def test_predicted_ramp_up_prefetches_and_a_wrong_prediction_fails_clearly():
    """A callable num_microbatches plus predict_microbatches: the thread prefetches across
    global batches on the predictions (each checked when the batch starts), the state is
    still the consumed one; a prediction that disagrees is an error naming the batch."""
    results = harness.launch(2, "predict", hard_timeout=120, schedule=SCHEDULE)
    ids = []
    for r, res in enumerate(results):
        assert res.get("outcome") == "ok", f"rank {r}: {res}"
        assert res["per_batch"] == SCHEDULE
        assert [[gb, k] for gb, k, _, _ in res["delivered"]] == [
            [gb, k] for gb, G in enumerate(SCHEDULE) for k in range(G)]
        assert all(res["prefetched"][1:]), res["prefetched"]
        assert res["state_after_1"] == 3 and res["pulled_after_1"] > 3
        ids += [row[2] for row in res["delivered"]]
    assert sorted(ids) == sorted(f"r{r}-p{i}" for r in range(2) for i in range(sum(SCHEDULE)))
    bad = harness.launch(2, "predict", hard_timeout=120, schedule=SCHEDULE, wrong_at=2)
    for r, res in enumerate(bad):
        assert res.get("outcome", "").startswith(
            "BalancerError: num_microbatches() is 4 at global batch 2 but the exchange thread "
            "prefetched it with 3 micro-batches"), f"rank {r}: {res}"
