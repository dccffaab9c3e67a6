"""The engine's Hugging Face tokenizer: loading it offline and applying the chat template.

The router has its own torch-free tokenizer (router/tokenizer.py); this one serves the engine's
detokenizer, ``LLMEngine.encode`` and the benchmarks.
"""
from __future__ import annotations

import os
from pathlib import Path

from engine.errors import InvalidRequestError


def load_hf_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return AutoTokenizer.from_pretrained(str(Path(path)), local_files_only=True)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; send a plain prompt")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]
