"""Stand-ins for GPU-only modules so megatron/training/*.py imports on a CPU machine.

Megatron-LM 0.16.1's ``megatron/training/initialize.py`` imports
``enable_batch_invariant_mode`` from a module that imports ``triton`` at module
level. On a CPU-only machine without triton, :func:`install` registers that one
kernel module as a stub (its names are no-op callables), so the *real*
training.py, arguments.py and data_samplers.py import and parse. Nothing here
runs a kernel; only the import-and-parse checks use it.
"""
import importlib.util
import sys
import types

KERNELS = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def _unavailable(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} is a CPU-test stub (triton not installed)")
        return _unavailable


def install() -> list:
    """Stub the triton-only kernel module when triton is missing; return what was stubbed."""
    if importlib.util.find_spec("triton") is not None or KERNELS in sys.modules:
        return []
    sys.modules[KERNELS] = _Stub(KERNELS)
    return [KERNELS]
