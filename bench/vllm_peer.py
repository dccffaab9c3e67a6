"""vLLM's side of `pdserve bench engine --baselines vllm`, run by vLLM's own Python.

    <vllm python> bench/vllm_peer.py IN.json OUT.json

vLLM pins packages the project's environment does not have (transformers, llguidance, numpy),
so this script runs in vLLM's environment (``make vllm``: .venv-vllm) and imports nothing of
the project: its input is a JSON file the bench wrote (the model directory, the requests as
token ids with their output lengths, the warm-up set, the batch and step budget, the mode), its
output one JSON file (seconds, per-request output lengths, the check prompts' greedy ids).

The run mirrors the engine's: the same requests queued at once (``LLM.generate`` takes them
all and batches them itself), at most ``batch`` sequences and ``step_tokens`` tokens a step,
prefix caching off, EOS ignored, greedy; warmed up on the same warm-up set through the same
call before the clock starts. ``mode`` is ``eager`` (``enforce_eager=True``) or ``compiled``
(vLLM's default, torch.compile of the model; its compile happens in the warm-up).
"""
from __future__ import annotations

import json
import sys
import time


def _prompts(token_lists):
    return [{"prompt_token_ids": list(p)} for p in token_lists]


def _params(SamplingParams, max_tokens: int):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[0]).read())
    from vllm import LLM, SamplingParams  # vLLM's environment only

    t_load = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], skip_tokenizer_init=True,
              enforce_eager=spec["mode"] == "eager", max_num_seqs=spec["batch"],
              max_num_batched_tokens=spec["step_tokens"], enable_prefix_caching=False,
              max_model_len=spec["max_model_len"], seed=0)
    load_s = time.perf_counter() - t_load

    def generate(reqs):
        outs = llm.generate(_prompts(p for p, _ in reqs), [_params(SamplingParams, o) for _, o in reqs],
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    generate(spec["warm"])
    t0 = time.perf_counter()
    got = generate(spec["requests"])
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "lengths": [len(g) for g in got], "load_s": load_s}
    if spec.get("check"):
        out["check_ids"] = generate(spec["check"])
    if spec.get("batch1"):
        p, o = spec["batch1"]
        generate([(p, 8)])  # batch 1 is its own shape: warm it too
        t0 = time.perf_counter()
        n = len(generate([(p, o)])[0])
        out["batch1_s"], out["batch1_tokens"] = time.perf_counter() - t0, n
    with open(argv[1], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":  # LLM starts its engine core in a spawned process: the guard is required
    raise SystemExit(main(sys.argv[1:]))
