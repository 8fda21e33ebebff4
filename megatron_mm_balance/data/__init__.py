"""Data: samples and traces, synthetic mixtures, packing, and the example dataset writer.

* :mod:`.traces` — :class:`~.traces.Sample` and trace files (the bundled real AI2D and
  ChartQA tile statistics live beside it as JSON);
* :mod:`.mixtures` — named synthetic mixtures built from documented shapes;
* :mod:`.packing` — greedy best-fit packing of whole samples into fixed-length packs;
* :mod:`.make_dataset` — ``mm-balance make-dataset``: a small energon VLM dataset.
* :mod:`.native_res` — the native-resolution mix: per sample its Qwen-VL grids and text
  length (``make-dataset --format bridge-qwen-vl --mix native-res`` and the simulator).
"""
