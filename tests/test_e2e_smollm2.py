"""End to end on the builtin SmolLM2-135M-Instruct: engine vs transformers, stop strings, CLI."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.tokenizer import encode_chat
from tokens.sampling_params import SamplingParams

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smol():
    return LLMEngine(EngineConfig(
        model="smollm2-135m", dtype="float32", device="cpu",
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),  # forces chunked prefill
    ))


def test_greedy_matches_transformers_in_one_batch(smol):
    import transformers

    from engine.models.builtin import resolve_builtin

    questions = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?"]
    prompts = [encode_chat(smol.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    outs = smol.generate(prompts, params)
    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_builtin("smollm2-135m"), dtype=torch.float32)
    eos = list(smol.eos_token_ids)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0])[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref
    assert "Paris" in outs[0].outputs[0].text


def test_stop_string_truncates_and_finishes(smol):
    ids = smol.encode("What is the capital of France?", chat=True)
    out = smol.generate([ids], SamplingParams(temperature=0.0, max_tokens=32, stop=("Paris",)))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop"
    assert "Paris" not in c.text and c.text.startswith("The capital of France is")
    assert smol.kv.num_free_blocks == smol.num_blocks


def test_streamed_deltas_add_up_to_the_text(smol):
    ids = smol.encode("Write one sentence about the ocean.", chat=True)
    deltas, last = [], None
    for out in smol.stream(ids, SamplingParams(temperature=0.0, max_tokens=24)):
        deltas += [c.text_delta for c in out.outputs]
        last = out
    assert "".join(deltas) == last.outputs[0].text
    assert smol.tokenizer.decode(last.outputs[0].token_ids, skip_special_tokens=True) == last.outputs[0].text


def test_cli_generate_streams_and_reports_speed():
    r = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "generate", "--max-tokens", "8", "What is the capital of France?"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr


def test_cli_rejects_unknown_model_and_long_prompt_clearly():
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "generate", "--model", "no-such-model", "hi"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "no-such-model" in r.stderr and "smollm2-135m" in r.stderr
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "generate", "--max-tokens", "9000", "hi"],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "9000" in r.stderr and "8192" in r.stderr
