"""Launch scripts and configs: the torchrun (python -m torch.distributed.run) command they build, the Slurm fan-out, and
(with the core_v0.16.1 tree of megatron_trees.py) that Megatron's own parse_args and
validate_args accept every config. About 30 s with a checkout, 2 s without.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_glue_patches import ROOT

LAUNCH = ROOT / "scripts" / "pretrain_vlm_moe.sh"
SLURM = ROOT / "scripts" / "slurm_pretrain_vlm_moe.sh"
CONFIGS = sorted((ROOT / "configs" / "megatron").glob("*.sh"))


def config_vars(cfg):
    out = subprocess.run(["bash", "-c", f'source "{cfg}"; echo $NNODES $GPUS_PER_NODE $TP $PP $EP $CP $MBS $GBS'],
                         capture_output=True, text=True, check=True).stdout.split()
    return dict(zip("NNODES GPUS_PER_NODE TP PP EP CP MBS GBS".split(), map(int, out)))


def dry_run(cfg, env=None, *extra):
    e = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM_DIR", "NNODES", "NPROC_PER_NODE")}
    e.update(DRY_RUN="1", **(env or {}))
    return subprocess.run(["bash", str(LAUNCH), "--config", str(cfg), *extra], capture_output=True,
                          text=True, env=e, timeout=60)


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_configs_exist_and_state_their_layouts():
    names = {c.stem for c in CONFIGS}
    assert {"tiny_cpu", "vlm_2b_dense", "vlm_30b_moe"} <= names
    moe = config_vars(ROOT / "configs/megatron/vlm_30b_moe.sh")
    assert (moe["TP"], moe["PP"], moe["EP"]) == (2, 2, 8)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.stem)
def test_dry_run_builds_a_consistent_torchrun_command(cfg):
    r = dry_run(cfg)
    assert r.returncode == 0, r.stderr
    argv = r.stdout.split("\n")
    v = config_vars(cfg)
    assert argv[1:3] == ["-m", "torch.distributed.run"] and "examples/multimodal/train.py" in argv
    assert flag(argv, "--nproc-per-node") == str(v["GPUS_PER_NODE"])
    assert flag(argv, "--tensor-model-parallel-size") == str(v["TP"])
    assert flag(argv, "--pipeline-model-parallel-size") == str(v["PP"])
    assert flag(argv, "--expert-model-parallel-size") == str(v["EP"])
    assert "--mm-balance" in argv and flag(argv, "--mm-balance-sync") == "auto"
    assert flag(argv, "--micro-batch-size") == "1" and "" not in argv[:-1]
    assert "global_aux_loss" not in argv


def test_mm_balance_off_and_extra_flags():
    cfg = ROOT / "configs/megatron/tiny_cpu.sh"
    argv = dry_run(cfg, {"MM_BALANCE": "0"}, "--log-interval", "1").stdout.split("\n")
    assert "--mm-balance" not in argv and argv[-3:-1] == ["--log-interval", "1"]


def test_inconsistent_world_is_refused():
    r = dry_run(ROOT / "configs/megatron/vlm_30b_moe.sh", {"NPROC_PER_NODE": "3", "NNODES": "1"})
    assert r.returncode == 1 and "not a multiple of TP*PP*CP" in r.stderr


def test_missing_checkout_and_data_are_clear_errors(tmp_path):
    e = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM_DIR", "DATA_PATH", "DRY_RUN")}
    r = subprocess.run(["bash", str(LAUNCH)], capture_output=True, text=True, env=e, timeout=60)
    assert r.returncode == 1 and "MEGATRON_LM_DIR" in r.stderr
    r = subprocess.run(["bash", str(LAUNCH), "--config", str(tmp_path / "nope.sh")], capture_output=True,
                       text=True, env=e, timeout=60)
    assert r.returncode == 2 and "no such config" in r.stderr


def test_slurm_script_runs_one_torchrun_per_node(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text("#!/bin/bash\nprintf 'gpu-a\\ngpu-b\\n'\n")
    # srun stand-in: run the command once per node, as Slurm would, with SLURM_NODEID set.
    (bin_ / "srun").write_text('#!/bin/bash\nwhile [[ $1 == --* ]]; do [[ $1 == --output ]] && shift; shift; done\n'
                               'for n in 0 1; do SLURM_NODEID=$n "$@" > "$OUT/node$n.txt" || exit 1; done\n')
    for f in ("scontrol", "srun"):
        (bin_ / f).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_DIR"}
    env.update(PATH=f"{bin_}:{env['PATH']}", SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_ID="42", SLURM_GPUS_ON_NODE="8", DRY_RUN="1", OUT=str(tmp_path),
               OUTPUT_DIR=str(tmp_path / "run"), MM_BALANCE_HOME=str(ROOT))
    r = subprocess.run(["bash", str(SLURM), "--config", str(ROOT / "configs/megatron/vlm_30b_moe.sh")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    for n in (0, 1):
        argv = (tmp_path / f"node{n}.txt").read_text().split("\n")
        assert flag(argv, "--node-rank") == str(n) and flag(argv, "--nnodes") == "2"
        assert flag(argv, "--master-addr") == "gpu-a" and "--mm-balance" in argv
        assert flag(argv, "--nproc-per-node") == "8"        # 2 nodes x 8: DP=4 under TP=2 x PP=2


VALIDATE = r"""
import os, sys
mlm, here, argv_file = sys.argv[1:4]
sys.path[:0] = [mlm, mlm + "/examples/multimodal", here, here + "/tests/megatron_glue"]
import glue_import_stubs; glue_import_stubs.install()
argv = [l for l in open(argv_file).read().split("\n") if l]
argv = argv[argv.index("examples/multimodal/train.py") + 1:]
from multimodal_args import add_multimodal_extra_args
import megatron.training.arguments as A
A.get_device_arch_version = lambda: 9      # validate as on Hopper: TP > 1 asks the GPU's arch,
A.torch.cuda.get_device_capability = lambda *a, **k: (9, 0)   # --moe-grouped-gemm its capability
sys.argv = ["train.py"] + argv
args = A.validate_args(A.parse_args(extra_args_provider=add_multimodal_extra_args),
                       {"tokenizer_type": "GPT2BPETokenizer"})
