"""``mm_balance.vision=images`` against the unbalanced tower, on 4 real gloo processes: the toy
Qwen3-VL model of configs/bridge/qwen3_vl_moe_tiny_cpu.py through Bridge's own
``Qwen3VLModel.forward`` with the glue's hooks (tests/bridge/vision_images_rank.py), its packs
through the balanced iterator with images mode's exchange-thread side (the frame table gathered
at the batch's meeting, each micro-step planned and its pixel rows sent ahead): micro-steps with
an empty rank, a video, the patch cap binding and no frame anywhere; then Bridge's
context-parallel vision block (CP 2 x DP 2, a rank with an empty share, a text-only rank).
Outputs (per-token losses, the vision outputs Bridge receives, main and deepstack) and parameter
gradients must agree with the unbalanced run's; the plan must be the same on every rank; the
micro-step must issue no collective of ours (point-to-point only, counted by stack), evaluation
forwards nothing. Each main micro-step is also run with one tower call per micro-step
(``mm_balance.image_overlap=false``), under the same bounds."""
from pathlib import Path

import numpy as np
import pytest

from megatron_mm_balance.testing.ranks import run_rank_script

RANK_SCRIPT = Path(__file__).with_name("vision_images_rank.py")
VIDEO_STEP = 1                     # vision_images_rank.VIDEO_STEP
WORLD = 4
#: fp32: largest difference / largest entry. Not bit-identical: a rank encodes other frames
#: than in the unbalanced run, so the CPU GEMMs get other row counts (their blocking and
#: summation order depend on it) and a parameter gradient sums its frames in another grouping
#: before the data-parallel sum. Measured up to 6.4e-7 (outputs, pixel gradients) and 1.2e-7
#: (parameter gradients); bounded as the context-parallel split's test bounds them.
FP32_OUTPUTS, FP32_PARAMS = 1e-6, 5e-6
#: fp64: the same comparison with the model cast to fp64 falls to rounding (measured <= 3e-16):
#: the fp32 differences are arithmetic order, nothing else.
FP64 = 1e-13


@pytest.fixture(scope="module")
def results(bridge_python, bridge_trees):
    out = run_rank_script(str(RANK_SCRIPT), WORLD, timeout=900, python=bridge_python,
                          pythonpath=(bridge_trees["mlm"], bridge_trees["bridge"] / "src"))
    for r in out:
        assert "error" not in r, r.get("error")
    return out


def _check(diffs, where):
    for name, value in diffs.items():
        if name.endswith("bit_equal") or name == "vision_outputs":
            continue
        fp32 = FP32_PARAMS if name == "param_grads" else FP32_OUTPUTS
        bound = {"fp32": fp32, "fp32_sync": fp32, "fp64": FP64}[where[0]]
        assert value <= bound, (where, name, value)


def _steps(results, key="steps"):
    return [(r, s) for r in results for s in (r[key] if key == "steps" else r["cp"]["steps"])]


pytestmark = pytest.mark.realpath


def test_images_mode_equals_the_unbalanced_tower(results):
    for r, s in _steps(results) + _steps(results, "cp"):
        for precision in ("fp32", "fp64", "fp32_sync"):
            if precision in s:                         # fp32_sync: the main steps
                _check(s[precision], (precision, r["rank"], s["step"]))
    assert all("fp32_sync" in s for _, s in _steps(results))
    compared = {name for _, s in _steps(results) for name in s["fp32"]}
    assert {"losses", "param_grads", "embeddings", "deepstack0"} <= compared
    worst = {p: max(v for _, s in _steps(results) + _steps(results, "cp") for n, v in s[p].items()
                    if not n.endswith("bit_equal") and n != "vision_outputs") for p in ("fp32", "fp64")}
    print(f"\nimages vs unbalanced, largest difference / largest entry: fp32 {worst['fp32']:.2e}, "
          f"fp64 {worst['fp64']:.2e}")


def test_the_plan_is_the_same_on_every_rank_and_frames_move(results):
    for step in range(len(results[0]["steps"])):
        plans = {str(r["steps"][step]["plan"]) for r in results}
        assert len(plans) == 1, (step, plans)
    figures = [s["figures"] for s in results[0]["steps"]]
    # step 0: rank 2 holds nothing and encodes one of rank 0's frames
    assert results[2]["steps"][0]["vision_calls"] == {"ref": 0, "balanced": 1}
    assert figures[0]["frames_moved"] >= 1 and 2 in results[0]["steps"][0]["plan"]["encoder"]
    # step 1: the video's four frames (rank 0's) are spread over other ranks
    video = results[0]["steps"][1]["plan"]
    assert video["owner"][:4] == [0] * 4 and len(set(video["encoder"][:4])) > 1
    assert figures[1]["cost_max_after"] < figures[1]["cost_max_before"]
    print("\nper micro-step (frames, moved, largest rank cost before -> after): " + "; ".join(
        f"{s['step']}: " + ("no frame" if s["figures"] is None else
                            f"{s['figures']['frames']}, {s['figures']['frames_moved']}, "
                            f"{s['figures']['cost_max_before']} -> {s['figures']['cost_max_after']}")
        for s in results[0]["steps"]))


