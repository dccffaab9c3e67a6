"""Prompt tokenization for the router, torch-free: ``tokenizers`` for ids, jinja2 for chat.

It must produce exactly the ids the nodes' transformers tokenizer would, since the router's
block hashes and the nodes' prefix caches are keyed by them. transformers renders a chat
template in a sandboxed jinja2 environment with ``trim_blocks`` / ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII, ``raise_exception`` and
``strftime_now`` globals and the special tokens as variables; then it tokenizes the rendered
text WITHOUT adding special tokens (the template writes them). Plain text is tokenized WITH
them (the tokenizer's post-processor, e.g. a BOS). This module reproduces both.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from tool_calling.formats import ToolFormat, detect_format, template_inputs, unsupported_message

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                       "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the messages (raise_exception) or failed to render them."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    transformers; for inference it only renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    # tokenizer_config stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _load_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    if template:
        return template
    # transformers >= 4.43 may save it to its own file instead.
    path = directory / "chat_template.jinja"
    return path.read_text() if path.is_file() else None


def _eos_from_configs(directory: Path) -> list[int]:
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = directory / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        for x in value if isinstance(value, list) else [value]:
            if isinstance(x, int) and x not in ids:
                ids.append(x)
    return ids


class PromptTokenizer:
    """Text and chat prompts -> token ids; token ids -> text (for the router's own chunks)."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: the router needs a fast (tokenizer.json) tokenizer")
        self._tok = Tokenizer.from_file(str(path))
        cfg_path = directory / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.special_tokens = {k: t for k in _SPECIAL_TOKEN_KEYS
                               if (t := _token_text(config.get(k))) is not None}
        source = _load_template(directory, config)
        # The tool-call format of the model, read from its template (tool_calling/formats.py).
        self.tool_format: ToolFormat | None = detect_format(source)
        self.template_source = source
        self._template = None
        if source is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True,
                extensions=[_GenerationTag, jinja2.ext.loopcontrols],
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(source)
        eos = _eos_from_configs(directory)
        eos_text = self.special_tokens.get("eos_token")
        eos_id = self._tok.token_to_id(eos_text) if eos_text else None
        if eos_id is not None and eos_id not in eos:
            eos.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        # Longest vocabulary entry: byte-level BPE spells each byte as one character (and
        # byte-fallback tokens as "<0xNN>"), so no token covers more input characters than this.
        self.max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    @cached_property
    def max_token_json_bytes(self) -> int:
        """The most bytes of JSON one token's text can take in a request body: each token
        decoded alone and escaped as the strictest encoder escapes it (ASCII only, so a
        control character costs 6 bytes). Bounds the body a prompt of N tokens can need."""
        texts = self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
        return max((len(json.dumps(t)) - 2 for t in texts), default=1) or 1

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what llguidance builds its token trie from)."""
        return self._tok.to_str()

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        """Like transformers' ``tokenizer.encode(text)``: special tokens added."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """``tools``: plain {"name", "description", "parameters"} dicts, rendered by the template
        in the model's own tool format (or written into the messages for a template that has
        none: tool_calling/formats.py); ``messages`` may carry tool calls and tool results."""
        if self._template is None:
            raise ChatTemplateError("this model's tokenizer has no chat template; send a text or token prompt")
        # Tool turns without tools and without calls are plain messages, rendered as transformers would.
        if tools or any(m.get("tool_calls") for m in messages):
            if self.tool_format is None:
                raise ChatTemplateError(unsupported_message(self.template_source))
            messages, tools_arg = template_inputs(self.tool_format, messages, tools or [])
        else:
            messages, tools_arg = list(messages), None
        try:
            return self._template.render(messages=messages, add_generation_prompt=True,
                                         tools=tools_arg, documents=None, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Like ``apply_chat_template(messages, tools=..., add_generation_prompt=True, tokenize=True)``."""
        return self._tok.encode(self.render_chat(messages, tools), add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
