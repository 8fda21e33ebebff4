"""What the docs test reads from the Markdown pages: links, the commands and flags quoted in
code, headings; and what it checks them against: the files, the CLI's parsers, the scripts'
argparse definitions, the flag table and Bridge's config fields."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
NOTES = DOCS / "notes"

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
#: a date, or a run label (a bench's output directory: x8, hp2, gn1, ...), in a heading
DATED = re.compile(r"\b20\d\d-\d\d(-\d\d)?\b|\((?:x|hp|hq|gn|xm|g)\d+\b|\b(?:x|hp|hq|gn|xm)\d+\)")


def user_pages() -> list:
    """The pages a user reads: the README, benchmarks/README.md and docs/ outside docs/notes/."""
    return [REPO / "README.md", REPO / "benchmarks" / "README.md"] + sorted(p for p in DOCS.glob("*.md"))


def all_pages() -> list:
    return user_pages() + sorted(NOTES.glob("*.md"))


def _lines_outside_fences(text: str):
    inside = False
    for no, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        yield no, line, inside


def code_snippets(text: str, *, fenced_too: bool = False) -> list:
    """``[(line, snippet)]``: each line of a fenced block (backslash continuations joined) and
    each inline code span outside them; ``fenced_too``: ``[(line, snippet, fenced)]``."""
    out, pending, start = [], "", 0
    for no, line, fenced in _lines_outside_fences(text):
        if fenced:
            if not pending:
                start = no
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((start, pending + line, True))
            pending = ""
        else:
            out.extend((no, m.group(2), False) for m in INLINE.finditer(line))
    return out if fenced_too else [(no, s) for no, s, _ in out]


def links(text: str) -> list:
    """``[(line, target)]`` of the Markdown links and images outside code."""
    out = []
    for no, line, fenced in _lines_outside_fences(text):
        if not fenced:
            line = INLINE.sub("", line)
            out.extend((no, m.group(1) or m.group(2)) for m in LINK.finditer(line))
    return out


def headings(text: str) -> list:
    """``[(line, level, title)]`` outside code."""
    return [(no, len(m.group(1)), m.group(2)) for no, line, fenced in _lines_outside_fences(text)
            if not fenced and (m := HEADING.match(line))]


def slug(title: str) -> str:
    """GitHub's anchor of a heading: lower case, code marks and punctuation dropped, spaces to
    hyphens."""
    title = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", title.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\- ]", "", title))


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset:
    seen, out = {}, set()
    for _, _, title in headings(path.read_text(encoding="utf-8")):
        s = slug(title)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return frozenset(out)


DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
#: a note's file name carries its date: naming the note is no dated section
NOTE_PATH = re.compile(r"\S*notes/20\d\d-\d\d-\d\d[\w.-]*")


def dated_lines(text: str) -> list:
    """``[(line, text)]`` outside code that date what they say (a day's date: a release's month
    is no run's) and headings labelled with a run."""
    heads = {no for no, _, title in headings(text) if DATED.search(title)}
    return [(no, line.strip()[:100]) for no, line, fenced in _lines_outside_fences(text)
            if not fenced and (DATE.search(NOTE_PATH.sub("", line)) or no in heads)]


# -- what commands and flags exist -------------------------------------------------------------

@lru_cache(maxsize=None)
def cli_commands() -> dict:
    """``{command: {its option strings}}`` of ``mm-balance``."""
    from megatron_mm_balance.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}


OPTION = re.compile(r"""add_argument\(\s*((?:["']-[^"']+["']\s*,\s*)+)""")


