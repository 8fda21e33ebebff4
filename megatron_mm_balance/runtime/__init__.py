"""Runtime: the balanced data iterator (knows nothing of Megatron).

See :mod:`.iterator` for the life of a global batch, :mod:`.wire` for the pack
format, :mod:`.groups` for the exchange's process groups, :mod:`.costs` for the
default cost function and :mod:`.device` for the CUDA side stream.
"""
from .costs import ImageTokenCost, default_cost_fn
from .engine import SourceExhausted, plan_placement
from .errors import BalancerError, ExchangeThreadError, InconsistentConfig, PeerFailure
from .groups import new_exchange_groups
from .iterator import BalancedDataIterator

__all__ = ["BalancedDataIterator", "new_exchange_groups", "plan_placement", "default_cost_fn",
           "ImageTokenCost", "BalancerError", "PeerFailure", "InconsistentConfig",
           "ExchangeThreadError", "SourceExhausted"]
