"""Timeline arithmetic on hand-computed 2-rank x 2-micro-step cases."""
import numpy as np
import pytest

from megatron_mm_balance.sim.timeline import simulate_timeline

# Rank 0 draws a light then a heavy pack, rank 1 the reverse.
# vision forward VF, LM (fwd + bwd) 10 everywhere, vision backward VB = 2 x VF.
VF = np.array([[[1.0, 3.0], [2.0, 1.0]]])
LM = np.full((1, 2, 2), 10.0)
VB = 2 * VF


def test_step_sync_is_max_of_rank_sums():
    r = simulate_timeline(VF, LM, VB, sync="step")
    # rank 0: (1+10+2) + (3+10+6) = 32; rank 1: (2+10+4) + (1+10+2) = 29
    assert r["time"].tolist() == [32.0]
    assert r["busy"].tolist() == [[32.0, 29.0]]
    assert r["wait"].tolist() == [[0.0, 3.0]]
    assert r["exchange"].tolist() == [[0.0, 0.0]]


def test_microstep_sync_meets_at_every_lm_phase():
    r = simulate_timeline(VF, LM, VB, sync="microstep")
    # m0: VF ends 1 / 2 -> LM 2..12 -> VB ends 14 / 16
    # m1: VF ends 14+3=17 / 16+1=17 -> LM 17..27 -> VB ends 33 / 29 -> step 33
    assert r["time"].tolist() == [33.0]
    assert r["wait"].tolist() == [[1.0, 4.0]]


def test_lockstep_lm_takes_the_slowest_rank():
    lm = np.array([[[10.0, 10.0], [12.0, 10.0]]])
    r = simulate_timeline(np.zeros_like(VF), lm, np.zeros_like(VF), sync="microstep")
    assert r["time"].tolist() == [22.0]          # max(10, 12) + max(10, 10)
    r = simulate_timeline(np.zeros_like(VF), lm, np.zeros_like(VF), sync="step")
    assert r["time"].tolist() == [22.0]          # rank 1: 12 + 10


def test_sync_exchange_is_a_meeting_plus_the_slowest_transfer():
    x = np.array([[[0.0, 5.0], [0.0, 2.0]]])     # only micro-step 1 moves packs
    r = simulate_timeline(VF, LM, VB, sync="step", exchange="sync", x=x)
    # m0 as before: rank 0 ends 13, rank 1 ends 16; meet at 16, exchange max(5, 2) = 5
    # m1 starts 21: rank 0 ends 21+19 = 40, rank 1 21+13 = 34
    assert r["time"].tolist() == [40.0]
    assert r["exchange"].tolist() == [[5.0, 5.0]]
    assert r["wait"].tolist() == [[40 - 32 - 5, 40 - 29 - 5]]


def test_overlap_exchange_hides_behind_the_previous_micro_step():
    x = np.array([[[0.0, 5.0], [0.0, 20.0]]])
    r = simulate_timeline(VF, LM, VB, sync="step", exchange="overlap", x=x)
    # rank 0: m0 0..13, m1's 5 ms started at 0 -> hidden; ends 13 + 19 = 32
    # rank 1: m0 0..16, m1's 20 ms started at 0 -> exposed 4; m1 20..33
    assert r["exchange"].tolist() == [[0.0, 4.0]]
    assert r["time"].tolist() == [33.0]


def test_overlap_first_micro_step_is_exposed():
    x = np.array([[[3.0, 0.0], [0.0, 0.0]]])
    r = simulate_timeline(VF, LM, VB, sync="microstep", exchange="overlap", x=x)
    # rank 0 starts m0 at 3: VF ends 4 > rank 1's 2 -> LM 4..14, VB 16 / 18
    # m1: arrive 16+3=19 / 18+1=19 -> LM 19..29 -> ends 35 / 31
    assert r["exchange"].tolist() == [[3.0, 0.0]]
    assert r["time"].tolist() == [35.0]
    # Synchronous: both ranks take part and start at 3: VF ends 4 / 5 -> LM 5..15,
    # VB 17 / 19; m1: arrive 20 / 20 -> LM 20..30 -> ends 36 / 32.
    rs = simulate_timeline(VF, LM, VB, sync="microstep", exchange="sync", x=x)
    assert rs["time"].tolist() == [36.0]
    assert rs["exchange"].tolist() == [[3.0, 3.0]]