@lru_cache(maxsize=None)
def source_options(path: Path) -> frozenset:
    """The option strings a Python file's argparse calls name (``add_argument("--x", "-y", ...)``);
    without argparse, the ``"--x"`` literals it compares its arguments with."""
    text = path.read_text(encoding="utf-8")
    if "add_argument(" not in text:                # a script reading sys.argv itself: its literals
        return frozenset(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", text))
    return frozenset(s for m in OPTION.finditer(text) for s in re.findall(r"""["'](-[^"']+)["']""", m.group(1)))


@lru_cache(maxsize=None)
def mm_balance_flags() -> frozenset:
    from megatron_mm_balance.megatron.config import flag_fields
    names = set()
    for _, spec in flag_fields():
        names.add(spec.name)
        if spec.negation:
            names.add(spec.negation[0])
    return frozenset(names)


@lru_cache(maxsize=None)
def bridge_fields() -> frozenset:
    from megatron_mm_balance.bridge.config import MMBalanceBridgeConfig
    props = {n for n, v in vars(MMBalanceBridgeConfig).items() if isinstance(v, property)}
    return frozenset({f.name for f in dataclasses.fields(MMBalanceBridgeConfig)} | props)


def module_path(module: str):
    """The file of a ``megatron_mm_balance`` module, or None."""
    base = REPO / Path(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py", base / "__main__.py"):
        if p.is_file():
            return p
    return None


# -- the checks of one snippet -----------------------------------------------------------------

MM_FLAG = re.compile(r"(?<![\w-])(--(?:no-)?mm-balance[a-z0-9-]*)")
BRIDGE_FIELD = re.compile(r"(?<![\w.])mm_balance\.([a-z_]+)")
SCRIPT = re.compile(r"(?<![\w./:-])((?:scripts|benchmarks)/[\w.-]+\.(?:sh|py))")
REPO_PATH = re.compile(r"^((?:megatron_mm_balance|configs|scripts|benchmarks|tests|patches|docs)/[\w./-]*[\w/])"
                       r"(?:::[\w.]+|:\d+)?$")
#: what separates two commands on a line; `` -- `` hands the rest to a wrapped command
SEPARATOR = re.compile(r"\s(?:&&|\|\||\||;|--)\s|;\s*$|[()]|\$\(|`")
#: words that run the command after them: (word, how many of its own arguments follow)
WRAPPERS = {"nice": None, "timeout": 1, "taskset": 2, "time": 0, "exec": 0, "$": 0, "env": 0, "sudo": 0}
#: modules run with ``python -m`` that are a ``mm-balance`` command
MODULE_COMMANDS = {"megatron_mm_balance.cli": None, "megatron_mm_balance.sim": "simulate"}


def commands_in(snippet: str) -> list:
    """The commands of a snippet, each as its words: environment assignments, wrappers
    (``nice -n 10``, ``timeout 600``) and a trailing comment left out."""
    out = []
    for part in SEPARATOR.split(snippet):
        words = part.split()
        if "#" in words:
            words = words[:words.index("#")]
        while words:
            if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
                words = words[1:]
            elif words[0] in WRAPPERS:
                n = WRAPPERS[words[0]]
                if n is None:                                       # nice [-n N]
                    n = 2 if len(words) > 1 and words[1] == "-n" else 0
                words = words[1 + n:]
            else:
                break
        if words:
            out.append(words)
    return out


def _flags(words) -> list:
    return [w.split("=", 1)[0] for w in words if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", w)]


def _mm_balance_problems(command: str, words: list, fenced: bool = True) -> list:
    commands = cli_commands()
    if command.endswith("-") or "*" in command:                    # mm-balance bench-*: a family
        return []
    if command not in commands:
        # in prose, "mm-balance NAME" also names other things (NVTX ranges): a command has options
        return [f"mm-balance {command}: no such command"] if fenced or _flags(words) else []
    known = set(commands[command])
    if command == "demo":          # the options it does not know go to the emulated training
        known |= source_options(REPO / "megatron_mm_balance" / "testing" / "train_demo.py")
    return [f"mm-balance {command} {f}: no such option" for f in _flags(words) if f not in known | {"--help"}]


def _script_options(path: Path) -> set:
    """A script's options, and those of the package module whose ``main`` it runs."""
    known = set(source_options(path))
    for module in re.findall(r"from (megatron_mm_balance[\w.]*) import main\b", path.read_text(encoding="utf-8")):
        if module_path(module) is not None:
            known |= source_options(module_path(module))
    return known | {"--help"}


def command_problems(words: list, fenced: bool = True) -> list:
    """What one command (:func:`commands_in`) names that does not exist (``fenced``: quoted in
    a code block, not in prose)."""
    first = words[0]
    if first == "mm-balance":
        return _mm_balance_problems(words[1], words[2:], fenced) if len(words) > 1 else []
    if first == "bash" and len(words) > 1:
        words = words[1:]
    elif re.fullmatch(r"(?:\S*/)?python3?(?:\.\d+)?", first) and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            module, rest = words[2], words[3:]
            if module in MODULE_COMMANDS:
                name = MODULE_COMMANDS[module] or (rest[0] if rest else "")
                rest = rest[1:] if rest and rest[0] == name else rest
                return _mm_balance_problems(name, rest) if name else []
            path = module_path(module) if module.startswith("megatron_mm_balance") else None
            if module.startswith("megatron_mm_balance") and path is None:
                return [f"python -m {module}: no such module"]
            if path is None:
                return []
            known = _script_options(path)
            return [f"python -m {module} {f}: no such option" for f in _flags(rest)
                    if f not in known and not MM_FLAG.fullmatch(f)]
        words = words[1:]
    path = words[0]
    if not re.fullmatch(r"(?:\./)?(?:scripts|benchmarks)/[\w.-]+\.(?:sh|py)", path):
        return []
    path = path.removeprefix("./")
    if not (REPO / path).is_file():
        return [f"{path}: no such file"]
    if path.endswith(".py"):
        known = _script_options(REPO / path)
        return [f"{path} {f}: no such option" for f in _flags(words[1:]) if f not in known]
    return []


def snippet_problems(snippet: str, fenced: bool = True) -> list:
    """What a quoted command or flag names that does not exist (one line each); ``fenced``: a
    line of a code block, not an inline span."""
    problems = []
    for flag in MM_FLAG.findall(snippet):
        if flag not in mm_balance_flags() and not flag.endswith("-"):
            problems.append(f"{flag}: no such flag in megatron/config.py's table")
    for name in BRIDGE_FIELD.findall(snippet):
        if name not in bridge_fields():
            problems.append(f"mm_balance.{name}: no such field of bridge/config.py's MMBalanceBridgeConfig")
    for path in SCRIPT.findall(snippet):
        if not (REPO / path).is_file():
            problems.append(f"{path}: no such file")
    for words in commands_in(snippet):
        problems += command_problems(words, fenced)
    m = REPO_PATH.match(snippet.strip())
    if m and not any(c in m.group(1) for c in "*<>{}") and not (REPO / m.group(1)).exists():
        problems.append(f"{m.group(1)}: no such path in the repository")
    return sorted(set(problems))
