"""The --mm-balance flags: registration (extra_args_provider style and twice), parsing, sync."""
import argparse

import pytest

from megatron_mm_balance.megatron.arguments import add_mm_balance_args, with_mm_balance_args
from megatron_mm_balance.megatron.checks import check_args
from megatron_mm_balance.megatron.config import MMBalanceConfig


def _parse(argv, parser=None):
    parser = parser or argparse.ArgumentParser(allow_abbrev=False)
    return add_mm_balance_args(parser).parse_args(argv)


def test_defaults_off_and_overlap_on():
    args = _parse([])
    assert args.mm_balance is False
    assert args.mm_balance_overlap is True
    assert args.mm_balance_sync == "auto"
    assert args.mm_balance_cost == "image-tokens"
    assert args.mm_balance_mode == "auto"
    assert args.mm_balance_log_interval is None
    assert args.mm_balance_task_encoder is False


def test_all_flags_parse():
    args = _parse(["--mm-balance", "--no-mm-balance-overlap", "--mm-balance-sync", "step",
                   "--mm-balance-cost", "model", "--mm-balance-cost-file", "c.json",
                   "--mm-balance-log-interval", "7", "--mm-balance-mode", "sampler",
                   "--mm-balance-tolerance", "0.01", "--mm-balance-timeout", "60",
                   "--mm-balance-task-encoder"])
    assert args.mm_balance_task_encoder is True
    assert (args.mm_balance, args.mm_balance_overlap, args.mm_balance_sync) == (True, False, "step")
    assert (args.mm_balance_cost, args.mm_balance_cost_file) == ("model", "c.json")
    assert (args.mm_balance_log_interval, args.mm_balance_mode) == (7, "sampler")
    assert (args.mm_balance_tolerance, args.mm_balance_timeout) == (0.01, 60.0)
    assert _parse(["--no-mm-balance-overlap", "--mm-balance-overlap"]).mm_balance_overlap is True


def test_timing_and_auto_cost_flags():
    from megatron_mm_balance.megatron.config import MMBalanceConfig

    def wants_timing(args):
        return MMBalanceConfig.from_args(args).timing
    args = _parse([])
    assert (args.mm_balance_timing, args.mm_balance_timing_dir, args.mm_balance_calibration_iters) == (
        False, None, 10) and not wants_timing(args)
    assert wants_timing(_parse(["--mm-balance-timing"])) and wants_timing(_parse(["--mm-balance-timing-dir", "d"]))
    auto = _parse(["--mm-balance", "--mm-balance-cost", "auto", "--mm-balance-calibration-iters", "3"])
    assert wants_timing(auto) and MMBalanceConfig.from_args(auto).calibration_iters == 3
    assert not wants_timing(_parse(["--mm-balance-cost", "auto"]))   # balancing off: no calibration


@pytest.mark.parametrize("argv", [["--mm-balance-sync", "always"], ["--mm-balance-cost", "flops"],
                                  ["--mm-balance-mode", "magic"], ["--mm-balance-log-interval", "x"]])
def test_bad_choice_is_an_argparse_error(argv, capsys):
    with pytest.raises(SystemExit):
        _parse(argv)
    assert argv[0] in capsys.readouterr().err


def test_registering_twice_is_harmless():
    # The arguments.py patch registers the flags and a script may also pass our provider.
    parser = add_mm_balance_args(argparse.ArgumentParser(allow_abbrev=False))
    assert add_mm_balance_args(parser) is parser
    assert parser.parse_args(["--mm-balance"]).mm_balance is True


def test_with_mm_balance_args_chains_the_scripts_provider():
    seen = []

    def script_provider(parser):
        seen.append(True)
        parser.add_argument("--img-h", type=int, default=336)
        return parser

    provider = with_mm_balance_args(script_provider)
    args = provider(argparse.ArgumentParser(allow_abbrev=False)).parse_args(["--img-h", "448", "--mm-balance"])
    assert seen and args.img_h == 448 and args.mm_balance
    assert with_mm_balance_args()(argparse.ArgumentParser()).parse_args([]).mm_balance is False


@pytest.mark.parametrize("sync,ep,want", [("auto", 1, "step"), ("auto", None, "step"), ("auto", 4, "microstep"),
                                          ("step", 4, "step"), ("microstep", 1, "microstep")])
def test_sync_resolved_when_the_config_is_built(sync, ep, want):
    args = argparse.Namespace(mm_balance_sync=sync, expert_model_parallel_size=ep)
    cfg = MMBalanceConfig.from_args(args)
    assert cfg.sync == want and cfg.runtime().sync == want


def test_log_interval_defaults_to_megatrons():
    def interval(**kw):
        return MMBalanceConfig.from_args(argparse.Namespace(**kw)).log_interval
    assert interval(mm_balance_log_interval=None, log_interval=10) == 10
    assert interval(mm_balance_log_interval=3, log_interval=10) == 3
    assert interval() == 100


