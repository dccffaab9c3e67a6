"""What every pdserve process needs to know about token sequences, torch-free.

The engine, the router, the KV index and the transfer headers must agree exactly on a few
things: how a prompt's blocks are hashed, what the sampling parameters mean, when a sequence
stops, and how token ids become text. Each lives here once, in stdlib-only modules (the
detokenizer takes any tokenizer object), so the router and the SDK-side tools can import them
without torch. Import submodules directly.
"""
