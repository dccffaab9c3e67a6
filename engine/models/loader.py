"""Load a model from a builtin name, a local Hugging Face directory or a ``.gguf`` file.

Nothing here touches a network. Every check that can fail (config, architecture, file
integrity, tensor names and shapes) runs on the safetensors headers before the model is built,
and the model is only returned once every parameter holds checkpoint data: a failed load never
leaves a half-loaded model behind.
"""
from __future__ import annotations

import hashlib
import json
import struct
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import torch

from engine.models.builtin import BUILTIN_MODELS, cache_dir, convert_gguf, resolve_builtin
from engine.models.config import ModelConfig, UnsupportedModelError
from engine.models.llama import (
    LlamaForCausalLM,
    is_ignored_weight,
    missing_weights,
    short_list,
    weight_targets,
)

Progress = Callable[[str], None] | None

# Bytes hashed from the start, middle and end of every tensor for the fingerprint: enough to
# tell apart any two real checkpoints, cheap enough for a 0.5 GB model (< 1 ms of reads).
_SAMPLE_BYTES = 64
_FINGERPRINT_VERSION = "pdserve-fp-1"


class ModelLoadError(ValueError):
    """The model cannot be loaded; the message says which file or tensor and why."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer_path: Path
    fingerprint: str  # short hex id of architecture + config + weights (block-hash extra key)


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    file: Path
    dtype: str  # safetensors dtype name, e.g. "F32"
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets of the data in the file
    end: int


def load_model(
    source: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: Progress = None,
) -> LoadedModel:
    """Load ``source`` (builtin name, HF directory or .gguf file); raise ModelLoadError on any problem.

    A builtin or GGUF source is converted once into the cache dir (``progress`` hears about it);
    later loads read safetensors only. ``tokenizer_path`` is the directory to hand to
    ``AutoTokenizer.from_pretrained``.
    """
    directory = resolve_source(source, progress)
    cfg = _read_config(directory)
    tensors = _read_index(directory)
    _check_names(cfg, tensors)
    fingerprint = _fingerprint(cfg, tensors)
    if progress is not None:
        progress(f"loading {cfg.architecture} weights from {directory}")
    model = _build(cfg, tensors, dtype, torch.device(device))
    return LoadedModel(model=model, config=cfg, tokenizer_path=directory, fingerprint=fingerprint)


def resolve_source(source: str, progress: Progress = None) -> Path:
    """Builtin name, HF directory or .gguf file -> a local HF directory with safetensors."""
    if source in BUILTIN_MODELS:
        try:
            return resolve_builtin(source, progress)
        except Exception as e:  # a missing package, or anything transformers raises converting it
            raise ModelLoadError(f"builtin model {source!r} is unavailable: {type(e).__name__}: {e}") from e
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {source!r} is neither a builtin name ({', '.join(sorted(BUILTIN_MODELS))}) "
            "nor an existing directory or .gguf file"
        )
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path, progress)
    if not path.is_dir():
        raise ModelLoadError(f"{path} is a file but not a .gguf; pass a Hugging Face model directory")
    return path


def _converted_gguf(path: Path, progress: Progress) -> Path:
    # A GGUF is dequantized once into a cache dir keyed by its path, size and mtime, so an edited
    # or replaced file converts again and the tokenizer gets a plain directory like any model.
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir() / "gguf" / f"{path.stem}-{key}"
    try:
        return convert_gguf(path, target, progress)
    except Exception as e:  # transformers raises many types for an unreadable GGUF
        raise ModelLoadError(f"cannot convert GGUF file {path}: {type(e).__name__}: {e}") from e


def checkpoint_fingerprint(directory: str | Path) -> tuple[ModelConfig, str]:
    """A local model directory's config and fingerprint, after the checks ``load_model`` runs on
    its headers (names, shapes, file integrity), without reading its weights."""
    directory = Path(directory)
    cfg = _read_config(directory)
    tensors = _read_index(directory)
    _check_names(cfg, tensors)
    return cfg, _fingerprint(cfg, tensors)


def tensor_names(directory: str | Path) -> set[str]:
    """The tensor names a local model directory's weight files hold (their headers only)."""
    return set(_read_index(Path(directory)))