def test_the_patch_cap_binds(results):
    """Step 2: rank 0 holds two large frames; a light rank taking one as it stands would end
    above the default cap (the most patches any rank held). The plan keeps every receiving
    rank within the cap (by keeping the frame home or by the receiver's small frames making
    room elsewhere), where the planner without the cap leaves a receiver above it."""
    from megatron_mm_balance.runtime.frames import default_patch_cap
    from megatron_mm_balance.solver.frames import plan_frames
    s = results[0]["steps"][2]
    plan = {k: np.array(v) for k, v in s["plan"].items()}
    owner, patches, encoder = plan["owner"], plan["patches"], plan["encoder"]
    cap = default_patch_cap(owner, patches, WORLD)
    smallest_large = patches[owner == 0].min()
    for r in range(1, WORLD):                          # taking one as it stands breaks the cap
        assert patches[owner == r].sum() + smallest_large > cap
    after = np.bincount(encoder, weights=patches, minlength=WORLD)
    for r in set(encoder[encoder != owner].tolist()):
        assert after[r] <= cap, (r, after, cap)
    assert s["figures"]["patches_max_after"] <= cap and s["figures"]["cost_moved_min"] > 0
    uncapped = plan_frames(owner, plan["cost"], WORLD, patches=patches, transfer=plan["transfer"]).encoder
    uncapped_after = np.bincount(uncapped, weights=patches, minlength=WORLD)
    receivers = set(uncapped[uncapped != owner].tolist())
    assert max(uncapped_after[r] for r in receivers) > cap, ("without the cap no receiver ends above it",
                                                             uncapped_after, cap)
    print(f"\nstep 2, cap {cap} patches: frames moved {s['figures']['frames_moved']}, patches per rank after "
          f"{after.astype(int).tolist()}, largest rank cost {s['figures']['cost_max_before']} -> "
          f"{s['figures']['cost_max_after']}")


def test_a_moved_frames_transfer_time_is_in_the_plan(results):
    """The glue charges a moved frame's outputs and their gradients to its receiver at the
    device's nominal rates (its pixel rows travel ahead, off the micro-step): every frame has a
    positive transfer cost, the same on every rank, and the figures count the moved frames'.
    Over a link a millionth as fast, moving costs more than it saves: nothing moves, and the
    outputs are still the unbalanced tower's."""
    from megatron_mm_balance.bridge.vision import NOMINAL_RATES
    assert results[0]["rates"] == list(NOMINAL_RATES["cpu"])
    for step in range(3):
        plan = results[0]["steps"][step]["plan"]
        assert all(t > 0 for t in plan["transfer"]), (step, plan)
        moved = [t for t, o, e in zip(plan["transfer"], plan["owner"], plan["encoder"]) if o != e]
        assert results[0]["steps"][step]["figures"]["transfer_moved"] == sum(moved) > 0, step
    for r in results:
        slow = r["slow_link"]
        assert slow["figures"]["frames_moved"] == 0 and slow["plan"]["encoder"] == slow["plan"]["owner"], slow
        _check(slow["diffs"], ("fp32", r["rank"], "slow link"))
    video = results[0]["steps"][VIDEO_STEP]["plan"]
    print(f"\nvideo step: frame cost {video['cost']}, transfer {video['transfer']} (nominal CPU rates "
          f"{results[0]['rates']} GB/s, TFLOP/s)")


def test_measured_rates_replace_a_wrong_prior_on_every_rank_alike(results):
    """``image_rates=measured`` with a tower rate a million times too fast: the first global
    batch's plan charges moves more than any frame costs, so nothing moves; the tower's rate
    every rank measured on its frames is agreed at the next batch's meeting (the same value on
    every rank) and replaces the prior, and the video's frames move. Outputs stay the
    unbalanced tower's."""
    runs = [r["measured"]["runs"] for r in results]
    for i in range(len(runs[0])):
        assert len({str((run[i]["used"], run[i]["measured"])) for run in runs}) == 1, i
    first, second = runs[0][0], runs[0][1]
    assert first["used"] == results[0]["measured"]["prior"] and first["frames_moved"] == 0
    assert first["measured"] == [0.0, 0.0]
    tower = second["measured"][1]
    assert 0 < tower < results[0]["measured"]["prior"][1] / 1e3 and second["used"][1] == tower
    assert second["frames_moved"] > 0
    for r in results:
        for run in r["measured"]["runs"]:
            _check(run["diffs"], ("fp32", r["rank"], "measured rates"))
    print(f"\nmeasured rates: prior {results[0]['measured']['prior']} (GB/s, TFLOP/s); per batch used "
          + "; ".join(f"{[round(x, 4) for x in run['used']]} (moved {run['frames_moved']})" for run in runs[0]))


