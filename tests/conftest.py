"""Shared fixtures: tiny random-weight Hugging Face models built from a config, saved locally.

Builders return ``transformers`` config objects so a test can tweak fields before building;
``save_hf_model`` writes one into a directory that ``engine.models.loader.load_model`` reads.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models.tiny import tiny_hf_config

TINY_VOCAB = 96


def _common(**overrides) -> dict:
    base = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        # Larger than HF's 0.02 so activations (and any mistake) are far from zero.
        initializer_range=0.1,
    )
    base.update(overrides)
    return base


def tiny_llama_config(**overrides):
    return tiny_hf_config("llama", **_common(**overrides))


def tiny_qwen2_config(**overrides):
    return tiny_hf_config("qwen2", **_common(**overrides))


def tiny_qwen3_config(**overrides):
    # Qwen3 carries an explicit head_dim (here hidden / heads = 16).
    return tiny_hf_config("qwen3", **_common(**overrides))


def tiny_mistral_config(**overrides):
    return tiny_hf_config("mistral", **_common(**overrides))


def build_hf_model(config, seed: int = 0):
    """Random float32 HF model in eval mode; norms get random weights too, so they are tested."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model.eval()


def save_hf_model(config, directory: Path, seed: int = 0):
    """Build a random HF model from ``config`` and save it (config.json + safetensors)."""
    model = build_hf_model(config, seed)
    model.save_pretrained(directory)
    return model


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Path:
    save_hf_model(tiny_llama_config(), tmp_path / "tiny-llama")
    return tmp_path / "tiny-llama"
