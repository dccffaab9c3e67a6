"""Constraints compiled for one engine's tokenizer: llguidance behind tokens.grammar's cache
and bounds (the router compiles the same grammar with the same limits: router/structured.py).

The cache is bounded by bytes as well as by count: a compiled matcher lives in llguidance's
native memory, from a few KB for a small schema to ~20 MB for one with hundreds of integer
ranges (its lexer's first states), so 128 of them could hold gigabytes. Python cannot see that
memory, so each compile's is measured as the growth of glibc's allocated bytes across it
(``mallinfo2``: allocated, not resident, so freed memory reused does not hide it). Other threads
allocating meanwhile make it an estimate; lexer states built later, as the matcher is used,
are not counted.
"""
from __future__ import annotations

import ctypes
import json
import threading
from collections.abc import Sequence

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from tokens.grammar import PARSER_LIMITS, GrammarCache, GrammarError, to_llguidance
from tokens.sampling_params import StructuredOutput

ENGINE_CACHE_BYTES = 1 << 30  # compiled matchers one engine keeps, by their measured native size


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def allocated_bytes() -> int | None:
    """Bytes the C allocator has handed out (heap and mmapped), or None where unknown."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def measured_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> tuple[llguidance.LLMatcher, int]:
    """``new_matcher`` and the native bytes it took (the grammar's length where unknown)."""
    before = allocated_bytes()
    m = new_matcher(tokenizer, grammar)
    after = allocated_bytes()
    return m, len(grammar) if before is None or after is None else max(len(grammar), after - before)


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
    strict) for this tokenizer and copied after that (copies share the compiled lexer). The
    cache holds (matcher, native bytes) and counts the bytes against its ``max_bytes``."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, cache: GrammarCache | None = None) -> None:
        self.tokenizer = tokenizer
        self.cache: GrammarCache = cache if cache is not None else GrammarCache(max_bytes=ENGINE_CACHE_BYTES)
        self.cache.value_bytes = _entry_bytes

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
        key = (so.kind, so.spec, so.strict)
        return self.cache.get(key, lambda: measured_matcher(tok, to_llguidance(so, any_to_lark)))[0]

    def matcher(self, so: StructuredOutput) -> llguidance.LLMatcher:
        return self.compile(so).deep_copy()


def _entry_bytes(entry: tuple[llguidance.LLMatcher, int]) -> int:
    return entry[1]


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
