"""The ``--mm-balance`` settings: one table of flags, one typed config, built and validated once.

* :class:`MMBalanceConfig` is the table. Each of its flag fields *is* one flag:
  its default (written here and nowhere else), its help text and the values it
  accepts (:func:`flag`). :func:`~.arguments.add_mm_balance_args` registers the
  flags from it; adding a flag is adding a field here and reading it where it is
  used.
* :class:`MegatronArgs` is what the glue needs from Megatron's own arguments,
  typed. :meth:`MegatronArgs.read` is the
  one place in the package that reads Megatron's ``args``; a partial namespace
  (tests, a custom harness) is fine, absent attributes take Megatron's defaults.
* :meth:`MMBalanceConfig.from_args` builds the config from ``args`` and resolves
  everything derived at that moment: ``auto`` sync (``microstep`` under expert
  parallel, until :meth:`MMBalanceConfig.with_meetings` gives the meeting groups read
  from the job's process groups, which then decide), the log interval (``--log-interval``), tokens per tile (the multimodal
  flags), the runtime's
  :class:`~megatron_mm_balance.runtime.config.BalancerConfig`. Every value is
  checked once: the runtime's settings by ``BalancerConfig`` (its error is
  re-raised naming our flag), the rest here. :func:`~.checks.checked_config`
  adds the refusals of settings that would change the loss; the glue below it
  (cost function, coordinators, sampler, telemetry) takes the config, not ``args``.

Imports nothing from Megatron or torch at module level.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

from ..cost.pack import DEFAULT_TOKENS_PER_TILE
from ..cost.timing_files import TIMING_FILE_LAYOUTS
from ..runtime.config import DEFAULT_TIMEOUT_S, TOLERANCE_BELOW, BalancerConfig, SettingError
from ..runtime.meeting import MeetingGroups
from ..solver.placement import DEFAULT_BALANCE_TOLERANCE

SYNC_CHOICES = ("auto", "microstep", "step")
COST_CHOICES = ("image-tokens", "model", "auto")
DEFAULT_CALIBRATION_ITERS = 10
#: the modes that exchange at the training iterations of one parity and move nothing at the others
CROSSOVER_MODES = ("crossover-even", "crossover-odd")
#: the modes that move packs every iteration, placed by the job's meeting groups at the training
#: iterations of one parity and as if every data-parallel rank met every micro-step at the others
GROUPS_CROSSOVER_MODES = ("groups-crossover-even", "groups-crossover-odd")
MODE_CHOICES = ("auto", "exchange", "sampler", "shadow", "control") + CROSSOVER_MODES + GROUPS_CROSSOVER_MODES
#: the modes that gather costs and solve on every rank but move nothing at some or all batches
MEASURING_MODES = ("shadow", "control") + CROSSOVER_MODES


def crossover_parity(mode: str) -> Optional[str]:
    """The runtime's ``BalancerConfig.crossover`` of a mode: ``"even"`` / ``"odd"`` for the
    crossover modes, None for the others."""
    return mode.split("-", 1)[1] if mode in CROSSOVER_MODES else None


def groups_crossover_parity(mode: str) -> Optional[str]:
    """The runtime's ``BalancerConfig.step_groups_parity`` of a mode: ``"even"`` / ``"odd"``
    for the groups-crossover modes, None for the others."""
    return mode.rsplit("-", 1)[1] if mode in GROUPS_CROSSOVER_MODES else None
VISION_CHOICES = ("packs", "images")
#: the statistics interval when neither --mm-balance-log-interval nor --log-interval is set
DEFAULT_LOG_INTERVAL = 100


class MMBalanceConfigError(ValueError):
    """An ``--mm-balance`` setting that is invalid or unsupported; the message names the flag."""


@dataclass(frozen=True)
class Flag:
    """How a config field is a command-line flag (the field's default is the flag's)."""

    name: str                                  #: e.g. ``--mm-balance-sync``
    help: str
    type: Any = None                           #: argparse ``type``; None: a boolean switch
    choices: Optional[Tuple[str, ...]] = None
    minimum: Optional[int] = None              #: checked here (not by the runtime): value >= minimum
    negation: Optional[Tuple[str, str]] = None  #: (flag, help) that sets a boolean to False
    metavar: Optional[str] = None              #: argparse ``metavar`` (the help's value name)

    @property
    def dest(self) -> str:
        """The attribute on Megatron's ``args``: ``--mm-balance-sync`` -> ``mm_balance_sync``."""
        return self.name.lstrip("-").replace("-", "_")


