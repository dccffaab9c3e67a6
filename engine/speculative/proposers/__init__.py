"""Speculative-decoding proposers (decode role), built from ``EngineConfig.speculative``.

The engine runs the mechanism and takes the proposer through ``LLMEngine(proposer_factory=
build_proposer)``; each method's module exposes ``from_engine(engine) -> Proposer``.
"""
from __future__ import annotations

import importlib

# method -> module in this package
PROPOSERS: dict[str, str] = {
    "ngram": "ngram",
    "draft": "draft_model",
    "early_exit": "early_exit",
    "low_precision": "low_precision",
    "medusa": "heads",
    "eagle": "eagle",
}


def build_proposer(engine):
    method = engine.config.speculative.method
    if method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {method!r}; known: off, {', '.join(sorted(PROPOSERS))}")
    return importlib.import_module(f"engine.speculative.proposers.{PROPOSERS[method]}").from_engine(engine)
