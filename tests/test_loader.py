"""load_model: error cases, fingerprints, sharded checkpoints, and the builtin SmolLM2 (e2e)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import save_hf_model, tiny_config
from engine.models.config import ModelConfig, UnsupportedModelError
from engine.models.loader import ModelLoadError, load_model

REPO = Path(__file__).resolve().parents[1]


def _weights(directory: Path) -> Path:
    return directory / "model.safetensors"


def test_unknown_builtin_name_lists_builtins():
    with pytest.raises(ModelLoadError, match="smollm2-135m"):
        load_model("no-such-model", torch.float32, "cpu")


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a builtin name"):
        load_model(str(tmp_path / "absent"), torch.float32, "cpu")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_truncated_safetensors_names_the_file(tiny_llama_dir):
    path = _weights(tiny_llama_dir)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(ModelLoadError, match="truncated.*model.safetensors"):
        load_model(str(tiny_llama_dir), torch.float32, "cpu")


def test_garbage_safetensors_header(tiny_llama_dir):
    _weights(tiny_llama_dir).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ModelLoadError, match="corrupt safetensors file .*model.safetensors"):
        load_model(str(tiny_llama_dir), torch.float32, "cpu")


def test_missing_tensor(tiny_llama_dir):
    tensors = load_file(_weights(tiny_llama_dir))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, _weights(tiny_llama_dir), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing tensors: model.layers.1.mlp.down_proj.weight"):
        load_model(str(tiny_llama_dir), torch.float32, "cpu")


def test_unexpected_tensor(tiny_llama_dir):
    tensors = load_file(_weights(tiny_llama_dir))
    tensors["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    save_file(tensors, _weights(tiny_llama_dir), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="unexpected tensors.*mystery"):
        load_model(str(tiny_llama_dir), torch.float32, "cpu")


def test_shape_mismatch_against_config(tiny_llama_dir):
    cfg_path = tiny_llama_dir / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["intermediate_size"] = 128
    cfg_path.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"mlp\.\w+_proj\.weight.* has shape \(\d+, \d+\), expected"):
        load_model(str(tiny_llama_dir), torch.float32, "cpu")


def test_bad_gguf_fails_cleanly_and_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF but not really")
    with pytest.raises(ModelLoadError, match="cannot convert GGUF file"):
        load_model(str(bogus), torch.float32, "cpu")
    leftovers = list((tmp_path / "cache" / "gguf").iterdir())
    assert leftovers == []


def test_unsupported_config_feature():
    raw = tiny_config().to_dict() | {"architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_hf(raw)


def test_rope_parameters_in_both_layouts():
    v5 = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    v4 = {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    base = tiny_config().to_dict() | {"architectures": ["LlamaForCausalLM"]}
    base.pop("rope_parameters", None)
    a, b = ModelConfig.from_hf(base | v5), ModelConfig.from_hf(base | v4)
    assert a == b and a.rope_theta == 5e5 and a.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_sliding_window_caps_max_model_len():
    base = tiny_config().to_dict() | {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert ModelConfig.from_hf(base | {"sliding_window": 64}).max_model_len == 64
    assert ModelConfig.from_hf(base | {"sliding_window": None}).max_model_len == 256
    qwen = base | {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64, "use_sliding_window": False}
    assert ModelConfig.from_hf(qwen).max_model_len == 256


def test_eos_token_ids_int_or_list():
    base = tiny_config().to_dict() | {"architectures": ["LlamaForCausalLM"]}
    assert ModelConfig.from_hf(base | {"eos_token_id": 2}).eos_token_ids == (2,)
    assert ModelConfig.from_hf(base | {"eos_token_id": [2, 7]}).eos_token_ids == (2, 7)


def _fingerprint_in_subprocess(directory: Path) -> str:
    code = (
        "import sys, torch; from engine.models.loader import load_model; "
        "print(load_model(sys.argv[1], torch.float32, 'cpu').fingerprint)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_fingerprint_stable_and_weight_sensitive(tmp_path):
    save_hf_model(tiny_config(), tmp_path / "a", seed=0)
    save_hf_model(tiny_config(), tmp_path / "b", seed=1)
    a1 = load_model(str(tmp_path / "a"), torch.float32, "cpu").fingerprint
    a2 = load_model(str(tmp_path / "a"), torch.float32, "cpu").fingerprint
    b = load_model(str(tmp_path / "b"), torch.float32, "cpu").fingerprint
    assert a1 == a2 != b
    assert len(a1) == 16 and int(a1, 16) >= 0
    assert _fingerprint_in_subprocess(tmp_path / "a") == a1


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = save_hf_model(tiny_config(), tmp_path / "one", seed=3)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    one = load_model(str(tmp_path / "one"), torch.float32, "cpu")
    sharded = load_model(str(tmp_path / "sharded"), torch.float32, "cpu")
    for (n1, p1), (n2, p2) in zip(one.model.state_dict().items(), sharded.model.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    # Same weights, same model: sharding is storage, not identity.
    assert one.fingerprint == sharded.fingerprint


def test_missing_shard_is_reported(tmp_path):
    save_hf_model(tiny_config(), tmp_path / "m").save_pretrained(tmp_path / "m", max_shard_size="40KB")
    (tmp_path / "m" / "model.safetensors").unlink(missing_ok=True)
    shard = sorted((tmp_path / "m").glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"missing: {shard.name}"):
        load_model(str(tmp_path / "m"), torch.float32, "cpu")


def test_bfloat16_load(tiny_llama_dir):
    loaded = load_model(str(tiny_llama_dir), torch.bfloat16, "cpu")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


# ---------------------------------------------------------------------------- the cache format


def _transformers_loading_info(directory: Path) -> dict:
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True, local_files_only=True)
    return {k: sorted(v) for k, v in info.items() if k != "error_msgs"}


@pytest.mark.parametrize("tied", [True, False])
def test_the_converter_writes_what_save_pretrained_writes(tmp_path, tied):
    # What the builtin converter does to a GGUF-loaded model, on a tiny model: the same tensors
    # under the same names as the model's own save_pretrained, no lm_head alias in place of the
    # embeddings, a config other loaders read.
    from engine.models.builtin import _save_as_pretrained
    from engine.models.tiny import build_tiny_model, tiny_hf_config

    model = build_tiny_model(tiny_hf_config("llama", tie_word_embeddings=tied), seed=3)
    _save_as_pretrained(model, tmp_path / "ours")
    model.save_pretrained(tmp_path / "theirs")
    ours, theirs = load_file(_weights(tmp_path / "ours")), load_file(_weights(tmp_path / "theirs"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert "model.embed_tokens.weight" in ours and ("lm_head.weight" in ours) == (not tied)
    assert _transformers_loading_info(tmp_path / "ours") == {
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": []
    }
    assert json.loads((tmp_path / "ours/config.json").read_text())["tie_word_embeddings"] is tied


def test_a_cache_of_the_old_format_is_not_complete(tmp_path):
    # Format 1 (lm_head.weight only) was served by vLLM with zero embeddings: it must be rebuilt.
    from engine.models.builtin import _FORMAT_FILE, CACHE_FORMAT, _complete

    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (tmp_path / name).write_text("{}")
    assert not _complete(tmp_path)
    (tmp_path / _FORMAT_FILE).write_text(json.dumps({"format": CACHE_FORMAT - 1}))
    assert not _complete(tmp_path)
    (tmp_path / _FORMAT_FILE).write_text("not json")
    assert not _complete(tmp_path)
    (tmp_path / _FORMAT_FILE).write_text(json.dumps({"format": CACHE_FORMAT}))
    assert _complete(tmp_path)


# ---------------------------------------------------------------------------- e2e


@pytest.mark.e2e
def test_builtin_cache_is_a_standard_checkpoint():
    """transformers' own loader finds every tensor the architecture names in the builtin cache."""
    from safetensors import safe_open

    from engine.models.builtin import resolve_builtin

    directory = resolve_builtin("smollm2-135m")
    assert _transformers_loading_info(directory) == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    with safe_open(str(_weights(directory)), framework="pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    config = json.loads((directory / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config and "_name_or_path" not in config


@pytest.mark.e2e
def test_builtin_smollm2_matches_transformers():
    """Builtin SmolLM2-135M (converted once from the GGUF) vs transformers on the same weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.attention import get_attention_backend
    from engine.attention.kv_cache import allocate_kv_cache
    from engine.attention.metadata import AttentionMetadata

    load_model("smollm2-135m", torch.float32, "cpu")  # converts on first use (~20 s)
    t0 = time.perf_counter()
    loaded = load_model("smollm2-135m", torch.float32, "cpu")
    load_s = time.perf_counter() - t0
    assert load_s < 3.0, f"cached builtin load took {load_s:.2f} s"
    cfg = loaded.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152

    tok = AutoTokenizer.from_pretrained(loaded.tokenizer_path)
    assert tok.chat_template
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(prompt)["input_ids"]

    hf = AutoModelForCausalLM.from_pretrained(loaded.tokenizer_path, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()

    bs = 16
    kv = allocate_kv_cache(cfg, 8, bs, torch.float32, "cpu")
    attn = get_attention_backend(torch.device("cpu"), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    table = [5, 2, 7, 1, 3]
    tokens, out = list(ids), []
    chunk = tokens
    with torch.no_grad():
        for _ in range(8):
            n = len(tokens)
            attn.begin_step(AttentionMetadata.build([len(chunk)], [n], [table], bs))
            hidden = loaded.model(torch.tensor(chunk), torch.arange(n - len(chunk), n), kv, attn)
            out.append(int(loaded.model.compute_logits(hidden[-1:]).argmax()))
            tokens.append(out[-1])
            chunk = [out[-1]]
    assert out == ref, (tok.decode(out), tok.decode(ref))
