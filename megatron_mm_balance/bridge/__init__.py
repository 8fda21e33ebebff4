"""Thin Megatron-Bridge glue for image-token load balancing (``mm_balance.enabled=true``).

Modules, each importable without Megatron-Bridge (it is imported inside functions):

* :mod:`.config` — ``MMBalanceBridgeConfig``: the ``mm_balance`` field of Bridge's
  ``ConfigContainer`` (overrides ``mm_balance.enabled=true``, ``mm_balance.mode=shadow``...);
* :mod:`.iterator` — ``wrap_train_data_iterator``: the hook the setup.py patch calls; it
  hands Bridge's train iterator to the core package's exchange coordinator;
* :mod:`.model_spec` — ``ModelSpec``: Bridge's model config, read once into the description
  of the vision tower and the model that the other modules take;
* :mod:`.timing` — the core package's per-micro-batch timing hooks on Bridge's Qwen3-VL model
  (``mm_balance.timing``, ``timing_dir``; ``cost=auto`` fits them);
* :mod:`.dataset` — ``make-dataset --format bridge-qwen-vl``;
* :mod:`.native_dataset` — its ``--mix native-res`` (images, documents, videos, text);
* :mod:`.bench` — ``bench-realpath --bridge``: the bench's Megatron-Bridge framework;
* :mod:`.run` — a pretraining entry point (recipe function + YAML + overrides -> ``pretrain()``).
"""

__all__ = ["wrap_train_data_iterator", "MMBalanceBridgeConfig"]


def __getattr__(name):
    # Lazy: the config module imports no torch/Bridge; the iterator imports them on use.
    if name == "wrap_train_data_iterator":
        from .iterator import wrap_train_data_iterator
        return wrap_train_data_iterator
    if name == "MMBalanceBridgeConfig":
        from .config import MMBalanceBridgeConfig
        return MMBalanceBridgeConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
