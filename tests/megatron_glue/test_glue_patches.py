"""patches/<release>/*.patch and scripts/apply_patches.sh.

The well-formedness tests are pure Python and always run. The others use Megatron-LM
release trees from the session cache of conftest.py (unpacked once from the archives in
../shared/megatron-lm/, or MEGATRON_LM_DIR for the release it holds; skipped with the
reason when neither exists). Each test works on its own copy: a plain source tree, or a
git checkout carrying one local commit that edits a context line of the training.py hunk
(so a plain apply fails there and the 3-way path is exercised). About 25 s for all.
"""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_trees import INFO_VERSION, LOCAL_EDIT_FILE, PATCH_SET, RELEASES, ROOT, git, tree_hash

SCRIPT = ROOT / "scripts" / "apply_patches.sh"
PATCH_SETS = {tag: sorted((ROOT / "patches" / PATCH_SET[tag]).glob("*.patch")) for tag in RELEASES}
PATCHES = PATCH_SETS["core_v0.16.1"]
TARGETS = {"megatron/training/arguments.py", "megatron/training/training.py",
           "megatron/training/datasets/data_samplers.py", "examples/multimodal/model.py"}
# Files later patches touch too (examples/multimodal's task encoder switch and test loader,
# Megatron's dataloader checkpoint directory; the last fixed upstream in core_v0.19.0).
EXTRA_TARGETS = {"examples/multimodal/dataloader_provider.py", "megatron/training/checkpointing.py",
                 "megatron/core/tokenizers/utils/build_tokenizer.py", "examples/multimodal/train.py"}
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
SUPPORTED_MSG = ("supported releases: core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0, "
                 "core_v0.20.0 (main@d98e8a64)")


# -- pure python ---------------------------------------------------------------------------
def parse_patch(text):
    """[(target path, [(old_start, old_len, new_start, new_len, lines)])] of a git diff."""
    lines = text.split("\n")
    assert text.endswith("\n"), "patch must end with a newline"
    assert "\r" not in text, "CRLF line endings"
    assert lines[0].startswith("diff --git a/"), lines[0]
    files, k = [], 0
    while k < len(lines) - 1:
        assert lines[k].startswith("diff --git a/"), f"expected a file header, got {lines[k]!r}"
        i = next(j for j in range(k, len(lines)) if lines[j].startswith("--- "))
        old, new = lines[i][4:], lines[i + 1][4:]
        assert old.startswith("a/") and new.startswith("b/") and old[2:] == new[2:], (old, new)
        hunks, k = [], i + 2
        while k < len(lines) and lines[k] and not lines[k].startswith("diff --git"):
            m = HUNK.match(lines[k])
            assert m, f"expected a hunk header, got {lines[k]!r}"
            os_, ol, ns, nl = (int(m.group(1)), int(m.group(2) or 1), int(m.group(3)), int(m.group(4) or 1))
            body, k = [], k + 1
            while k < len(lines) and lines[k] and not lines[k].startswith(("@@", "diff --git")):
                assert lines[k][0] in " +-\\", f"bad hunk line {lines[k]!r}"
                body.append(lines[k])
                k += 1
            hunks.append((os_, ol, ns, nl, body))
        assert hunks
        files.append((old[2:], hunks))
    assert k == len(lines) - 1, "trailing garbage after the last hunk"
    return files


def targets(tag):
    """The files the patch set of a release touches."""
    return {f for p in PATCH_SETS[tag] for f, _ in parse_patch(p.read_text())}


def test_every_supported_release_has_a_patch_set():
    assert sorted(p.name for p in (ROOT / "patches").iterdir() if p.is_dir()
                  and not p.name.startswith("megatron-bridge-")) == sorted(PATCH_SET.values())   # docs/bridge.md
    sets = (ROOT / "patches" / "sets.tsv").read_text()
    for tag in RELEASES:
        assert f"megatron-lm\t{PATCH_SET[tag]}\t{INFO_VERSION[tag]}\t" in sets


@pytest.mark.parametrize("tag", RELEASES)
def test_patch_files_are_well_formed_unified_diffs(tag):
    patches = PATCH_SETS[tag]
    # 0006 (checkpointing): not for core_v0.19.0 (fixed upstream); 0008: core_v0.17.1+ (their
    # MultimodalTokenizer never got its path, fixed upstream on main); 0009: core_v0.19.0 and main
    # (train.py and pretrain()); 0010: main (model.py reads a --vision-projection-type nobody defines).
    want = {"core_v0.16.1": ["0006", "0007"], "core_v0.19.0": ["0007", "0008", "0009"],
            "main-d98e8a64": ["0007", "0009", "0010"]}.get(tag, ["0006", "0007", "0008"])
    assert [p.name[:4] for p in patches] == ["0001", "0002", "0003", "0004", "0005"] + want
    added = 0
    for p in patches:
        for target, hunks in parse_patch(p.read_text()):
            for os_, ol, ns, nl, body in hunks:
                assert sum(1 for l in body if l[0] in " -") == ol, f"{p.name}: old count"
                assert sum(1 for l in body if l[0] in " +") == nl, f"{p.name}: new count"
                added += sum(1 for l in body if l[0] == "+")
    assert TARGETS <= targets(tag) <= TARGETS | EXTRA_TARGETS
    assert added <= 45, f"patches add {added} lines; keep them minimal"


