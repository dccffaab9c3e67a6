"""The pdserve router: tokenize, look up the global KV index, place, orchestrate, stream.

Torch-free and Ray-free: it runs as its own process (``python -m router.server``) and several
replicas can share one Redis. ``serve(config)`` lives in ``router.server``.
"""
