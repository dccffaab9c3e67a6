"""The router's torch-free tokenizer gives exactly the ids transformers gives."""
from __future__ import annotations

import pytest

from router.tokenizer import ChatTemplateError, PromptTokenizer

MESSAGES = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": "Où est la gare ?"}],
    [{"role": "user", "content": "日本語で答えてください。東京はどこ？"}],
    [{"role": "user", "content": "emoji 🤖🚀 and combining e\u0301"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "  leading and trailing spaces  \n\n\tand tabs"}],
    [{"role": "user", "content": "<|im_start|>looks special<|im_end|>"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}],
    [{"role": "tool", "content": "{\"temp\": 21}"}, {"role": "user", "content": "weather?"}],
    [{"role": "user", "content": "code:\n```python\ndef f(x):\n    return x * 2\n```"}],
]

TEXTS = ["Hello world", "", " ", "The quick brown fox jumps over the lazy dog.", "日本語のテキスト",
         "emoji 🤖🚀", "<|im_start|>user\nhi<|im_end|>", "line1\nline2\r\n\ttab", "a" * 300,
         "Numbers 1234567890 and symbols !@#$%^&*()"]


@pytest.fixture(scope="module")
def tokenizer_dir():
    from engine.models.builtin import resolve_builtin

    return resolve_builtin("smollm2-135m")


@pytest.fixture(scope="module")
def hf(tokenizer_dir):
    from engine.tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def ours(tokenizer_dir):
    return PromptTokenizer(tokenizer_dir)


def _hf_chat_ids(hf, messages):
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return [int(t) for t in out]


@pytest.mark.parametrize("i", range(len(MESSAGES)))
def test_chat_ids_match_transformers(hf, ours, i):
    messages = MESSAGES[i]
    assert ours.render_chat(messages) == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.encode_chat(messages) == _hf_chat_ids(hf, messages)


@pytest.mark.parametrize("text", TEXTS)
def test_text_ids_match_transformers(hf, ours, text):
    assert ours.encode(text) == hf.encode(text)


def test_decode_and_metadata_match_transformers(hf, ours):
    ids = hf.encode("Hello 🤖 world, 日本")
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(hf)
    assert hf.eos_token_id in ours.eos_token_ids


def test_raise_exception_in_template(tmp_path, tokenizer_dir):
    import json
    import shutil

    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}" \
               "{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    tok = PromptTokenizer(tmp_path)
    assert tok.render_chat([{"role": "user", "content": "é"}]) == '"é"'
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.render_chat([{"role": "system", "content": "x"}])


def test_no_chat_template(tmp_path, tokenizer_dir):
    import shutil

    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = PromptTokenizer(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "x"}])