def flag(default, name: str, help: str, **spec):
    """A config field that is the flag ``name`` (see :class:`Flag`)."""
    return field(default=default, metadata={"flag": Flag(name, help, **spec)})


def flag_fields():
    """``(field, Flag)`` of every flag of :class:`MMBalanceConfig`, in table order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(MMBalanceConfig) if "flag" in f.metadata]


# -- what the glue reads from Megatron --------------------------------------------------------
@dataclass(frozen=True)
class BatchSchedule:
    """Megatron's global-batch arguments: what its micro-batch calculator is built from."""

    global_batch_size: Optional[int] = None
    micro_batch_size: int = 1
    data_parallel_size: int = 1
    #: core_v0.19.0 counts data-parallel replicas times this
    gtp_weight_remat_size: int = 1
    decrease_batch_size_if_needed: bool = False
    #: ``--rampup-batch-size`` (up to core_v0.17.1)
    rampup_batch_size: Optional[Tuple[int, ...]] = None
    #: ``--step-batch-size-schedule`` (its replacement from core_v0.18.2) and ``--seq-length``
    step_batch_size_schedule: Optional[str] = None
    seq_length: Optional[int] = None
    #: samples the run has consumed (a resumed run's position), when the config is built
    consumed_train_samples: int = 0

    @property
    def variable(self) -> bool:
        """Whether the micro-batch count changes during training (ramp-up)."""
        return bool(self.rampup_batch_size or self.step_batch_size_schedule)


def _as_tuple(value) -> tuple:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


#: Megatron-LM's own data rebalancing, by the argument that turns it on: (flag, what it does).
#: core_v0.16.1 to core_v0.19.0 (and the Megatron-LM that Megatron-Bridge v0.6.0 pins) have
#: hybrid context parallel; the dynamic context parallel and sequence-packing schedulers that
#: replace it came after core_v0.19.0 (a newer line, apply_patches.sh --force).
UPSTREAM_BALANCERS = {
    "hybrid_context_parallel": (
        "--hybrid-context-parallel",
        "HybridCPDataLoaderWrapper splits every global batch's packs into sub-samples and reroutes "
        "them over the data- and context-parallel ranks by sequence length"),
    "dynamic_context_parallel": (
        "--dynamic-context-parallel",
        "it regroups every global batch's sequences over the data- and context-parallel ranks by "
        "sequence length"),
    "sequence_packing_scheduler": (
        "--sequence-packing-scheduler",
        "its scheduler re-packs and reroutes every global batch's sequences between data-parallel "
        "ranks by sequence length"),
}


