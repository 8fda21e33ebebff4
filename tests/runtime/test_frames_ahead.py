"""Images mode's runtime on 4 real gloo processes, two step groups of 2 ([0, 1] and [2, 3], as
DP=4 x EP=2): every global batch's unit table gathered once at the meeting, each micro-step's
plan made and its rows sent ahead on the exchange thread, only point-to-point transfers of
outputs and their gradients inside the micro-step.

Units of different row counts (``r`` rows in, ``r/2`` out, as a frame's patches and merged
rows), empty packs, micro-steps where a group holds no unit, packs moved across groups (so the
rank that sends a unit's rows ahead is not the rank that computes its pack): the outputs every
rank receives equal the unbalanced encoder's on its own pack, and the data-parallel sums of the
encoder's gradients equal the unbalanced run's (fp64: rounding only), with and without the
exchange thread (and then with one encoder call per micro-step instead of two). All forwards of a batch run before its backwards (as pipeline warm-up does),
so the rows sent ahead must live until their micro-step's backward: alive after the forward,
freed after it. Counted by stack (``runtime/dist_audit.py``): no collective of ours on the
training thread, rows sent and received only by the exchange thread, no plan on the training
thread. A peer that never sends its outputs ends the wait with an error naming it."""
import os
import sys

import numpy as np
import pytest

from megatron_mm_balance.testing.ranks import run_rank_script

HERE = os.path.abspath(__file__)
WORLD = 4
STEP_GROUPS = ((0, 1), (2, 3))
G = 4
BATCHES = 3
IN, OUT = 6, 5


def test_units_plan_within_the_receive_budget():
    from megatron_mm_balance.runtime.frames import within_receive_budget
    owner = np.array([0, 0, 0, 1])
    encoder = np.array([1, 1, 0, 1])
    cost = np.array([10, 30, 5, 8])
    rows = np.array([4, 4, 2, 6])
    assert within_receive_budget(owner, encoder, cost, rows, 8).tolist() == [1, 1, 0, 1]
    # room for one: the heavier move is kept, the lighter one stays home
    assert within_receive_budget(owner, encoder, cost, rows, 5).tolist() == [0, 1, 0, 1]
    assert within_receive_budget(owner, encoder, cost, rows, 0).tolist() == owner.tolist()


def test_a_step_plan_is_the_group_members_units_in_order():
    """``plan_step`` reads each member's pack of the micro-step from the placement and the
    table, plans the group alone, and a byte budget of one unit's rows leaves at most that."""
    import torch
    from megatron_mm_balance.runtime.frame_ahead import BatchUnits, plan_step
    # rank 0 pulled pack 0 (units of 8 and 8 rows), rank 1 pack 0 (none), rank 2 pack 0 (one of 2)
    table = BatchUnits(source=np.array([0, 0, 2]), pack=np.array([0, 0, 0]), index=np.array([0, 1, 0]),
                       cost=np.array([64, 64, 4]), in_rows=np.array([8, 8, 2]), out_rows=np.array([4, 4, 1]),
                       meta=np.zeros((3, 1), np.int64), row_shape=(IN,), row_dtype=torch.float64)
    src_rank, src_index = np.array([1, 0, 2]), np.array([0, 0, 0])     # rank 1 computes rank 0's pack
    plan = plan_step(table, src_rank, src_index, (0, 1))
    assert plan.owner.tolist() == [1, 1] and plan.unit.tolist() == [0, 1]
    assert sorted(plan.encoder.tolist()) == [0, 1] and plan.figures.cost_max_after == 64
    kept = plan_step(table, src_rank, src_index, (0, 1), budget_rows=4)
    assert kept.encoder.tolist() == [1, 1] and kept.figures.frames_moved == 0
    alone = plan_step(table, src_rank, src_index, (2,))
    assert alone.unit.tolist() == [2] and alone.figures.frames_moved == 0
    empty = plan_step(table, np.array([1, 1, 1]), np.array([0, 0, 0]), (0, 1))
    assert empty.figures is None and empty.unit.size == 0


@pytest.fixture(scope="module")
def results():
    out = run_rank_script(HERE, WORLD, timeout=180)
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r}: {res.get('error')}"
    return out


def test_outputs_and_gradients_equal_the_unbalanced_encoder(results):
    for res in results:
        for mode in ("thread", "no_thread"):
            run = res[mode]
            assert run["out_diff"] <= 1e-12, (res["rank"], mode, run["out_diff"])
            assert run["grad_diff"] <= 1e-12, (res["rank"], mode, run["grad_diff"])
    moved = {mode: sum(r[mode]["moved"] for r in results) for mode in ("thread", "no_thread")}
    assert moved["thread"] > 0 and moved["thread"] == moved["no_thread"], moved
    cases = {k: sum(r["thread"]["cases"][k] for r in results) for k in results[0]["thread"]["cases"]}
    # every case the issue names happened: a rank with no unit that encodes others', a group
    # with no unit at a micro-step, a unit sent ahead by a rank that does not compute its pack
    assert cases["no_units_but_encodes"] > 0 and cases["group_without_units"] > 0, cases
    assert cases["sent_by_non_owner"] > 0, cases
    print(f"\nunits moved {moved['thread']}; cases {cases}")


