"""patches/*.patch and scripts/apply_patches.sh.

The well-formedness tests are pure Python and always run. The others need a
Megatron-LM git checkout that contains commit 55ac708 (tag core_v0.16.1): set
MEGATRON_LM_DIR to it (default: ./.megatron-lm when present). They never touch that checkout: they clone it (shared
objects, about a second) into a temporary directory and work there. Without
MEGATRON_LM_DIR they are skipped with the reason. About 40 s with a checkout.
"""
import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
SCRIPT = ROOT / "scripts" / "apply_patches.sh"
COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"
TARGETS = {"megatron/training/arguments.py", "megatron/training/training.py",
           "megatron/training/datasets/data_samplers.py", "examples/multimodal/model.py",
           "examples/multimodal/dataloader_provider.py", "megatron/training/checkpointing.py"}
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


# -- pure python ---------------------------------------------------------------------------
def parse_patch(text):
    """(target path, [(old_start, old_len, new_start, new_len, lines)]) of a one-file git diff."""
    lines = text.split("\n")
    assert text.endswith("\n"), "patch must end with a newline"
    assert "\r" not in text, "CRLF line endings"
    assert lines[0].startswith("diff --git a/"), lines[0]
    i = next(k for k, l in enumerate(lines) if l.startswith("--- "))
    old, new = lines[i][4:], lines[i + 1][4:]
    assert old.startswith("a/") and new.startswith("b/") and old[2:] == new[2:], (old, new)
    hunks, k = [], i + 2
    while k < len(lines) and lines[k]:
        m = HUNK.match(lines[k])
        assert m, f"expected a hunk header, got {lines[k]!r}"
        os_, ol, ns, nl = (int(m.group(1)), int(m.group(2) or 1), int(m.group(3)), int(m.group(4) or 1))
        body, k = [], k + 1
        while k < len(lines) and lines[k] and not lines[k].startswith("@@"):
            assert lines[k][0] in " +-\\", f"bad hunk line {lines[k]!r}"
            body.append(lines[k])
            k += 1
        hunks.append((os_, ol, ns, nl, body))
    assert k == len(lines) - 1, "trailing garbage after the last hunk"
    return old[2:], hunks


def test_patch_files_are_well_formed_unified_diffs():
    assert len(PATCHES) == 7
    targets = set()
    added = 0
    for p in PATCHES:
        target, hunks = parse_patch(p.read_text())
        targets.add(target)
        assert hunks
        for os_, ol, ns, nl, body in hunks:
            assert sum(1 for l in body if l[0] in " -") == ol, f"{p.name}: old count"
            assert sum(1 for l in body if l[0] in " +") == nl, f"{p.name}: new count"
            added += sum(1 for l in body if l[0] == "+")
    assert targets == TARGETS
    assert added <= 45, f"patches add {added} lines; keep them minimal"


def test_patched_code_imports_our_package_only_when_asked():
    """Every added import of megatron_mm_balance is lazy (behind the flag or a guarded try)."""
    for p in PATCHES:
        plus = [l[1:] for l in p.read_text().splitlines() if l.startswith("+") and not l.startswith("+++")]
        for k, line in enumerate(plus):
            if "import" in line and "megatron_mm_balance" in line:
                guard = " ".join(plus[max(0, k - 2):k])
                assert re.search(r"getattr\(args, 'mm_balance[a-z_]*', False\)", guard) or "try:" in guard, (p.name, line)


# -- against a real checkout ------------------------------------------------------------------
def _checkout_dir():
    d = os.environ.get("MEGATRON_LM_DIR")
    if not d and (ROOT / ".megatron-lm" / ".git").exists():
        d = str(ROOT / ".megatron-lm")
    if not d:
        pytest.skip("MEGATRON_LM_DIR is not set (a Megatron-LM git checkout containing core_v0.16.1)")
    if not (Path(d) / ".git").exists():
        pytest.skip(f"MEGATRON_LM_DIR={d} is not a git checkout")
    if subprocess.run(["git", "-C", d, "cat-file", "-e", COMMIT + "^{commit}"], capture_output=True).returncode:
        pytest.skip(f"MEGATRON_LM_DIR={d} does not contain commit {COMMIT[:10]} (core_v0.16.1)")
    return d


@pytest.fixture()
def clone(tmp_path):
    src = _checkout_dir()
    dst = tmp_path / "Megatron-LM"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", src, str(dst)], check=True)
    subprocess.run(["git", "-C", str(dst), "checkout", "-q", COMMIT], check=True)
    return dst


def run_script(*args):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)


def is_clean(d):
    return subprocess.run(["git", "-C", str(d), "status", "--porcelain"], capture_output=True,
                          text=True).stdout.strip() == ""


def test_check_apply_idempotent_revert(clone):
    r = run_script(clone, "--check")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": pending") == 5 and is_clean(clone)
    r = run_script(clone)
    assert r.returncode == 0 and "applied 5 patch(es)" in r.stdout, r.stderr
    changed = subprocess.run(["git", "-C", str(clone), "diff", "--name-only"], capture_output=True,
                             text=True).stdout.split()
    assert set(changed) == TARGETS
    r = run_script(clone)                                    # idempotent
    assert r.returncode == 0 and "applied 0 patch(es)" in r.stdout and r.stdout.count(": applied") == 5
    assert run_script(clone, "--check").returncode == 0
    r = run_script(clone, "--revert")
    assert r.returncode == 0 and "reverted 5 patch(es)" in r.stdout and is_clean(clone)
    r = run_script(clone, "--revert")                        # idempotent
    assert r.returncode == 0 and "reverted 0 patch(es)" in r.stdout and is_clean(clone)


