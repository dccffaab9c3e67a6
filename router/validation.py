"""What the router refuses before it places a request: the served model, the prompt (its kind,
its size before and after tokenizing, its token ids), the sampling parameters, the structured
output and the tools (tool_calling/requests.py), and the context limits of ``RouterConfig``.
Every refusal is a ``RouterError`` naming the field at fault.

Tools are rendered by the model's chat template; ``tool_choice`` "required" or a named function
(and "auto" where the format has tags) becomes the request's structured output, so a call in
the model's format always parses. One constraint per request: a response_format beside a tool
choice that constrains is refused naming both.

Runs on the orchestrator's worker thread (tokenizing blocks), before the node view is read:
a request that could never run is refused without looking at the cluster. A constraint that
finds no compile slot in time (``max_concurrent_compiles``, ``compile_wait_s``) is not judged:
RESOURCE_EXHAUSTED / HTTP 429 with a retry hint, not a 400.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import grpc

from protos.convert import sampling_from_proto, slo_class_from_proto
from protos.pdserve.v1 import serving_pb2 as pb
from router.config import RouterConfig
from router.structured import StructuredChecker, check_structured
from router.tokenizer import ChatTemplateError, PromptTokenizer
from telemetry import tracing
from tokens.grammar import GrammarBusy, GrammarCache
from tokens.sampling_params import SamplingParams
from tool_calling import requests as tool_requests


class RouterError(Exception):
    """A failure before any output: becomes the RPC's status (with retry-after-ms if set)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None,
                 reason: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.param = param  # the request field at fault, when one is (HTTP's error "param")
        # One word for the requests_rejected_total metric.
        self.reason = reason or _REJECT_REASONS.get(code, code.name.lower())


_REJECT_REASONS = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.ALREADY_EXISTS: "duplicate_id",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
}


def invalid(message: str, param: str | None = None) -> RouterError:
    return RouterError(grpc.StatusCode.INVALID_ARGUMENT, message, param=param)


@dataclass(frozen=True, slots=True)
class ValidRequest:
    """A request the router can run, before placement."""

    prompt: list[int]
    params: SamplingParams  # max_tokens final: capped by the context when the front-end asked
    slo_class: str


