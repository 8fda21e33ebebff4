"""Data: samples and traces, synthetic mixtures, packing, and the example dataset writer.

* :mod:`.traces` — :class:`~.traces.Sample` and trace files (the bundled real AI2D and
  ChartQA tile statistics live beside it as JSON);
* :mod:`.mixtures` — named synthetic mixtures built from documented shapes;
* :mod:`.packing` — greedy best-fit packing of whole samples into fixed-length packs;
* :mod:`.make_dataset` — ``mm-balance make-dataset``: a small energon VLM dataset.
"""