@dataclass(frozen=True)
class MegatronArgs:
    """The Megatron settings the glue depends on (Megatron's defaults when absent)."""

    expert_model_parallel_size: int = 1
    micro_batch_size: int = 1
    calculate_per_token_loss: bool = False
    num_experts: Optional[int] = None
    moe_router_load_balancing_type: Tuple[str, ...] = ()
    moe_aux_loss_coeff: Tuple[float, ...] = (0.0,)
    #: Megatron-LM's own data rebalancing that is on: ``(dest, value)`` per
    #: :data:`UPSTREAM_BALANCERS` entry set in ``args``
    upstream_balancers: Tuple[Tuple[str, object], ...] = ()
    dataloader_type: Optional[str] = None
    log_interval: Optional[int] = None
    tensorboard_dir: Optional[str] = None
    #: image embeddings per tile from the examples/multimodal flags (None: not a VLM run)
    tokens_per_tile: Optional[int] = None
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    tensor_model_parallel_size: int = 1
    #: ``--load`` and ``--save`` (``--mm-balance-cost auto`` keeps its fit beside the checkpoints)
    load: Optional[str] = None
    save: Optional[str] = None
    #: the iteration training starts from (``args.iteration``: a resumed run's checkpoint)
    start_iteration: int = 0
    #: the language model's sequence length (``--decoder-seq-length``, else ``--seq-length``):
    #: the longest packed sample the pack check lets through
    decoder_seq_length: Optional[int] = None
    schedule: BatchSchedule = field(default_factory=BatchSchedule)
    #: the framework derives a cost model from its model config when
    #: ``--mm-balance-cost model`` has no cost file (Megatron-Bridge: ``mm_balance_model_cost_from_config``)
    model_cost_from_config: bool = False

    @classmethod
    def read(cls, args) -> "MegatronArgs":
        """The one reader of Megatron's arguments (see the module docstring)."""
        def get(name, default=None):
            value = getattr(args, name, None)
            return default if value is None else value

        mbs = int(get("micro_batch_size", 1))
        rampup = get("rampup_batch_size")
        return cls(
            expert_model_parallel_size=int(get("expert_model_parallel_size", 1)),
            micro_batch_size=mbs,
            calculate_per_token_loss=bool(get("calculate_per_token_loss", False)),
            num_experts=get("num_experts"),
            moe_router_load_balancing_type=_as_tuple(get("moe_router_load_balancing_type")),
            moe_aux_loss_coeff=tuple(float(c) for c in _as_tuple(get("moe_aux_loss_coeff", 0.0))),
            upstream_balancers=tuple((dest, getattr(args, dest)) for dest in UPSTREAM_BALANCERS
                                     if getattr(args, dest, None) not in (None, False)),
            dataloader_type=get("dataloader_type"),
            log_interval=get("log_interval"),
            tensorboard_dir=get("tensorboard_dir"),
            tokens_per_tile=_multimodal_tokens_per_tile(args),
            pipeline_model_parallel_size=int(get("pipeline_model_parallel_size", 1)),
            context_parallel_size=int(get("context_parallel_size", 1)),
            tensor_model_parallel_size=int(get("tensor_model_parallel_size", 1)),
            load=get("load"),
            save=get("save"),
            start_iteration=int(get("iteration", 0)),
            decoder_seq_length=get("decoder_seq_length", get("seq_length")),
            schedule=BatchSchedule(
                global_batch_size=get("global_batch_size"), micro_batch_size=mbs,
                data_parallel_size=int(get("data_parallel_size", 1)),
                gtp_weight_remat_size=int(get("gtp_weight_remat_size", 1)),
                decrease_batch_size_if_needed=bool(get("decrease_batch_size_if_needed", False)),
                rampup_batch_size=None if rampup is None else tuple(int(x) for x in rampup),
                step_batch_size_schedule=get("step_batch_size_schedule"),
                seq_length=get("seq_length"),
                consumed_train_samples=int(get("consumed_train_samples", 0))),
            model_cost_from_config=bool(get("mm_balance_model_cost_from_config", False)),
        )


def live_iteration(args) -> Callable[[], Optional[int]]:
    """The iteration Megatron's loop is in, read when called (the number it prints:
    ``args.curr_iteration + 1``; None before training starts). The one live read of
    ``args``: the per-micro-batch records (samples, timings) label their lines with it."""
    def now() -> Optional[int]:
        it = getattr(args, "curr_iteration", None)
        return None if it is None else int(it) + 1
    return now