def test_every_flag_is_a_config_field_with_its_default_once():
    """The table: each flag's argparse default is its config field's default, and the
    config built from the parsed defaults equals the default config (nothing set twice)."""
    import dataclasses
    from megatron_mm_balance.megatron.config import flag_fields
    parser = add_mm_balance_args(argparse.ArgumentParser())
    defaults = parser.parse_args([])
    names = set()
    for f, spec in flag_fields():
        assert getattr(defaults, spec.dest) == f.default, spec.name
        names.add(spec.name)
    registered = {o for a in parser._actions for o in a.option_strings if o.startswith("--mm-balance")}
    assert registered == names
    assert MMBalanceConfig.from_args(defaults) == MMBalanceConfig(megatron=MMBalanceConfig.from_args(
        defaults).megatron)
    assert {f.name for f in dataclasses.fields(MMBalanceConfig)} - {f.name for f, _ in flag_fields()} == {
        "megatron", "balancer", "meetings", "sync_requested"}


def test_validate_is_noop_when_off():
    check_args(argparse.Namespace(mm_balance=False, micro_batch_size=8))


def test_config_built_once_from_args_resolves_auto_and_defaults():
    from megatron_mm_balance.megatron.checks import checked_config
    from megatron_mm_balance.runtime.config import DEFAULT_TIMEOUT_S
    from megatron_mm_balance.solver.placement import DEFAULT_BALANCE_TOLERANCE
    args = _parse(["--mm-balance"])
    args.expert_model_parallel_size, args.log_interval = 4, 10
    cfg = checked_config(args)
    assert (cfg.enabled, cfg.sync, cfg.log_interval) == (True, "microstep", 10)
    assert cfg.megatron.expert_model_parallel_size == 4 and cfg.megatron.log_interval == 10
    assert cfg.timeout == DEFAULT_TIMEOUT_S == _parse([]).mm_balance_timeout
    assert cfg.tolerance == DEFAULT_BALANCE_TOLERANCE == _parse([]).mm_balance_tolerance
    rt = cfg.runtime()
    assert (rt.sync, rt.overlap, rt.timeout, rt.device, rt.shadow) == ("microstep", True, 300.0, "auto", False)
    assert rt.balance_tolerance == DEFAULT_BALANCE_TOLERANCE
    assert MMBalanceConfig.from_args(argparse.Namespace(mm_balance=True)).sync == "step"
    # None (a partial namespace) means the default, resolved once by the runtime's config.
    assert MMBalanceConfig.from_args(argparse.Namespace(mm_balance_tolerance=None)).tolerance == \
        DEFAULT_BALANCE_TOLERANCE
    shadow = checked_config(_parse(["--mm-balance", "--mm-balance-mode", "shadow",
                                    "--mm-balance-tolerance", "0.01"]))
    assert shadow.runtime().shadow and shadow.runtime().balance_tolerance == 0.01
    control = checked_config(_parse(["--mm-balance", "--mm-balance-mode", "control"])).runtime()
    assert control.control and not control.shadow and not rt.control
    crossover = checked_config(_parse(["--mm-balance", "--mm-balance-mode", "crossover-odd"])).runtime()
    assert crossover.crossover == "odd" and not crossover.shadow and rt.crossover is None
    with pytest.raises(Exception):
        cfg.timeout = 1.0                                     # frozen


def test_megatron_arguments_are_read_once_into_the_config():
    """Tokens per tile, the batch schedule, the start iteration, the tensorboard dir: typed
    fields of the config, resolved when it is built."""
    from megatron_mm_balance.megatron.config import BatchSchedule
    args = _parse(["--mm-balance"])
    args.__dict__.update(global_batch_size=16, micro_batch_size=1, data_parallel_size=2,
                         rampup_batch_size=["4", "4", "40"], iteration=7, consumed_train_samples=12,
                         tensorboard_dir="/tb")
    cfg = MMBalanceConfig.from_args(args)
    assert cfg.schedule == BatchSchedule(global_batch_size=16, micro_batch_size=1, data_parallel_size=2,
                                         rampup_batch_size=(4, 4, 40), consumed_train_samples=12)
    assert cfg.schedule.variable and cfg.megatron.start_iteration == 7 and cfg.tensorboard_dir == "/tb"
    assert cfg.tokens_per_tile == 256                         # not a multimodal run: the default


def test_sampler_mode_flag_error_is_a_config_error():
    from megatron_mm_balance.megatron.checks import MMBalanceConfigError
    from megatron_mm_balance.megatron.sampler import maybe_balanced_sampler
    args = argparse.Namespace(mm_balance=True, mm_balance_mode="sampler")
    with pytest.raises(MMBalanceConfigError, match="--mm-balance-mode sampler does not apply"):
        maybe_balanced_sampler(object(), object(), args)


def test_ranks_per_node_is_an_override_not_local_world_size(monkeypatch):
    """Unset, the nodes are found at exchange-group creation (megatron.groups), never read
    from LOCAL_WORLD_SIZE as rank // local world size; the flag overrides them."""
    from megatron_mm_balance.megatron.config import MMBalanceConfig
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = MMBalanceConfig.from_args(_parse(["--mm-balance"]))
    assert cfg.ranks_per_node is None and cfg.runtime().ranks_per_node is None
    cfg = MMBalanceConfig.from_args(_parse(["--mm-balance", "--mm-balance-ranks-per-node", "4"]))
    assert cfg.runtime().ranks_per_node == 4
