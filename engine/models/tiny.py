"""Tiny random-weight Hugging Face models built from a config, for tests and benchmarks.

Nothing is downloaded: the architecture comes from transformers' config classes, the weights
from a seeded random init, and the result is saved as a normal local HF directory so it goes
through the same loader as a real model.
"""
from __future__ import annotations

from pathlib import Path

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def tiny_hf_config(arch: str = "llama", **overrides):
    import transformers

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        # A wide init gives peaked next-token distributions, so greedy argmax is not decided by
        # float rounding between near-equal logits (as it would be at the usual 0.02).
        initializer_range=0.2,
    )
    common.update(overrides)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        common.setdefault("head_dim", common["hidden_size"] // common["num_attention_heads"])
        return transformers.Qwen3Config(**common)
    if arch == "mistral":
        common.setdefault("sliding_window", None)
        return transformers.MistralConfig(**common)
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHS}")


def build_tiny_model(config, seed: int = 0, random_norms: bool = False):
    """A seeded random float32 Hugging Face model of ``config`` in eval mode (eager attention,
    the reference tests compare against). ``random_norms``: norm weights and biases random too,
    so a test notices when they are loaded wrongly (they start at 1 and 0 otherwise)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    if random_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def save_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Build a seeded random model of ``arch`` and save it (safetensors + config) at ``path``."""
    return save_model(build_tiny_model(tiny_hf_config(arch, **overrides), seed), path)


def save_tiny_chat_model(path: str | Path, seed: int = 0, **overrides) -> Path:
    """A tiny random model with SmolLM2's vocabulary, tokenizer and chat template beside it, so
    that routers and nodes tokenize and render chat prompts for real (tests, quick benches)."""
    import shutil

    from engine.models.builtin import resolve_builtin

    path = save_tiny_model(path, seed=seed, **{"vocab_size": 49152, **overrides})
    tok = resolve_builtin("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok / name).exists():
            shutil.copy(tok / name, path / name)
    return path


def save_model(model, path: str | Path) -> Path:
    """Save a Hugging Face model as a local directory the engine's loader reads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path
