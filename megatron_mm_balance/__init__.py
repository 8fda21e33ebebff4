"""megatron-mm-balance: image-token load balancing for Megatron-LM VLM (and MoE) pretraining.

Layers, bottom up (each imports only from the layers above it in this list):

* pure algorithms, no torch.distributed: :mod:`.data` (samples, traces, mixtures,
  packing), :mod:`.solver` (the placement of a global batch), :mod:`.cost` (what a
  pack costs, as integers);
* the runtime that swaps packs between data-parallel ranks: :mod:`.runtime`
  (``BalancedDataIterator``), which knows nothing of Megatron;
* the simulator: :mod:`.sim`; the benchmarks the CLI runs: :mod:`.bench`;
* the thin Megatron-LM glue: :mod:`.megatron`;
* the opt-in CPU harness for tests and the demo: :mod:`.testing`;
* the command line: :mod:`.cli`.
"""
__version__ = "0.1.0"

__all__ = ["BalancedDataIterator", "plan_placement", "pack_greedy", "__version__"]


def __getattr__(name):
    # Lazy: importing the package must not import torch (the CLI's pack/place
    # commands and the simulator run without it).
    if name == "BalancedDataIterator":
        from .runtime import BalancedDataIterator
        return BalancedDataIterator
    if name == "plan_placement":
        from .solver.placement import plan_placement
        return plan_placement
    if name == "pack_greedy":
        from .data.packing import pack_greedy
        return pack_greedy
    raise AttributeError(f"module 'megatron_mm_balance' has no attribute {name!r}")