def test_prefetch_hides_the_first_exchange_behind_the_previous_batchs_tail():
    # x0 = 25 on rank 0. Without prefetch: rank 0 starts at 25: VF ends 26 -> LM
    # 26..36, VB ends 38 / 40; m1 starts 38 / 40 (its tail: 57 - 38 = 19 ms), arrive
    # 41 / 41 -> LM 41..51 -> ends 57 / 53.
    x = np.array([[[25.0, 0.0], [0.0, 0.0]]])
    r = simulate_timeline(VF, LM, VB, sync="microstep", exchange="overlap", x=x)
    assert r["time"].tolist() == [57.0]
    # Prefetch: the exchange started 19 ms before the batch, 6 ms stay exposed:
    # VF ends 7 -> LM 7..17, VB 19 / 21; m1 arrive 22 / 22 -> LM 22..32 -> 38 / 34.
    p = simulate_timeline(VF, LM, VB, sync="microstep", exchange="overlap", x=x, prefetch=True)
    assert p["exchange"].tolist() == [[6.0, 0.0]]
    assert p["time"].tolist() == [38.0]
    # The step's tail counts too: with 10 ms of overhead the tail is 29 ms, the
    # exchange hides completely and the step is the no-exchange one (33) + 10.
    p = simulate_timeline(VF, LM, VB, sync="microstep", exchange="overlap", x=x,
                          overhead=10.0, prefetch=True)
    assert p["exchange"].tolist() == [[0.0, 0.0]]
    assert p["time"].tolist() == [43.0]
    # Later micro-steps are unchanged: the same 20 ms exposed on rank 1 as without it.
    x = np.array([[[0.0, 5.0], [0.0, 20.0]]])
    r = simulate_timeline(VF, LM, VB, sync="step", exchange="overlap", x=x)
    p = simulate_timeline(VF, LM, VB, sync="step", exchange="overlap", x=x, prefetch=True)
    assert p["exchange"].tolist() == r["exchange"].tolist() == [[0.0, 4.0]]
    with pytest.raises(ValueError, match="prefetch needs the overlap"):
        simulate_timeline(VF, LM, VB, exchange="sync", x=x, prefetch=True)


def test_sync_vs_overlap_ordering_and_no_exchange_equivalence():
    rng = np.random.default_rng(0)
    vf, lm = rng.uniform(1, 5, (3, 4, 5)), rng.uniform(5, 9, (3, 4, 5))
    vb, x = 2 * vf, rng.uniform(0, 3, (3, 4, 5))
    for sync in ("step", "microstep"):
        base = simulate_timeline(vf, lm, vb, sync=sync)
        zero = simulate_timeline(vf, lm, vb, sync=sync, exchange="overlap", x=0 * x)
        assert np.allclose(base["time"], zero["time"])
        ov = simulate_timeline(vf, lm, vb, sync=sync, exchange="overlap", x=x)
        sy = simulate_timeline(vf, lm, vb, sync=sync, exchange="sync", x=x)
        assert np.all(base["time"] <= ov["time"] + 1e-9)
        assert np.all(ov["time"] <= sy["time"] + 1e-9)
    assert np.all(simulate_timeline(vf, lm, vb, sync="step")["time"]
                  <= simulate_timeline(vf, lm, vb, sync="microstep")["time"] + 1e-9)


def test_bubble_and_overhead_are_added_once():
    r = simulate_timeline(VF, LM, VB, sync="step", bubble=7.0, overhead=2.0)
    assert r["time"].tolist() == [41.0]
    assert r["wait"].tolist() == [[0.0, 3.0]]


def test_bad_shapes_and_modes():
    with pytest.raises(ValueError, match="sync"):
        simulate_timeline(VF, LM, VB, sync="bogus")
    with pytest.raises(ValueError, match="shape"):
        simulate_timeline(VF, LM[:, :1], VB)
    with pytest.raises(ValueError, match="exchange"):
        simulate_timeline(VF, LM, VB, exchange="overlap")
