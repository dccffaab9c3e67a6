"""The pdserve router: tokenize, look up the global KV index, place, orchestrate, stream.

Torch-free and Ray-free: it runs as its own process (``python -m frontend.server``) and several
replicas can share one Redis. ``serve(config)`` lives in ``frontend.server``.
"""
