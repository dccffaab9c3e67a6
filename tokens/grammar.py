"""What the router and the nodes must agree on about a structured-output constraint: the
grammar it compiles to, and the bounded, cached compile (stdlib only).

Both sides compile with llguidance (docs/structured.md says why that engine): the router to
refuse a bad constraint with a 400 before it places the request, the nodes to mask logits.
They import llguidance themselves (the router stays torch-free; this package stays
stdlib-only) and pass the llguidance calls in; the translation, the limits and the cache
policy are here once, so a constraint the router accepts is one every node compiles.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from tokens.sampling_params import StructuredOutput

# llguidance's JSON options for every schema (json_schema, json_object, the JSON inside a
# structural tag): Python's json.dumps layout, ", " and ": ", and no other whitespace. Free
# whitespace (llguidance's default) lets a model emit blanks forever where a value belongs;
# this layout is the one models have read most. A schema's own "x-guidance" may override it.
JSON_OPTIONS: dict = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# llguidance.LLParserLimits for every compile: they bound the work of building the lexer and
# of each token's mask in native code (llguidance's defaults; a grammar past them is an error
# naming the limit, not a slow step). Kept here so the router and the nodes refuse the same.
PARSER_LIMITS: dict = {"max_items_in_row": 2000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
                       "step_max_items": 50_000, "max_lexer_states": 250_000, "max_grammar_size": 500_000}

COMPILE_TIMEOUT_S = 2.0  # wall-clock bound on one compile (grammar build + first mask)
CACHE_SIZE = 128  # compiled grammars kept per tokenizer (LRU)
NEGATIVE_CACHE_SIZE = 256  # refused specs remembered, so a slow one is never compiled twice
MAX_ABANDONED = 4  # compiles past the bound still running (native code cannot be stopped)
CACHE_BYTES = 64 << 20  # constraint text both caches keep (a key holds the whole spec)


class GrammarError(ValueError):
    """A constraint the engine refuses: a syntax error, an unsupported construct, a limit, or
    a compile over ``COMPILE_TIMEOUT_S``. The message names it; the router answers 400."""

    field = "structured"


class GrammarBusy(GrammarError):
    """No compile slot came free in time (or too many compiles past the bound still run): the
    constraint was not judged, a retry after ``retry_after_ms`` may pass (429, not 400)."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


def _key_bytes(key) -> int:
    # The text a key holds: (kind, spec, strict) tuples, or a plain string.
    parts = key if isinstance(key, tuple) else (key,)
    return 64 + sum(len(p) for p in parts if isinstance(p, str | bytes))


def to_llguidance(so: StructuredOutput, gbnf_to_lark: Callable[[str], str]) -> str:
    """The grammar llguidance compiles for ``so`` (already ``validate``d): Lark text, or
    llguidance's JSON grammar object. ``gbnf_to_lark``: llguidance's converter
    (``llguidance.gbnf_to_lark.any_to_lark``), which passes Lark through unchanged."""
    kind = so.kind
    if kind == "json_schema":
        return _json_grammar(json.loads(so.spec), so.strict)
    if kind == "json_object":
        return _json_grammar({"type": "object"}, True)
    if kind == "regex":
        return f"start: /{lark_regex(so.spec)}/"
    if kind == "choice":
        return "start: " + " | ".join(_lark_str(c) for c in json.loads(so.spec))
    if kind == "grammar":
        return gbnf_to_lark(so.spec)
    if kind == "structural_tag":
        return structural_tag_lark(json.loads(so.spec))
    raise GrammarError(f"structured output kind {kind!r} is not supported")


def _with_options(schema, strict: bool) -> dict:
    schema = {} if schema is True else dict(schema)
    options = {**JSON_OPTIONS, **schema.get("x-guidance", {})}
    if not strict:
        options["lenient"] = True  # ignore keywords llguidance does not implement
    schema["x-guidance"] = options
    return schema


def _json_grammar(schema, strict: bool) -> str:
    return json.dumps({"grammars": [{"json_schema": _with_options(schema, strict)}]})


def _lark_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a Lark string literal llguidance reads


def lark_regex(regex: str) -> str:
    """``regex`` as the body of a Lark ``/.../`` literal: unescaped slashes escaped."""
    out, i = [], 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            out.append(regex[i : i + 2])
            i += 2
            continue
        out.append("\\/" if c == "/" else c)
        i += 1
    return "".join(out)


