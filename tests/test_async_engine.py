"""AsyncEngine: the engine on its own loop thread, driven from other threads."""
from __future__ import annotations

import threading
import time

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError
from node.engine_thread import AsyncEngine, EngineStoppedError, RequestFailedError
from tokens.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)


def make_engine(path, num_blocks=64) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=str(path), dtype="float32", device="cpu", num_threads=1,
                     cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                     scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)),
        load_tokenizer=False,
    )


@pytest.fixture()
def aengine(tiny_dir):
    events: list = []
    ae = AsyncEngine(make_engine(tiny_dir), on_kv_events=events.extend)
    ae.events = events
    yield ae
    ae.shutdown()


PROMPTS = [list(range(10 + 7 * i, 20 + 9 * i)) for i in range(4)]


def test_concurrent_submissions_from_threads_equal_one_engine(tiny_dir, aengine):
    ref = [o.outputs[0].token_ids for o in make_engine(tiny_dir).generate(PROMPTS, GREEDY)]
    got: dict[int, list[int]] = {}

    def client(i: int) -> None:
        stream = aengine.add_request(PROMPTS[i], GREEDY, request_id=f"r{i}")
        got[i] = [t for out in stream.iter(timeout=30) for t in out.outputs[0].new_token_ids]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(len(PROMPTS))] == ref
    # Blocks freed, prefix-cache registrations reported to the callback.
    assert aengine.run(lambda e: e.kv.num_free_blocks) == aengine.engine.num_blocks
    assert any(type(e).__name__ == "BlockStored" for e in aengine.events)


def test_stream_yields_one_token_per_step_then_finishes(aengine):
    outs = list(aengine.add_request([5, 6, 7, 8, 9], GREEDY).iter(timeout=30))
    assert [len(o.outputs[0].new_token_ids) for o in outs] == [1] * 8
    assert [o.finished for o in outs] == [False] * 7 + [True]
    assert outs[-1].outputs[0].finish_reason == "length"
    load = aengine.load
    assert load.num_blocks == 64 and load.running == 0 and load.waiting == 0


def test_the_engine_says_which_steps_ran_prompt_tokens(tiny_dir):
    """A prompt's step (or chunk) counts its tokens; a decode step none: the node's decode-only
    step time is taken over the latter (LoadSnapshot.decode_step_s)."""
    eng = make_engine(tiny_dir)
    eng.add_request(prompt_token_ids=list(range(3, 23)), params=GREEDY)
    eng.step()
    assert eng.last_step_prefill_tokens == 20
    eng.step()
    assert eng.last_step_prefill_tokens == 0
    eng.add_request(prompt_token_ids=list(range(30, 40)), params=GREEDY)  # a prompt beside a running decode
    eng.step()
    assert eng.last_step_prefill_tokens == 10


def test_load_reports_the_decode_only_step_time_apart(aengine):
    assert aengine.load.decode_step_s == 0.0 and aengine.load.step_s == 0.0  # nothing measured yet
    aengine.add_request(list(range(3, 43)), SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)).result(
        timeout=30)
    load = aengine.load
    assert load.step_s > 0 and load.decode_step_s > 0
    # One sequence decoded alone, its context 41-52 tokens over its decode steps.
    assert load.decode_step_running == 1.0 and 41 <= load.decode_step_tokens <= 52
    from kv_index.schema import LOAD_FIELDS  # what the node heartbeats
    assert {"decode_step_s", "decode_step_running", "decode_step_tokens"} <= set(load.as_dict()) & set(LOAD_FIELDS)


def test_cancel_mid_stream_aborts_and_frees_blocks(aengine):
    stream = aengine.add_request(list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=200))
    first = stream.get(timeout=30)
    assert first is not None and not first.finished
    assert aengine.run(lambda e: e.kv.num_free_blocks) < aengine.engine.num_blocks
    stream.cancel()
    rest = list(stream.iter(timeout=30))
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert aengine.run(lambda e: e.kv.num_free_blocks) == aengine.engine.num_blocks
    assert stream.get() is None  # ended streams stay ended
    stream.cancel()  # idempotent


