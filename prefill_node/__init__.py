"""Prefill role: a node that prefills prompts and streams their KV to decode nodes."""