def test_rows_sent_ahead_live_until_their_backward(results):
    """The rows a rank received ahead are held by its micro-step's graph until that backward,
    and freed by it. (With one encoder call, ``image_overlap=false``, where a rank also keeps
    units, they are copied into the call's input and may go at once: only freed is asserted.)"""
    for res in results:
        for mode in ("thread", "no_thread"):
            life = res[mode]["received_life"]
            if mode == "thread":
                assert life["alive_before_backward"] == life["steps"], (res["rank"], mode, life)
            assert life["freed_after_backward"] == life["steps"], (res["rank"], mode, life)
    assert sum(r["thread"]["received_life"]["steps"] for r in results) > 0


def test_no_collective_and_no_plan_inside_the_micro_step(results):
    for res in results:
        for mode in ("thread", "no_thread"):
            audit = res[mode]["audit"]
            assert audit["our_collectives_in_step"] == 0, (res["rank"], mode, audit)
            step_calls = {(r["call"], r["ours"]) for r in audit["rows"]
                          if r["thread"] == "training" and r["place"] == "step" and r["ours"]}
            assert {c for c, _ in step_calls} <= {"batch_isend_irecv", "isend", "irecv"}, step_calls
            assert {o for _, o in step_calls} == {"megatron_mm_balance.runtime.image_exchange:_post"}, step_calls
            ahead = [r for r in audit["rows"] if ".frame_ahead:" in r["ours"]]
            expect = "mm-balance-exchange" if mode == "thread" else "training"
            assert ahead and all(r["thread"] == expect for r in ahead), ahead   # the table's gathers at least
            if mode == "no_thread":                 # the batch's meeting: inside next() only
                assert all(r["place"] == "next" for r in ahead), ahead
            assert set(res[mode]["plan_threads"]) == {expect}, res[mode]["plan_threads"]
    sent = [r for res in results for r in res["thread"]["audit"]["rows"] if r["call"] == "isend"
            and ".frame_ahead:" in r["ours"]]
    assert sent, "no rows were sent ahead"


def test_a_peer_that_never_sends_is_named(results):
    assert "rank 1" in results[0]["stalled"] and "frame outputs" in results[0]["stalled"], results[0]["stalled"]


# -- one rank ------------------------------------------------------------------------------------

def _pack(rank: int, gb: int, k: int):
    import torch
    gen = torch.Generator().manual_seed(1000 * gb + 10 * k + rank)
    n = int(torch.randint(0, 4, (), generator=gen)) if torch.rand((), generator=gen) > 0.3 else 0
    if gb == 2 and rank >= 2:
        n = 0                                                    # group [2, 3] pulls no unit
    rows = [int(2 ** torch.randint(1, 7, (), generator=gen)) for _ in range(n)]
    if gb == 1:                                                  # one pack of units in the batch:
        rows = [32, 32, 16] if (rank, k) == (0, 0) else []       # its group partner holds none
    data = torch.randn(sum(rows), IN, generator=gen, dtype=torch.float64) if rows else None
    return {"id": 100 * gb + 10 * k + rank, "units": rows, "rows": data}


