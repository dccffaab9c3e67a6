"""`pdserve prepare-model`: put a model directory where a pod reads it (the chart's init containers).

    pdserve prepare-model smollm2-135m /model --tokenizer-only   # the router's tokenizer, from the builtin
    pdserve prepare-model hf:Qwen/Qwen2.5-7B-Instruct /model     # a download; token from $HF_TOKEN

SOURCE is what ``--model`` takes (a builtin name, a local Hugging Face directory, a .gguf file),
resolved by the engine's loader (torch: run it from a node image), or ``hf:ORG/NAME`` for a
download from the Hugging Face Hub (``huggingface_hub`` reads ``$HF_TOKEN`` itself; the command
line never carries it). ``--tokenizer-only`` copies what the torch-free router reads: the
tokenizer, its config, the chat template and the model's config.

A finished directory is left as it is (a pod restart does not download again): files land in a
temporary sibling that is renamed into place in one step, so DEST must be a new path inside a
writable volume (the chart uses /models/model on the model volume), not the mount point itself.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Callable

HUB_PREFIX = "hf:"
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja")
# What the engine's loader reads from a full model directory (no .bin / .pth duplicates).
MODEL_PATTERNS = ("*.json", "*.safetensors", "*.jinja")


def is_complete(directory: Path, tokenizer_only: bool) -> bool:
    if not (directory / "config.json").is_file() or not (directory / "tokenizer.json").is_file():
        return False
    return tokenizer_only or any(directory.glob("*.safetensors"))


def prepare(source: str, dest: str | Path, *, tokenizer_only: bool = False, revision: str | None = None,
            progress: Callable[[str], None] = lambda m: None) -> Path:
    """Make ``dest`` a model directory (or its tokenizer part) from ``source``; returns ``dest``."""
    dest = Path(dest)
    if is_complete(dest, tokenizer_only):
        progress(f"{dest} is already prepared")
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}-", dir=dest.parent) as tmp:
        staging = Path(tmp) / "model"
        if source.startswith(HUB_PREFIX):
            from huggingface_hub import snapshot_download

            progress(f"downloading {source[len(HUB_PREFIX):]}")
            snapshot_download(repo_id=source[len(HUB_PREFIX):], revision=revision, local_dir=staging,
                              allow_patterns=list(TOKENIZER_FILES if tokenizer_only else MODEL_PATTERNS))
        else:
            from engine.models.loader import resolve_source

            resolved = resolve_source(source, progress=progress)
            names = TOKENIZER_FILES if tokenizer_only else [p.name for p in resolved.iterdir() if p.is_file()]
            staging.mkdir()
            for name in names:
                if (resolved / name).is_file():
                    shutil.copy2(resolved / name, staging / name)
        if not is_complete(staging, tokenizer_only):
            raise FileNotFoundError(f"{source} gave no {'tokenizer' if tokenizer_only else 'model'} "
                                    "(config.json, tokenizer.json" + ("" if tokenizer_only else ", *.safetensors") + ")")
        if dest.is_dir():  # incomplete: what a crashed run left
            shutil.rmtree(dest)
        staging.rename(dest)
    progress(f"{dest} ready")
    return dest


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="builtin name, local HF directory, .gguf file, or hf:ORG/NAME")
    p.add_argument("dest", help="the directory to create (e.g. a volume's mount point)")
    p.add_argument("--tokenizer-only", action="store_true", help="only what the router reads")
    p.add_argument("--revision", default=None, help="hf: sources: a branch, tag or commit")


def run(a: argparse.Namespace, progress: Callable[[str], None]) -> int:
    prepare(a.source, a.dest, tokenizer_only=a.tokenizer_only, revision=a.revision, progress=progress)
    return 0