def structural_tag_lark(tag: dict) -> str:
    """Lark for a structural tag (the shape StructuredOutput documents).

    Free text (``at_least_one`` false) is ``NOTRIG``: text holding no trigger, so every trigger
    the model writes starts a structure and no tool call escapes its schema. A structure
    begins at a lazy lexeme, free text up to the first trigger, then the rest of its ``begin``,
    JSON under its schema and its ``end``.
    """
    triggers = sorted(set(tag["triggers"]), key=len, reverse=True)
    rules: list[str] = []
    segs: list[str] = []
    for i, trig in enumerate(triggers):
        bodies = []
        for st in tag["structures"]:
            if next(t for t in triggers if st["begin"].startswith(t)) != trig:
                continue
            schema = json.dumps(_with_options(st["schema"], True))
            rest = st["begin"][len(trig):]
            bodies.append(" ".join(p for p in (_lark_str(rest) if rest else "", f"%json {schema}",
                                               _lark_str(st["end"]) if st["end"] else "") if p))
        if not bodies:
            continue
        alts = " | ".join(f"({b})" for b in bodies)
        if tag.get("at_least_one"):
            rules.append(f"seg_{i}: {_lark_str(trig)} ({alts})")
        else:
            rules.append(f"trig_{i}[lazy]: NOTRIG {_lark_str(trig)}")
            rules.append(f"seg_{i}: trig_{i} ({alts})")
        segs.append(f"seg_{i}")
    seg = " | ".join(segs)
    if tag.get("at_least_one"):
        start = "start: seg" if tag.get("stop_after_first") else "start: seg (WS seg)*"
        rules.append('WS: /[ \\t\\n]*/')
    else:
        start = "start: seg | NOTRIG" if tag.get("stop_after_first") else "start: seg* NOTRIG"
        no_trig = "|".join(lark_regex(_regex_literal(t)) for t in triggers)
        rules.append(f"NOTRIG: /(.|\\n)*/ & ~/(.|\\n)*({no_trig})(.|\\n)*/")
    return "\n".join(["%llguidance {}", start, f"seg: {seg}", *rules]) + "\n"


def _regex_literal(s: str) -> str:
    return "".join("\\" + c if c in r".^$*+?()[]{}|\/" else ("\\n" if c == "\n" else c) for c in s)


K = TypeVar("K")
V = TypeVar("V")


