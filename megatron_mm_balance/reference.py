"""The reference page (``docs/reference.md``), written from the code so that it cannot drift.

* Megatron-LM's ``--mm-balance*`` flags: the flag table, :class:`~.megatron.config.MMBalanceConfig`;
* Megatron-Bridge's ``mm_balance.*`` fields: :class:`~.bridge.config.MMBalanceBridgeConfig`,
  each with the ``#:`` comment above it;
* the telemetry: the fields of the ``[mm-balance]`` line and ``mm-balance/*`` scalars
  (:func:`~.megatron.telemetry.summarize`) and of the ``[mm-balance-timing]`` line and
  ``mm-balance-timing/*`` scalars (:func:`~.megatron.timing.summarize_timings`), with their
  meanings here (:data:`TELEMETRY`, :data:`TIMING_TELEMETRY`; a test checks these are exactly
  the fields the code writes);
* every ``mm-balance`` command with its options (the CLI's own parsers).

``mm-balance reference --out docs/reference.md`` writes it; the docs test checks the committed
page is what this writes.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
from typing import Dict, List

#: the ``[mm-balance]`` line's fields and ``mm-balance/<field>`` scalars, what each measures
TELEMETRY: Dict[str, str] = {
    "global_batches": "global batches this line covers",
    "num_microbatches": "micro-batches per rank per global batch (mean)",
    "cost_step_max_before": "mean over the covered micro-steps of the micro-step's cost (its costliest "
                            "micro-batch across the ranks), as drawn",
    "cost_step_max_after": "the same, as trained",
    "cost_step_mean": "mean over the covered micro-steps of the mean micro-batch cost (the same before and after)",
    "imbalance_before": "`cost_step_max_before / cost_step_mean`: how much longer than even a micro-step is "
                        "(1.0: every micro-step even); what `--mm-balance-sync microstep` minimises",
    "imbalance_after": "the same, as trained",
    "rank_imbalance_before": "the heaviest rank's total cost over the mean rank total (1.0: every rank's total "
                             "even); what `--mm-balance-sync step` evens",
    "rank_imbalance_after": "the same, as trained",
    "packs_moved": "packs trained on another rank than the one that drew them, whole group, per global batch "
                   "(0 in shadow mode)",
    "nodes": "nodes the data-parallel group spans; this and the two `inter_node_*` fields appear only where "
             "the nodes are known",
    "inter_node_packs": "of the moved packs, those that changed node, whole group, per global batch",
    "step_groups": "the job's per-micro-step meeting groups in the data-parallel group (its expert-parallel "
                   "groups); this and the three fields below appear only where they split the group",
    "group_cost_before": "the group objective per micro-step, as drawn: the slowest meeting group's sum of "
                         "its per-micro-step maxima (what `auto` sync minimises under expert parallelism)",
    "group_cost_after": "the same, as trained",
    "inter_group_packs": "of the moved packs, those that changed meeting group, whole group, per global batch",
    "inter_group_packs_would_move": "shadow mode: the packs the plan would move to another meeting group, "
                                    "per global batch",
    "packs_sent": "this rank: packs it sent to peers, per global batch",
    "packs_received": "this rank: packs it received from peers, per global batch",
    "bytes_sent": "this rank: bytes it sent on the exchange group (records, headers, tensor data), per global "
                  "batch",
    "bytes_received": "this rank: bytes it received, per global batch",
    "inter_node_bytes_sent": "this rank: bytes it sent to a rank on another node, per global batch",
    "allgather_ms": "the cost all-gather, with the wait for the slowest peer, per global batch",
    "solver_ms": "the planner, per global batch",
    "exchange_ms": "the point-to-point steps, with the waits for peers, per global batch",
    "exchange_cpu_ms": "CPU time of the thread that pulled, agreed, planned and exchanged the batch (the "
                       "background thread with overlap), per global batch",
    "consumer_wait_ms": "how long the training loop's `next()` blocked, per global batch: the exposed part "
                        "of balancing",
    "consumer_wait_first_ms": "the same, at a global batch's first micro-batch",
    "prefetched": "share of global batches pulled and planned before the training loop asked for them",
    "packs_would_move": "shadow mode: packs the plan would move, per global batch",
    "cost_step_max_would_be": "shadow mode: `cost_step_max_after` of the plan not delivered",
    "imbalance_would_be": "shadow mode: `imbalance_after` of the plan not delivered",
    "rank_imbalance_would_be": "shadow mode: `rank_imbalance_after` of the plan not delivered",
    "gain_would_be": "shadow mode: share of the summed micro-step cost the plan would save, "
                     "`1 - cost_step_max_would_be / cost_step_max_before`",
    "control": "control mode: 1 (every rank kept its own packs, reordered across micro-steps)",
    "packs_reordered": "control mode: slots (whole group) that trained a pack at another micro-step than "
                       "the one it was drawn for, per global batch",
}

#: the ``[mm-balance-timing]`` line's fields and ``mm-balance-timing/<field>`` scalars
TIMING_TELEMETRY: Dict[str, str] = {
    "vision_forward_ms": "the vision encoder's forward, per micro-batch (mean over the interval, this rank)",
    "vision_backward_ms": "the vision encoder's backward, per micro-batch",
    "lm_forward_ms": "the language model's forward, per micro-batch (under expert parallelism with the wait "
                     "for the other ranks inside its all-to-alls)",
    "lm_backward_ms": "the language model's backward, per micro-batch",
    "vision_share": "the vision encoder's share of the micro-batch's timed compute",
    "image_tokens": "image tokens per micro-batch",
    "microbatches": "micro-batches timed in the interval",
}


def _md(text) -> str:
    """One table cell: reStructuredText's literals and roles as Markdown code, no bar or newline."""
    text = re.sub(r":[a-z]+:`~?\.?([^`]*)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", str(text))
    return text.replace("``", "`").replace("|", "\\|").replace("\n", " ")


