"""Constrained decoding (structured outputs): grammars compiled by llguidance, one matcher per
sequence, the token bitmask applied to the logits before sampling (docs/structured.md)."""
