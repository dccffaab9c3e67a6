"""Per-request sampling parameters (plain data, validated once at admission)."""
from __future__ import annotations

import math
from dataclasses import dataclass


class SamplingParamError(ValueError):
    """A sampling parameter out of its range; ``field`` names it (as in SamplingParams)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
