"""The --mm-balance flags: registration (extra_args_provider style and twice), parsing, sync."""
import argparse

import pytest

from megatron_mm_balance.megatron.arguments import add_mm_balance_args, with_mm_balance_args
from megatron_mm_balance.megatron.checks import check_args
from megatron_mm_balance.megatron.config import log_interval, resolve_sync


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
    from megatron_mm_balance.megatron.config import MMBalanceConfig, wants_timing
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
def test_resolve_sync(sync, ep, want):
    args = argparse.Namespace(mm_balance_sync=sync, expert_model_parallel_size=ep)
    assert resolve_sync(args) == want


def test_log_interval_defaults_to_megatrons():
    assert log_interval(argparse.Namespace(mm_balance_log_interval=None, log_interval=10)) == 10
    assert log_interval(argparse.Namespace(mm_balance_log_interval=3, log_interval=10)) == 3
    assert log_interval(argparse.Namespace()) == 100


def test_validate_is_noop_when_off():
    check_args(argparse.Namespace(mm_balance=False, micro_batch_size=8))


def test_config_built_once_from_args_resolves_auto_and_defaults():
    from megatron_mm_balance.megatron.checks import checked_config
    from megatron_mm_balance.megatron.config import MMBalanceConfig
    from megatron_mm_balance.runtime.config import DEFAULT_TIMEOUT_S
    args = _parse(["--mm-balance"])
    args.expert_model_parallel_size, args.log_interval = 4, 10
    cfg = checked_config(args)
    assert cfg == MMBalanceConfig(enabled=True, sync="microstep", log_interval=10)
    assert cfg.timeout == DEFAULT_TIMEOUT_S == _parse([]).mm_balance_timeout
    rt = cfg.runtime()
    assert (rt.sync, rt.overlap, rt.timeout, rt.device, rt.shadow) == ("microstep", True, 300.0, None, False)
    assert MMBalanceConfig.from_args(argparse.Namespace(mm_balance=True)).sync == "step"
    shadow = checked_config(_parse(["--mm-balance", "--mm-balance-mode", "shadow",
                                    "--mm-balance-tolerance", "0.01"]))
    assert shadow.runtime().shadow and shadow.runtime().balance_tolerance == 0.01
    with pytest.raises(Exception):
        cfg.timeout = 1.0                                     # frozen


def test_sampler_mode_flag_error_is_a_config_error():
    from megatron_mm_balance.megatron.checks import MMBalanceConfigError
    from megatron_mm_balance.megatron.sampler import maybe_balanced_sampler
    args = argparse.Namespace(mm_balance=True, mm_balance_mode="sampler")
    with pytest.raises(MMBalanceConfigError, match="--mm-balance-mode sampler does not apply"):
        maybe_balanced_sampler(object(), object(), args)


def test_ranks_per_node_flag_then_local_world_size(monkeypatch):
    from megatron_mm_balance.megatron.config import MMBalanceConfig
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert MMBalanceConfig.from_args(_parse(["--mm-balance"])).ranks_per_node is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = MMBalanceConfig.from_args(_parse(["--mm-balance"]))
    assert cfg.ranks_per_node == 8 and cfg.runtime().ranks_per_node == 8
    cfg = MMBalanceConfig.from_args(_parse(["--mm-balance", "--mm-balance-ranks-per-node", "4"]))
    assert cfg.runtime().ranks_per_node == 4
