"""Benchmarks the CLI runs (``mm-balance bench-*``); the ones run as scripts are in ``benchmarks/``."""