class RequestValidator:
    """``validate`` turns a ``GenerateRequest`` into a ``ValidRequest`` or raises RouterError."""

    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.vocab_size or tokenizer.vocab_size
        # Compiles bounded in number at once and the cache in bytes (tokens/grammar.py): 50 slow
        # constraints at once must not hold every worker thread the router prepares requests on.
        cache = GrammarCache(max_concurrent=config.max_concurrent_compiles, wait_s=config.compile_wait_s,
                             max_bytes=config.grammar_cache_bytes)
        self.structured = StructuredChecker(tokenizer, self.vocab_size, cache=cache)

    def validate(self, req: pb.GenerateRequest, max_tokens_to_context: bool = False) -> ValidRequest:
        """``max_tokens_to_context``: ignore the request's max_tokens and let it use the rest
        of the context (the HTTP API's chat default)."""
        cfg = self.config
        slo_class = slo_class_from_proto(req.slo_class) or cfg.default_slo_class
        if req.model and req.model != cfg.model_name:
            raise RouterError(grpc.StatusCode.NOT_FOUND,
                              f"model {req.model!r} is not served here; served models: [{cfg.model_name!r}]")
        prompt, tools_constraint = self._prompt_ids(req)
        tracing.event("tokenized", {tracing.GEN_AI_USAGE_INPUT_TOKENS: len(prompt)})
        try:
            params = sampling_from_proto(req.sampling)
            if max_tokens_to_context:  # capped below, once the prompt's length is known
                params = replace(params, max_tokens=cfg.max_model_len)
            if tools_constraint is not None:
                if params.structured is not None:
                    raise invalid("a structured output (response_format, structured_outputs or guided_*) and "
                                  "tools whose tool_choice constrains the answer cannot be combined: the output "
                                  "follows one constraint; send tool_choice 'none' or no structured output",
                                  "tool_choice")
                params = replace(params, structured=tools_constraint)
            params.validate(self.vocab_size)
            # A constraint compiles here as on the nodes: an unsupported construct, a syntax
            # error or a compile over the time bound is a 400 naming it (GrammarError).
            check_structured(params.structured, self.structured)
        except GrammarBusy as e:  # not judged: no compile slot in time, a retry may pass
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), retry_after_ms=e.retry_after_ms,
                              reason="compile_busy", param="structured") from None
        except ValueError as e:  # SamplingParamError and GrammarError name the field
            raise invalid(str(e), getattr(e, "field", None)) from None
        n = len(prompt)
        if n == 0:
            raise invalid("the prompt is empty (0 tokens)", req.WhichOneof("prompt"))
        if n > cfg.effective_max_prompt_tokens:
            raise invalid(f"this model's maximum context length is {cfg.max_model_len} tokens and a prompt "
                          f"may use {cfg.effective_max_prompt_tokens} of them (max_prompt_tokens); "
                          f"the prompt has {n} tokens")
        if max_tokens_to_context:
            # OpenAI's chat default: no max_tokens = as many as the context leaves.
            budget = max(params.min_tokens, cfg.max_model_len - n)
            if cfg.max_tokens_limit is not None:
                budget = min(budget, cfg.max_tokens_limit)
            params = replace(params, max_tokens=budget)
        if cfg.max_tokens_limit is not None and params.max_tokens > cfg.max_tokens_limit:
            raise invalid(f"max_tokens is {params.max_tokens}; max_tokens_limit is {cfg.max_tokens_limit}")
        if n + params.max_tokens > cfg.max_model_len:
            raise invalid(f"the prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                          f"{n + params.max_tokens} exceeds this model's maximum context length of "
                          f"{cfg.max_model_len} tokens (max_model_len)")
        return ValidRequest(prompt, params, slo_class)

    def _prompt_ids(self, req: pb.GenerateRequest):
        """The prompt's token ids, and the constraint its tools ask for (None: none)."""
        kind = req.WhichOneof("prompt")
        if kind == "text":
            self._check_text_length(len(req.text), "text")
            return self.tokenizer.encode(req.text), None
        if kind == "chat":
            return self._chat_ids(req.chat)
        if kind == "tokens":
            ids = list(req.tokens.ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise invalid(f"token ids must be in [0, {self.vocab_size}) (the vocab size); got {bad[:5]}",
                              "tokens.ids")
            return ids, None
        raise invalid("no prompt: set one of text, chat or tokens", "prompt")

    def _chat_ids(self, chat: pb.ChatPrompt):
        if not chat.messages:
            raise invalid("chat prompt has no messages", "chat.messages")
        limit = self.config.effective_max_prompt_tokens
        if len(chat.messages) > limit:  # chat templates write at least a role marker per message
            raise invalid(f"chat prompt has {len(chat.messages)} messages; a prompt may use {limit} "
                          f"tokens (max_prompt_tokens)", "chat.messages")
        self._check_text_length(tool_requests.text_length(chat), "chat.messages")
        tok = self.tokenizer
        try:
            messages = tool_requests.template_messages(chat)
            tools = tool_requests.template_tools(chat)
            constraint = tool_requests.tool_constraint(chat, tools, tok.tool_format, tok.template_source)
            return tok.encode_chat(messages, tools=tools), constraint
        except tool_requests.ToolRequestError as e:
            raise invalid(str(e), e.field) from None
        except ChatTemplateError as e:
            raise invalid(str(e)) from None

    def _check_text_length(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing it, text that cannot fit: every token covers at most
        ``max_token_chars`` characters, so longer text is surely over max_prompt_tokens (and
        tokenizing tens of MB would hold a router thread for seconds)."""
        cfg = self.config
        limit = cfg.effective_max_prompt_tokens * self.tokenizer.max_token_chars
        if chars > limit:
            raise invalid(f"the prompt has {chars} characters: more than the {cfg.effective_max_prompt_tokens} "
                          f"tokens a prompt may use (max_prompt_tokens) can hold, at most "
                          f"{self.tokenizer.max_token_chars} characters per token", param)
