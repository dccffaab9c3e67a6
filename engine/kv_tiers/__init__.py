"""Tiers below the device pool: a host tier (pinned host memory on CUDA, a DRAM budget of its own
on CPU) and an optional disk tier (a directory with a byte budget). docs/engine.md, "KV tiers",
has the design; ``tiers.py`` the coordinator, ``build.py`` how an engine makes one.

The bookkeeping modules (``host.py``, ``disk.py``, ``block_file.py``, ``tiers.py``,
``worker.py``, ``stats.py``) import no torch; the tensors live in ``mover.py``.
"""
