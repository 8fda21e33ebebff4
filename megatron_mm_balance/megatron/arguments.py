"""The ``--mm-balance`` command-line flags, in Megatron-LM style.

Registered two ways, both ending in :func:`add_mm_balance_args`:

* the ``patches/`` diff to ``megatron/training/arguments.py`` calls it from
  ``add_megatron_arguments``, so every Megatron entry point knows the flags;
* on an unpatched checkout a training script passes it (or
  :func:`with_mm_balance_args` chaining the script's own provider) as
  ``pretrain(..., extra_args_provider=...)``.

Registering twice is harmless: the second call sees ``--mm-balance`` and returns.
The flags themselves (names, defaults, help, choices) are the table in
:mod:`.config`: one :class:`~.config.MMBalanceConfig` field per flag; this module
only turns the table into argparse arguments.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

from .config import flag_fields


def add_mm_balance_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``mm-balance`` argument group to ``parser`` and return the parser."""
    if "--mm-balance" in parser._option_string_actions:  # already registered (patch + provider)
        return parser
    group = parser.add_argument_group(title="mm-balance (image-token load balancing)")
    for f, spec in flag_fields():
        if spec.type is None:            # a boolean switch: on by its flag, off by its negation
            group.add_argument(spec.name, dest=spec.dest, action="store_true", default=f.default,
                               help=spec.help)
            if spec.negation is not None:
                neg, neg_help = spec.negation
                group.add_argument(neg, dest=spec.dest, action="store_false", help=neg_help)
            continue
        group.add_argument(spec.name, dest=spec.dest, type=spec.type, choices=spec.choices,
                           default=f.default, help=spec.help, metavar=spec.metavar)
    return parser


def with_mm_balance_args(provider: Optional[Callable] = None) -> Callable:
    """Chain ``provider`` (a script's own ``extra_args_provider``) with ours.

    ``pretrain(..., extra_args_provider=with_mm_balance_args(add_multimodal_extra_args))``.
    """
    def _provider(parser):
        if provider is not None:
            parser = provider(parser)
        return add_mm_balance_args(parser)
    _provider.__name__ = f"with_mm_balance_args({getattr(provider, '__name__', provider)})"
    return _provider
