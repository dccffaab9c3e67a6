"""The global KV-block index and node registry in Redis.

Nodes publish through ``kv_index.publisher.NodePublisher``; routers (any number of replicas,
all reading the same keys) read through ``kv_index.reader.IndexReader``; ``kv_index.schema``
holds the key layout (compact buckets under one hash tag), ``kv_index.scripts`` the server-side
scripts; ``kv_index.nodes`` the plain data both sides
exchange (``NodeInfo``, ``StepReport``, ``Role``), importable without redis. A router looks
prefixes up in its own copy (``kv_index.local_index``), fed by the index's event stream
(``kv_index.event_feed``).

The index is a hint: a stale entry costs a cache miss on the chosen node (which verifies
tokens before reusing a block), never a wrong answer. Torch-, Ray- and gRPC-free.
"""
