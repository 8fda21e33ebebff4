"""scripts/slurm_pretrain_vlm_moe.sh under a simulated Slurm: ``SLURM_*`` variables as
``sbatch`` sets them, and stand-ins for ``scontrol`` (the node list's host names) and
``srun`` (records its arguments and environment, then runs the task once per node, as
Slurm would, with that node's ``SLURM_NODEID``). The launcher runs with ``DRY_RUN=1``, so
each node prints the torchrun command it would start; the test checks they form one job.
A few seconds (each node starts the launcher's Python once)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "scripts" / "slurm_pretrain_vlm_moe.sh"

SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST: one host per line (the test's list, in order)
[ "$1 $2" = "show hostnames" ] || { echo "fake scontrol: unexpected $*" >&2; exit 2; }
printf '%s\\n' $FAKE_HOSTS
"""

SRUN = """#!/bin/bash
# Record the call, then run the task once per node with that node's Slurm variables.
printf '%s\\n' "$@" > "$REC/srun-args"
env > "$REC/srun-env"
while [[ $1 == --* ]]; do
  case $1 in
    *=*) shift ;;
    --output|--container-image|--container-mounts) shift 2 ;;
    *) shift ;;
  esac
done
hosts=($FAKE_HOSTS)
for ((n = 0; n < SLURM_JOB_NUM_NODES; n++)); do
  SLURM_NODEID=$n SLURM_PROCID=$n SLURM_LOCALID=0 SLURMD_NODENAME=${hosts[$n]} "$@" \\
    > "$REC/node$n.cmd" 2> "$REC/node$n.err" || exit 1
done
"""


def _fake_slurm(tmp_path: Path, hosts, gpus: int, **extra) -> dict:
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("MEGATRON_LM_DIR", "NNODES", "NODE_RANK",
                                                        "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")}
    env.update(PATH=f"{bin_}:{env['PATH']}", FAKE_HOSTS=" ".join(hosts), REC=str(tmp_path),
               SLURM_JOB_NODELIST=f"{hosts[0]}-list", SLURM_JOB_NUM_NODES=str(len(hosts)),
               SLURM_JOB_ID="4242", SLURM_GPUS_ON_NODE=str(gpus), SLURM_SUBMIT_DIR=str(ROOT),
               DRY_RUN="1", OUTPUT_DIR=str(tmp_path / "run"), **extra)
    return env


def _slurm(env, config: str):
    return subprocess.run(["bash", str(SLURM), "--config", str(ROOT / "configs" / "megatron" / config),
                           "--log-interval", "5"], capture_output=True, text=True, env=env, timeout=120)


def _flag(argv, name):
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("config,hosts,gpus", [
    ("tiny_cpu.sh", ["cpu-01", "cpu-02"], 2),
    ("vlm_30b_moe.sh", ["gpu-a1", "gpu-a2", "gpu-b1", "gpu-b2"], 8),
])
def test_every_node_runs_its_part_of_one_job(tmp_path, config, hosts, gpus):
    env = _fake_slurm(tmp_path, hosts, gpus)
    r = _slurm(env, config)
    assert r.returncode == 0, r.stderr
    srun_args = (tmp_path / "srun-args").read_text().splitlines()
    assert "--ntasks-per-node=1" in srun_args and "--kill-on-bad-exit=1" in srun_args
    assert _flag(srun_args, "--output") == f"{tmp_path}/run/node-%n.log"
    assert "--container-image" not in srun_args
    srun_env = dict(line.split("=", 1) for line in (tmp_path / "srun-env").read_text().splitlines()
                    if "=" in line)
    assert (srun_env["MASTER_ADDR"], srun_env["NNODES"], srun_env["NPROC_PER_NODE"]) == (
        hosts[0], str(len(hosts)), str(gpus))
    assert srun_env["OUTPUT_DIR"] == f"{tmp_path}/run"
    cmds = [(tmp_path / f"node{n}.cmd").read_text().split("\n") for n in range(len(hosts))]
    for n, argv in enumerate(cmds):
        assert argv[1:3] == ["-m", "torch.distributed.run"], argv[:4]
        assert _flag(argv, "--nnodes") == str(len(hosts))
        assert _flag(argv, "--node-rank") == str(n)
        assert _flag(argv, "--master-addr") == hosts[0]
        assert _flag(argv, "--master-port") == "29500"
        assert _flag(argv, "--nproc-per-node") == str(gpus)
        assert "--mm-balance" in argv and argv[-3:-1] == ["--log-interval", "5"]
        # node ids are found at start-up (torchrun's GROUP_RANK): nothing is set by hand
        assert "--mm-balance-ranks-per-node" not in argv
    # the same job everywhere: only the node rank differs
    node_rank_at = cmds[0].index("--node-rank") + 1
    for argv in cmds[1:]:
        assert argv[:node_rank_at] + argv[node_rank_at + 1:] == cmds[0][:node_rank_at] + cmds[0][node_rank_at + 1:]


def test_container_and_port_reach_every_node(tmp_path):
    hosts = ["cpu-01", "cpu-02"]
    env = _fake_slurm(tmp_path, hosts, 2, CONTAINER_IMAGE="nvcr.io/nvidia/pytorch:25.01-py3",
                      MASTER_PORT="31337")
    r = _slurm(env, "tiny_cpu.sh")
    assert r.returncode == 0, r.stderr
    srun_args = (tmp_path / "srun-args").read_text().splitlines()
    assert _flag(srun_args, "--container-image") == "nvcr.io/nvidia/pytorch:25.01-py3"
    assert _flag(srun_args, "--container-mounts").startswith(f"{ROOT}:{ROOT}")
    for n in range(2):
        argv = (tmp_path / f"node{n}.cmd").read_text().split("\n")
        assert _flag(argv, "--master-port") == "31337" and _flag(argv, "--node-rank") == str(n)


def test_outside_an_allocation_is_refused_in_one_line(tmp_path):
    env = _fake_slurm(tmp_path, ["cpu-01"], 2)
    del env["SLURM_JOB_NODELIST"]
    r = _slurm(env, "tiny_cpu.sh")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0
    assert "run it with sbatch" in r.stderr and not (tmp_path / "srun-args").exists()
