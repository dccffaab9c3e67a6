"""pdserve's model core, one model in one process: paged KV cache, Llama-family model, sampler,
scheduler, engine, speculation loop. What the router shares with it (block hashes, sampling
parameters, the stop rule, the detokenizer) lives in ``tokens/``. Import submodules directly.
"""