print("VALID", args.world_size, args.data_parallel_size, args.expert_model_parallel_size, args.mm_balance)
"""


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.stem)
def test_megatron_accepts_each_config(cfg, tmp_path, patched_v16):
    clone = patched_v16
    r = dry_run(cfg, {"MEGATRON_LM_DIR": str(clone)})
    assert r.returncode == 0, r.stderr
    argv_file = tmp_path / "argv.txt"
    argv_file.write_text(r.stdout)
    v = config_vars(cfg)
    world = v["NNODES"] * v["GPUS_PER_NODE"]
    env = dict(os.environ, WORLD_SIZE=str(world), RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    r = subprocess.run([sys.executable, "-c", VALIDATE, str(clone), str(ROOT), str(argv_file)],
                       capture_output=True, text=True, env=env, timeout=300, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    dp = world // (v["TP"] * v["PP"] * v["CP"])
    assert f"VALID {world} {dp} {v['EP']} True" in r.stdout


def upstream_balancer_specs(tree, python, tmp_path):
    """release_check.py specs: the tiny config's command with --hybrid-context-parallel added,
    balancing on and off (see release_check.py)."""
    cfg = ROOT / "configs/megatron/tiny_cpu.sh"
    specs = []
    for on in ("1", "0"):
        r = dry_run(cfg, {"MEGATRON_LM_DIR": str(tree), "PYTHON": python, "MM_BALANCE": on})
        assert r.returncode == 0, r.stderr
        f = tmp_path / f"upstream-{on}.argv"
        f.write_text(r.stdout)
        specs.append(f"upstream:{f}:4")
    return specs


def check_upstream_balancer_lines(stdout, tmp_path):
    on, off = tmp_path / "upstream-1.argv", tmp_path / "upstream-0.argv"
    want = (f"REFUSED {on} --mm-balance cannot be combined with --hybrid-context-parallel: "
            "HybridCPDataLoaderWrapper")
    assert want in stdout and f"VALID-UPSTREAM {off}" in stdout, stdout[-2000:]


def test_megatron_refuses_hybrid_context_parallel_with_mm_balance(tmp_path, patched_v16):
    """Through core_v0.16.1's own parse_args + validate_args (with the settings Megatron's
    validate_args asks of hybrid context parallel): refused with --mm-balance by our one-line
    error, accepted without it."""
    clone = patched_v16
    specs = upstream_balancer_specs(clone, sys.executable, tmp_path)
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "release_check.py"), str(clone), str(ROOT),
                        *specs], capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                       env=dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    check_upstream_balancer_lines(r.stdout, tmp_path)


def test_gpu_path_refuses_without_transformer_engine_and_probes_apex(tmp_path, patched_v16):
    """Without the CPU harness (a GPU config) and no transformer-engine, the launcher stops
    before torchrun with one message; an importable apex drops the no-fusion flags."""
    clone = patched_v16
    e = {k: v for k, v in os.environ.items() if k not in ("DRY_RUN", "NNODES", "NPROC_PER_NODE")}
    e.update(MEGATRON_LM_DIR=str(clone), DATA_PATH=str(tmp_path), OUTPUT_DIR=str(tmp_path / "run"))
    r = subprocess.run(["bash", str(LAUNCH), "--config", str(ROOT / "configs/megatron/vlm_2b_dense.sh")],
                       capture_output=True, text=True, env=e, timeout=120)
    assert r.returncode == 1 and "transformer-engine is not importable" in r.stderr, r.stderr
    assert "torch.distributed.run" not in r.stdout
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "apex.py").write_text("")
    without = dry_run(ROOT / "configs/megatron/vlm_2b_dense.sh").stdout.split("\n")
    with_apex = dry_run(ROOT / "configs/megatron/vlm_2b_dense.sh",
                        {"PYTHONPATH": f"{fake}:{os.environ.get('PYTHONPATH', '')}"}).stdout.split("\n")
    assert "--no-gradient-accumulation-fusion" in without
    assert "--no-gradient-accumulation-fusion" not in with_apex
