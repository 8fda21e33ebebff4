"""Settings the glue refuses, each with a one-line error naming the flag."""
import argparse

import pytest

from megatron_mm_balance.megatron.arguments import add_mm_balance_args
from megatron_mm_balance.megatron.checks import MMBalanceConfigError, check_args, global_aux_loss_coeff


def make_args(*argv, **megatron):
    args = add_mm_balance_args(argparse.ArgumentParser()).parse_args(["--mm-balance", *argv])
    base = dict(micro_batch_size=1, calculate_per_token_loss=False, num_experts=None,
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
                dataloader_type="external", expert_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=None, hybrid_context_parallel=False)
    base.update(megatron)
    args.__dict__.update(base)
    return args


def refused(args) -> str:
    with pytest.raises(MMBalanceConfigError) as exc:
        check_args(args)
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_supported_configurations_pass():
    check_args(make_args())
    check_args(make_args(micro_batch_size=4, calculate_per_token_loss=True))
    check_args(make_args(num_experts=8, expert_model_parallel_size=4,
                         moe_router_load_balancing_type=["seq_aux_loss"], moe_aux_loss_coeff=[1e-3]))
    check_args(make_args(virtual_pipeline_model_parallel_size=2))
    check_args(make_args("--mm-balance-mode", "sampler", dataloader_type="single"))
    # Off: nothing is checked.
    off = make_args(micro_batch_size=8)
    off.mm_balance = False
    check_args(off)


def test_micro_batch_size_needs_per_token_loss():
    msg = refused(make_args(micro_batch_size=2))
    assert "--micro-batch-size 2" in msg and "--calculate-per-token-loss" in msg


@pytest.mark.parametrize("types,coeffs", [("global_aux_loss", 1e-3), (["global_aux_loss"], [1e-3]),
                                          (["aux_loss", "global_aux_loss"], [1e-2, 1e-3]),
                                          (["seq_aux_loss", "global_aux_loss"], 1e-3)])
def test_global_aux_loss_is_refused(types, coeffs):
    msg = refused(make_args(num_experts=8, moe_router_load_balancing_type=types, moe_aux_loss_coeff=coeffs))
    assert "--moe-router-load-balancing-type global_aux_loss" in msg


def test_global_aux_loss_with_zero_coefficient_is_fine():
    args = make_args(num_experts=8, moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
                     moe_aux_loss_coeff=[1e-2, 0.0])
    from megatron_mm_balance.megatron.config import MegatronArgs
    assert global_aux_loss_coeff(MegatronArgs.read(args)) == 0.0
    check_args(args)


def test_cost_model_needs_a_readable_file(tmp_path):
    assert "--mm-balance-cost-file" in refused(make_args("--mm-balance-cost", "model"))
    missing = tmp_path / "nope.json"
    assert str(missing) in refused(make_args("--mm-balance-cost", "model", "--mm-balance-cost-file", str(missing)))
    assert "--mm-balance-cost model" in refused(make_args("--mm-balance-cost-file", str(missing)))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert "--mm-balance-cost-file" in refused(make_args("--mm-balance-cost", "model",
                                                         "--mm-balance-cost-file", str(bad)))
    from megatron_mm_balance.cost.model import CostModel
    good = tmp_path / "cost.json"
    CostModel(vision_ms_per_token=2e-3).save(str(good))
    check_args(make_args("--mm-balance-cost", "model", "--mm-balance-cost-file", str(good)))


@pytest.mark.parametrize("argv,flag", [(["--mm-balance-log-interval", "0"], "--mm-balance-log-interval"),
                                       (["--mm-balance-timeout", "0"], "--mm-balance-timeout"),
                                       (["--mm-balance-tolerance", "1.5"], "--mm-balance-tolerance"),
                                       (["--mm-balance-ranks-per-node", "0"],
                                        "--mm-balance-ranks-per-node")])
def test_bad_numbers(argv, flag):
    assert flag in refused(make_args(*argv))


def test_sampler_mode_needs_single_dataloader():
    assert "--dataloader-type single" in refused(make_args("--mm-balance-mode", "sampler",
                                                           dataloader_type="external"))


