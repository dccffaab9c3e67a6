"""pdserve's model core: paged KV cache, Llama-family model, sampler, scheduler, engine.

Importing this package must stay cheap and torch-free: the router imports
``tokens.block_hash`` and must not pull torch in. Import submodules directly.
"""
