"""``python -m megatron_mm_balance.sim simulate ...`` (same as ``mm-balance simulate``)."""
import sys

from .cli import main

sys.exit(main())
