"""Opt-in test support: megatron-core on CPU over gloo (:mod:`.cpu_megatron`) and the
CPU training demo (:mod:`.train_demo`). Never imported by the package's normal path."""
