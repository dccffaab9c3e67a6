"""Trace replay: a simulator of the prefill/decode cluster (simulator.py) that runs the router's
real placement policies against the real Redis index, the published policies it is compared
with (baselines.py), the LRU block cache of nodes and approximate trees (lru.py), and trace
loading (traces.py).

Benchmarks (``pdserve bench router``) and tests use it; the serving path never imports it (a
test over the import graph checks that).
"""
