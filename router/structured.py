"""Structured-output constraints checked by the router before it places a request (torch-free).

The router compiles a constraint exactly as the nodes will (tokens/grammar.py: the same
grammar text, parser limits, compile-time bound and caches; llguidance, which needs no torch)
against its own copy of the model's tokenizer, so a schema with an unsupported construct, a
syntax error, or one that compiles too slowly is refused with INVALID_ARGUMENT / HTTP 400
naming it, before any node sees it. Nodes compile again (engine/structured/), from their own
cache: the router's check is the early answer, not the only guard. The cache bounds how many
compiles run at once (RequestValidator gives it RouterConfig's max_concurrent_compiles and
compile_wait_s: past them GrammarBusy, a 429) and how many bytes of specs it keeps.
"""
from __future__ import annotations

import threading

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from router.tokenizer import PromptTokenizer
from tokens.grammar import PARSER_LIMITS, GrammarCache, to_llguidance
from tokens.sampling_params import StructuredOutput


def _compile(tokenizer: llguidance.LLTokenizer, so: StructuredOutput) -> bool:
    # As engine/structured/compiler.py new_matcher: the grammar, then its first mask.
    m = llguidance.LLMatcher(tokenizer, to_llguidance(so, any_to_lark), log_level=0,
                             limits=llguidance.LLParserLimits(**PARSER_LIMITS))
    if not m.is_error():
        m.compute_bitmask()
    if m.is_error():
        raise ValueError(m.get_error())
    return True


class StructuredChecker:
    """``check(so)``: None, or tokens.grammar.GrammarError (a ValueError; ``field`` "structured") naming what
    was refused. Compiled specs are remembered (LRU), refused ones too. Thread-safe; llguidance's
    tokenizer is built on the first constraint (~0.3 s), not at router start."""

    def __init__(self, tokenizer: PromptTokenizer, vocab_size: int | None = None,
                 cache: GrammarCache | None = None) -> None:
        self._source = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.cache: GrammarCache = cache if cache is not None else GrammarCache()
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self._source.to_json(), n_vocab=self.vocab_size,
                                                         eos_token=list(self._source.eos_token_ids) or None)
            return self._tokenizer

    def check(self, so: StructuredOutput) -> None:
        tok = self._ll_tokenizer()
        self.cache.get((so.kind, so.spec, so.strict), lambda: _compile(tok, so))


def check_structured(structured: StructuredOutput | None, checker: StructuredChecker) -> None:
    """The router's check before dispatch (router/validation.py): GrammarError when refused."""
    if structured is not None:
        checker.check(structured)
