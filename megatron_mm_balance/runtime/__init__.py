"""Runtime: the balanced data iterator (knows nothing of Megatron).

See :mod:`.iterator` for the life of a global batch, :mod:`.wire` for the pack
format, :mod:`.groups` for the exchange's process groups and :mod:`.device` for the CUDA
side stream; the cost functions live in :mod:`megatron_mm_balance.cost.pack`.

Names are resolved lazily: the cost functions and :mod:`.errors` import without
torch (the energon task encoder and the pure CLI use them), the rest on first use.
"""
import importlib

_HOME = {
    "BalancedDataIterator": ".iterator", "new_exchange_groups": ".groups",
    "plan_placement": "..solver.placement", "default_cost_fn": "..cost.pack",
    "ImageTokenCost": "..cost.pack", "ModelCost": "..cost.pack", "QwenVLCost": "..cost.pack",
    "QwenVLGridFeatures": "..cost.pack", "BalancerError": ".errors",
    "PeerFailure": ".errors", "InconsistentConfig": ".errors", "ExchangeThreadError": ".errors",
    "SourceExhausted": ".engine", "BalancerConfig": ".config", "SettingError": ".config", "BatchStats": ".stats",
    "plan_batch": ".planner",
}

__all__ = list(_HOME)


def __getattr__(name):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