def _multimodal_tokens_per_tile(args) -> Optional[int]:
    """Image embeddings per tile for examples/multimodal arguments (None if not a VLM run),
    as megatron-core's ``get_num_image_embeddings`` computes them. Megatron's own vision
    flags (``--img-h`` defaults to 224 in every run) are not enough: the example's
    ``--vision-model-type`` marks a multimodal run."""
    if getattr(args, "img_h", None) is None or getattr(args, "vision_model_type", None) is None:
        return None
    from megatron.core.models.vision.clip_vit_model import get_num_image_embeddings
    return int(get_num_image_embeddings(
        args.img_h, args.img_w, args.patch_dim, args.vision_model_type,
        args.disable_vision_class_token, 1, getattr(args, "pixel_shuffle", False),
        getattr(args, "use_tile_tags", False), getattr(args, "max_num_tiles", 1),
        getattr(args, "tokenizer_prompt_format", None)))


# -- the table ------------------------------------------------------------------------------
#: the runtime setting each flag feeds (its value is checked by BalancerConfig)
_RUNTIME_FLAGS = {"sync": "--mm-balance-sync", "timeout": "--mm-balance-timeout",
                  "balance_tolerance": "--mm-balance-tolerance",
                  "ranks_per_node": "--mm-balance-ranks-per-node"}


