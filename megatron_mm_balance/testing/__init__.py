"""Opt-in test support: megatron-core on CPU over gloo (:mod:`.cpu_megatron`) and the
CPU training demo (:mod:`.train_demo`), the demo's real-compute part (:mod:`.real_demo`) and
where the Megatron-LM trees come from (:mod:`.megatron_tree`). Never imported by the
package's normal path."""