class GrammarCache(Generic[K, V]):
    """Compiled grammars by key, LRU-bounded; refused keys remembered (negative cache).

    ``get(key, compile_fn)`` runs ``compile_fn()`` on a worker thread and waits at most
    ``timeout_s``: a compile that raises (the engine refused the constraint) or runs past the
    bound becomes a ``GrammarError`` naming it, cached for the key so the same spec is refused
    at once next time. A compile past the bound keeps running in native code (it cannot be
    stopped; llguidance's fuel limits bound it); while ``max_abandoned`` of them run, new
    compiles are refused instead of piling up threads. Thread-safe.

    ``max_concurrent``: compiles running at once, past the bound too (a slot is held until the
    native compile returns, so slow compiles cannot pile up on the caller's threads); one more
    waits ``wait_s`` for a slot, then GrammarBusy. Hits never wait. ``max_bytes`` bounds what
    both caches hold, least recent out first: each key's text, plus ``value_bytes(value)`` of
    a compiled value when given (a node's matcher: engine/structured/compiler.py measures it).
    """

    def __init__(self, size: int = CACHE_SIZE, timeout_s: float = COMPILE_TIMEOUT_S,
                 negative_size: int = NEGATIVE_CACHE_SIZE, max_abandoned: int = MAX_ABANDONED,
                 max_concurrent: int | None = None, wait_s: float = 0.0, max_bytes: int = CACHE_BYTES,
                 value_bytes: Callable[[V], int] | None = None) -> None:
        self.size, self.timeout_s = size, timeout_s
        self.negative_size, self.max_abandoned = negative_size, max_abandoned
        self.wait_s, self.max_bytes, self.max_concurrent = wait_s, max_bytes, max_concurrent
        self.value_bytes = value_bytes
        self._sizes: dict[K, int] = {}  # what each compiled entry counts in ``bytes``
        self._slots = threading.BoundedSemaphore(max_concurrent) if max_concurrent else None
        self._lock = threading.Lock()
        self._hits: OrderedDict[K, V] = OrderedDict()
        self._refused: OrderedDict[K, str] = OrderedDict()
        self._abandoned = 0
        self.bytes = 0  # what both caches hold (keys' text, compiled values' measured size)
        self.running = self.peak_running = self.busy = 0
        self.compile_ms: list[float] = []  # every successful compile's time (benchmarks read it)

    def __len__(self) -> int:
        return len(self._hits)

    def get(self, key: K, compile_fn: Callable[[], V]) -> V:
        with self._lock:
            if key in self._hits:
                self._hits.move_to_end(key)
                return self._hits[key]
            if key in self._refused:
                raise GrammarError(self._refused[key])
            if self._abandoned >= self.max_abandoned:
                raise GrammarBusy(f"the grammar compiler is busy: {self._abandoned} compiles past the "
                                  f"{self.timeout_s:g} s bound are still running; retry later", self._retry_ms())
        if self._slots is not None and not self._slots.acquire(timeout=self.wait_s):
            with self._lock:
                self.busy += 1
                retry = self._retry_ms()
            raise GrammarBusy(f"the router is compiling {self.max_concurrent} structured-output constraints, the most "
                              f"it compiles at once (max_concurrent_compiles), and none finished within "
                              f"{self.wait_s:g} s (compile_wait_s); retry after {retry} ms", retry)
        value = self._compile(key, compile_fn)
        size = _key_bytes(key) + (self.value_bytes(value) if self.value_bytes is not None else 0)
        with self._lock:
            self.bytes += size - self._sizes.get(key, 0)  # a key two callers compiled counts once
            self._sizes[key] = size
            self._hits[key] = value
            self._hits.move_to_end(key)
            self._evict()
        return value

    def _retry_ms(self) -> int:
        # About one typical compile (the median of the last few), within [200 ms, the bound].
        recent = sorted(self.compile_ms[-16:])
        typical = recent[len(recent) // 2] if recent else 1000 * self.timeout_s
        return int(max(200.0, min(1000 * self.timeout_s, typical)))

    def _evict(self) -> None:
        """Least recent out, positive and negative entries alike, past the count or the bytes."""
        while len(self._hits) > self.size or (self.bytes > self.max_bytes and len(self._hits) > 1):
            self.bytes -= self._sizes.pop(self._hits.popitem(last=False)[0])
        while len(self._refused) > self.negative_size or (self.bytes > self.max_bytes and self._refused):
            self.bytes -= _key_bytes(self._refused.popitem(last=False)[0])

    def _compile(self, key: K, compile_fn: Callable[[], V]) -> V:
        box: dict = {}
        done = threading.Event()

        def work() -> None:
            t0 = time.perf_counter()
            try:
                box["value"] = compile_fn()
                box["ms"] = (time.perf_counter() - t0) * 1e3
            except Exception as e:  # noqa: BLE001 - handed to the waiting thread as a refusal
                box["error"] = e
            finally:
                done.set()
                with self._lock:
                    self.running -= 1
                    if box.get("abandoned"):
                        self._abandoned -= 1
                if self._slots is not None:  # only now: the compile's CPU is free
                    self._slots.release()

        with self._lock:
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
        try:
            threading.Thread(target=work, name="grammar-compile", daemon=True).start()
        except BaseException:
            with self._lock:
                self.running -= 1
            if self._slots is not None:
                self._slots.release()
            raise
        finished = done.wait(self.timeout_s)
        with self._lock:
            if not finished and not done.is_set():
                box["abandoned"] = True
                self._abandoned += 1
                message = (f"compiling the structured-output constraint took more than {self.timeout_s:g} s "
                           f"(the compile-time bound); simplify the schema or grammar")
                self._refuse(key, message)
                raise GrammarError(message)
        if "error" in box:
            message = f"structured output refused by the grammar engine: {box['error']}"
            with self._lock:
                self._refuse(key, message)
            raise GrammarError(message) from None
        self.compile_ms.append(box["ms"])
        return box["value"]

    def _refuse(self, key: K, message: str) -> None:
        if key not in self._refused:
            self.bytes += _key_bytes(key)
        self._refused[key] = message
        self._evict()
