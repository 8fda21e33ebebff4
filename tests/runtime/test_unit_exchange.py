"""The unit exchange of variable-size units on 3 real gloo processes: units of different row
counts in and out (as Qwen-VL frames: ``h*w`` pixel rows in, ``h*w/4`` rows out) encoded on
other ranks equal the unbalanced encoder forward and backward (outputs, input gradients,
encoder gradients), with a rank that holds no unit and one that encodes none; the unit table
all-gather costs one collective when no rank has a unit, and when no rank holds more units
than its first collective carries. The overlapped encode (transfers in
flight while the encoder works on the kept units, ``UnitExchange.encode_overlapped``) is
exact too, for every split of the kept units around the arrivals, with and without input
gradients, on a plan where a rank sends and receives nothing and one exchanges nothing."""
import json
import os
import sys

from megatron_mm_balance.testing.ranks import run_rank_script

HERE = os.path.abspath(__file__)
#: per rank: the rows of each unit it holds (multiples of 4: 4 input rows make 1 output row)
UNITS = {0: [64, 16, 4, 36], 1: [], 2: [8, 100]}
#: encoder rank per unit in global order (rank 0's, then rank 2's): rank 1 holds nothing and
#: encodes two of rank 0's units; rank 2 encodes only its own second unit and one of rank 0's
ENCODER = [0, 1, 2, 1, 0, 2]
#: rank 0 keeps one unit and sends three to rank 1, receiving none; rank 2 keeps both of its own
ENCODER_SENDS_ONLY = [0, 1, 1, 1, 2, 2]


def test_variable_size_units_are_exact_forward_and_backward():
    results = run_rank_script(HERE, 3, timeout=120)
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}: {res.get('error')}"
    for res in results:
        assert res["out_diff"] <= 1e-12 and res["input_grad_diff"] <= 1e-12   # fp64: GEMM rounding only
        assert res["param_grad_diff"] <= 1e-12
        assert res["empty_table"] is None and res["empty_collectives"] == 1
        assert res["table_owner"] == [0, 0, 0, 0, 2, 2] and res["table_header"] == [[7], [-1], [7]]
        # the first collective carries up to rows_in_first units of every rank: one collective
        # where no rank holds more (rank 0 holds 4), the same table either way
        assert res["first_rows"] == {"0": dict(collectives=2, same=True), "2": dict(collectives=2, same=True),
                                     "4": dict(collectives=1, same=True), "9": dict(collectives=1, same=True),
                                     "empty": dict(collectives=1, same=True)}, res["first_rows"]
    assert results[1]["encoded_rows"] == 16 + 36 and results[1]["local_rows"] == 0
    for res in results:
        assert len(res["overlapped"]) == 2 * 2 * 3
        for case in res["overlapped"]:
            assert case["out"] <= 1e-12 and case["param_grad"] <= 1e-12, case
            assert case["input_grad"] is None or case["input_grad"] <= 1e-12, case
    print("\nrows encoded per rank:", [r["encoded_rows"] for r in results])


def test_the_kept_units_encoded_while_the_received_ones_arrive():
    """The shortest prefix of a rank's kept units whose cost reaches the received units'
    transfer; none when nothing is received (or the transfer is free); all when they do not
    reach it."""
    from megatron_mm_balance.runtime.image_exchange import kept_before_arrivals
    assert kept_before_arrivals([5, 5, 5], 0) == 0
    assert kept_before_arrivals([5, 5, 5], 1) == 1
    assert kept_before_arrivals([5, 5, 5], 5) == 1
    assert kept_before_arrivals([5, 5, 5], 6) == 2
    assert kept_before_arrivals([5, 5, 5], 100) == 3
    assert kept_before_arrivals([], 7) == 0