@pytest.mark.parametrize("tag", RELEASES)
def test_patched_code_imports_our_package_only_when_asked(tag):
    """Every added import of megatron_mm_balance is lazy (behind the flag or a guarded try)."""
    for p in PATCH_SETS[tag]:
        plus = [l[1:] for l in p.read_text().splitlines() if l.startswith("+") and not l.startswith("+++")]
        for k, line in enumerate(plus):
            if "import" in line and "megatron_mm_balance" in line:
                guard = " ".join(plus[max(0, k - 2):k])
                assert re.search(r"getattr\(args, 'mm_balance[a-z_]*', False\)", guard) or "try:" in guard, (p.name, line)


# -- against release trees -------------------------------------------------------------------
def run_script(*args):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture()
def clone(mlm_trees, tmp_path):
    """core_v0.16.1 as a plain source tree of this test's own."""
    return mlm_trees.copy("core_v0.16.1", tmp_path / "Megatron-LM")


def states(out):
    """{file: state word} from the per-file lines of apply_patches.sh."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^(\S+\.py): (\w+)", out, re.M)}


@pytest.mark.parametrize("kind", ["plain", "git"])
@pytest.mark.parametrize("tag", RELEASES)
def test_release_tree_accepted_idempotent_and_reverted_byte_for_byte(mlm_trees, tmp_path, tag, kind):
    d = mlm_trees.copy(tag, tmp_path / "Megatron-LM", kind)
    before = tree_hash(d)
    r = run_script(d, "--check")
    assert r.returncode == 0, r.stderr
    assert f"Megatron-LM {PATCH_SET[tag]} (" in r.stdout
    files = targets(tag)
    assert states(r.stdout) == dict.fromkeys(files, "pending") and tree_hash(d) == before
    r = run_script(d)
    n = len(PATCH_SETS[tag])
    assert r.returncode == 0 and f"applied {n} patch(es)" in r.stdout, r.stdout + r.stderr
    if kind == "git":       # the local commit moved training.py's context: 3-way, reported
        assert f"{LOCAL_EDIT_FILE}: applied with git apply --3way" in r.stdout
        assert git(d, "diff", "--cached", "--name-only").stdout == ""        # index untouched
        assert "# our team's local change" in (d / LOCAL_EDIT_FILE).read_text()
    for f in files:
        ast.parse((d / f).read_text())
    for f in TARGETS:
        text = (d / f).read_text()
        assert "megatron_mm_balance" in text or "num_experts:  # MoE" in text or \
            "vision on the first stage only" in text, f
    patched = tree_hash(d)
    r = run_script(d)                                                  # idempotent
    assert r.returncode == 0 and "applied 0 patch(es) to" in r.stdout, r.stdout + r.stderr
    assert states(r.stdout) == dict.fromkeys(files, "applied") and tree_hash(d) == patched
    assert states(run_script(d, "--check").stdout) == dict.fromkeys(files, "applied")
    r = run_script(d, "--revert")
    assert r.returncode == 0 and f"reverted {n} patch(es)" in r.stdout, r.stdout + r.stderr
    assert tree_hash(d) == before                                       # byte for byte
    r = run_script(d, "--revert")                                       # idempotent
    assert r.returncode == 0 and "reverted 0 patch(es)" in r.stdout and tree_hash(d) == before


@pytest.mark.parametrize("kind", ["plain", "git"])
def test_unknown_release_is_refused_and_tree_untouched(mlm_trees, tmp_path, kind):
    d = mlm_trees.copy("core_v0.18.2", tmp_path / "Megatron-LM", kind)
    info = d / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("MINOR = 18", "MINOR = 15"))
    if kind == "git":        # a tag of an unsupported release, and its package_info
        git(d, "commit", "-q", "-am", "0.15")
        git(d, "tag", "core_v0.15.0")
    before = tree_hash(d)
    for mode in ((), ("--check",), ("--revert",)):
        r = run_script(d, *mode)
        assert r.returncode == 1, r.stdout
        assert "0.15.2" in r.stderr and SUPPORTED_MSG in r.stderr and len(r.stderr.splitlines()) == 1
        if kind == "git":
            assert "git describe: core_v0.15.0" in r.stderr
    assert tree_hash(d) == before


#: Another release of a supported line -> (the tested release whose tree stands in for it, kind).
#: 0.19.0 in the version file is the 0.19 line before its tag (the core_v0.19.0 tag's file says
#: 0.19.1); "git" trees carry the local commit too (so the 3-way path is taken) and a tag.
PATCH_RELEASES = {"0.16.0": ("core_v0.16.1", "plain"), "0.17.0": ("core_v0.17.1", "plain"),
                  "0.18.0": ("core_v0.18.2", "plain"), "0.18.1": ("core_v0.18.2", "git"),
                  "0.19.0": ("core_v0.19.0", "plain"), "0.19.2": ("core_v0.19.0", "git")}


@pytest.mark.parametrize("version", list(PATCH_RELEASES))
def test_patch_release_gets_its_lines_patch_set(mlm_trees, tmp_path, version):
    """A tree whose version file (or tag) says another release of a supported line is patched
    with that line's set, says so in its first line, applies (3-way on the git trees) and
    reverts byte for byte."""
    tag, kind = PATCH_RELEASES[version]
    d = mlm_trees.copy_as(tag, version, tmp_path / "Megatron-LM", kind)
    before = tree_hash(d)
    line = ".".join(version.split(".")[:2])
    r = run_script(d, "--check")
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    source = f"git describe: core_v{version}" if kind == "git" else f"package_info.py: {version}"
    assert first.startswith(f"Megatron-LM core_v{version} (") and source in first, first
    assert f"a patch release (or another commit) of the {line} line" in first and f"patches/{tag}/" in first
    assert states(r.stdout) == dict.fromkeys(targets(tag), "pending") and tree_hash(d) == before
    r = run_script(d)
    assert r.returncode == 0 and f"applied {len(PATCH_SETS[tag])} patch(es)" in r.stdout, r.stdout + r.stderr
    if kind == "git":
        assert f"{LOCAL_EDIT_FILE}: applied with git apply --3way" in r.stdout
    assert run_script(d, "--revert").returncode == 0 and tree_hash(d) == before


NEWEST = RELEASES[-1]
NEWEST_SET = PATCH_SET[NEWEST]


def test_new_minor_line_is_refused_and_force_tries_the_newest_set(mlm_trees, tmp_path):
    d = mlm_trees.copy_as(NEWEST, "0.21.0", tmp_path / "Megatron-LM")
    before = tree_hash(d)
    for mode in ((), ("--check",), ("--revert",)):
        r = run_script(d, *mode)
        assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stdout + r.stderr
        assert "0.21.0" in r.stderr and "the 0.21 line is newer" in r.stderr and SUPPORTED_MSG in r.stderr
        assert f"--force tries the newest patch set ({NEWEST_SET})" in r.stderr
    assert tree_hash(d) == before
    r = run_script(d, "--check", "--force")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("Megatron-LM core_v0.21.0 (") and \
        f"--force: trying the newest patch set patches/{NEWEST_SET}/" in r.stdout
    assert tree_hash(d) == before
    r = run_script(d, "--force")
    assert r.returncode == 0 and f"applied {len(PATCH_SETS[NEWEST])} patch(es)" in r.stdout, r.stderr
    assert run_script(d, "--revert").returncode == 1             # the same refusal without --force
    r = run_script(d, "--force", "--revert")
    assert r.returncode == 0 and tree_hash(d) == before


def test_force_is_all_or_nothing_and_only_for_newer_lines(mlm_trees, tmp_path):
    d = mlm_trees.copy_as(NEWEST, "0.21.0", tmp_path / "Megatron-LM", "git")
    f = d / "megatron/training/training.py"           # upstream moved the hook's context away
    f.write_text(f.read_text().replace("    timers('train/valid/test-data-iterators-setup').stop()\n",
                                       "    pass\n", 1))
    before = tree_hash(d)
    r = run_script(d, "--force")
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("apply_patches: megatron/training/training.py:")
    assert f"--force: the newest patch set ({NEWEST_SET}) does not fit core_v0.21.0" in r.stderr
    assert "Nothing was changed" in r.stderr and tree_hash(d) == before
    old = mlm_trees.copy_as("core_v0.16.1", "0.15.2", tmp_path / "old")
    r = run_script(old, "--force")
    assert r.returncode == 1 and "--force only tries the newest patch set" in r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_usage_with_force(tmp_path):
    assert run_script(tmp_path, "--check", "--revert").returncode == 2
    assert run_script(tmp_path, "--force", "--bogus").returncode == 2


@pytest.mark.parametrize("kind", ["plain", "git"])
def test_conflicting_local_edit_is_refused_naming_the_file(mlm_trees, tmp_path, kind):
    d = mlm_trees.copy("core_v0.19.0", tmp_path / "Megatron-LM", kind)
    f = d / "megatron/training/training.py"
    f.write_text(f.read_text().replace("    timers('train/valid/test-data-iterators-setup').stop()\n",
                                       "    pass\n", 1))
    before = tree_hash(d)
    r = run_script(d)
    assert r.returncode == 1
    assert states(r.stdout)["megatron/training/training.py"] == "conflict"
    assert r.stderr.startswith("apply_patches: megatron/training/training.py:") and SUPPORTED_MSG in r.stderr
    assert "Nothing was changed" in r.stderr and len(r.stderr.splitlines()) == 1
    assert tree_hash(d) == before
    r = run_script(d, "--check")
    assert r.returncode == 1 and states(r.stdout)["megatron/training/training.py"] == "conflict"


def test_release_from_git_describe_and_local_commits(mlm_trees, tmp_path):
    d = mlm_trees.copy("core_v0.17.1", tmp_path / "Megatron-LM", "git")
    git(d, "tag", "core_v0.17.1", "HEAD~1")
    r = run_script(d, "--check")
    assert r.returncode == 0 and re.search(r"Megatron-LM core_v0.17.1 \(git describe: core_v0.17.1-1-g", r.stdout)


def test_patch_dir_inside_another_git_repository(mlm_trees, tmp_path):
    """A plain tree inside some other repository is patched by its own paths."""
    git(tmp_path, "init", "-q")
    d = mlm_trees.copy("core_v0.16.1", tmp_path / "vendor", "plain")
    r = run_script(d)
    assert r.returncode == 0 and "applied 7 patch(es)" in r.stdout, r.stderr
    assert "megatron_mm_balance" in (d / "megatron/training/training.py").read_text()


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


def test_patched_megatron_imports_parses_and_validates(patched_v16):
    clone = patched_v16
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


@pytest.mark.parametrize("tag", RELEASES)
def test_multimodal_model_provider_accepts_what_get_model_passes(mlm_trees, tmp_path, tag):
    d = mlm_trees.copy(tag, tmp_path / "Megatron-LM")
    passed = _get_model_call_keywords(d / "megatron/training/training.py")
    assert {"config", "pg_collection", "vp_stage"} <= passed
    params, _ = _params(d / "examples/multimodal/model.py", "model_provider")
    # The bug at core_v0.16.1 (fixed upstream from core_v0.17.1 on, where the patch leaves
    # the signature alone).
    assert (passed <= params) == (tag != "core_v0.16.1")
    assert run_script(d).returncode == 0
    params, _ = _params(d / "examples/multimodal/model.py", "model_provider")
    assert passed <= params


@pytest.mark.parametrize("tag", RELEASES)
def test_moe_layer_spec_positional_order_in_each_release(mlm_trees, tag):
    """The model.py hunk calls the GPT layer-spec builders positionally (num_experts,
    moe_grouped_gemm, qk_layernorm): check that order in each release's source. From
    core_v0.17.1 on the *_spec functions forward *args to *_submodules."""
    src = mlm_trees.source(tag) / "megatron/core/models/gpt/gpt_layer_specs.py"
    text = next(p for p in PATCH_SETS[tag] if "multimodal" in p.name).read_text()
    if tag == "main-d98e8a64":      # the example builds MoE with TE itself; the CPU harness the local spec
        text = (ROOT / "megatron_mm_balance/testing/cpu_pretrain.py").read_text()
    assert "args.num_experts, args.moe_grouped_gemm, args.qk_layernorm" in text
    tree = ast.parse(src.read_text())
    fns = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in ("get_gpt_layer_local_spec", "get_gpt_layer_with_transformer_engine_spec"):
        fn = fns[name]
        if fn.args.vararg:        # def f(*args, **kwargs): return ModuleSpec(... f_submodules(*args, **kwargs))
            fn = fns[name.replace("_spec", "_submodules")]
        assert [a.arg for a in fn.args.args][:3] == ["num_experts", "moe_grouped_gemm", "qk_layernorm"], name


def test_moe_layer_spec_call_matches_megatron_core():
    """The model.py hunk calls the GPT layer-spec builders positionally; check the order."""
    import inspect
    pytest.importorskip("megatron.core", reason="megatron-core 0.16.1 not installed")
    from megatron.core.models.gpt import gpt_layer_specs as specs
    text = next(p for p in PATCHES if "multimodal" in p.name).read_text()
    assert "args.num_experts, args.moe_grouped_gemm, args.qk_layernorm" in text
    for fn in (specs.get_gpt_layer_local_spec, specs.get_gpt_layer_with_transformer_engine_spec):
        assert list(inspect.signature(fn).parameters)[:3] == ["num_experts", "moe_grouped_gemm", "qk_layernorm"]
    spec = specs.get_gpt_layer_local_spec(8, False, True)
    assert "MoE" in spec.submodules.mlp.module.__name__