class _Reader:
    meta_width = 1

    def __call__(self, pack):
        from megatron_mm_balance.runtime.frame_ahead import Units
        r = np.array(pack["units"], dtype=np.int64)
        if r.size == 0:
            return Units.none(1)
        return Units(cost=r * r, in_rows=r, out_rows=r // 2, meta=r.reshape(-1, 1), rows=pack["rows"])

    def encode_args(self, meta):
        import torch
        return (torch.from_numpy(np.ascontiguousarray(meta[:, 0])),)


def _weights(pack_id: int, rows: int):
    import torch
    gen = torch.Generator().manual_seed(pack_id)
    return torch.randn(rows, OUT, generator=gen, dtype=torch.float64)


def _train(rank, encoder, group, exchange, overlap: bool, balanced: bool):
    """BATCHES global batches through the balanced iterator; every forward of a batch, then every
    backward; returns the outputs' largest difference from the plain encoder on the same pack,
    the encoder's gradient, and what the frames did."""
    import threading
    import weakref

    import torch
    from megatron_mm_balance.runtime import frame_ahead
    from megatron_mm_balance.runtime.frame_ahead import FrameAhead
    from megatron_mm_balance.runtime.image_exchange import FrameSteps
    from megatron_mm_balance.runtime.iterator import BalancedDataIterator
    from megatron_mm_balance.runtime.dist_audit import DistAudit

    encode = lambda rows, args: torch.tanh(encoder(rows.reshape(-1, 2 * IN)))      # noqa: E731
    empty = lambda: torch.zeros((0, OUT), dtype=torch.float64, requires_grad=True)  # noqa: E731
    source = iter([_pack(rank, gb, k) for gb in range(BATCHES) for k in range(G)])
    cost_fn = lambda pack: sum(r * r for r in pack["units"])                         # noqa: E731
    ahead = FrameAhead(_Reader(), STEP_GROUPS, ahead_bytes=1 << 24) if balanced else None
    plan_threads = []
    original_plan = frame_ahead.plan_step

    def counted_plan(*a, **k):
        plan_threads.append("training" if threading.current_thread() is threading.main_thread()
                            else threading.current_thread().name)
        return original_plan(*a, **k)
    frame_ahead.plan_step = counted_plan
    audit = DistAudit().install()
    audit.training()
    it = BalancedDataIterator(source, num_microbatches=G, exchange_group=exchange, cost_fn=cost_fn,
                              overlap=overlap, timeout=30, frames=ahead)
    steps = FrameSteps(ahead.relay, group, encode=encode, empty=empty, timeout=30,
                       overlap=overlap) if balanced else None     # without the thread: one encoder call
    encoder.zero_grad(set_to_none=True)
    out_diff, moved = 0.0, 0
    cases = dict(no_units_but_encodes=0, group_without_units=0, sent_by_non_owner=0)
    life = dict(steps=0, alive_before_backward=0, freed_after_backward=0)
    try:
        for gb in range(BATCHES):
            losses, held = [], []
            for k in range(G):
                pack = next(it)
                inputs = pack["rows"]
                if steps is not None:
                    steps.begin()
                    frames = steps.current
                    if frames.figures is None:
                        cases["group_without_units"] += 1
                    else:
                        moved += frames.figures.frames_moved if frames.group[0] == rank else 0
                    out = steps.outputs(inputs) if steps.balanced() else None
                    if frames.received is not None:
                        cases["no_units_but_encodes"] += int(inputs is None)
                        held.append((len(losses), weakref.ref(frames.received)))
                    steps.end()
                else:
                    out = None
                if out is None and inputs is not None:
                    out = encode(inputs, None)
                loss = torch.zeros((), dtype=torch.float64)
                if out is not None and out.shape[0]:
                    plain = encode(inputs, None).detach()
                    out_diff = max(out_diff, float((out.detach() - plain).abs().max() / plain.abs().max()))
                    loss = (out * _weights(pack["id"], out.shape[0])).sum()
                elif out is not None:
                    loss = loss + out.sum() * 0                      # joined: backward reaches the flight
                losses.append(loss)
            for i, loss in enumerate(losses):
                mine = [ref for j, ref in held if j == i]
                life["steps"] += len(mine)
                life["alive_before_backward"] += sum(ref() is not None for ref in mine)
                if loss.requires_grad:
                    loss.backward()
                losses[i] = None
                life["freed_after_backward"] += sum(ref() is None for ref in mine)
        if balanced:
            cases["sent_by_non_owner"] = ahead.sent["units_of_others_packs"]
    finally:
        it.close()
        audit.uninstall()
        frame_ahead.plan_step = original_plan
    grad = torch.cat([p.grad.reshape(-1) for p in encoder.parameters()])
    torch.distributed.all_reduce(grad)
    return dict(out_diff=out_diff, grad=grad, moved=moved, cases=cases, received_life=life,
                audit=audit.summary(), plan_threads=sorted(set(plan_threads)))


def _stalled_peer(rank, group):
    """Rank 0 waits for outputs rank 1 never sends: the wait ends within its timeout, naming
    rank 1."""
    import torch
    from megatron_mm_balance.runtime.frame_ahead import StepFrames
    from megatron_mm_balance.runtime.image_exchange import encode_step
    if rank != 0:
        return ""
    frames = StepFrames("global batch 9, micro-step 0", balanced=True, group=(0, 1), local_rows=4,
                        sends_away=True, recv_out={1: (0, 2)}, arrived_rows=2)
    try:
        encode_step(frames, torch.zeros(4, IN, dtype=torch.float64), lambda r, a, c: r,
                    lambda: torch.zeros((0, OUT), dtype=torch.float64), group, timeout=2.0)
    except Exception as e:                       # the error under test
        return f"{type(e).__name__}: {e}"
    return "no error"


def main():
    import datetime
    import json

    import torch
    import torch.distributed as dist

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    result = {"rank": rank}
    try:
        exchange = dist.new_group(list(range(world)), backend="gloo")
        group = dist.new_group(list(range(world)), backend="gloo")
        torch.manual_seed(0)
        encoder = torch.nn.Linear(2 * IN, OUT, dtype=torch.float64)
        reference = _train(rank, encoder, group, exchange, True, balanced=False)
        for mode, overlap in (("thread", True), ("no_thread", False)):
            got = _train(rank, encoder, group, exchange, overlap, balanced=True)
            ref = reference["grad"]
            got["grad_diff"] = float((got.pop("grad") - ref).abs().max() / ref.abs().max())
            result[mode] = got
        dist.barrier()
        result["stalled"] = _stalled_peer(rank, group)
        dist.barrier()
    except Exception:
        import traceback
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
