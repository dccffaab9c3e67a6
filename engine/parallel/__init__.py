"""Tensor parallelism inside one engine: Megatron-style shards of the Llama-family model over a
gloo group on loopback, rank 0 scheduling and broadcasting each step (docs/engine.md)."""
