"""Fast tests of the Megatron-Bridge glue: the Qwen-VL grid cost, the ``mm_balance`` config
section and its checks, dataclass packs on the wire, the Bridge form of make-dataset, the
Bridge block of apply_patches.sh, the CPU harness's import stand-ins and the launcher's
dry run. None needs Megatron-Bridge's Python 3.12 environment."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest
import torch

import bridge_util as bu
from megatron_mm_balance.bridge.config import MMBalanceBridgeConfig, as_args
from megatron_mm_balance.bridge.model_spec import ModelSpec
from megatron_mm_balance.megatron.checks import MMBalanceConfigError, checked_config
from megatron_mm_balance.cost.pack import QwenVLCost, QwenVLGridFeatures
from megatron_mm_balance.runtime import wire


def _as_args(mm, cfg, **kw):
    """``as_args`` as ``wrap_train_data_iterator`` calls it, the model read once first."""
    return as_args(mm, cfg, ModelSpec.read(cfg.model), **kw)


# --------------------------------------------------------------------------- Qwen-VL cost

@dataclasses.dataclass
class VisualInputs:          # the shape of Bridge's GenericVisualInputs
    pixel_values: object = None
    image_grid_thw: object = None
    video_grid_thw: object = None


def _batch(images=(), videos=(), rows=((1, 40),)):
    vi = VisualInputs(image_grid_thw=torch.tensor(images, dtype=torch.long).reshape(-1, 3) if images else None,
                      video_grid_thw=torch.tensor(videos, dtype=torch.long).reshape(-1, 3) if videos else None)
    mask = torch.zeros(len(rows), max(n for _, n in rows), dtype=torch.long)
    for r, (_, n) in enumerate(rows):
        mask[r, :n] = 1
    return {"input_ids": torch.zeros_like(mask), "attention_mask": mask, "visual_inputs": vi}


def test_grid_features_before_and_after_merge():
    f = QwenVLGridFeatures(2)
    b = _batch(images=[(1, 16, 8), (1, 4, 4)], videos=[(4, 8, 8)])
    assert f.encoder_tokens(b) == [128, 16, 256]            # t*h*w patches
    assert f.lm_tokens(b) == [32, 4, 64]                    # t*h*w / 2**2
    assert QwenVLCost(2)(b) == 128 + 16 + 256
    # the same grids at the top level of the batch, as nested lists, or in a dict
    assert QwenVLCost(2)({"image_grid_thw": [[[1, 16, 8]], [[1, 4, 4]]]}) == 144
    assert QwenVLCost(2)({"visual_inputs": {"image_grid_thw": [[1, 2, 2]]}}) == 4
    assert QwenVLCost(2)({"input_ids": torch.zeros(1, 5)}) == 0        # text only
    with pytest.raises(ValueError, match="is a str, expected a dict"):  # never a silent 0
        QwenVLCost(2)("not a dict")


def test_grid_cost_rejects_bad_grids():
    with pytest.raises(ValueError, match="triples"):
        QwenVLCost(2)({"image_grid_thw": [1, 2]})
    with pytest.raises(ValueError, match="non-negative"):
        QwenVLCost(2)({"image_grid_thw": [[1, -2, 2]]})
    with pytest.raises(ValueError):
        QwenVLCost(0)


def test_grid_cost_model_quadratic_term_is_per_image(tmp_path):
    from megatron_mm_balance.cost import CostModel
    m = CostModel(vision_ms_per_token=0.0, vision_ms_per_token_sq=1e-3, llm_ms_per_len_sq=0.0,
                  const_ms=0.0, backward_ratio=0.0)
    path = tmp_path / "cost.json"
    m.save(str(path))
    cost = QwenVLCost.from_file(str(path), 2)
    one_big = cost(_batch(images=[(1, 16, 16)]))          # 256 patches in one image
    four_small = cost(_batch(images=[(1, 8, 8)] * 4))      # 4 x 64 patches: same total
    assert one_big == round(1000 * 1e-3 * 256 ** 2) and four_small == round(1000 * 1e-3 * 4 * 64 ** 2)
    assert one_big == 4 * four_small
    two = QwenVLCost.from_file(str(path), 2, phases=True)
    assert two.components == 2 and two(_batch(images=[(1, 16, 16)])) == (one_big, 0)
    assert cost.identity != two.identity != QwenVLCost(2).identity


def test_grid_cost_lengths_from_attention_mask():
    assert QwenVLGridFeatures.lengths(_batch(rows=((0, 7), (1, 3)))) == (7, 3)
    assert QwenVLGridFeatures.lengths({"input_ids": torch.zeros(2, 9)}) == (9, 9)


# --------------------------------------------------------------------------- config + checks

def _bridge_cfg(mbs=1, ep=2, lb="aux_loss", coeff=1e-2, per_token=False):
    model = types.SimpleNamespace(expert_model_parallel_size=ep, num_moe_experts=4,
                                  moe_router_load_balancing_type=lb, moe_aux_loss_coeff=coeff,
                                  calculate_per_token_loss=per_token, hybrid_context_parallel=False,
                                  vision_config=types.SimpleNamespace(spatial_merge_size=2))
    train = types.SimpleNamespace(micro_batch_size=mbs, global_batch_size=8, rampup_batch_size=None,
                                  decrease_batch_size_if_needed=False)
    logger = types.SimpleNamespace(log_interval=5, tensorboard_dir="/tmp/tb")
    return types.SimpleNamespace(model=model, train=train, logger=logger, data_parallel_size=2,
                                 dataset=types.SimpleNamespace(dataloader_type="external"))


def test_config_defaults_are_the_flags_defaults():
    from megatron_mm_balance.megatron.config import MMBalanceConfig
    mm, core = MMBalanceBridgeConfig(), MMBalanceConfig()
    assert not mm.enabled and mm.mode == "auto" and mm.sync == "auto"
    assert (mm.overlap, mm.cost, mm.timeout) == (core.overlap, core.cost, core.timeout)


def test_config_resolves_like_the_megatron_lm_path():
    ts = types.SimpleNamespace(step=7, consumed_train_samples=56)
    args = _as_args(MMBalanceBridgeConfig(enabled=True), _bridge_cfg(ep=2), train_state=ts)
    cfg = checked_config(args)
    assert cfg.enabled and cfg.sync == "microstep" and cfg.log_interval == 5
    assert args.curr_iteration == 7
    ts.step = 8
    assert args.curr_iteration == 8                     # follows Bridge's live counter
    cfg1 = checked_config(_as_args(MMBalanceBridgeConfig(enabled=True, mode="shadow", log_interval=2),
                                  _bridge_cfg(ep=1)))
    assert cfg1.sync == "step" and cfg1.mode == "shadow" and cfg1.log_interval == 2
    assert cfg1.runtime().shadow
    cfg2 = checked_config(_as_args(MMBalanceBridgeConfig(enabled=True, mode="control"), _bridge_cfg(ep=2)))
    assert cfg2.mode == "control" and cfg2.runtime().control and not cfg2.runtime().shadow
    cfg3 = checked_config(_as_args(MMBalanceBridgeConfig(enabled=True, mode="crossover-even"), _bridge_cfg(ep=2)))
    assert cfg3.runtime().crossover == "even" and not cfg3.runtime().shadow


@pytest.mark.parametrize("mm,cfg,match", [
    (dict(mode="sampler"), {}, "mm_balance.mode=sampler"),
    (dict(mode="bogus"), {}, "--mm-balance-mode"),
    (dict(sync="bogus"), {}, "--mm-balance-sync"),
    (dict(cost="model", cost_file="/nonexistent/cost.json"), {}, "no such file"),
    (dict(timeout=0), {}, "timeout"),
    ({}, dict(mbs=2), "micro-batch-size 2"),
    ({}, dict(lb="global_aux_loss"), "global_aux_loss"),
])
def test_config_refuses(mm, cfg, match):
    with pytest.raises(MMBalanceConfigError, match=match):
        checked_config(_as_args(MMBalanceBridgeConfig(enabled=True, **mm), _bridge_cfg(**cfg)))


@pytest.mark.parametrize("setting,flag", [
    (dict(hybrid_context_parallel=True), "--hybrid-context-parallel"),
    (dict(sequence_packing_scheduler="dp_balanced"), "--sequence-packing-scheduler dp_balanced"),
    (dict(dynamic_context_parallel=True), "--dynamic-context-parallel"),
])
def test_config_refuses_upstreams_rebalancing_in_one_line(setting, flag):
    """The model config's own per-global-batch rebalancing (hybrid context parallel; the
    sequence-packing scheduler and dynamic context parallel where the pinned megatron-core has
    them) with balancing: one line naming it; either alone is accepted."""
    cfg = _bridge_cfg()
    for key, value in setting.items():
        setattr(cfg.model, key, value)
    with pytest.raises(MMBalanceConfigError, match=f"cannot be combined with {flag}: ") as e:
        checked_config(_as_args(MMBalanceBridgeConfig(enabled=True), cfg))
    assert "\n" not in str(e.value)
    checked_config(_as_args(MMBalanceBridgeConfig(enabled=False), cfg))


def test_config_accepts_per_token_loss_with_larger_micro_batches():
    checked_config(_as_args(MMBalanceBridgeConfig(enabled=True), _bridge_cfg(mbs=2, per_token=True)))


# --------------------------------------------------------------------------- wire

def test_dataclass_packs_travel_by_fields():
    vi = VisualInputs(pixel_values=torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
                      image_grid_thw=torch.tensor([[1, 2, 2]]))
    pack = {"input_ids": torch.arange(5), "visual_inputs": vi, "__keys__": ["a"]}
    s = wire.split(pack)
    assert len(s.parts) == 3                              # the dataclass's tensors are parts, not pickled
    buf = torch.zeros(s.data_nbytes, dtype=torch.uint8)
    header = pickle_loads(s.header)
    for ref, part in zip(wire.refs_of(header), s.parts):
        buf[ref.offset:ref.offset + ref.nbytes] = part
    out = wire.decode(header, lambda ref: buf)
    assert type(out["visual_inputs"]) is VisualInputs and out["__keys__"] == ["a"]
    assert torch.equal(out["visual_inputs"].pixel_values, vi.pixel_values)
    assert out["visual_inputs"].pixel_values.dtype == torch.bfloat16
    assert torch.equal(out["visual_inputs"].image_grid_thw, vi.image_grid_thw)
    assert out["visual_inputs"].video_grid_thw is None


def pickle_loads(b):
    import pickle
    return pickle.loads(b)


# --------------------------------------------------------------------------- make-dataset

def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def test_make_dataset_bridge_form(tmp_path):
    pytest.importorskip("megatron.energon")
    from megatron_mm_balance.bridge.dataset import SPECIAL_TOKENS, make_qwen_vl_dataset, token_ids
    lines = make_qwen_vl_dataset(tmp_path / "a", samples=32, seed=3)
    make_qwen_vl_dataset(tmp_path / "b", samples=32, seed=3)
    assert _tree_digest(tmp_path / "a") == _tree_digest(tmp_path / "b")     # same seed, same bytes
    make_qwen_vl_dataset(tmp_path / "a", samples=32, seed=3)                # rewriting its own output
    assert _tree_digest(tmp_path / "a") == _tree_digest(tmp_path / "b")
    assert f"DATA_PATH={tmp_path / 'a'}" in lines
    meta = (tmp_path / "a" / ".nv-meta" / "dataset.yaml").read_text()
    assert "ChatMLWebdataset" in meta and "imgs: jpgs" in meta
    # the ids the tiny config gives the model are the processor's
    ids = token_ids(tmp_path / "a" / "processor")
    assert ids["image_token_id"] == SPECIAL_TOKENS.index("<|image_pad|>")
    assert ids["vision_start_token_id"] == SPECIAL_TOKENS.index("<|vision_start|>")
    # every image is whole merge units of 32 px (native-resolution grids), light and heavy
    import io
    import pickle
    from PIL import Image
    sizes = set()
    with tarfile.open(tmp_path / "a" / "train-000000.tar") as tf:
        for m in tf.getmembers():
            if m.name.endswith(".jpgs"):
                for png in pickle.loads(tf.extractfile(m).read()):
                    w, h = Image.open(io.BytesIO(png)).size
                    assert w % 32 == 0 and h % 32 == 0
                    sizes.add(w * h // (32 * 32))
    assert min(sizes) <= 2 and max(sizes) >= 32
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("x")
    from megatron_mm_balance.data.make_dataset import MakeDatasetError
    with pytest.raises(MakeDatasetError, match="not empty"):
        make_qwen_vl_dataset(tmp_path / "c", samples=32)


def test_make_dataset_default_form_unchanged_by_the_format_flag(tmp_path):
    pytest.importorskip("megatron.energon")
    env = dict(os.environ, PYTHONPATH=str(bu.REPO))
    cmd = [sys.executable, "-m", "megatron_mm_balance.cli", "make-dataset"]
    for name, extra in (("plain", []), ("flag", ["--format", "megatron-multimodal"])):
        r = subprocess.run(cmd + [str(tmp_path / name), "--samples", "16", "--seed", "1", *extra],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    assert _tree_digest(tmp_path / "plain") == _tree_digest(tmp_path / "flag")
    assert (tmp_path / "plain" / "captions").is_dir() and not (tmp_path / "plain" / "processor").exists()


def test_make_dataset_bridge_form_through_the_cli(tmp_path):
    """The user's command: ``mm-balance make-dataset OUT --format bridge-qwen-vl`` writes the
    same bytes as the function; the Megatron-LM format's ``--mix`` is refused there."""
    pytest.importorskip("megatron.energon")
    from megatron_mm_balance.bridge.dataset import make_qwen_vl_dataset
    env = dict(os.environ, PYTHONPATH=str(bu.REPO))
    cmd = [sys.executable, "-m", "megatron_mm_balance.cli", "make-dataset"]
    r = subprocess.run(cmd + [str(tmp_path / "cli"), "--samples", "32", "--seed", "3", "--format",
                              "bridge-qwen-vl"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"DATA_PATH={tmp_path / 'cli'}" in r.stdout.splitlines()
    make_qwen_vl_dataset(tmp_path / "fn", samples=32, seed=3)
    assert _tree_digest(tmp_path / "cli") == _tree_digest(tmp_path / "fn")
    bad = subprocess.run(cmd + [str(tmp_path / "bad"), "--format", "bridge-qwen-vl", "--mix", "vision-heavy"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--mix vision-heavy apply to --format megatron-multimodal" in bad.stderr


# --------------------------------------------------------------------------- apply_patches.sh

def _bridge_tree(tmp_path) -> Path:
    src = bu.archive_dir() / bu.BRIDGE_ARCHIVE
    if not src.is_file():
        pytest.skip(f"no {src}")
    with tarfile.open(src) as tf:
        tf.extractall(tmp_path, filter="data")
    return tmp_path / "Megatron-Bridge-v0.6.0"


def _files_digest(root: Path) -> str:
    return _tree_digest(root)


def _apply(tree, *mode):
    return subprocess.run(["bash", str(bu.REPO / "scripts" / "apply_patches.sh"), str(tree), *mode],
                          capture_output=True, text=True, timeout=120)


def test_apply_patches_bridge_plain_tree(tmp_path):
    tree = _bridge_tree(tmp_path)
    before = _files_digest(tree)
    r = _apply(tree, "--check")
    assert r.returncode == 0 and "Megatron-Bridge v0.6.0" in r.stdout and r.stdout.count(": pending") == 3
    assert _files_digest(tree) == before                                  # --check writes nothing
    assert _apply(tree).returncode == 0
    r = _apply(tree)
    assert r.returncode == 0 and "applied 0 patch(es)" in r.stdout         # idempotent
    text = (tree / "src/megatron/bridge/training/config.py").read_text()
    assert "mm_balance: Optional[Any]" in text
    r = _apply(tree, "--revert")
    assert r.returncode == 0 and _files_digest(tree) == before             # byte for byte


def test_apply_patches_bridge_refuses_other_release_and_conflicts(tmp_path):
    tree = _bridge_tree(tmp_path)
    info = tree / "src/megatron/bridge/package_info.py"
    orig = info.read_text()
    info.write_text(orig.replace("MINOR = 6", "MINOR = 8"))
    before = _files_digest(tree)
    r = _apply(tree)
    assert r.returncode == 1 and "not a supported Megatron-Bridge release" in r.stderr and "v0.6.0" in r.stderr
    assert _files_digest(tree) == before
    info.write_text(orig)
    setup = tree / "src/megatron/bridge/training/setup.py"
    setup.write_text(setup.read_text().replace('    print_rank_0("done with setup ...")',
                                               '    print_rank_0("setup done ...")'))
    before = _files_digest(tree)
    r = _apply(tree)
    assert r.returncode == 1 and "setup.py" in r.stderr and _files_digest(tree) == before   # all or nothing


# --------------------------------------------------------------------------- CPU harness stand-ins

def test_import_stand_ins_only_for_bridge_importers():
    code = (
        "import builtins, importlib.util\n"
        "from megatron_mm_balance.testing import cpu_bridge\n"
        "cpu_bridge._install_bridge_import_stubs()\n"
        "m = builtins.__import__('nvidia_resiliency_ext.inprocess', {'__name__': 'megatron.bridge.x'}, None,"
        " ['CallWrapper'], 0)\n"
        "W = m.CallWrapper\n"
        "class Sub(W): pass\n"                                  # usable as a base class / annotation
        "try:\n    W()\nexcept RuntimeError as e:\n    print('calls fail:', 'not installed' in str(e))\n"
        "try:\n    builtins.__import__('nvidia_resiliency_ext', {'__name__': 'megatron.core.x'}, None, (), 0)\n"
        "except ImportError:\n    print('core sees absent')\n"
        "print('spec', importlib.util.find_spec('nvidia_resiliency_ext'))\n"
        "import sys; print('in sys.modules', 'nvidia_resiliency_ext' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(bu.REPO)),
                       capture_output=True, text=True, timeout=120)
    if "nvidia_resiliency_ext" in r.stdout and "spec ModuleSpec" in r.stdout:
        pytest.skip("nvidia_resiliency_ext is installed here")
    assert r.returncode == 0, r.stderr
    assert "calls fail: True" in r.stdout and "core sees absent" in r.stdout
    assert "spec None" in r.stdout and "in sys.modules False" in r.stdout


# --------------------------------------------------------------------------- launcher

def test_launcher_dry_run_one_setting():
    env = dict(os.environ, DRY_RUN="1", DATA_PATH="/data/q")
    env.pop("MEGATRON_BRIDGE_DIR", None)
    on = subprocess.run(["bash", str(bu.LAUNCHER), "--config", str(bu.CONFIG), "train.exit_interval=3"],
                        env=env, capture_output=True, text=True, timeout=60)
    off = subprocess.run(["bash", str(bu.LAUNCHER), "--config", str(bu.CONFIG)],
                         env=dict(env, MM_BALANCE="0", EP="1"), capture_output=True, text=True, timeout=60)
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    a, b = on.stdout.splitlines(), off.stdout.splitlines()
    assert "mm_balance.enabled=true" in a and "mm_balance.enabled=false" in b
    assert "megatron_mm_balance.bridge.run" in a and a[-1] == "train.exit_interval=3"
    assert "dataset.path=/data/q" in a and "dataset.task_encoder.hf_processor_path=/data/q/processor" in a
    assert "model.expert_model_parallel_size=1" in b
    assert any(x.endswith("runs/qwen3_vl_moe_tiny_cpu-baseline/checkpoints") for x in b)
    assert not any("cpu_bridge" in x for x in a)          # DRY_RUN prints the GPU command


def test_launcher_refuses_unpatched_tree(tmp_path):
    tree = _bridge_tree(tmp_path)
    r = subprocess.run(["bash", str(bu.LAUNCHER), "--config", str(bu.CONFIG)],
                       env=dict(os.environ, MEGATRON_BRIDGE_DIR=str(tree), DATA_PATH="/x"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "patches are not applied" in r.stderr


def test_bridge_patches_import_our_package_only_when_asked():
    """Each added import of megatron_mm_balance sits behind ``mm_balance.enabled`` (or
    ``mm_balance.wraps_train_iterator``: balancing or the timing hooks) or a guarded try."""
    for p in sorted(bu.PATCHES.glob("*.patch")):
        plus = [l[1:] for l in p.read_text().splitlines() if l.startswith("+") and not l.startswith("+++")]
        for k, line in enumerate(plus):
            if "megatron_mm_balance" in line and "import" in line:
                before = "\n".join(plus[max(0, k - 3):k])
                asked = "enabled" in before or "wraps_train_iterator" in before
                assert "try:" in before or "mm_balance" in before and asked, (p.name, line)
    assert sorted(p.name[:4] for p in bu.PATCHES.glob("*.patch")) == ["0001", "0002", "0003"]


def test_wgrad_accumulation_stand_in_accumulates_in_fp32():
    """The CPU stand-in for apex's fused_weight_gradient_mlp_cuda, through megatron-core's
    own linear with ``gradient_accumulation_fusion``: two micro-steps of a bf16 weight's
    gradient land in its fp32 ``main_grad`` unrounded (as the fp32 product of the bf16
    operands), where the unfused path rounds each micro-step's gradient to bf16 first."""
    code = (
        "import os, torch, torch.distributed as dist\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PORT'])\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "from megatron.core import parallel_state as ps\n"
        "ps.initialize_model_parallel()\n"
        "from megatron_mm_balance.testing import cpu_bridge\n"
        "cpu_bridge._wgrad_accumulation()\n"
        "from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce as lin\n"
        "g = torch.Generator().manual_seed(0)\n"
        "xs = [torch.randn(300, 64, generator=g).bfloat16() for _ in range(2)]\n"
        "dys = [torch.randn(300, 32, generator=g).bfloat16() for _ in range(2)]\n"
        "want = sum(dy.double().t() @ x.double() for x, dy in zip(xs, dys))\n"
        "def run(fused):\n"
        "    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()\n"
        "    w.main_grad = torch.zeros(32, 64)\n"
        "    for x, dy in zip(xs, dys):\n"
        "        lin(x.requires_grad_(), w, None, fused, False, False).backward(dy)\n"
        "        if not fused:\n"
        "            w.main_grad += w.grad.float(); w.grad = None\n"
        "    return float((w.main_grad.double() - want).abs().max() / want.abs().max())\n"
        "print('fused', run(True)); print('unfused', run(False))\n")
    env = dict(os.environ, PYTHONPATH=str(bu.REPO), PORT=str(bu.free_port()))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    err = {k: float(v) for k, v in (line.split() for line in r.stdout.splitlines() if line.split()[0] in
                                     ("fused", "unfused"))}
    assert err["fused"] < 1e-5, r.stdout           # fp32 rounding only
    assert err["unfused"] > 1e-4, r.stdout         # bf16 rounding of each micro-step's gradient
    print(f"\nmain_grad error vs fp64, relative to its largest entry: {err}")


def test_the_model_is_read_once_into_a_frozen_spec_with_the_reasons_it_lacks():
    """``ModelSpec.read``: the provider's settings and its tower's derived figures, read once;
    what the config cannot give is a one-line reason, raised by whoever needs it."""
    from megatron_mm_balance.cost.flops import VisionTower
    cfg = _bridge_cfg(ep=2)
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, patch_size=16, temporal_patch_size=2,
                  in_channels=3, spatial_merge_size=4, out_hidden_size=128, deepstack_visual_indexes=[0])
    cfg.model.vision_config = types.SimpleNamespace(**vision)
    spec = ModelSpec.read(cfg.model, flops_per_ms=1.0)
    assert (spec.expert_model_parallel_size, spec.context_parallel_size, spec.spatial_merge_size) == (2, 1, 4)
    assert spec.qwen3_tower and spec.provider == "SimpleNamespace" and not spec.splits_frames_across_cp
    assert spec.required_tower() == VisionTower.from_config(vision)
    assert spec.required_frame_alpha() == VisionTower.from_config(vision).frame_alpha()
    assert spec.flops_model is None and "language config: the config has no 'hidden_size'" in spec.flops_problem
    with pytest.raises(ValueError, match="language config"):
        spec.required_flops_model()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.spatial_merge_size = 2
    bare = ModelSpec.read(types.SimpleNamespace())          # not Qwen-VL: the reasons, once
    assert bare.spatial_merge_size == 2 and not bare.qwen3_tower and bare.tower is None
    for need in (bare.required_tower, bare.required_frame_alpha):
        with pytest.raises(ValueError, match="model.vision_config: the config has no 'depth'") as exc:
            need()
        assert "\n" not in str(exc.value)


def test_cost_model_without_a_file_is_the_flop_count_of_the_provider(tmp_path):
    from megatron_mm_balance.bridge.iterator import cost_fn_for
    from megatron_mm_balance.cost.flops import (CPU_FLOPS_PER_MS, DEFAULT_FLOPS_PER_MS, TrainingRegime,
                                                vision_cost_model)
    vision = types.SimpleNamespace(depth=2, hidden_size=64, intermediate_size=128, patch_size=16,
                                   temporal_patch_size=2, in_channels=3, spatial_merge_size=2,
                                   out_hidden_size=128, deepstack_visual_indexes=[0])
    cfg = _bridge_cfg(ep=2)
    cfg.model.__dict__.update(vision_config=vision, num_layers=2, hidden_size=128, ffn_hidden_size=256,
                              num_attention_heads=4, num_query_groups=2, kv_channels=32,
                              moe_ffn_hidden_size=128, moe_router_topk=2, freeze_vision_model=True,
                              recompute_granularity="full", recompute_method="uniform")
    core = checked_config(_as_args(MMBalanceBridgeConfig(enabled=True, cost="model"), cfg))
    spec = ModelSpec.read(cfg.model)
    cost = cost_fn_for(core, spec)
    regime = spec.regime
    assert regime == TrainingRegime(freeze_vision_model=True, recompute_granularity="full",
                                    recompute_method="uniform", language_recompute_granularity="full")
    rate = DEFAULT_FLOPS_PER_MS if torch.cuda.is_available() else CPU_FLOPS_PER_MS
    assert cost.phases and cost.model == vision_cost_model(vision, regime, language_config=cfg.model,
                                                           flops_per_ms=rate)
    big, small = cost(_batch(images=[(1, 32, 32)]))[0], cost(_batch(images=[(1, 8, 8)] * 16))[0]
    assert big > small > 0                        # equal patches; the large frame costs more
    assert "flops" in cost.identity
    # cost=auto replays the same model as its flops candidate; a timing directory gets it too
    from megatron_mm_balance.bridge.iterator import auto_features_for, save_flops_model
    from megatron_mm_balance.cost.model import load_cost_file
    assert auto_features_for(spec).flops_model == cost.model
    assert load_cost_file(save_flops_model(str(tmp_path / "timing"), spec)) == cost.model
    cfg.model.vision_cuda_graph_impl = "transformer_engine"
    graphs = ModelSpec.read(cfg.model)
    with pytest.raises(MMBalanceConfigError, match="vision CUDA graphs"):
        cost_fn_for(core, graphs)
    features = auto_features_for(graphs)               # auto: the candidate refused, with the reason
    assert features.flops_model is None and "vision CUDA graphs" in features.flops_note
    assert save_flops_model(str(tmp_path / "graphs"), graphs) is None


# --------------------------------------------------------------------------- context-parallel frame split

def _fake_qwen3vl_module(monkeypatch, with_split=True):
    """A stand-in for Bridge's Qwen3-VL model module: its ``qwen3vl_cp_split`` returns what
    Bridge's does for unpadded frames (pixels, expanded grids, frames per rank by count)."""
    from megatron_mm_balance.bridge import cp_split as glue
    from megatron_mm_balance.solver.cp_split import equal_count_split
    module = types.ModuleType(glue.QWEN3_VL_MODEL)
    calls = []

    def qwen3vl_cp_split(cp_size, pixel_values, image_grid_thw):
        calls.append(cp_size)
        grid = torch.cat([row.repeat(int(row[0]), 1) for row in image_grid_thw])
        grid[:, 0] = 1
        return pixel_values, grid, equal_count_split(grid.shape[0], cp_size), [0] * cp_size

    if with_split:
        module.qwen3vl_cp_split = qwen3vl_cp_split
    monkeypatch.setitem(sys.modules, glue.QWEN3_VL_MODEL, module)
    return module, calls


def _cp_cfg(cp_split="cost", cp=2, vision_dp=True):
    vision = types.SimpleNamespace(hidden_size=64, intermediate_size=128, depth=2, patch_size=16,
                                   out_hidden_size=128)
    return types.SimpleNamespace(
        mm_balance=MMBalanceBridgeConfig(enabled=True, cp_split=cp_split),
        model=types.SimpleNamespace(context_parallel_size=cp, vision_dp_when_cp=vision_dp, vision_config=vision))


def _install(cfg) -> bool:
    """``install_cp_split`` as ``wrap_train_data_iterator`` calls it: the model read once."""
    from megatron_mm_balance.bridge.cp_split import install_cp_split
    return install_cp_split(cfg.mm_balance, ModelSpec.read(cfg.model))


def test_cp_split_replaces_bridge_count_by_cost(monkeypatch):
    module, calls = _fake_qwen3vl_module(monkeypatch)
    original = module.qwen3vl_cp_split
    assert MMBalanceBridgeConfig().cp_split == "cost"
    assert _install(_cp_cfg()) and _install(_cp_cfg())                     # idempotent
    assert module.qwen3vl_cp_split.mm_balance_wraps is original
    grid = torch.tensor([[1, 32, 32], [1, 32, 32], [1, 4, 4], [2, 4, 4], [1, 2, 2]])
    pixels = torch.arange(int(grid.prod(1).sum()), dtype=torch.float32)[:, None]
    out_pixels, out_grid, counts, padded = module.qwen3vl_cp_split(2, pixels, grid)
    assert calls == [2] and out_pixels is pixels and padded == [0, 0]           # Bridge's own call
    assert out_grid.shape[0] == 6 and counts == [1, 5]                          # count would be [3, 3]


@pytest.mark.parametrize("cfg", [_cp_cfg(cp_split="count"), _cp_cfg(cp=1), _cp_cfg(vision_dp=False)])
def test_cp_split_changes_nothing_when_off_or_without_context_parallel(monkeypatch, cfg):
    module, _ = _fake_qwen3vl_module(monkeypatch)
    original = module.qwen3vl_cp_split
    assert not _install(cfg) and module.qwen3vl_cp_split is original


def test_cp_split_refuses_bad_value_and_missing_bridge_function(monkeypatch):
    with pytest.raises(MMBalanceConfigError, match="mm_balance.cp_split must be one of cost, count"):
        _as_args(MMBalanceBridgeConfig(enabled=True, cp_split="frames"), _bridge_cfg())
    _fake_qwen3vl_module(monkeypatch, with_split=False)
    with pytest.raises(RuntimeError, match="has no qwen3vl_cp_split.*cp_split=count"):
        _install(_cp_cfg())


def test_gloo_uneven_all_gather_stand_in():
    """Bridge's vision all-gather has outputs of different sizes: gloo refuses them (NCCL
    takes them), the harness stand-in pads, gathers and cuts; 2 real gloo processes."""
    code = (
        "import os, sys, torch, torch.distributed as dist\n"
        "rank = int(sys.argv[1])\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=os.environ['PORT'])\n"
        "dist.init_process_group('gloo', rank=rank, world_size=2)\n"
        "x = torch.full((2 + 3 * rank, 4), float(rank + 1))\n"
        "outs = [torch.zeros(2, 4), torch.zeros(5, 4)]\n"
        "probe = dist.new_group([0, 1])\n"                 # the refused call on its own group
        "try:\n    dist.all_gather(outs, x, group=probe); print('plain gloo accepts')\n"
        "except RuntimeError as e:\n    print('plain gloo refuses:', 'invalid tensor size' in str(e))\n"
        "from megatron_mm_balance.testing import cpu_bridge\n"
        "cpu_bridge.install_gloo_uneven_all_gather()\n"
        "outs = [torch.zeros(2, 4), torch.zeros(5, 4)]\n"
        "dist.all_gather(outs, x)\n"
        "print('gathered', bool((outs[0] == 1).all() and (outs[1] == 2).all()))\n"
        "even = [torch.zeros(3), torch.zeros(3)]\n"
        "dist.all_gather(even, torch.full((3,), float(rank))); print('even', even[1].tolist())\n"
        # gloo's teardown after the refused call on the probe group can abort: skip it
        "sys.stdout.flush(); dist.barrier(); os._exit(0)\n")
    env = dict(os.environ, PYTHONPATH=str(bu.REPO), PORT=str(bu.free_port()))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "plain gloo refuses: True" in out and "gathered True" in out and "even [1.0, 1.0, 1.0]" in out


def test_a_telemetry_figure_is_read_by_its_leading_number():
    """Should another rank's output share a telemetry line, the figure is still ours."""
    log = ("[mm-balance] iteration 4 | packs_moved: 4 | prefetched: 0\n"
           "[mm-balance] iteration 5 | packs_moved: 2.5e0 | prefetched: 1 [2026-12-03 03:01:19] "
           "iteration        5/       6 | lm loss: 6.305675E+00 |\n")
    run = bu.parse(log)
    assert run.stat("prefetched") == {4: 0.0, 5: 1.0}
    assert run.stat("packs_moved") == {4: 4.0, 5: 2.5}
    assert run.losses == {5: 6.305675}


def test_predrawn_batches_are_the_loaders_own_in_order():
    """The benchmark's predraw (MM_BALANCE_CPU_PREDRAW): the first N items are drawn when the
    wrapper is made, then the same items come out in the same order, and the rest follow from
    the loader as they are asked for; ``all`` is the job's micro-batches on one rank."""
    from megatron_mm_balance.testing.host_side import PredrawnBatches, predraw_count
    drawn = []

    def loader():
        for i in range(7):
            drawn.append(i)
            yield {"i": i}

    it = PredrawnBatches(loader(), 4)
    assert drawn == [0, 1, 2, 3]                                   # drawn up front
    assert [next(it)["i"] for _ in range(5)] == [0, 1, 2, 3, 4] and drawn == [0, 1, 2, 3, 4]
    assert [b["i"] for b in it] == [5, 6]
    short = PredrawnBatches(iter(range(2)), 5)                      # a loader shorter than the count
    assert list(short) == [0, 1]
    job = dict(train_iters=10, global_batch_size=16, micro_batch_size=1)
    assert predraw_count("all", **job, dp_size=2) == 80 and predraw_count(" ALL ", **job, dp_size=4) == 40
    assert predraw_count("12", **job, dp_size=2) == 12
    for bad, match in (("some", "must be 'all' or a micro-batch count"), ("-3", "must not be negative")):
        with pytest.raises(ValueError, match=match):
            predraw_count(bad, **job, dp_size=2)


_HEAP_PROBE = """
import os, resource, sys, torch
from megatron_mm_balance.testing.host_side import grow_heap
grow_heap(int(sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t = torch.empty(200 << 20, dtype=torch.uint8)
t.fill_(2)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.parametrize("grown_mb", [0, 256])
def test_a_grown_heap_serves_the_next_large_tensor_without_faults(grown_mb):
    """MM_BALANCE_CPU_HEAP_MB (``--host gpu-node``): with glibc keeping what it frees, the heap
    grown at setup serves a later 200 MiB tensor from resident pages; without it the tensor's
    ~51,000 pages are faulted in one by one (what stalled a rank meeting a larger frame)."""
    env = dict(os.environ, MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40), OMP_NUM_THREADS="1",
               PYTHONPATH=f"{bu.REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-c", _HEAP_PROBE, str(grown_mb)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    faults = int(r.stdout.split()[-1])
    if grown_mb:
        assert faults < 5_000, faults
    else:
        assert faults > 40_000, faults


def test_the_heap_setting_is_refused_where_it_would_not_hold():
    """The heap is grown only where the allocator keeps it and the loader's workers are forked
    already; every missing setting is named."""
    from megatron_mm_balance.testing.host_side import check_heap_settings, heap_mb
    assert heap_mb("") == 0 and heap_mb("3072") == 3072
    for bad, match in (("3G", "whole number of MiB"), ("-1", "must not be negative")):
        with pytest.raises(ValueError, match=match):
            heap_mb(bad)
    good = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MM_BALANCE_CPU_PREDRAW": "all"}
    check_heap_settings(3072, good)
    check_heap_settings(0, {})
    with pytest.raises(ValueError) as e:
        check_heap_settings(3072, {"MALLOC_TRIM_THRESHOLD_": "1024"})
    assert all(k in str(e.value) for k in ("MALLOC_MMAP_MAX_=0", "MALLOC_TRIM_THRESHOLD_", "MM_BALANCE_CPU_PREDRAW"))
    with pytest.raises(ValueError, match="MM_BALANCE_CPU_PREDRAW"):
        check_heap_settings(64, dict(good, MM_BALANCE_CPU_PREDRAW="0"))