def read_model_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig of a local model directory, without touching its weights."""
    return _read_config(Path(directory))


def _read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory} has no config.json; is it a Hugging Face model directory?")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    try:
        return ModelConfig.from_hf(raw)
    except UnsupportedModelError as e:
        raise ModelLoadError(f"{directory}: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{path} is missing or has a bad field: {e!r}") from e


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e!r}") from e
        files = [directory / f for f in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index.name} lists shards that are missing: {', '.join(absent)}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weights (other formats are not supported)")
    return files


def _read_index(directory: Path) -> dict[str, _TensorInfo]:
    tensors: dict[str, _TensorInfo] = {}
    for file in _weight_files(directory):
        for name, info in _read_header(file).items():
            if name in tensors:
                raise ModelLoadError(f"tensor {name!r} appears in both {tensors[name].file.name} and {file.name}")
            tensors[name] = info
    return tensors


def _read_header(file: Path) -> dict[str, _TensorInfo]:
    """Parse and validate a safetensors header: every tensor's bytes must lie inside the file.

    This is the check that catches a truncated download before any weight is read.
    """
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"header length {n} exceeds the file ({size} bytes)")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"corrupt safetensors file {file}: {e}") from e
    base = 8 + n
    out: dict[str, _TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (base + int(x) for x in meta["data_offsets"])
            info = _TensorInfo(file, str(meta["dtype"]), tuple(int(x) for x in meta["shape"]), begin, end)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"corrupt safetensors file {file}: bad entry for {name!r}") from e
        if end > size:
            raise ModelLoadError(
                f"corrupt or truncated safetensors file {file}: tensor {name!r} needs bytes up to "
                f"{end} but the file has {size}"
            )
        out[name] = info
    return out


def _check_names(cfg: ModelConfig, tensors: dict[str, _TensorInfo]) -> None:
    targets = weight_targets(cfg)
    unexpected = sorted(n for n in tensors if n not in targets and not is_ignored_weight(n))
    if unexpected:
        raise ModelLoadError(f"unexpected tensors for {cfg.architecture}: {short_list(unexpected)}")
    filled = {(targets[n].param, targets[n].start) for n in tensors if n in targets}
    missing = missing_weights(cfg, filled)
    if missing:
        raise ModelLoadError(f"checkpoint is missing tensors: {short_list(missing)}")
    for name, info in tensors.items():
        if name in targets and info.shape != targets[name].shape:
            raise ModelLoadError(
                f"tensor {name!r} in {info.file.name} has shape {info.shape}, "
                f"expected {targets[name].shape} from config.json"
            )


def _fingerprint(cfg: ModelConfig, tensors: dict[str, _TensorInfo]) -> str:
    """Identical for the same model in any process; different when weights differ."""
    h = hashlib.sha256(_FINGERPRINT_VERSION.encode())
    h.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    names = {_canonical_name(cfg, n, tensors): n for n in tensors}
    with ExitStack() as stack:
        handles: dict[Path, BinaryIO] = {}
        # Tensor-name order, whatever file holds each: sharding is storage, not identity.
        for canonical in sorted(names):
            info = tensors[names[canonical]]
            h.update(f"|{canonical}:{info.dtype}:{list(info.shape)}".encode())
            if info.file not in handles:
                handles[info.file] = stack.enter_context(open(info.file, "rb"))
            f = handles[info.file]
            for offset in _sample_offsets(info.begin, info.end):
                f.seek(offset)
                h.update(f.read(min(_SAMPLE_BYTES, info.end - offset)))
    return h.hexdigest()[:16]


def _canonical_name(cfg: ModelConfig, name: str, tensors: dict[str, _TensorInfo]) -> str:
    # A tied matrix saved only as lm_head.weight (safetensors' save_model keeps that alias) is the
    # same model as one saved as model.embed_tokens.weight.
    if cfg.tie_word_embeddings and name == "lm_head.weight" and "model.embed_tokens.weight" not in tensors:
        return "model.embed_tokens.weight"
    return name


def _sample_offsets(begin: int, end: int) -> list[int]:
    if end - begin <= 3 * _SAMPLE_BYTES:
        return [begin]
    mid = begin + (end - begin) // 2
    return [begin, mid, end - _SAMPLE_BYTES]


def _build(cfg: ModelConfig, tensors: dict[str, _TensorInfo], dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    from safetensors import SafetensorError, safe_open

    # Parameters start uninitialized in the target dtype and device; load_weights fills all.
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name, info in tensors.items():
            by_file.setdefault(info.file, []).append(name)
        for file, names in by_file.items():
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in names:
                        yield name, f.get_tensor(name)
            except SafetensorError as e:
                raise ModelLoadError(f"corrupt safetensors file {file}: {e}") from e

    try:
        model.load_weights(stream())
    except ModelLoadError:
        raise
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    return model.eval().requires_grad_(False)