def _rank_main(rank: int, world: int, port: int, outdir: str) -> None:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron_mm_balance.runtime.image_exchange import UnitExchange, gather_unit_table
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        rows_here = UNITS[rank]
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(sum(rows_here), 6, generator=gen, dtype=torch.float64)
        torch.manual_seed(5)
        lin = torch.nn.Linear(6, 3).double()              # the same weights on every rank

        def encode(rows, sizes):
            """Per unit: rows -> rows / 4 (sums of 4 consecutive rows, a linear map, tanh)."""
            pooled = rows.reshape(-1, 4, rows.shape[1]).sum(1) if rows.shape[0] else rows[:0]
            return torch.tanh(lin(pooled)) * 1.5

        weight = torch.linspace(-1, 1, 3, dtype=torch.float64) * (rank + 1)

        def loss_of(out):
            return (out * weight).sum() + (out ** 2).sum() * 0.1

        def reduced_grads():
            flat = torch.cat([p.grad.reshape(-1) for p in lin.parameters()])
            dist.all_reduce(flat)
            return flat

        ref_x = x.clone().requires_grad_(True)
        ref_out = encode(ref_x, rows_here)
        loss_of(ref_out).backward()
        ref_grads = reduced_grads()
        lin.zero_grad()

        table = gather_unit_table(np.array(rows_here, dtype=np.int64).reshape(-1, 1), [7 if rows_here else -1])
        in_rows = table.columns[:, 0]
        ex = UnitExchange(table.owner, np.array(ENCODER), in_rows, in_rows // 4, num_ranks=world)
        bx = x.clone().requires_grad_(True)
        out = ex.to_owners(encode(ex.to_encoders(bx), in_rows[ex.encoded_units]))
        loss_of(out).backward()
        grads = reduced_grads()

        overlapped = []
        for plan_name, plan in (("mixed", ENCODER), ("sends only", ENCODER_SENDS_ONLY)):
            oex = UnitExchange(table.owner, np.array(plan), in_rows, in_rows // 4, num_ranks=world)
            for input_grad in (True, False):
                for first_kept in (0, 1, 5):
                    lin.zero_grad()
                    ox = x.clone().requires_grad_(input_grad)
                    oout = oex.encode_overlapped(ox, lambda rows, units: encode(rows, None), first_kept)
                    loss_of(oout).backward()
                    ograds = reduced_grads()
                    overlapped.append({
                        "plan": plan_name, "first_kept": first_kept,
                        "out": float((oout - ref_out).abs().max()) if oout.numel() else 0.0,
                        "input_grad": (float((ox.grad - ref_x.grad).abs().max()) if x.numel() else 0.0)
                        if input_grad else None,
                        "param_grad": float((ograds - ref_grads).abs().max())})
        lin.zero_grad()

        calls = []
        real = dist.all_gather
        dist.all_gather = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        empty = gather_unit_table(np.zeros((0, 1), dtype=np.int64), [0])
        empty_collectives = len(calls)
        first_rows = {}
        for rows_in_first in (0, 2, 4, 9):              # rank 0 holds 4 units: 2 needs a second
            before = len(calls)
            got = gather_unit_table(np.array(rows_here, dtype=np.int64).reshape(-1, 1),
                                    [7 if rows_here else -1], rows_in_first=rows_in_first)
            first_rows[rows_in_first] = dict(collectives=len(calls) - before, same=bool(
                np.array_equal(got.owner, table.owner) and np.array_equal(got.columns, table.columns)
                and np.array_equal(got.headers, table.headers)))
        before = len(calls)
        empty_first = gather_unit_table(np.zeros((0, 1), dtype=np.int64), [0], rows_in_first=4)
        first_rows["empty"] = dict(collectives=len(calls) - before, same=empty_first is None)
        dist.all_gather = real
        res = {"rank": rank, "out_diff": float((out - ref_out).abs().max()) if out.numel() else 0.0,
               "input_grad_diff": float((bx.grad - ref_x.grad).abs().max()) if x.numel() else 0.0,
               "param_grad_diff": float((grads - ref_grads).abs().max()),
               "encoded_rows": ex.encoded_in_rows, "local_rows": ex.local_in_rows,
               "table_owner": table.owner.tolist(), "table_header": table.headers.tolist(),
               "empty_table": empty, "empty_collectives": empty_collectives, "overlapped": overlapped,
               "first_rows": first_rows}
    except BaseException as e:                              # reported, not hidden
        import traceback
        res = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
