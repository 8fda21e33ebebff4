"""``mm-balance bench-realpath --bridge``: the real-speed bench on Megatron-Bridge's Qwen3-VL.

What differs from the Megatron-LM bench (:mod:`megatron_mm_balance.bench.realpath`, which runs,
analyses and simulates both) is :class:`BridgeFramework`: the launcher
(``scripts/pretrain_bridge_vlm.sh``), the native-resolution CPU config
(``configs/bridge/qwen3_vl_moe_native_res_cpu.sh``: DP=2 x EP=2 on 2 ranks, 8 micro-batches per
rank), the data (``make-dataset --format bridge-qwen-vl --mix native-res``), the modes as
Hydra overrides of ``cfg.mm_balance``, and Bridge's log (each line its iteration's own loss).
The timing records carry Qwen-VL grids, so the analysis reads them per frame.

Modes: ``off`` (``MM_BALANCE=0``), ``packs`` (pack placement, ``mm_balance.cost`` = ``--cost``,
image tokens by default), ``model`` (pack placement with the FLOP-derived cost,
``mm_balance.cost=model``), ``images`` (``mm_balance.vision=images``: frames balanced across
ranks every micro-step, the transfers overlapped with the tower; refused in one line where
``MMBalanceBridgeConfig`` has no ``vision`` field), ``images-sync`` (``images`` with each
exchange completed before the tower: ``mm_balance.image_overlap=false``), ``images-measured``
(``images`` charging moves at the rates the run measures: ``mm_balance.image_rates=measured``),
``images-by-cost`` (``images`` with the packs placed on ``mm_balance.cost`` first instead of
their heaviest frame: ``mm_balance.image_pack_cost=cost``), ``packs-sync`` (``packs`` with the
exchange inside the training loop's ``next()``: ``mm_balance.overlap=false``),
``crossover-even`` and ``crossover-odd`` (``packs-sync`` at the even, or odd, iterations, the
others as drawn: ``mm_balance.mode=crossover-*``; the two together time every iteration balanced
and not inside the same jobs, ``benchmarks/crossover_gain.py``), ``images-crossover-even`` and
``images-crossover-odd`` (the same with ``mm_balance.vision=images``: packs and frames balanced at
that parity, the plain tower at the other; ``crossover_gain.py --pair images-crossover``),
``packs-sync-all`` (``packs-sync`` placed as if all data-parallel ranks met every micro-step,
``mm_balance.sync=microstep``, instead of by the job's meeting groups), ``groups-crossover-even`` and
``groups-crossover-odd`` (``packs-sync`` placed by the meeting groups at that parity and as
``packs-sync-all`` at the other: ``crossover_gain.py --pair groups-crossover``), ``untimed`` (``off``
without the timing hooks).

``--host`` (:data:`HOST_ENV`): ``gpu-node`` by default, the ranks' host side as on a GPU node
(the batches drawn before the first iteration, the allocator keeping what it frees, its pool
faulted in at setup);
``shared``, the CPU harness as it runs by default.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Dict, Optional

from ..bench.realpath import DEFAULTS, HOST_ENV, REPO, BenchError, register_framework
from .config import MMBalanceBridgeConfig
from .native_dataset import make_native_res_dataset

LAUNCHER = REPO / "scripts" / "pretrain_bridge_vlm.sh"
CONFIG = REPO / "configs" / "bridge" / "qwen3_vl_moe_native_res_cpu.sh"
MODES = ("off", "packs", "model")
#: ``packs-sync``: pack placement with each global batch's gather, plan and exchanges run inside
#: the training loop's ``next()`` (``mm_balance.overlap=false``) instead of on the exchange
#: thread, which on this host's two cores shares the ranks' cores and their interpreter lock
SYNC_MODES = {"packs-sync": ["mm_balance.overlap=false"],
              # ``packs-sync`` placed as if all data-parallel ranks met every micro-step (today's
              # objective), not by the job's expert-parallel meeting groups
              "packs-sync-all": ["mm_balance.overlap=false", "mm_balance.sync=microstep"]}
#: a pair of runs that time every iteration both ways inside the same jobs: ``packs-sync`` at
#: the iterations of one parity, the others as drawn (gathered and solved, nothing moved). The
#: exchange runs inside ``next()`` so each iteration carries its own exchange: overlapped, an
#: unbalanced iteration would carry the next (balanced) batch's
CROSSOVER_MODES = {f"crossover-{parity}": ["mm_balance.overlap=false", f"mm_balance.mode=crossover-{parity}"]
                   for parity in ("even", "odd")}
#: a pair of runs that time both placements inside the same jobs: ``packs-sync`` placed by the job's
#: meeting groups at the iterations of one parity, as if all ranks met every micro-step at the others
GROUPS_CROSSOVER_MODES = {f"groups-crossover-{parity}": ["mm_balance.overlap=false",
                                                         f"mm_balance.mode=groups-crossover-{parity}"]
                          for parity in ("even", "odd")}
#: the image-level modes: their overrides beyond ``mm_balance.vision=images``
IMAGE_MODES = {"images": [], "images-sync": ["mm_balance.image_overlap=false"],
               "images-measured": ["mm_balance.image_rates=measured"],
               "images-by-cost": ["mm_balance.image_pack_cost=cost"],
               **{f"images-{mode}": overrides for mode, overrides in CROSSOVER_MODES.items()}}
#: ``mm_balance.cost`` values the ``packs`` and ``images`` modes take (``--cost``)
COSTS = ("image-tokens", "model")
def bridge_images_available() -> bool:
    """Whether ``cfg.mm_balance`` has the ``vision`` field (image-level balancing on Bridge)."""
    return "vision" in {f.name for f in dataclasses.fields(MMBalanceBridgeConfig)}


@register_framework
@dataclass
class BridgeFramework:
    """Megatron-Bridge's Qwen3-VL through ``scripts/pretrain_bridge_vlm.sh`` on the native-res mix."""

    bridge: Optional[str] = None            # MEGATRON_BRIDGE_DIR (default: the Bridge PYTHON imports)
    megatron_lm: Optional[str] = None       # MEGATRON_LM_DIR (default: the one Bridge pins)
    cost: str = COSTS[0]
    host: str = "gpu-node"
    name: ClassVar[str] = "bridge"
    launcher: ClassVar[Path] = LAUNCHER
    config: ClassVar[Path] = CONFIG
    #: Bridge resets its accumulators at every log line
    first_two_averaged: ClassVar[bool] = False
    #: a record's grids give its frames (attention units) for the timing model
    frames: ClassVar[bool] = True
    simulated: ClassVar[Dict[str, str]] = {"none": "off", "redistribute-overlap": "packs"}
    #: fp32: balancing's losses equal off's at Bridge's printed precision under expert
    #: parallelism (bf16 is judged against a control run instead, docs/notes/2026-12-02-bridge-control-band.md)
    defaults: ClassVar[dict] = {"PRECISION": "fp32"}
    #: the native-res job's iterations are shorter than the Megatron-LM job's: more of them
    bench_defaults: ClassVar[dict] = dict(DEFAULTS, iters=8, samples=256)

    @classmethod
    def from_args(cls, a) -> "BridgeFramework":
        return cls(bridge=a.bridge or os.environ.get("MEGATRON_BRIDGE_DIR") or None,
                   megatron_lm=a.megatron_lm or None, cost=a.cost,
                   host=getattr(a, "host", None) or cls.host)

    @staticmethod
    def python() -> str:
        """The ranks' interpreter: the Bridge environment of scripts/setup_env_bridge.sh when
        it exists (Bridge 0.6 needs Python 3.12), else this one."""
        venv = REPO / ".venv-bridge" / "bin" / "python"
        return str(venv) if venv.is_file() else sys.executable

    def all_modes(self) -> tuple:
        return (MODES + tuple(SYNC_MODES) + tuple(CROSSOVER_MODES) + tuple(GROUPS_CROSSOVER_MODES)
                + tuple(IMAGE_MODES) + ("untimed",))

    def default_modes(self) -> tuple:
        return MODES + (("images",) if bridge_images_available() else ())

    def check(self) -> None:
        if self.cost not in COSTS:
            raise BenchError(f"--cost must be one of {', '.join(COSTS)}, got {self.cost!r}")
        if self.host not in HOST_ENV:
            raise BenchError(f"--host must be one of {', '.join(HOST_ENV)}, got {self.host!r}")
        for flag, d in (("--bridge", self.bridge), ("--megatron-lm", self.megatron_lm)):
            if d and not Path(d).is_dir():
                raise BenchError(f"{flag} {d}: no such directory")

    def environment(self) -> dict:
        """The launcher's tree variables, as absolute paths (the launcher runs elsewhere), and
        the host side's settings of ``--host`` (:data:`HOST_ENV`)."""
        env = dict(HOST_ENV[self.host])
        if self.bridge:
            env["MEGATRON_BRIDGE_DIR"] = os.path.abspath(self.bridge)
        if self.megatron_lm:
            env["MEGATRON_LM_DIR"] = os.path.abspath(self.megatron_lm)
        return env

    def mode_args(self, mode: str) -> tuple:
        """(MM_BALANCE, Hydra overrides) of a mode."""
        if mode in ("off", "untimed"):
            return "0", []
        if mode == "packs":
            return "1", [f"mm_balance.cost={self.cost}"]
        if mode == "model":
            return "1", ["mm_balance.cost=model"]
        fixed = {**SYNC_MODES, **CROSSOVER_MODES, **GROUPS_CROSSOVER_MODES}
        if mode in fixed:
            return "1", [f"mm_balance.cost={self.cost}", *fixed[mode]]
        if mode in IMAGE_MODES:
            if not bridge_images_available():
                raise BenchError(f"mode {mode} needs mm_balance.vision (image-level balancing on Bridge), which "
                                 "this installation's MMBalanceBridgeConfig does not have")
            return "1", ["mm_balance.vision=images", f"mm_balance.cost={self.cost}", *IMAGE_MODES[mode]]
        raise BenchError(f"unknown mode {mode!r} (choose from {', '.join(self.all_modes())})")

    def timing_args(self, directory: Path) -> list:
        return [f"mm_balance.timing_dir={directory}"]

    def make_data(self, out: Path, samples: int, seed: int) -> dict:
        """``mm-balance make-dataset OUT --format bridge-qwen-vl --mix native-res`` (skipped when
        OUT already has it)."""
        if not ((out / ".nv-meta" / "dataset.yaml").is_file() and (out / "processor").is_dir()):
            make_native_res_dataset(out, samples=samples, seed=seed)
        return {"DATA_PATH": str(out), "PROCESSOR": str(out / "processor")}

    def auto_switch(self) -> Optional[int]:
        return None


def register(subparsers) -> None:
    """The CLI's extension hook: no subcommand of its own; makes ``bench-realpath --bridge`` run
    :class:`BridgeFramework`."""
    register_framework(BridgeFramework)
