"""The model the soak tests serve (bench/load.py, bench/load_http.py): a tiny random-weight
Llama with the SmolLM2 tokenizer, since the point is the serving machinery, not the model."""
from __future__ import annotations

import shutil
from pathlib import Path

# Files of a tokenizer directory the router and decode nodes read.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "chat_template.jinja")


def tiny_model_with_tokenizer(tmp: Path, max_position_embeddings: int = 1024) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary, its tokenizer files beside it."""
    from engine.models.builtin import resolve_builtin
    from engine.models.tiny import save_tiny_model

    tok_dir = resolve_builtin("smollm2-135m")
    model_dir = save_tiny_model(tmp / "tiny-llama-smollm2-vocab", arch="llama", seed=0, vocab_size=49152,
                                max_position_embeddings=max_position_embeddings)
    for name in _TOKENIZER_FILES:
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, model_dir / name)
    return model_dir