def _help(text: str, default) -> str:
    return (text or "").replace("%(default)s", str(default)).replace("%%", "%")


def flag_rows() -> List[tuple]:
    """``(flag, default, help)`` of every ``--mm-balance*`` flag, in table order."""
    from .megatron.config import flag_fields
    rows = []
    for f, spec in flag_fields():
        name = spec.name
        if spec.choices:
            name += " {" + ",".join(spec.choices) + "}"
        elif spec.type is not None:
            name += f" {spec.metavar or {int: 'N', float: 'X'}.get(spec.type, 'VALUE')}"
        default = "off" if f.default is False else "on" if f.default is True else f.default
        rows.append((name, "—" if default is None else default, _help(spec.help, f.default)))
        if spec.negation is not None:
            rows.append((spec.negation[0], "", spec.negation[1]))
    return rows


def field_comments(cls) -> Dict[str, str]:
    """The ``#:`` comment lines above each field of dataclass ``cls``, joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above, k = [], node.lineno - 2
            while k >= 0 and lines[k].strip().startswith("#:"):
                above.insert(0, lines[k].strip()[2:].strip())
                k -= 1
            out[node.target.id] = " ".join(above)
    return out


def bridge_rows() -> List[tuple]:
    """``(mm_balance.field, default, comment)`` of every Megatron-Bridge ``mm_balance`` field."""
    from .bridge.config import MMBalanceBridgeConfig
    comments = field_comments(MMBalanceBridgeConfig)
    def shown(value):
        return "—" if value is None else str(value).lower() if isinstance(value, bool) else value
    return [(f"mm_balance.{f.name}", shown(f.default), comments.get(f.name, ""))
            for f in dataclasses.fields(MMBalanceBridgeConfig)]


def commands() -> List[tuple]:
    """``(name, help, [(option, help)])`` of every ``mm-balance`` command."""
    from .cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    out = []
    for name, p in sub.choices.items():
        options = []
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            names = ", ".join(a.option_strings) if a.option_strings else (a.metavar or a.dest.upper())
            if a.choices and a.option_strings:
                names += " {" + ",".join(str(c) for c in a.choices) + "}"
            text = _help(a.help, a.default)
            if not text and a.default not in (None, False, argparse.SUPPRESS) and a.option_strings:
                text = f"default {a.default}"
            options.append((names, text))
        out.append((name, helps.get(name, ""), options))
    return out


def render() -> str:
    """The whole page (Markdown)."""
    out = ["# Reference", "",
           "Written from the code by `mm-balance reference --out docs/reference.md`; a test checks it is "
           "current. Guides: [Megatron-LM](megatron.md), [Megatron-Bridge](bridge.md).", "",
           "## Megatron-LM flags", "",
           "| flag | default | what it does |", "|---|---|---|"]
    out += [f"| `{_md(n)}` | {_md(d)} | {_md(h)} |" for n, d, h in flag_rows()]
    out += ["", "## Megatron-Bridge: `cfg.mm_balance`", "",
            "The same settings as the flags, as fields of the `mm_balance` section of Bridge's config "
            "(recipe code, YAML or Hydra overrides such as `mm_balance.enabled=true`).", "",
            "| field | default | what it does |", "|---|---|---|"]
    out += [f"| `{_md(n)}` | {_md(d)} | {_md(h)} |" for n, d, h in bridge_rows()]
    out += ["", "## Telemetry", "",
            "Every `--mm-balance-log-interval` iterations one `[mm-balance] iteration N | field: value | ...` "
            "line, and `mm-balance/<field>` TensorBoard and W&B scalars. Costs are in the cost's unit (image "
            "tokens, or microseconds with a cost model); \"before\" is the order the packs were drawn in, "
            "\"after\" the order they were trained in.", "",
            "| field | what it measures |", "|---|---|"]
    out += [f"| `{k}` | {_md(v)} |" for k, v in TELEMETRY.items()]
    out += ["", "With `--mm-balance-timing` (Bridge: `mm_balance.timing`), per log interval one "
            "`[mm-balance-timing] iteration N | ...` line and `mm-balance-timing/<field>` scalars:", "",
            "| field | what it measures |", "|---|---|"]
    out += [f"| `{k}` | {_md(v)} |" for k, v in TIMING_TELEMETRY.items()]
    out += ["", "## Commands", ""]
    for name, help_, options in commands():
        out += [f"### `mm-balance {name}`", "", _md(help_) + ("." if help_ and not help_.endswith(".") else ""),
                "", "| option | what it does |", "|---|---|"]
        out += [f"| `{_md(o)}` | {_md(h)} |" for o, h in options]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def cmd(a) -> int:
    text = render()
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {a.out}")
    else:
        print(text, end="")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("reference", help="print (or --out FILE: write) the reference of every flag, "
                              "Bridge field, telemetry field and command, from the code")
    p.add_argument("--out", default=None, metavar="FILE", help="write it to FILE (docs/reference.md)")
    p.set_defaults(func=cmd)