def test_no_collective_in_the_micro_step_and_none_in_evaluation(results):
    """Counted by stack on every rank: the balanced forward and backward of every micro-step
    issue no collective of ours, only point-to-point transfers, and only where frames cross the
    rank; a micro-step with no frame anywhere and an evaluation forward issue nothing."""
    from megatron_mm_balance.runtime.dist_audit import COLLECTIVES
    for r in results:
        for s in r["steps"]:
            calls = {key.split(" from ")[0] for key in s["calls"]}
            assert not calls & set(COLLECTIVES), (r["rank"], s["step"], s["calls"])
            assert bool(s["calls"]) == s["balanced"], (r["rank"], s["step"], s["calls"])
        assert r["steps"][3]["figures"] is None and r["steps"][3]["calls"] == {}
        assert r["eval"] == {"calls": {}, "bit_equal": True, "frames_left": 1}


def test_crossover_runs_the_plain_tower_at_the_other_parity(results):
    """``mm_balance.mode=crossover-even`` with images: at an odd iteration the exchange thread
    plans nothing and the tower runs as it is (no transfer, the unbalanced outputs and gradients
    bit for bit); at an even one the frames move (the video step), within the fp32 bounds."""
    moved = 0
    for r in results:
        odd, even = r["crossover"]["3"], r["crossover"]["4"]
        assert odd["calls"] == {} and not odd["planned"], odd
        assert odd["frames_moved"] is None and odd["vision_bit_equal"], odd
        assert odd["diffs"]["losses_bit_equal"] and odd["diffs"]["param_grads_bit_equal"], odd
        assert even["planned"], even
        _check(even["diffs"], ("fp32",))
        moved += even["frames_moved"]
    assert moved > 0


def test_the_timing_details_split_the_exchange(results):
    """With a ``detail`` sink (the timing hooks' ``add_detail``), a rank whose frames cross
    records its exchange's forward: the whole, the tower's calls and their time, the wait for
    the outputs; the parts never exceed the whole. Two tower calls where it both keeps and
    receives frames, one with ``image_overlap=false``."""
    for r in results:
        for s in r["steps"]:
            for key in ("details", "details_sync"):
                d, where = s[key], (r["rank"], s["step"], key)
                if not s["balanced"]:
                    assert d == {}, (where, d)
                    continue
                assert d["vision_exchange_ms"] >= d.get("vision_tower_ms", 0.0) + d["vision_wait_ms"] - 1e-6, (where, d)
                assert d.get("vision_tower_calls", 0) >= 1 or r["rank"] not in s["plan"]["encoder"], (where, d)
            calls, sync = s["details"].get("vision_tower_calls", 0), s["details_sync"].get("vision_tower_calls", 0)
            assert sync <= calls <= 2, (r["rank"], s["step"], calls, sync)
    print("\nrank 0's exchange forward per micro-step (ms: whole / tower / waiting for outputs, calls): " + "; ".join(
        f"{s['step']}: " + ("not crossing" if not s["balanced"] else
                            f"{s['details']['vision_exchange_ms']:.1f} / {s['details'].get('vision_tower_ms', 0):.1f}"
                            f" / {s['details']['vision_wait_ms']:.1f}, {int(s['details'].get('vision_tower_calls', 0))}")
        for s in results[0]["steps"]))


def test_the_video_frames_encode_alone(results):
    """Bridge's tower attends per frame and positions each frame by (h, w): a video's grid
    (4, 16, 16) and four (1, 16, 16) rows of one call give the same outputs bit for bit; four
    calls of one frame each the same values up to GEMM rounding."""
    claim = results[0]["per_frame"]
    assert claim["outputs"] == 2 and claim["rows_bit_equal"], claim
    assert claim["alone_max_rel"] <= FP32_OUTPUTS, claim


def test_context_parallel_split_then_data_parallel_balance(results):
    by_rank = {(r["cp"]["dp_rank"], r["cp"]["cp_rank"]): r["cp"]["steps"] for r in results}
    step0 = {k: v[0] for k, v in by_rank.items()}
    assert step0[(1, 1)]["shares"] == [1, 0]                # an empty context-parallel share ...
    assert step0[(1, 1)]["vision_calls"] == 1               # ... that encodes another rank's frame
    for cp in (0, 1):                                       # one plan per data-parallel group
        assert step0[(0, cp)]["plan"] == step0[(1, cp)]["plan"]
    assert by_rank[(0, 0)][1]["shares"] is None             # a text-only data-parallel rank