def test_wrong_version_says_what_to_do(clone):
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", "HEAD~1"], check=True)
    r = run_script(clone)
    assert r.returncode == 1
    assert "core_v0.16.1" in r.stderr and f"git -C {clone} checkout core_v0.16.1" in r.stderr
    assert is_clean(clone)


def test_locally_modified_file_changes_nothing(clone):
    f = clone / "megatron/training/training.py"
    text = f.read_text()
    f.write_text(text.replace("    timers('train/valid/test-data-iterators-setup').stop()\n", "    pass\n", 1))
    r = run_script(clone)
    assert r.returncode == 1 and "conflict" in r.stdout and "nothing was changed" in r.stderr
    out = subprocess.run(["git", "-C", str(clone), "diff", "--name-only"], capture_output=True, text=True).stdout
    assert out.split() == ["megatron/training/training.py"]


def test_source_tree_without_git(clone, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(clone, plain, ignore=shutil.ignore_patterns(".git"))
    r = run_script(plain)
    assert r.returncode == 0 and "applied 5 patch(es)" in r.stdout, r.stderr
    info = plain / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("MINOR = 16", "MINOR = 15"))
    r = run_script(plain, "--check")
    assert r.returncode == 1 and "0.15.1" in r.stderr and "--branch core_v0.16.1" in r.stderr


def test_usage_errors(tmp_path):
    assert run_script().returncode == 2
    assert run_script(tmp_path, "--bogus").returncode == 2
    r = run_script(tmp_path / "missing")
    assert r.returncode == 1 and "no such directory" in r.stderr
    r = run_script(tmp_path)
    assert r.returncode == 1 and "not a Megatron-LM checkout" in r.stderr


PARSE_CHECK = r"""
import sys, glue_import_stubs
glue_import_stubs.install()
import megatron.training.training as T, megatron.training.arguments as A
import megatron.training.datasets.data_samplers as S
assert T.__file__.startswith(sys.argv[1]), T.__file__
sys.argv = ['pretrain', '--mm-balance', '--no-mm-balance-overlap', '--mm-balance-sync', 'microstep',
            '--mm-balance-log-interval', '5', '--num-layers', '2', '--hidden-size', '64',
            '--num-attention-heads', '4', '--seq-length', '128', '--max-position-embeddings', '128',
            '--global-batch-size', '4', '--micro-batch-size', '2', '--lr', '1e-4', '--train-iters', '5']
args = A.parse_args()
print('parsed', args.mm_balance, args.mm_balance_overlap, args.mm_balance_sync, args.mm_balance_log_interval)
try:
    A.validate_args(args)
except Exception as e:
    print('validate:', type(e).__name__, e)
"""


def test_patched_megatron_imports_parses_and_validates(clone):
    assert run_script(clone).returncode == 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(clone), str(ROOT), str(Path(__file__).parent)]))
    r = subprocess.run([sys.executable, "-c", PARSE_CHECK, str(clone)], capture_output=True, text=True,
                       env=env, timeout=300, cwd=str(clone))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "parsed True False microstep 5" in r.stdout
    assert "validate: MMBalanceConfigError --mm-balance with --micro-batch-size 2" in r.stdout


def test_unpatched_megatron_takes_the_flags_through_extra_args_provider(clone):
    code = PARSE_CHECK.replace("args = A.parse_args()", "from megatron_mm_balance.megatron.arguments import "
                               "add_mm_balance_args\nargs = A.parse_args(extra_args_provider=add_mm_balance_args)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(clone), str(ROOT), str(Path(__file__).parent)]))
    r = subprocess.run([sys.executable, "-c", code, str(clone)], capture_output=True, text=True,
                       env=env, timeout=300, cwd=str(clone))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "parsed True False microstep 5" in r.stdout
    # Unpatched validate_args does not run our checks: nothing refused here.
    assert "validate:" not in r.stdout


def _params(path, func):
    tree = ast.parse(Path(path).read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == func)
    return {a.arg for a in fn.args.args + fn.args.kwonlyargs}, fn.args.kwarg is not None


def _get_model_call_keywords(training_py):
    tree = ast.parse(Path(training_py).read_text())
    get_model = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "get_model")
    kws = set()
    for node in ast.walk(get_model):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "model_provider_func":
            kws |= {k.arg for k in node.keywords}
    return kws


def test_multimodal_model_provider_accepts_what_get_model_passes(clone):
    passed = _get_model_call_keywords(clone / "megatron/training/training.py")
    assert {"config", "pg_collection", "vp_stage"} <= passed
    params, _ = _params(clone / "examples/multimodal/model.py", "model_provider")
    assert not passed <= params                     # the bug at core_v0.16.1
    assert run_script(clone).returncode == 0
    params, _ = _params(clone / "examples/multimodal/model.py", "model_provider")
    assert passed <= params


def test_moe_layer_spec_call_matches_megatron_core():
    """The model.py hunk calls the GPT layer-spec builders positionally; check the order."""
    import inspect
    pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 not installed")
    from megatron.core.models.gpt import gpt_layer_specs as specs
    text = next(p for p in PATCHES if "multimodal" in p.name).read_text()
    assert "get_gpt_layer_local_spec(\n+                args.num_experts, args.moe_grouped_gemm, args.qk_layernorm," in text
    assert "normalization=language_config.normalization" in text
    for fn in (specs.get_gpt_layer_local_spec, specs.get_gpt_layer_with_transformer_engine_spec):
        assert list(inspect.signature(fn).parameters)[:3] == ["num_experts", "moe_grouped_gemm", "qk_layernorm"]
    spec = specs.get_gpt_layer_local_spec(8, False, True)
    assert "MoE" in spec.submodules.mlp.module.__name__