def test_invalid_request_raises_at_submission(aengine):
    with pytest.raises(InvalidRequestError, match="empty"):
        aengine.add_request([], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        aengine.add_request([5, 6], SamplingParams(max_tokens=50), request_id="dup")
        aengine.add_request([5, 6], SamplingParams(max_tokens=50), request_id="dup")


def test_idle_loop_does_not_spin(aengine):
    aengine.add_request([5, 6, 7], GREEDY).result(timeout=30)
    time.sleep(0.05)
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(0.5)
    assert time.process_time() - cpu0 < 0.05 * (time.monotonic() - wall0)


def test_waiting_request_that_cannot_be_admitted_does_not_spin(tiny_dir):
    ae = AsyncEngine(make_engine(tiny_dir, num_blocks=8))
    try:
        assert ae.reserve_kv("hold", list(range(3, 31))) is not None  # 7 of 8 blocks
        stream = ae.add_request(list(range(40, 52)), SamplingParams(temperature=0.0, max_tokens=2))
        time.sleep(0.05)
        cpu0 = time.process_time()
        time.sleep(0.3)
        assert time.process_time() - cpu0 < 0.03
        assert ae.load.waiting == 1
        ae.release_kv("hold")  # a command wakes the loop; the request now fits
        assert stream.result(timeout=30).outputs[0].finish_reason == "length"
    finally:
        ae.shutdown()


class _FailingStep:
    """Delegates to a real engine; its step raises once while ``fail`` is set."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.fail = False

    def step(self):
        if self.fail:
            self.fail = False
            raise RuntimeError("injected step failure")
        return self._engine.step()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_step_failure_fails_open_requests_and_the_loop_keeps_serving(tiny_dir, caplog):
    wrapped = _FailingStep(make_engine(tiny_dir))
    ae = AsyncEngine(wrapped)
    try:
        # The loop is idle, so its next step is the one right after this request is added.
        wrapped.fail = True
        stream = ae.add_request([5, 6, 7], GREEDY, request_id="doomed")
        with pytest.raises(RequestFailedError, match="injected"):
            list(stream.iter(timeout=30))
        assert "engine step failed" in caplog.text
        assert ae.num_step_errors == 1
        assert ae.run(lambda e: e.kv.num_free_blocks) == wrapped.num_blocks
        out = ae.add_request([5, 6, 7], GREEDY).result(timeout=30)
        assert len(out.outputs[0].token_ids) == 8
    finally:
        ae.shutdown()


def test_shutdown_fails_open_streams_and_refuses_commands(tiny_dir):
    ae = AsyncEngine(make_engine(tiny_dir))
    stream = ae.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=200))
    ae.shutdown()
    assert not ae.alive
    with pytest.raises(EngineStoppedError):
        list(stream.iter(timeout=30))
    with pytest.raises(EngineStoppedError):
        ae.abort("x")


def test_progress_moves_layer_by_layer_inside_a_slow_step_and_stops_in_a_wedged_one(aengine):
    """A step that is merely slow (a long prompt chunk beside a full batch on a CPU core) still
    moves ``progress`` as each decoder layer finishes, so a decode node heartbeats its silent
    streams; a loop that stands between steps (``step_delay_s``: wedged) does not."""
    layers = aengine.engine.runner.model.layers
    at_layer: list[tuple[int, int]] = []  # (layer, progress as it starts), inside the step
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: at_layer.append((i, aengine.progress)))
             for i, layer in enumerate(layers)]
    try:
        list(aengine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=1)).iter(timeout=30))
    finally:
        for h in hooks:
            h.remove()
    first = at_layer[:len(layers)]  # the one step
    assert [i for i, _ in first] == list(range(len(layers)))
    assert [p - first[0][1] for _, p in first] == list(range(len(layers)))  # one more per layer done
    aengine.step_delay_s = 1.0  # wedged after each step: no layer runs, no iteration ends
    stream = aengine.add_request([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4))
    samples, t0 = [], time.monotonic()
    while time.monotonic() - t0 < 2.5:
        samples.append((time.monotonic(), aengine.progress))
        time.sleep(0.05)
    still = longest = 0.0
    for (t1, p1), (t2, p2) in zip(samples, samples[1:]):
        still = still + (t2 - t1) if p2 == p1 else 0.0
        longest = max(longest, still)
    assert longest >= 0.7, samples  # the loop stood still for most of each 1 s wedge
    aengine.step_delay_s = 0.0
    list(stream.iter(timeout=30))
