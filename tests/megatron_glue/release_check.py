"""Run by a release's interpreter (Python 3.12 for core_v0.17.1+): the patched tree imports,
and Megatron's own parse_args + validate_args accept each launcher command given.

    python release_check.py MEGATRON_LM_DIR REPO_ROOT [upstream:]ARGV_FILE:WORLD...

Each ARGV_FILE holds a `DRY_RUN=1 scripts/pretrain_vlm_moe.sh` command, one word a line.
Prints "IMPORTED <tree>" and, per file, "VALID <file> <world> <dp> <ep> <mm_balance>".
With the prefix ``upstream:`` the command gets Megatron's own data rebalancing on top
(``--hybrid-context-parallel`` with the settings Megatron's validate_args asks for it:
``--dataloader-type single --calculate-per-token-loss``), and the line is
"REFUSED <file> <message>" when validate_args raised our one-line error, or
"VALID-UPSTREAM <file>" when it accepted the command (as it must without --mm-balance).
"""
import os
import sys

mlm, here = sys.argv[1:3]
sys.path[:0] = [mlm, os.path.join(mlm, "examples/multimodal"), here, os.path.join(here, "tests/megatron_glue")]
import glue_import_stubs  # noqa: E402

glue_import_stubs.install()
import megatron.training.training as T  # noqa: E402
import megatron.training.arguments as A  # noqa: E402
import megatron.training.datasets.data_samplers  # noqa: E402,F401
import model  # noqa: E402,F401  (examples/multimodal/model.py)
import train  # noqa: E402,F401  (examples/multimodal/train.py)
from multimodal_args import add_multimodal_extra_args  # noqa: E402

assert T.__file__.startswith(mlm) and model.__file__.startswith(mlm), (T.__file__, model.__file__)
print("IMPORTED", mlm, flush=True)
# Validate as on Hopper: TP > 1 asks the GPU's arch, --moe-grouped-gemm its compute capability.
A.get_device_arch_version = lambda: 9
A.torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
UPSTREAM = ["--hybrid-context-parallel", "--dataloader-type", "single", "--calculate-per-token-loss"]
for spec in sys.argv[3:]:
    upstream = spec.startswith("upstream:")
    path, world = spec.removeprefix("upstream:").rsplit(":", 1)
    argv = [l for l in open(path).read().split("\n") if l]
    argv = argv[argv.index("examples/multimodal/train.py") + 1:] + (UPSTREAM if upstream else [])
    os.environ.update(WORLD_SIZE=world, RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    sys.argv = ["train.py"] + argv
    args = A.parse_args(extra_args_provider=add_multimodal_extra_args)
    # What pretrain() does before validate_args (initialize_megatron: world size from env).
    if upstream:
        from megatron_mm_balance.megatron.checks import MMBalanceConfigError
        try:
            A.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        except MMBalanceConfigError as exc:
            print("REFUSED", path, exc, flush=True)
        else:
            print("VALID-UPSTREAM", path, flush=True)
        continue
    args = A.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    print("VALID", path, args.world_size, args.data_parallel_size, args.expert_model_parallel_size,
          args.mm_balance, flush=True)