@dataclass(frozen=True)
class MMBalanceConfig:
    """What ``--mm-balance*`` asks for: one field per flag (``auto`` and defaults resolved)."""

    enabled: bool = flag(False, "--mm-balance", "Balance image tokens across data-parallel ranks "
                         "every global batch by moving whole micro-batches (packs) between ranks.")
    overlap: bool = flag(True, "--mm-balance-overlap", "Gather costs and exchange packs for the "
                         "next global batch on a background thread, overlapped with compute "
                         "(default).",
                         negation=("--no-mm-balance-overlap",
                                   "Balance synchronously when the global batch is first read."))
    #: resolved: from the job's meeting groups (:meth:`with_meetings`), until they are read
    #: ``microstep`` under expert parallel, else ``step``
    sync: str = flag("auto", "--mm-balance-sync", "Objective: 'auto' follows the meeting groups "
                     "read from the job's process groups: every micro-step balanced inside each "
                     "expert-parallel group (whose all-to-alls make its ranks wait for each other) "
                     "and rank totals across them, or only rank totals when no two data-parallel "
                     "ranks share one; 'microstep' balances every micro-step as if all "
                     "data-parallel ranks met in it; 'step' balances per-rank totals.",
                     type=str, choices=SYNC_CHOICES)
    cost: str = flag("image-tokens", "--mm-balance-cost", "Cost of a pack: its image tokens, a "
                     "calibrated cost model read from --mm-balance-cost-file, or 'auto': the cost that "
                     "a replay of the job's own per-pack timings of its first "
                     "--mm-balance-calibration-iters iterations chooses (models fitted on the first "
                     "half, judged by the balance they reach on the second; image tokens unless "
                     "beaten; image tokens until then; saved beside the checkpoints). Exchange and shadow mode; sampler mode reads image "
                     "tokens only.", type=str, choices=COST_CHOICES)
    calibration_iters: int = flag(DEFAULT_CALIBRATION_ITERS, "--mm-balance-calibration-iters",
                                  "Iterations --mm-balance-cost auto calibrates on (the first is "
                                  "dropped; at least 3 leave the replay an iteration to fit and "
                                  "one to judge on); default %(default)s.", type=int, minimum=2)
    #: resolved: also on with --mm-balance-timing-dir, or --mm-balance with --mm-balance-cost auto
    timing: bool = flag(False, "--mm-balance-timing", "Time the vision encoder and the language "
                        "model, forward and backward, for every micro-batch (module hooks; works "
                        "with --mm-balance off); logged per --log-interval.")
    timing_dir: Optional[str] = flag(None, "--mm-balance-timing-dir", "Also write the per-pack "
                                     "timings as JSON Lines, one file per rank, into this directory "
                                     "(implies --mm-balance-timing).", type=str, metavar="DIR")
    timing_files: str = flag("rank", "--mm-balance-timing-files", "With --mm-balance-timing-dir: "
                             "'rank' (default) writes one file per rank, timing-rank<R>.jsonl; 'node' one "
                             "per node, timing-node-<node>.jsonl, which the node's ranks append whole "
                             "lines to (fewer files on a shared filesystem at scale).", type=str,
                             choices=TIMING_FILE_LAYOUTS)
    timing_every: int = flag(1, "--mm-balance-timing-every", "With --mm-balance-timing-dir: write the "
                             "records of every N-th iteration only, every rank's and micro-batch's "
                             "(the log lines, scalars and --mm-balance-cost auto still see every "
                             "iteration); default %(default)s.", type=int, minimum=1)
    cost_file: Optional[str] = flag(None, "--mm-balance-cost-file", "Cost file (JSON, format "
                                    "mm-balance-cost/v1) for --mm-balance-cost model.", type=str)
    mode: str = flag("auto", "--mm-balance-mode", "'exchange' moves packed tensors between ranks; "
                     "'sampler' reassigns sample indices before loading (needs --dataloader-type "
                     "single, a dataset with mm_balance_image_tokens(idx) and --mm-balance-cost "
                     "image-tokens); 'auto' uses the sampler when it applies, else the exchange; "
                     "'shadow' gathers costs and solves like the exchange and logs what balancing "
                     "would do, but moves nothing; 'control' solves like the exchange, then every "
                     "rank keeps its own packs, reordered across micro-steps in balancing's order "
                     "(nothing crosses ranks): the arithmetic-order band that mm-balance "
                     "compare-logs --control judges an off-vs-on difference against; "
                     "'crossover-even'/'crossover-odd' exchange at iterations of that parity and "
                     "run the others as shadow: two jobs, one of each, time every iteration "
                     "balanced and not in the same processes (mm-balance bench-realpath "
                     "--bridge --modes crossover-even,crossover-odd); "
                     "'groups-crossover-even'/'groups-crossover-odd' exchange at every iteration, "
                     "placed by the job's meeting groups at iterations of that parity and as if "
                     "all data-parallel ranks met every micro-step at the others: two jobs time "
                     "both placements on the same data.",
                     type=str, choices=MODE_CHOICES)
    vision: str = flag("packs", "--mm-balance-vision", "'packs' (default): the vision encoder "
                       "computes the tiles of the packs its rank holds. 'images': every micro-step, "
                       "also send tiles across data-parallel ranks so each encodes about the same "
                       "number, and the embeddings back (gradients likewise; exact for per-tile "
                       "encoders such as the example's CLIP/SigLIP/InternViT). Needs --mm-balance.",
                       type=str, choices=VISION_CHOICES)
    #: resolved: ``--log-interval``, else DEFAULT_LOG_INTERVAL
    log_interval: Optional[int] = flag(None, "--mm-balance-log-interval", "Write balance "
                                       "statistics every this many iterations (default: "
                                       "--log-interval).", type=int, minimum=1)
    tolerance: float = flag(DEFAULT_BALANCE_TOLERANCE, "--mm-balance-tolerance", "How far above "
                            "the mean (a fraction of it) a rank's total may end; larger keeps more "
                            f"packs home. In [0, {TOLERANCE_BELOW:g}); default %(default)s.",
                            type=float)
    #: None: the nodes are found at exchange-group creation (``megatron.groups``)
    ranks_per_node: Optional[int] = flag(None, "--mm-balance-ranks-per-node", "Override the "
                                         "nodes found at start-up (torchrun's GROUP_RANK, else "
                                         "SLURM_NODEID, else the host name) for placement: global "
                                         "rank r on node r // N (1: plan as if every rank were its "
                                         "own node). Packs move between node-mates where balance "
                                         "allows; the statistics count what crosses the nodes "
                                         "found.", type=int)
    timeout: float = flag(DEFAULT_TIMEOUT_S, "--mm-balance-timeout", "Seconds the exchange waits "
                          "on its collectives before failing (default %(default)s).", type=float)
    #: read by the wrapper's consumer side (:mod:`.samples`), balancing on or off
    record_samples: Optional[str] = flag(None, "--mm-balance-record-samples", "Write, per rank, the "
                                         "sample keys and a content digest of every micro-batch the "
                                         "training loop consumes, per iteration, to "
                                         "DIR/samples-rank<R>.jsonl (balancing on or off; for "
                                         "checking resumed and balanced runs against a reference). "
                                         "Off by default.", type=str, metavar="DIR")
    #: read by the examples/multimodal patch (0005), which builds the task encoder
    task_encoder: bool = flag(False, "--mm-balance-task-encoder", "examples/multimodal: build the "
                              "example's TaskEncoder with BalancedPackingMixin (per-pack image "
                              "tokens in the batch; with --packing-buffer-size, best-fit packing of "
                              "whole samples into --packing-seq-length). Works with or without "
                              "--mm-balance.")
    #: what the config was resolved against (Megatron's defaults unless built from ``args``)
    megatron: MegatronArgs = field(default_factory=MegatronArgs)
    #: who meets whom in this rank's exchange group, read from the job's process groups when
    #: the exchange groups are made (:meth:`with_meetings`); None: not read (yet)
    meetings: Optional[MeetingGroups] = field(default=None, repr=False)
    #: ``--mm-balance-sync`` as given: ``auto`` lets the job's meeting groups decide
    sync_requested: str = field(init=False, repr=False, default="auto")
    #: the runtime's settings, derived (device "auto": on a GPU, packs arrive on it, copied on
    #: the exchange's side stream; on a CPU they stay where the loader put them)
    balancer: BalancerConfig = field(init=False, repr=False)

    def __post_init__(self):
        for f, spec in flag_fields():
            _check_flag(spec, getattr(self, f.name))
        m = self.megatron
        object.__setattr__(self, "sync_requested", self.sync)
        resolve = {
            "sync": self.sync if self.sync != "auto" else
            self.meetings.sync() if self.meetings is not None else
            ("microstep" if m.expert_model_parallel_size > 1 else "step"),
            "log_interval": int(self.log_interval if self.log_interval is not None else
                                m.log_interval or DEFAULT_LOG_INTERVAL),
            "timing": bool(self.timing or self.timing_dir or (self.enabled and self.cost == "auto")),
        }
        for name, value in resolve.items():
            object.__setattr__(self, name, value)
        try:
            balancer = BalancerConfig(sync=self.sync, overlap=bool(self.overlap), timeout=self.timeout,
                                      device="auto", balance_tolerance=self.tolerance,
                                      shadow=self.mode == "shadow", control=self.mode == "control",
                                      crossover=crossover_parity(self.mode),
                                      ranks_per_node=self.ranks_per_node,
                                      job_step_groups=None if self.meetings is None else self.meetings.labels(),
                                      step_groups=self._placed_step_groups(),
                                      step_groups_parity=groups_crossover_parity(self.mode))
        except SettingError as e:
            raise MMBalanceConfigError(f"{_RUNTIME_FLAGS[e.field]} {e.requirement}, got {e.value!r}") from None
        object.__setattr__(self, "balancer", balancer)
        object.__setattr__(self, "tolerance", balancer.balance_tolerance)
        object.__setattr__(self, "timeout", balancer.timeout)
        self._check_cost_file()

    def _check_cost_file(self) -> None:
        if self.cost == "model":
            if not self.cost_file and self.megatron.model_cost_from_config:
                return
            if not self.cost_file:
                raise MMBalanceConfigError("--mm-balance-cost model needs --mm-balance-cost-file PATH "
                                           "(a calibrated cost file)")
            if not os.path.isfile(self.cost_file):
                raise MMBalanceConfigError(f"--mm-balance-cost-file {self.cost_file}: no such file")
            from ..cost.model import load_cost_file
            try:
                load_cost_file(self.cost_file)
            except ValueError as exc:
                raise MMBalanceConfigError(f"--mm-balance-cost-file: {exc}") from None
        elif self.cost_file:
            raise MMBalanceConfigError("--mm-balance-cost-file is only read with --mm-balance-cost model")

    @classmethod
    def from_args(cls, args) -> "MMBalanceConfig":
        """Build from Megatron's ``args``: the flags (absent ones take their defaults) and
        :class:`MegatronArgs`. Values are checked; the loss refusals are
        :func:`~.checks.checked_config`'s."""
        values = {}
        for f, spec in flag_fields():
            value = getattr(args, spec.dest, None)
            values[f.name] = f.default if value is None else value
        return cls(**values, megatron=MegatronArgs.read(args))

    def _placed_step_groups(self) -> Optional[Tuple[int, ...]]:
        """The meeting groups the planner places by: the job's, when ``auto`` sync lets them
        decide and some ranks meet every micro-step; None otherwise (``microstep`` set by
        hand: as if every rank met every micro-step; ``step``: rank totals only)."""
        if self.meetings is None or self.sync_requested != "auto" or self.sync != "microstep":
            return None
        return self.meetings.labels()

    def with_meetings(self, meetings: Optional[MeetingGroups]) -> "MMBalanceConfig":
        """This config with the meeting groups read from the job (``auto`` sync re-resolved
        from them; an explicit ``--mm-balance-sync`` stays)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        values.update(sync=self.sync_requested, meetings=meetings)
        return type(self)(**values)

    def meeting_line(self) -> str:
        """One log line saying who meets whom and what the placement balances, e.g.
        ``[mm-balance] meeting groups: per iteration: data parallel of 4 [0, 1, 2, 3]; per
        micro-step: 2 groups of 2 (expert parallel) [0, 1] [2, 3] | sync: microstep inside
        each step group, from the job``."""
        m = self.meetings
        found = m.describe() if m is not None else "not read from the job"
        if self.sync_requested == "auto":
            if m is None:
                how = (f"{self.sync}, from --expert-model-parallel-size "
                       f"{self.megatron.expert_model_parallel_size}")
            elif self.sync == "step":
                how = "step (rank totals; nobody waits within an iteration), from the job"
            elif m.all_meet_each_step:
                how = "microstep (all ranks meet every micro-step), from the job"
            else:
                how = "microstep inside each step group, rank totals across them, from the job"
            parity = groups_crossover_parity(self.mode)
            if parity is not None:
                how += (f"; --mm-balance-mode {self.mode}: by these groups at {parity} iterations only, "
                        "as if all ranks met every micro-step at the others")
        else:
            how = f"{self.sync} across all data-parallel ranks, as set (the job: {m.sync() if m else 'unknown'})"
        return f"[mm-balance] meeting groups: {found} | sync: {how}"

    # -- derived from Megatron's arguments ------------------------------------------------
    def runtime(self) -> BalancerConfig:
        """The balanced iterator's settings (on a GPU, packs are delivered on it)."""
        return self.balancer

    @property
    def tokens_per_tile(self) -> int:
        """Image embeddings per tile: the multimodal flags', else the runtime's default."""
        tpt = self.megatron.tokens_per_tile
        return DEFAULT_TOKENS_PER_TILE if tpt is None else tpt

    @property
    def schedule(self) -> BatchSchedule:
        return self.megatron.schedule

    @property
    def tensorboard_dir(self) -> Optional[str]:
        return self.megatron.tensorboard_dir


def _check_flag(spec: Flag, value) -> None:
    """One flag's own value (the runtime's settings are checked by BalancerConfig)."""
    if spec.choices is not None and value not in spec.choices:
        raise MMBalanceConfigError(f"{spec.name} must be one of {', '.join(spec.choices)}, got {value!r}")
    if spec.minimum is not None and value is not None and not value >= spec.minimum:
        raise MMBalanceConfigError(f"{spec.name} must be >= {spec.minimum}, got {value}")
