"""Request migration, the parts without sockets: a request resumed on a fresh engine from its
prompt + the output tokens already streamed continues exactly as the run that never failed
(greedy and seeded, with penalties and min_tokens), and the router's bookkeeping for it
(router/migration.py)."""
from __future__ import annotations

import random

import grpc
import pytest

from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from engine.models.tiny import save_tiny_model
from kv_index.nodes import NodeInfo
from router.migration import Exclusions, continuation, is_node_failure
from tokens.sampling_params import SamplingParams

MAX_TOKENS = 24
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
    "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=MAX_TOKENS, min_tokens=12,
                             presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.2),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=5)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                  cache=CacheConfig(block_size=4, num_blocks=512)), load_tokenizer=False)


def run(engine: LLMEngine, prompt, params, **kw) -> list[int]:
    rid = engine.add_request(prompt_token_ids=prompt, params=params, **kw)
    tokens: list[int] = []
    while True:
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.outputs[0].new_token_ids
                if out.finished:
                    return tokens


@pytest.mark.parametrize("kind", sorted(PARAMS))
def test_resumed_request_continues_the_uninterrupted_run(engine, kind):
    params = PARAMS[kind]
    prompt = [random.Random(1).randrange(3, 500) for _ in range(21)]
    whole = run(engine, prompt, params)
    assert len(whole) > 13
    for k in (1, 5, 13):
        # The engine streams only the tokens after the k already streamed: no duplicate, no gap.
        rest = run(engine, prompt + whole[:k], params, resumed_output_tokens=k)
        assert whole[:k] + rest == whole, k


def test_resumed_count_is_checked(engine):
    p = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="leaves nothing to generate"):
        engine.add_request(prompt_token_ids=[5, 6, 7, 8, 9], params=p, resumed_output_tokens=4)
    with pytest.raises(InvalidRequestError, match="at least one must be prompt"):
        engine.add_request(prompt_token_ids=[5, 6], params=p, resumed_output_tokens=2)
    with pytest.raises(InvalidRequestError, match="n must be 1"):
        engine.add_request(prompt_token_ids=[5, 6, 7], params=SamplingParams(n=2, max_tokens=4),
                           resumed_output_tokens=1)


# ----------------------------------------------------------------------------- router bookkeeping
def test_continuation_appends_every_streamed_token_as_output():
    c = continuation([10, 11, 12], [7, 8], max_tokens=5)
    assert c.prompt == [10, 11, 12, 7, 8] and c.resumed_output_tokens == 2 and c.remaining_tokens == 3
    # a second migration continues from the client's prompt and all tokens so far
    c2 = continuation([10, 11, 12], [7, 8, 9], max_tokens=5)
    assert c2.prompt == [10, 11, 12, 7, 8, 9] and c2.resumed_output_tokens == 3 and c2.remaining_tokens == 2
    assert continuation([1], [], 4).resumed_output_tokens == 0  # failed before output: a plain retry


def test_which_failures_move_a_request():
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        assert is_node_failure(code) and is_node_failure(code.value[0])  # status, or in-stream Error.code
    # a failed engine step (INTERNAL) would fail the next node's batch too; the rest are about the request
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert not is_node_failure(code)
    assert not is_node_failure(999)  # an unknown number reads as UNKNOWN


def node(node_id: str, address: str, role: str = "decode") -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, grpc_address=address, fingerprint="f", block_size=16, num_blocks=8)


def test_exclusions_expire_and_spare_a_restarted_node():
    ex = Exclusions(exclude_s=10.0)
    dead = node("decode-0", "h:1")
    ex.exclude(dead, now=100.0)
    reborn = node("decode-0", "h:2")  # Ray restarted it on a new port: a new life, usable at once
    other = node("decode-1", "h:3")
    active = ex.active(now=105.0)
    assert Exclusions.usable([dead, reborn, other], active) == [reborn, other]
    assert ex.active(now=110.0) == frozenset()  # expired
    assert Exclusions.usable([dead], ex.active(now=110.0)) == [dead]


# ----------------------------------------------------------------------------- text across the break
@pytest.fixture(scope="module")
def text_engine(tmp_path_factory):
    from engine.models.builtin import resolve_builtin
    from engine.tokenizer import load_hf_tokenizer

    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "wide", vocab_size=49152, seed=4)
    tok = load_hf_tokenizer(resolve_builtin("smollm2-135m"))
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                  cache=CacheConfig(block_size=4, num_blocks=256)), tokenizer=tok)


def node_stream(tok, prompt, outs, stop) -> list[str]:
    """The text deltas a node streams for ``outs``, one token per step (engine/sequence_text.py)."""
    from tokens.detokenizer import IncrementalDetokenizer, StopStringMatcher

    detok, stops, parts = IncrementalDetokenizer(tok, prompt), StopStringMatcher(stop, False) if stop else None, []
    for i, t in enumerate(outs):
        last = i == len(outs) - 1
        delta = detok.step([t]) + (detok.flush() if last else "")
        if stops is not None:
            delta, hit = stops.feed(delta)
            if last and not hit:
                delta += stops.flush()
        parts.append(delta)
    return parts


@pytest.mark.parametrize("stop", [(), ("Smile!",)])
def test_text_goes_on_where_the_client_stopped(text_engine, stop):
    """The break falls inside an emoji's bytes (held back by the first node, so the client has
    not seen them) and, with a stop string, inside a possible stop string's start: the next
    node's text begins with what was held back, so the client's text is the uninterrupted one."""
    tok = text_engine.tokenizer
    prompt = tok.encode("Say something.", add_special_tokens=False)
    earlier = tok.encode("Smile 😀", add_special_tokens=False)[:3]  # "Smile " + the emoji's first bytes
    assert tok.decode(earlier).endswith("\ufffd")
    params = SamplingParams(temperature=0.0, max_tokens=len(earlier) + 6, ignore_eos=True, stop=stop)
    rid = text_engine.add_request(prompt_token_ids=prompt + earlier, params=params,
                                  resumed_output_tokens=len(earlier))
    new_ids, text_after, done = [], "", False
    while not done:
        for out in text_engine.step():
            if out.request_id == rid:
                new_ids += out.outputs[0].new_token_ids
                text_after += out.outputs[0].text_delta
                done = out.finished
    whole = node_stream(tok, prompt, earlier + new_ids, stop)
    assert "".join(whole[: len(earlier)]) != tok.decode(earlier)  # the first node held text back
    assert text_after == "".join(whole[len(earlier):])
