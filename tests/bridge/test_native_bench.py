"""Fast tests of the native-resolution Bridge benchmark's parts: the data set (``make-dataset
--format bridge-qwen-vl --mix native-res``: byte-reproducible, images and videos at their
grids, text-only samples), the FLOP share of the CPU config against Qwen3-VL-30B-A3B at 8K,
Bridge's log lines, the framework's modes, per-frame records and the hold-out prediction."""
from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

import bridge_util as bu
from megatron_mm_balance.bench import native_share, realpath
from megatron_mm_balance.bridge import bench as bridge_bench
from megatron_mm_balance.data import native_res as nr
from megatron_mm_balance.sim.run_trace import frames_view
from megatron_mm_balance.testing.host_side import check_heap_settings


def _digest(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _records(root: Path) -> dict:
    recs = {}
    with tarfile.open(root / "train-000000.tar") as tf:
        for m in tf.getmembers():
            key, part = m.name.split(".", 1)
            recs.setdefault(key, {})[part] = tf.extractfile(m).read()
    return recs


def test_native_res_dataset_reproducible_and_at_its_grids(tmp_path):
    pytest.importorskip("megatron.energon")
    from PIL import Image
    from megatron_mm_balance.bridge.native_dataset import make_native_res_dataset
    lines = make_native_res_dataset(tmp_path / "a", samples=48, seed=5)
    make_native_res_dataset(tmp_path / "b", samples=48, seed=5)
    make_native_res_dataset(tmp_path / "c", samples=48, seed=6)
    a, b, c = _digest(tmp_path / "a"), _digest(tmp_path / "b"), _digest(tmp_path / "c")
    assert a == b and a["train-000000.tar"] != c["train-000000.tar"]
    assert f"DATA_PATH={tmp_path / 'a'}" in lines and "longest sample" in lines[1]
    meta = (tmp_path / "a" / ".nv-meta" / "dataset.yaml").read_text()
    assert "imgs: jpgs" in meta and "videos: videos" in meta and "conversation: json" in meta
    # the pixels are the mix's grids: 16 px per patch, 2 frames per temporal patch
    want = nr.draw(np.random.default_rng(5), 48)
    kinds = set()
    for i, (key, rec) in enumerate(sorted(_records(tmp_path / "a").items())):
        s, turns = want[i], json.loads(rec["json"])
        images, videos = pickle.loads(rec["jpgs"]), pickle.loads(rec["videos"])
        grids_i = [g for g, v in zip(s.grids, s.videos) if not v]
        grids_v = [g for g, v in zip(s.grids, s.videos) if v]
        assert [Image.open(io.BytesIO(x)).size for x in images] == [(16 * w, 16 * h) for _, h, w in grids_i]
        assert [len(v) for v in videos] == [2 * t for t, _, _ in grids_v]
        assert all(Image.open(io.BytesIO(f)).size == (16 * w, 16 * h) for v, (_, h, w) in zip(videos, grids_v)
                   for f in v)
        assert turns[0]["value"].count("<image>") == len(images) and turns[0]["value"].count("<video>") == len(videos)
        kinds.add(s.kind)
    assert kinds == set(nr.KINDS)


def test_native_res_through_the_cli_and_its_refusals(tmp_path):
    pytest.importorskip("megatron.energon")
    env = dict(os.environ, PYTHONPATH=str(bu.REPO))
    cmd = [sys.executable, "-m", "megatron_mm_balance.cli", "make-dataset"]
    r = subprocess.run(cmd + [str(tmp_path / "d"), "--samples", "16", "--seed", "1", "--format", "bridge-qwen-vl",
                              "--mix", "native-res"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "native-res: text:" in r.stdout and (tmp_path / "d" / "processor" / "tokenizer.json").is_file()
    bad = subprocess.run(cmd + [str(tmp_path / "e"), "--mix", "native-res"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "--mix must be one of" in bad.stderr


def test_cpu_config_share_matches_the_30b_at_8k():
    rep = native_share.table(samples=2048, seed=0)
    packed, padded, cpu = rep["rows"]
    assert packed["model"] == padded["model"] == "Qwen3-VL-30B-A3B" and cpu["model"] == "CPU config"
    assert packed["seq_length"] == 8192 and cpu["seq_length"] == native_share.cpu_shapes().seq_length
    # the target and the config's share, within the stated tolerance
    assert rep["within_tolerance"], native_share.format_table(rep)
    assert abs(cpu["share"] - packed["share"]) * 100 <= native_share.SHARE_TOLERANCE_POINTS
    # padding every row to 8K (Bridge 0.6's step under expert parallelism) leaves vision a sliver
    assert padded["share"] < 0.05 < 0.2 < packed["share"] < 0.4
    # an 8K pack holds many samples; its vision FLOPs are theirs summed
    assert packed["samples_per_micro_batch"] > 8
    assert packed["vision_gflop"] == pytest.approx(padded["vision_gflop"] * packed["samples_per_micro_batch"],
                                                   rel=0.02)


def test_share_of_a_hand_computed_case():
    """One image of 64 patches padded to a 100-position row: the share is the hand count."""
    big = native_share.qwen3_vl_30b()
    a, b, t, s = big.terms()
    one = [nr.NativeResSample("image", ((1, 8, 8),), (False,), 10)]
    row = native_share.padded_rows(one, native_share.Shapes("x", big.vision, big.language, 100))
    v, l_ = a * 64 + b * 64 * 64, t * 100 + s * 100 * 100
    assert row["share"] == pytest.approx(v / (v + l_))


BRIDGE_LOG = """\
 [2026-12-02 17:14:13] iteration        1/       4 | consumed samples:           16 | elapsed time per iteration (ms): 7515.2 | learning rate: 1.000000E-04 | global batch size:    16 | lm loss: 6.475800E+00 | load_balancing_loss: 1.000E+00 | loss scale: 1.0 |
[mm-balance] iteration 1 | packs_moved: 4 | consumer_wait_ms: 0.7 | exchange_ms: 31.5
 [2026-12-02 17:14:19] iteration        2/       4 | consumed samples:           32 | elapsed time per iteration (ms): 5832.6 | learning rate: 7.750000E-05 | global batch size:    16 | lm loss: 6.473000E+00 | loss scale: 1.0 |
 [2026-12-02 17:14:26] iteration        3/       4 | consumed samples:           48 | elapsed time per iteration (ms): 7041.1 | learning rate: 3.250000E-05 | global batch size:    16 | lm loss: 6.371700E+00 | loss scale: 1.0 |
"""


def test_bridge_log_lines_are_each_their_own_iteration():
    elapsed, losses, tele, fit = realpath.parse_log(BRIDGE_LOG, first_two_averaged=False)
    assert elapsed == {1: 7515.2, 2: 5832.6, 3: 7041.1}
    assert losses == {1: 6.4758, 2: 6.473, 3: 6.3717}                   # no first-two correction
    assert tele == {1: {"packs_moved": 4.0, "consumer_wait_ms": 0.7, "exchange_ms": 31.5}} and fit == ""
    _, megatron_losses, _, _ = realpath.parse_log(BRIDGE_LOG)           # Megatron-LM's reading differs
    assert megatron_losses[2] == pytest.approx(2 * 6.473 - 6.4758)


def test_bridge_modes_and_refusals(monkeypatch):
    fw = bridge_bench.BridgeFramework(cost="image-tokens")
    assert fw.mode_args("off") == ("0", []) and fw.mode_args("untimed") == ("0", [])
    assert fw.mode_args("packs") == ("1", ["mm_balance.cost=image-tokens"])
    assert fw.mode_args("model") == ("1", ["mm_balance.cost=model"])
    assert fw.mode_args("packs-sync") == ("1", ["mm_balance.cost=image-tokens", "mm_balance.overlap=false"])
    assert "packs-sync" in fw.all_modes() and "packs-sync" not in fw.default_modes()
    assert fw.mode_args("crossover-odd") == ("1", ["mm_balance.cost=image-tokens", "mm_balance.overlap=false",
                                                   "mm_balance.mode=crossover-odd"])
    assert {"crossover-even", "crossover-odd"} <= set(fw.all_modes()) - set(fw.default_modes())
    assert fw.mode_args("images-crossover-even") == ("1", ["mm_balance.vision=images", "mm_balance.cost=image-tokens",
                                                           "mm_balance.overlap=false",
                                                           "mm_balance.mode=crossover-even"])
    assert {"images-crossover-even", "images-crossover-odd"} <= set(fw.all_modes()) - set(fw.default_modes())
    megatron = realpath.MegatronLMFramework()
    assert megatron.mode_args("crossover-even") == ("1", ["--no-mm-balance-overlap", "--mm-balance-mode",
                                                         "crossover-even"])
    assert {"crossover-even", "crossover-odd"} <= set(megatron.all_modes()) - set(megatron.default_modes())
    assert fw.timing_args(Path("/x/timing")) == ["mm_balance.timing_dir=/x/timing"]
    with pytest.raises(realpath.BenchError, match="unknown mode 'sync'"):
        fw.mode_args("sync")
    monkeypatch.setattr(bridge_bench, "bridge_images_available", lambda: False)
    with pytest.raises(realpath.BenchError, match="mode images needs mm_balance.vision"):
        fw.mode_args("images")
    assert "images" not in fw.default_modes()
    monkeypatch.setattr(bridge_bench, "bridge_images_available", lambda: True)
    assert bridge_bench.BridgeFramework(cost="model").mode_args("images") == (
        "1", ["mm_balance.vision=images", "mm_balance.cost=model"])
    assert fw.default_modes() == ("off", "packs", "model", "images")
    assert fw.mode_args("images-sync") == (
        "1", ["mm_balance.vision=images", "mm_balance.cost=image-tokens", "mm_balance.image_overlap=false"])
    assert fw.mode_args("images-measured")[1][-1] == "mm_balance.image_rates=measured"
    assert fw.mode_args("images-by-cost")[1][-1] == "mm_balance.image_pack_cost=cost"
    assert {"images-sync", "images-measured"} <= set(fw.all_modes())
    with pytest.raises(realpath.BenchError, match="--cost must be one of"):
        bridge_bench.BridgeFramework(cost="tiles").check()
    assert realpath.FRAMEWORKS["bridge"] is bridge_bench.BridgeFramework


def test_bench_refuses_before_running(tmp_path, monkeypatch):
    monkeypatch.setattr(bridge_bench, "bridge_images_available", lambda: False)
    env = dict(os.environ, PYTHONPATH=str(bu.REPO))
    cmd = [sys.executable, "-m", "megatron_mm_balance.cli", "bench-realpath", "--bridge", "--out", str(tmp_path)]
    r = subprocess.run(cmd + ["--modes", "packs"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--modes must include off" in r.stderr
    r = subprocess.run(cmd + ["--modes", "off,sync"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unknown mode 'sync'" in r.stderr
    r = subprocess.run(cmd + ["--holdout-seed", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--holdout-seed 0: must differ from --seed" in r.stderr
    assert not list(tmp_path.iterdir())                                  # nothing made, nothing run


def test_frames_view_of_a_qwen_record():
    rec = {"images": [72, 4], "grids": [[3, 4, 6], [1, 2, 2]]}
    assert frames_view(rec)["images"] == [24, 24, 24, 4] and rec["images"] == [72, 4]
    assert frames_view({"images": [16]}) == {"images": [16]}


def _write_run(d: Path, seed: int, iterations=5, ranks=2, G=4):
    """A synthetic timed job: per-frame vision a*p + b*p^2, a fixed language phase, micro-batches
    back to back on each rank's clock (the language phase waits for the slower rank)."""
    rng = np.random.default_rng(seed)
    lines = {r: [] for r in range(ranks)}
    clock = 0.0
    for it in range(1, iterations + 1):
        t = [clock] * ranks
        for m in range(G):
            grids = [[[1, 2 * int(rng.integers(4, 30)), 2 * int(rng.integers(4, 30))]] for _ in range(ranks)]
            vis = [sum(0.02 * h * w + 2e-5 * (h * w) ** 2 for _, h, w in g) for g in grids]
            meet = max(t[r] + vis[r] / 3 for r in range(ranks))
            for r in range(ranks):
                rec = dict(iteration=it, microbatch=m, rank=r, images=[h * w for _, h, w in grids[r]],
                           grids=grids[r], lengths=[1024], vision_forward_ms=vis[r] / 3,
                           vision_backward_ms=2 * vis[r] / 3, lm_forward_ms=(meet - t[r]) - vis[r] / 3 + 40.0,
                           lm_backward_ms=60.0, start_s=t[r] / 1e3, end_s=(meet + 100.0 + 2 * vis[r] / 3) / 1e3)
                lines[r].append(json.dumps(rec))
                t[r] = meet + 100.0 + 2 * vis[r] / 3
        clock = max(t) + 50.0
    (d / "timing").mkdir(parents=True)
    for r, ls in lines.items():
        (d / "timing" / f"timing-rank{r:05d}.jsonl").write_text("\n".join(ls) + "\n")
    return d


def test_holdout_prediction_fits_one_run_and_predicts_another(tmp_path):
    a, b = _write_run(tmp_path / "a", 1), _write_run(tmp_path / "b", 2)
    main = [realpath.RunResult("off", 1, 0, 1.0, str(a), {i: 1000.0 for i in range(1, 6)})]
    hold = [realpath.RunResult("off", 0, 0, 1.0, str(b), {i: 1500.0 for i in range(1, 6)}),
            realpath.RunResult("packs", 0, 0, 1.0, str(b), {i: 1200.0 for i in range(1, 6)})]
    out = realpath.predict_holdout(main, hold, warmup=2, frames=True,
                                   simulated={"none": "off", "redistribute-overlap": "packs"})
    assert out["fitted_on"] == [str(a)] and out["predicted_run"] == str(b)
    assert out["off"]["measured_ms"] == 1500.0 and out["packs"]["measured_ms"] == 1200.0
    assert out["off"]["iterations"] == 3 and out["off"]["strategy"] == "none"
    for mode in ("off", "packs"):
        v = out[mode]
        assert v["simulated_ms"] > 0 and v["rel_error"] == pytest.approx(v["simulated_ms"] / v["measured_ms"] - 1)
    assert out["packs"]["simulated_ms"] <= out["off"]["simulated_ms"]
    two = realpath.predict_holdout(main, hold + [realpath.RunResult("off", 2, 0, 1.0, str(b), {i: 1700.0 for i in
                                                                                             range(1, 6)})],
                                   warmup=2, frames=True, simulated={"none": "off"})
    assert two["off"]["iterations"] == 6 and two["off"]["measured_ms"] == 1600.0   # both rounds' iterations
    assert two["off"]["simulated_ms"] == pytest.approx(out["off"]["simulated_ms"])
    # fitted on the run itself, the simulator's off figure is simulate_against's
    same = realpath.predict_holdout(main, [realpath.RunResult("off", 0, 0, 1.0, str(a), main[0].elapsed_ms)],
                                    warmup=2, frames=True, simulated={"none": "off"})
    rep = realpath.analyze(main, warmup=2, loss_tolerance=1e-5, frames=True)
    sim = realpath.simulate_against(main, rep, warmup=2, frames=True, simulated={"none": "off"})
    assert same["off"]["simulated_ms"] == pytest.approx(sim["off"]["simulated_ms"])


def test_holdout_rounds_run_beside_the_main_rounds(tmp_path, monkeypatch):
    """--holdout-rounds N: hold-out round r runs right after main round r (the extra ones after
    the last), in alternating order like the main rounds, each in its own directory; the
    prediction's measured figure is the median over all of them; 0 is refused."""
    import argparse
    calls = []

    def launch(mode, rnd, *, data, name=None, **_):
        calls.append(name or f"round{rnd}-{mode}")
        return realpath.RunResult(mode, rnd, 0, 1.0, str(tmp_path / calls[-1]), {i: 1.0 for i in range(1, 5)})

    fw = bridge_bench.BridgeFramework(host="shared")
    monkeypatch.setattr(realpath, "framework_of", lambda a: fw)
    monkeypatch.setattr(bridge_bench.BridgeFramework, "check", lambda self: None)
    monkeypatch.setattr(bridge_bench.BridgeFramework, "make_data", lambda self, path, n, seed: {"seed": seed})
    monkeypatch.setattr(realpath, "run_launcher", launch)
    monkeypatch.setattr(realpath, "report_of", lambda results, a, modes, fw, holdout=(), **m: (results, holdout))
    p = argparse.ArgumentParser()
    realpath.add_arguments(p)
    base = ["--bridge", "--modes", "off,packs", "--out", str(tmp_path), "--holdout-seed", "5"]
    results, hold = realpath.run_bench(p.parse_args(base + ["--rounds", "2", "--holdout-rounds", "3"]))
    assert calls == ["round1-off", "round1-packs", "holdout-off", "holdout-packs",
                     "round2-packs", "round2-off", "holdout2-packs", "holdout2-off",
                     "holdout3-off", "holdout3-packs"]
    assert [(r.mode, r.round) for r in hold] == [("off", 1), ("packs", 1), ("packs", 2), ("off", 2),
                                                 ("off", 3), ("packs", 3)]
    calls.clear()
    realpath.run_bench(p.parse_args(base + ["--rounds", "1"]))
    assert calls == ["round1-off", "round1-packs", "holdout-off", "holdout-packs"]
    with pytest.raises(realpath.BenchError, match="--holdout-rounds must be >= 1"):
        realpath.run_bench(p.parse_args(base + ["--holdout-rounds", "0"]))
    assert realpath.holdout_dir("off", 1) == "holdout-off" and realpath.holdout_dir("packs", 4) == "holdout4-packs"


def test_the_launcher_gets_absolute_tree_paths(tmp_path, monkeypatch):
    """Relative --bridge / --megatron-lm paths reach the launcher (which runs in its own
    directory) as absolute ones."""
    import os
    from megatron_mm_balance.bench.realpath import MegatronLMFramework
    from megatron_mm_balance.bridge.bench import BridgeFramework
    monkeypatch.chdir(tmp_path)
    env = BridgeFramework(bridge="b", megatron_lm="m", host="shared").environment()
    assert env == {"MEGATRON_BRIDGE_DIR": os.path.join(str(tmp_path), "b"),
                   "MEGATRON_LM_DIR": os.path.join(str(tmp_path), "m")}
    assert MegatronLMFramework(megatron_lm="m").environment() == {"MEGATRON_LM_DIR": os.path.join(str(tmp_path), "m")}


def test_host_settings_reach_the_ranks_and_the_report(tmp_path):
    """--host gpu-node (the Bridge default) hands the ranks the harness's predraw and grown heap
    and glibc's keep-what-you-free settings, which the harness accepts together; shared hands
    them nothing; the Megatron-LM bench takes the same settings with --host gpu-node and runs
    shared by default; --reanalyze reads the host from the runs' logs, not from the flag."""
    import argparse
    fw = bridge_bench.BridgeFramework.from_args(argparse.Namespace(bridge=None, megatron_lm=None, cost="model",
                                                                   host=None))
    assert fw.host == "gpu-node"
    env = fw.environment()
    assert env["MM_BALANCE_CPU_PREDRAW"] == "all" and env["MALLOC_MMAP_MAX_"] == "0"
    assert int(env["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 40 and int(env["MM_BALANCE_CPU_HEAP_MB"]) > 0
    check_heap_settings(int(env["MM_BALANCE_CPU_HEAP_MB"]), env)        # the harness accepts them together
    shared = bridge_bench.BridgeFramework(host="shared").environment()
    assert not {"MM_BALANCE_CPU_PREDRAW", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
                "MM_BALANCE_CPU_HEAP_MB"} & set(shared)
    with pytest.raises(realpath.BenchError, match="--host must be one of"):
        bridge_bench.BridgeFramework(host="laptop").check()
    mlm = realpath.MegatronLMFramework.from_args(argparse.Namespace(megatron_lm="m", calibration_iters=3,
                                                                    host=None))
    assert mlm.host == "shared" and set(mlm.environment()) == {"MEGATRON_LM_DIR"}
    mlm = realpath.MegatronLMFramework.from_args(argparse.Namespace(megatron_lm="m", calibration_iters=3,
                                                                    host="gpu-node"))
    assert {k: v for k, v in mlm.environment().items() if k != "MEGATRON_LM_DIR"} == env
    tree = tmp_path / "tree"
    (tree / "examples" / "multimodal").mkdir(parents=True)
    (tree / "examples" / "multimodal" / "train.py").write_text("")
    realpath.MegatronLMFramework(megatron_lm=str(tree), host="gpu-node").check()
    with pytest.raises(realpath.BenchError, match="--host must be one of"):
        realpath.MegatronLMFramework(megatron_lm=str(tree), host="laptop").check()
    for name, line in (("round1-off", "mm-balance CPU harness: drew 80 micro-batches before the first "
                        "iteration (MM_BALANCE_CPU_PREDRAW=all)\n"), ("round1-packs", "iteration 1/ 10 |\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.log").write_text(line)
    assert realpath.host_of_logs(tmp_path) == "shared"                  # one run without it
    (tmp_path / "round1-packs" / "train.log").write_text("drew 80 micro-batches before the first iteration")
    assert realpath.host_of_logs(tmp_path) == "gpu-node"
    assert realpath.host_of_logs(tmp_path / "nothing") == "shared"


def test_what_the_off_runs_packs_could_reach(tmp_path):
    """With the FLOP-derived cost a Qwen-VL run writes beside its records, the report adds the
    placement objective on the off runs' measured packs: as laid out, by the image-token, the
    FLOP-cost and the measured-time placements, the floors of whole packs and of whole frames, and perfect
    balance, in that order of time (each placement at or above the packs floor, frames at or
    below packs, perfect below all); without the file, none of it."""
    from megatron_mm_balance.cost.model import CostModel
    from megatron_mm_balance.cost.replay import FLOPS_MODEL_FILE
    a = _write_run(tmp_path / "a", 3)
    runs = [realpath.RunResult("off", 1, 0, 1.0, str(a), {i: 1000.0 for i in range(1, 6)})]
    bare = realpath.analyze(runs, warmup=2, loss_tolerance=1e-5, frames=True)["predicted"]
    assert "objective" not in bare and "placement objective" not in realpath.format_report(
        {"modes": {}, "losses": [], "predicted": bare, "simulated": {}})
    CostModel(vision_ms_per_token=0.02, vision_ms_per_token_sq=2e-5, llm_ms_per_len_sq=1e-5).save(
        str(a / "timing" / FLOPS_MODEL_FILE))
    rep = realpath.analyze(runs, warmup=2, loss_tolerance=1e-5, frames=True)
    o = {k: v["ms"] for k, v in rep["predicted"]["objective"].items()}
    eps = 1e-6
    assert o["unbalanced"] > o["image_tokens"] >= o["floor_packs"] - eps and o["flop_cost"] >= o["floor_packs"] - eps
    assert o["floor_packs"] >= o["floor_frames"] - eps and o["floor_frames"] >= o["perfect"] - eps
    # frames spread after a placement: no worse than that placement's packs, never below the frames floor
    assert o["floor_frames"] - eps <= o["frames_after_image_tokens"] <= o["image_tokens"] + eps
    assert o["floor_frames"] - eps <= o["frames_after_heaviest_frame"] <= o["unbalanced"] + eps
    # the planner on the packs' own times: no costlier than either estimate, at the floor here
    assert o["measured"] <= min(o["image_tokens"], o["flop_cost"]) + eps
    assert o["measured"] == pytest.approx(o["floor_packs"], rel=1e-3)
    share = rep["predicted"]["objective"]["floor_packs"]["share_of_perfect"]
    assert 0 < share <= 1 and share == pytest.approx((o["unbalanced"] / o["floor_packs"] - 1)
                                                      / (o["unbalanced"] / o["perfect"] - 1))
    assert "floor of whole packs" in realpath.format_report(rep)
