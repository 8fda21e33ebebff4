"""The docs say only what exists: every relative link resolves (to a file, and to a heading
where it names one), every command and flag quoted in the README and docs/ exists (``mm-balance``
commands and their options, scripts and their options, ``--mm-balance*`` flags, Bridge's
``mm_balance.*`` fields), the reference page is what the code writes, and no user page (docs/
outside docs/notes/) carries a dated section."""
from __future__ import annotations

import pytest

import docs_check as dc
from megatron_mm_balance import reference

def _rel(page) -> str:
    return str(page.relative_to(dc.REPO))


def test_the_checks_see_the_pages_and_catch_what_does_not_exist():
    assert len(dc.user_pages()) >= 10
    found = [w for p in dc.all_pages() for _, s in dc.code_snippets(p.read_text(encoding="utf-8"))
             for w in dc.commands_in(s)]
    assert sum(w[0] == "mm-balance" for w in found) >= 50          # the docs quote commands, and they are read
    for snippet, problem in (
            ("mm-balance simulate mixed --dp 64 --no-such-flag", "mm-balance simulate --no-such-flag: no such option"),
            ("nice -n 10 mm-balance nope --x", "mm-balance nope: no such command"),
            ("python benchmarks/nothing.py", "benchmarks/nothing.py: no such file"),
            ("torchrun train.py --mm-balance-typo", "--mm-balance-typo: no such flag"),
            ("mm_balance.enabeld=true", "mm_balance.enabeld: no such field"),
            ("python benchmarks/crossover_gain.py OUT --warmpu 2", "crossover_gain.py --warmpu: no such option"),
            ("python -m megatron_mm_balance.nothing", "no such module"),
            ("megatron_mm_balance/solver/nothing.py", "no such path"),
            ("MEGATRON_LM_DIR=x bash scripts/nothing.sh --config y", "scripts/nothing.sh: no such file")):
        assert any(problem in p for p in dc.snippet_problems(snippet)), (snippet, dc.snippet_problems(snippet))
    for fine in ("mm-balance demo --steps 5 --microbatches 8", "python benchmarks/cpu_by_process.py -- mm-balance "
                 "bench-realpath --bridge D --modes off", "python -m megatron_mm_balance.sim simulate mixed --dp 8",
                 "BadPack: mm-balance refuses a pack", "mm_balance.timing_dir=DIR --mm-balance-timing-every 5"):
        assert dc.snippet_problems(fine) == [], fine
    assert dc.snippet_problems("mm-balance pull", fenced=False) == []          # prose: an NVTX range's name
    assert dc.snippet_problems("mm-balance pull") != []                        # a code block: a command


def test_every_quoted_command_and_flag_exists():
    problems = [f"{_rel(page)}:{no}: {p}" for page in dc.all_pages()
                for no, snippet, fenced in dc.code_snippets(page.read_text(encoding="utf-8"), fenced_too=True)
                for p in dc.snippet_problems(snippet, fenced)]
    assert not problems, "\n".join(problems)


def test_every_relative_link_resolves():
    problems = []
    for page in dc.all_pages():
        for no, target in dc.links(page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.append(f"{_rel(page)}:{no}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in dc.anchors(dest):
                problems.append(f"{_rel(page)}:{no}: {target}: no such heading in {dest.name}")
            elif anchor and page.parent == dc.DOCS and dest.parent == dc.NOTES:
                problems.append(f"{_rel(page)}:{no}: {target}: a user page links into the middle of a note")
    assert not problems, "\n".join(problems)


def test_every_benchmark_has_its_row_in_the_benchmarks_readme():
    text = (dc.REPO / "benchmarks" / "README.md").read_text(encoding="utf-8")
    rows = {w[1] for _, s in dc.code_snippets(text) for w in dc.commands_in(s) if w[0].startswith("python")}
    scripts = {f"benchmarks/{p.name}" for p in (dc.REPO / "benchmarks").glob("*.py")}
    assert scripts == rows, f"not listed: {sorted(scripts - rows)}; listed but gone: {sorted(rows - scripts)}"
    benches = {name for name in dc.cli_commands() if name.startswith("bench-")}
    listed = {w[1] for _, s in dc.code_snippets(text) for w in dc.commands_in(s) if w[0] == "mm-balance"}
    assert benches <= listed, f"commands not listed: {sorted(benches - listed)}"


def test_the_reference_is_what_the_code_writes():
    page = dc.DOCS / "reference.md"
    assert page.read_text(encoding="utf-8") == reference.render(), \
        "docs/reference.md is stale: run mm-balance reference --out docs/reference.md"


def test_the_telemetry_reference_names_exactly_the_fields_the_code_writes():
    from megatron_mm_balance.megatron.telemetry import summarize
    from megatron_mm_balance.megatron.timing import summarize_timings
    from megatron_mm_balance.runtime.stats import BatchStats
    from megatron_mm_balance.solver.placement import PlanStats, plan_placement
    import numpy as np
    costs = np.array([[5, 1], [1, 1]])
    plan = PlanStats.of(costs, plan_placement(costs))
    grouped = PlanStats.of(costs, plan_placement(costs), step_groups=(0, 1))
    entries = [BatchStats(0, 2, plan, nodes=2, inter_node_packs=1, inter_node_bytes_sent=10),
               BatchStats(1, 2, plan, mode="shadow"), BatchStats(2, 2, plan, mode="control"),
               BatchStats(3, 2, grouped, mode="shadow")]
    written = set(summarize(entries))
    assert written == set(reference.TELEMETRY)
    timing = summarize_timings([dict(images=[4], vision_forward_ms=1.0, vision_backward_ms=2.0,
                                     lm_forward_ms=3.0, lm_backward_ms=4.0)])
    assert set(timing) == set(reference.TIMING_TELEMETRY)


def test_no_user_page_has_a_dated_section():
    dated = {page.name: found[:3] for page in dc.user_pages()
             if (found := dc.dated_lines(page.read_text(encoding="utf-8")))}
    assert not dated, f"dated sections in user pages (a dated finding goes to docs/notes/): {dated}"


def test_every_note_has_its_line_in_the_index_and_a_dated_name():
    index = (dc.NOTES / "README.md").read_text(encoding="utf-8")
    listed = {target for _, target in dc.links(index) if not target.startswith("..")}
    notes = {p.name for p in dc.NOTES.glob("*.md")} - {"README.md"}
    assert notes == listed, f"not in docs/notes/README.md: {sorted(notes - listed)}; listed but gone: {sorted(listed - notes)}"
    undated = sorted(n for n in notes if not dc.NOTE_PATH.fullmatch("notes/" + n))
    assert not undated, f"a note is named YYYY-MM-DD-topic.md: {undated}"


@pytest.mark.parametrize("text, dated", [
    ("## The quiet-machine measurement (2026-12-02)", True),
    ("### Packs and frames inside the same jobs (x8, x9)", True),
    ("| a later run (2026-12-03, `--out /tmp/x/out`) | +4% |", True),
    ("| `core_v0.16.1` (2026-03) | patches |", False),
    ("## Install", False),
    ("```\n# run 2026-12-03\n```", False),
    ("the earlier figures are in docs/notes/2026-12-06-first-gpu-run.md.", False),
])
def test_what_counts_as_dated(text, dated):
    assert bool(dc.dated_lines(text)) is dated
