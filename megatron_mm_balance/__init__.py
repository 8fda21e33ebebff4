"""megatron-mm-balance: image-token load balancing for Megatron-LM VLM (and MoE) pretraining.

Layers, bottom up:

* pure algorithms, no torch.distributed: :mod:`.traces`, :mod:`.mixtures`,
  :mod:`.packing`, :mod:`.cost`, :mod:`.placement`;
* the runtime that swaps packs between data-parallel ranks: :mod:`.runtime`
  (``BalancedDataIterator``), which knows nothing of Megatron;
* the simulator: :mod:`.sim`;
* the thin Megatron-LM glue: :mod:`.megatron`.
"""
__version__ = "0.1.0"

__all__ = ["BalancedDataIterator", "solve_placement", "pack_greedy", "__version__"]


def __getattr__(name):
    # Lazy: importing the package must not import torch (the CLI's pack/place
    # commands and the simulator run without it).
    if name == "BalancedDataIterator":
        from .runtime import BalancedDataIterator
        return BalancedDataIterator
    if name == "solve_placement":
        from .placement import solve_placement
        return solve_placement
    if name == "pack_greedy":
        from .packing import pack_greedy
        return pack_greedy
    raise AttributeError(f"module 'megatron_mm_balance' has no attribute {name!r}")
