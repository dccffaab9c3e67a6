"""Per-request sampling parameters (plain data, validated once at admission)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass


class SamplingParamError(ValueError):
    """A sampling parameter out of its range; ``field`` names it (as in SamplingParams)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output's text, enforced token by token by the grammar engine
    (engine/structured/; docs/structured.md). The wire carries it unchanged
    (protos SamplingParams.structured) to the prefill and decode nodes.

    ``kind`` and what ``spec`` holds:

    - ``"json_schema"``: the JSON schema as JSON text (an object, or ``true``).
    - ``"json_object"``: any JSON object; spec ``""``.
    - ``"regex"``: a regular expression the whole output matches (Rust ``regex`` syntax).
    - ``"choice"``: a JSON list of strings; the output is exactly one of them.
    - ``"grammar"``: a context-free grammar in Lark syntax as llguidance reads it (``start:`` is
      the start rule; docs/structured.md). A llama.cpp GBNF grammar (rules written ``::=``,
      ``root`` the start rule, vLLM's ``guided_grammar`` for xgrammar) is accepted too and
      converted.
    - ``"structural_tag"`` (tool calls): a JSON object
      ``{"structures": [{"begin": str, "schema": {...}, "end": str}, ...], "triggers": [str, ...],
      "at_least_one": bool, "stop_after_first": bool}``. Each structure is ``begin`` + JSON
      valid under ``schema`` + ``end``; every ``begin`` starts with one of the ``triggers``.
      With ``at_least_one`` false (tool_choice "auto") the text is free until a trigger
      appears, and from the trigger on it must complete one of the structures; free text may
      follow. With ``at_least_one`` true (tool_choice "required" or a named function) there is
      no free text: the output is one or more structures separated only by whitespace.
      ``stop_after_first`` (parallel_tool_calls false) ends the output after the first
      structure.

    ``strict`` (OpenAI's json_schema ``strict``): true refuses a schema keyword the engine
    cannot enforce (the 400 names it); false ignores such keywords and enforces the rest.
    The generated text is always a complete match of the constraint unless max_tokens cuts it.
    """

    kind: str
    spec: str = ""
    strict: bool = True

    KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
    # Characters per spec: a schema is compiled for every new spec, and this bounds the work
    # (the compile has its own time bound on the node, engine/structured/).
    MAX_SPEC_CHARS = 65536

    def validate(self) -> None:
        """Raise SamplingParamError on field ``structured`` for a malformed spec (plain data
        checks; whether the engine supports every construct is checked by compiling it)."""
        def bad(msg: str) -> SamplingParamError:
            return SamplingParamError("structured", f"structured output ({self.kind}): {msg}")
        if self.kind not in self.KINDS:
            raise SamplingParamError("structured", f"structured output kind must be one of {list(self.KINDS)}, "
                                                   f"got {self.kind!r}")
        if len(self.spec) > self.MAX_SPEC_CHARS:
            raise bad(f"spec may have at most {self.MAX_SPEC_CHARS} characters, got {len(self.spec)}")
        if self.kind == "json_object":
            if self.spec:
                raise bad("spec must be empty")
            return
        if self.kind in ("regex", "grammar"):
            if not self.spec.strip():
                raise bad("spec must be non-empty")
            return
        try:
            value = json.loads(self.spec)
        except ValueError as e:
            raise bad(f"spec is not valid JSON: {e}") from None
        if self.kind == "json_schema" and not (isinstance(value, dict) or value is True):
            raise bad(f"the schema must be a JSON object, got {type(value).__name__}")
        if self.kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise bad("spec must be a non-empty JSON list of non-empty strings")
        if self.kind == "structural_tag":
            _validate_structural_tag(value, bad)


def _validate_structural_tag(value: object, bad) -> None:
    if not isinstance(value, dict):
        raise bad("spec must be a JSON object")
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise bad("'structures' must be a non-empty list")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise bad("'triggers' must be a non-empty list of non-empty strings")
    for i, st in enumerate(structures):
        if not isinstance(st, dict) or not all(isinstance(st.get(k), str) for k in ("begin", "end")):
            raise bad(f"structures[{i}] must have string 'begin' and 'end'")
        if not (isinstance(st.get("schema"), dict) or st.get("schema") is True):
            raise bad(f"structures[{i}].schema must be a JSON schema object")
        if not any(st["begin"].startswith(t) for t in triggers):
            raise bad(f"structures[{i}].begin {st['begin']!r} must start with one of the triggers")
    for key in ("at_least_one", "stop_after_first"):
        if not isinstance(value.get(key, False), bool):
            raise bad(f"'{key}' must be a boolean")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to generate and when to stop.

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those
    filters. Penalties follow the usual conventions: ``repetition_penalty`` (HF/CTRL style,
    over prompt and output tokens, 1.0 = off); ``presence_penalty`` / ``frequency_penalty``
    (OpenAI style, over output tokens only, 0.0 = off).
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0 = only the chosen one)
    structured: StructuredOutput | None = None  # constrained decoding (JSON schema, regex, grammar, ...)

    MAX_N = 16
    MAX_LOGPROBS = 20
    MAX_STOP = 16  # stop strings per request (each one is matched at every step)
    # Characters per stop string: the detokenizer holds back up to a stop string's length of
    # text while it might still match, and matches every one at each step. OpenAI documents up
    # to 4 stop sequences and vLLM no limit; 256 leaves room for any delimiter or closing tag.
    MAX_STOP_CHARS = 256
    _FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamError (a ValueError) naming the field and its limit."""
        for name in self._FLOATS:
            # NaN passes every "x < limit" test below, and inf reaches the sampler as inf logits.
            if not math.isfinite(getattr(self, name)):
                raise SamplingParamError(name, f"{name} must be a finite number, got {getattr(self, name)}")
        if not 1 <= self.n <= self.MAX_N:
            raise SamplingParamError("n", f"n must be between 1 and {self.MAX_N}, got {self.n}")
        if self.max_tokens <= 0:
            raise SamplingParamError("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamError(
                "min_tokens", f"min_tokens must be between 0 and max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.temperature < 0.0:
            raise SamplingParamError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0 and self.top_k != -1:
            raise SamplingParamError("top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise SamplingParamError("top_k", f"top_k must be <= vocab size {vocab_size}, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise SamplingParamError("repetition_penalty",
                                     f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise SamplingParamError("presence_penalty",
                                     f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise SamplingParamError("frequency_penalty",
                                     f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise SamplingParamError("logprobs",
                                     f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamError("stop_token_ids",
                                         f"stop_token_ids must be in [0, {vocab_size}), got {bad[:5]}")
        if len(self.stop) > self.MAX_STOP:
            raise SamplingParamError("stop", f"stop may hold at most {self.MAX_STOP} strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise SamplingParamError("stop", "stop strings must be non-empty")
        long = [i for i, s in enumerate(self.stop) if len(s) > self.MAX_STOP_CHARS]
        if long:
            raise SamplingParamError("stop", f"stop strings may have at most {self.MAX_STOP_CHARS} characters; "
                                             f"stop[{long[0]}] has {len(self.stop[long[0]])}")
        if self.structured is not None:
            self.structured.validate()
