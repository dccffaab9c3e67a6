"""Decode role: a node that receives prompt KV, decodes and streams tokens back."""
