"""One plain vLLM instance over the cases tests/test_vllm_node.py sends through a vLLM node: run
under vLLM's own Python (``python tests/vllm_reference.py MODEL_DIR < cases.json``), it prints one
JSON line, the generated token ids of each case. Only vLLM and the standard library here."""
import json
import sys


def main() -> None:
    from vllm import LLM, SamplingParams

    cases = json.load(sys.stdin)
    llm = LLM(model=sys.argv[1], dtype="float32", seed=0, enforce_eager=True, kv_cache_memory_bytes=512 << 20)
    # One at a time, as the test sends them: a batch of another shape may round differently.
    outs = [llm.generate([{"prompt_token_ids": c["prompt"]}], SamplingParams(**c["params"]), use_tqdm=False)[0]
            for c in cases]
    print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))


if __name__ == "__main__":  # vLLM may start its engine core in a spawned process
    main()
