"""What a request is checked against at admission, so the scheduler never meets one that
cannot fit: a request that can never be served is refused with ``InvalidRequestError`` naming
the limit and the request's own number. Plain data, no torch."""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from tokens.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int  # the engine's context: the model's, or less when configured
    block_size: int
    num_blocks: int  # the whole KV cache

    def check(self, tokens: list[int], params: SamplingParams, resumed_output_tokens: int = 0) -> int:
        """Check a request whose ``tokens`` end with ``resumed_output_tokens`` output tokens
        it produced elsewhere (``LLMEngine.add_request``); -> that count, k. The prompt is
        ``tokens[:-k]``."""
        k = _check_resumed(tokens, params, resumed_output_tokens)
        self._check_prompt(tokens[: len(tokens) - k], params)
        return k

    def _check_prompt(self, tokens: list[int], params: SamplingParams) -> None:
        vocab = self.vocab_size
        try:
            params.validate(vocab)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        n = len(tokens)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens but the model's context is {self.max_model_len} tokens "
                f"(at least one token must remain for the output)"
            )
        if n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        need = math.ceil((n + params.max_tokens) / self.block_size) * params.n
        if need > self.num_blocks:
            raise InvalidRequestError(
                f"request needs {need} KV blocks (prompt {n} + max_tokens {params.max_tokens}, "
                f"n={params.n}) but the KV cache has only {self.num_blocks} blocks"
            )


def _check_resumed(tokens: list[int], params: SamplingParams, k: int) -> int:
    if k == 0:
        return 0
    if params.n != 1:
        raise InvalidRequestError(f"a resumed request continues one sequence: n must be 1, got {params.n}")
    if not 0 < k < len(tokens):
        raise InvalidRequestError(f"resumed_output_tokens is {k} but the prompt has {len(tokens)} tokens "
                                  "(at least one must be prompt)")
    if k >= params.max_tokens:
        raise InvalidRequestError(f"resumed_output_tokens is {k}: max_tokens ({params.max_tokens}) leaves "
                                  "nothing to generate")
    return k
