"""Constraints compiled for one engine's tokenizer: llguidance behind tokens.grammar's cache
and bounds (the router compiles the same grammar with the same limits: router/structured.py)."""
from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from tokens.grammar import PARSER_LIMITS, GrammarCache, GrammarError, to_llguidance
from tokens.sampling_params import StructuredOutput


def new_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """Compile ``grammar`` into a matcher in its start state, or raise ValueError with
    llguidance's message. The first mask is part of the compile: it builds the lexer's first
    states, which every copy of the matcher shares."""
    m = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits(**PARSER_LIMITS))
    if not m.is_error():
        m.compute_bitmask()
    if m.is_error():
        raise ValueError(m.get_error())
    return m


class GrammarCompiler:
    """``matcher(so)``: a fresh matcher for a constraint, compiled once per (kind, spec,
    strict) for this tokenizer and copied after that (copies share the compiled lexer)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, cache: GrammarCache | None = None) -> None:
        self.tokenizer = tokenizer
        self.cache: GrammarCache = cache if cache is not None else GrammarCache()

    @classmethod
    def from_hf(cls, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                cache: GrammarCache | None = None) -> GrammarCompiler:
        """From a transformers fast tokenizer; masks are ``vocab_size`` wide (the model's
        logits, which may be wider than the tokenizer: those ids are never allowed)."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow (Python) tokenizer: llguidance reads tokenizer.json
            raise GrammarError("structured outputs need a fast tokenizer (tokenizer.json); this model's is slow")
        # The backend's JSON carries the added tokens; padding and truncation must not apply to
        # llguidance's tokenizing (llguidance.hf copies the whole tokenizer for that: ~1 s).
        text = backend.to_str()
        if backend.padding is not None or backend.truncation is not None:
            spec = json.loads(text)
            spec["padding"] = spec["truncation"] = None
            text = json.dumps(spec)
        tok = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        return cls(tok, cache)

    def compile(self, so: StructuredOutput) -> llguidance.LLMatcher:
        """The template matcher (never advance it: take ``matcher``); GrammarError when the
        constraint is refused or over a bound."""
        tok = self.tokenizer
        return self.cache.get((so.kind, so.spec, so.strict), lambda: new_matcher(tok, to_llguidance(so, any_to_lark)))

    def matcher(self, so: StructuredOutput) -> llguidance.LLMatcher:
        return self.compile(so).deep_copy()


class LazyCompiler:
    """A GrammarCompiler built on first use (llguidance's tokenizer takes ~0.3 s to build:
    engines that never see a constraint never pay it). Thread-safe: node servers compile on
    their own threads before the engine thread adds the request."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 cache: GrammarCache | None = None) -> None:
        self._args = (hf_tokenizer, vocab_size, tuple(eos_token_ids), cache)
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None

    def get(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                hf, vocab, eos, cache = self._args
                if hf is None:
                    raise GrammarError("structured outputs need the model's tokenizer; this engine has none")
                self._compiler = GrammarCompiler.from_hf(hf, vocab, eos, cache)
            return self._compiler
