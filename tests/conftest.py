"""Shared fixtures: tiny random-weight models (engine/models/tiny.py) and a tokenizer directory.
The embedded cluster and real services are plugins (tests/clusters.py, tests/services.py, loaded
by the root conftest); plain helpers are in tests/helpers.py; the node-failure tests' harness in
tests/migration_harness.py, a hand-driven prefill + decode node pair in tests/node_pair.py.

The model tests use a smaller tiny model than the benchmarks (``TEST_MODEL``): a 96-token
vocabulary keeps the reference comparisons fast, and a 0.1 init keeps activations far from zero.
The node and cluster tests use ``save_tiny_model``'s default (llama, seed 0), built once per
session (``tiny_dir``): no test writes into it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.models.tiny import build_tiny_model, save_model, save_tiny_model, tiny_hf_config

TINY_VOCAB = 96
TEST_MODEL = dict(vocab_size=TINY_VOCAB, intermediate_size=96, max_position_embeddings=256, initializer_range=0.1)


def tiny_config(arch: str = "llama", **overrides):
    """A transformers config of the test-sized tiny model (tweak fields before building)."""
    return tiny_hf_config(arch, **{**TEST_MODEL, **overrides})


def save_hf_model(config, directory: Path, seed: int = 0):
    """Build a random HF model from ``config`` (norms random too) and save it; returns the model."""
    model = build_tiny_model(config, seed, random_norms=True)
    save_model(model, directory)
    return model


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Path:
    save_hf_model(tiny_config(), tmp_path / "tiny-llama")
    return tmp_path / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The default tiny model (llama, seed 0, ``tiny_hf_config``'s sizes) saved once: read only."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir) -> str:
    """``tiny_dir`` as the string ``EngineConfig.model`` takes."""
    return str(tiny_dir)


@pytest.fixture(scope="session")
def tok_dir() -> str:
    """SmolLM2-135M's directory: the real tokenizer the router tests load beside a tiny model."""
    from engine.models.builtin import resolve_builtin

    return str(resolve_builtin("smollm2-135m"))