@pytest.mark.parametrize("megatron,shown", [
    ({"hybrid_context_parallel": True}, "--hybrid-context-parallel"),
    ({"dynamic_context_parallel": True}, "--dynamic-context-parallel"),
    ({"sequence_packing_scheduler": "dp_balanced"}, "--sequence-packing-scheduler dp_balanced"),
    ({"sequence_packing_scheduler": "default_dynamic_cp"}, "--sequence-packing-scheduler default_dynamic_cp"),
])
def test_upstream_balancers_are_refused_naming_both_flags(megatron, shown):
    msg = refused(make_args(**megatron))
    assert msg.startswith(f"--mm-balance cannot be combined with {shown}:"), msg
    assert "undoes the image-token placement" in msg


def test_upstream_balancers_off_are_fine():
    check_args(make_args(hybrid_context_parallel=False, dynamic_context_parallel=False,
                         sequence_packing_scheduler=None))
    off = make_args(sequence_packing_scheduler="dp_balanced", hybrid_context_parallel=True)
    off.mm_balance = False
    check_args(off)


def test_sampler_mode_refuses_a_cost_it_cannot_honour(tmp_path):
    """The dataset reports image tokens by index only: sampler mode with another cost kind is
    refused at start-up, naming both flags."""
    from megatron_mm_balance.cost.model import CostModel
    good = tmp_path / "cost.json"
    CostModel(vision_ms_per_token=2e-3).save(str(good))
    msg = refused(make_args("--mm-balance-mode", "sampler", "--mm-balance-cost", "model",
                            "--mm-balance-cost-file", str(good), dataloader_type="single"))
    assert "--mm-balance-mode sampler" in msg and "--mm-balance-cost model" in msg
    check_args(make_args("--mm-balance-cost", "model", "--mm-balance-cost-file", str(good),
                         dataloader_type="single"))                # auto: the exchange honours it


def test_cost_auto_settings():
    """--mm-balance-cost auto: the calibration length is checked, and it needs one exchange group
    (every data-holding rank fits the same costs); sampler mode cannot honour a cost model."""
    from megatron_mm_balance.megatron.checks import checked_config
    cfg = checked_config(make_args("--mm-balance-cost", "auto", "--mm-balance-calibration-iters", "4"))
    assert (cfg.cost, cfg.calibration_iters, cfg.timing) == ("auto", 4, True)
    assert "--mm-balance-calibration-iters" in refused(make_args("--mm-balance-cost", "auto",
                                                                 "--mm-balance-calibration-iters", "1"))
    assert "--pipeline-model-parallel-size 1" in refused(make_args("--mm-balance-cost", "auto",
                                                                   pipeline_model_parallel_size=2))
    assert "--context-parallel-size 1" in refused(make_args("--mm-balance-cost", "auto",
                                                            context_parallel_size=2))
    msg = refused(make_args("--mm-balance-cost", "auto", "--mm-balance-mode", "sampler",
                            dataloader_type="single"))
    assert "sampler" in msg and "--mm-balance-cost auto" in msg


def test_vision_images_settings():
    check_args(make_args("--mm-balance-vision", "images"))
    check_args(make_args("--mm-balance-vision", "images", pipeline_model_parallel_size=2))
    off = make_args("--mm-balance-vision", "images")
    off.mm_balance = False
    assert refused(off) == "--mm-balance-vision images needs --mm-balance"
    assert "shadow moves nothing" in refused(make_args("--mm-balance-vision", "images",
                                                       "--mm-balance-mode", "shadow"))
    assert "control moves nothing" in refused(make_args("--mm-balance-vision", "images",
                                                        "--mm-balance-mode", "control"))
    assert "crossover-even moves nothing" in refused(make_args("--mm-balance-vision", "images",
                                                               "--mm-balance-mode", "crossover-even"))
    assert "--mm-balance-cost auto" in refused(make_args("--mm-balance-vision", "images",
                                                         "--mm-balance-cost", "auto"))
    assert "--context-parallel-size 1" in refused(make_args("--mm-balance-vision", "images",
                                                            context_parallel_size=2))
    with pytest.raises(SystemExit):
        make_args("--mm-balance-vision", "tiles")
