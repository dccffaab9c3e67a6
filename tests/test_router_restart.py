"""Clients across a router restart: a real ``python -m frontend.server`` process killed and
started again on the same ports, in front of an in-process decode node (real gRPC, Redis, a
tiny random model carrying SmolLM2's tokenizer). A request sent while the router is down
completes once it is back: the pdserve SDK with its default retry budget, and the official
``openai`` client with its own connection-error retries. Plus the SDK's retry policy on plain
data (no clock, a seeded jitter)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest

import pdserve
from pdserve.core import DEFAULT_BACKOFF, DEFAULT_RETRY_BUDGET_S, Backoff, Deadline, RetryPolicy

REPO = Path(__file__).resolve().parents[1]
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
OVERLOADED = grpc.StatusCode.RESOURCE_EXHAUSTED


# ----------------------------------------------------------------------------- the policy, plain data
def outage_covered(policy: RetryPolicy) -> float:
    """Instantly refused attempts, each followed by the policy's wait: when the last retry
    starts, counted from the first failure (the longest outage the call rides out)."""
    elapsed, attempts = 0.0, 1
    while (delay := policy.delay(UNAVAILABLE, attempts, Deadline(None), elapsed)) is not None:
        elapsed += delay
        attempts += 1
    return elapsed


@pytest.mark.parametrize("seed", range(50))
def test_default_budget_rides_out_several_seconds_and_stops_at_ten(seed):
    base, cap = DEFAULT_BACKOFF
    policy = RetryPolicy(None, Backoff(base, cap, random.Random(seed)))
    covered = outage_covered(policy)
    # A wait is at most the cap, so the last retry starts after budget - cap (8 s), never after the budget.
    assert DEFAULT_RETRY_BUDGET_S - cap <= covered <= DEFAULT_RETRY_BUDGET_S


def test_count_limit_budget_off_deadline_and_codes():
    backoff = Backoff(0.1, 2.0, random.Random(1))
    assert RetryPolicy(0, backoff).delay(UNAVAILABLE, 1, Deadline(None)) is None  # 0: never retry
    three = RetryPolicy(3, backoff)
    assert all(three.delay(UNAVAILABLE, k, Deadline(None)) is not None for k in (1, 2, 3))
    assert three.delay(UNAVAILABLE, 4, Deadline(None)) is None
    unbounded = RetryPolicy(None, backoff, budget_s=None)
    assert unbounded.delay(UNAVAILABLE, 10_000, Deadline(None), elapsed=1e6) is not None
    assert unbounded.delay(UNAVAILABLE, 1, Deadline(0.0)) is None  # the call's deadline still binds
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert RetryPolicy(None, backoff).delay(code, 1, Deadline(None)) is None
    with pytest.raises(ValueError):
        RetryPolicy(-1, backoff)
    with pytest.raises(ValueError):
        RetryPolicy(None, backoff, float("nan"))


@pytest.mark.parametrize("seed", range(20))
def test_overload_waits_the_servers_hint_plus_jitter_within_the_budget(seed):
    """RESOURCE_EXHAUSTED is retried like UNAVAILABLE, each wait at least the server's hint:
    clients refused together spread out instead of coming back at the same instant."""
    base, cap = DEFAULT_BACKOFF
    policy = RetryPolicy(None, Backoff(base, cap, random.Random(seed)), budget_s=5.0)
    elapsed, attempts, waits = 0.0, 1, []
    while True:
        delay, why = policy.decide(OVERLOADED, attempts, Deadline(None), elapsed, retry_after_s=0.2)
        if delay is None:
            break
        waits.append(delay)
        elapsed += delay
        attempts += 1
    assert waits and all(0.2 <= w <= 0.2 + cap for w in waits)
    assert elapsed <= 5.0 and "retry_budget_s=5" in why
    # A hint beyond the budget is not waited for; nor one the call's deadline would not survive.
    assert "retry budget spent" in policy.decide(OVERLOADED, 1, Deadline(None), 0.0, retry_after_s=6.0)[1]
    assert "timeout" in policy.decide(OVERLOADED, 1, Deadline(0.1), 0.0, retry_after_s=0.2)[1]
    assert RetryPolicy(2, policy.backoff).decide(OVERLOADED, 3, Deadline(None))[1] == "retries=2 used up"


def test_client_defaults_are_time_based():
    with pdserve.Client("127.0.0.1:1") as c:
        assert c.retries is None and c.retry_budget_s == DEFAULT_RETRY_BUDGET_S == 10.0
    with pdserve.Client("127.0.0.1:1", retries=0, retry_budget_s=None) as c:
        assert c.retries == 0 and c.retry_budget_s is None


# ----------------------------------------------------------------------------- a real router restart
@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    from engine.models.tiny import save_tiny_chat_model

    # SmolLM2's vocabulary, so the router tokenizes chat prompts for real (as tests/test_chaos.py).
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "chat", seed=3)
    return model


class RouterProcess:
    """``python -m frontend.server`` on fixed ports; the Redis password through the environment."""

    def __init__(self, model: Path, redis_server, namespace: str, grpc_port: int, http_port: int) -> None:
        url = urlsplit(redis_server.url)
        self.args = [sys.executable, "-m", "frontend.server", "--redis-url", f"redis://{url.hostname}:{url.port}/0",
                     "--namespace", namespace, "--tokenizer-dir", str(model), "--model-name", "m",
                     "--max-model-len", "512", "--port", str(grpc_port), "--http-port", str(http_port),
                     "--ready-min-prefill", "0", "--node-refresh-s", "0.1", "--drain-timeout", "1"]
        self.env = dict(os.environ, PDSERVE_REDIS_PASSWORD=redis_server.password, PYTHONPATH=str(REPO))
        self.proc: subprocess.Popen | None = None
        self.address = f"127.0.0.1:{grpc_port}"
        self.base_url = f"http://127.0.0.1:{http_port}/v1"

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, env=self.env, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self.listening = threading.Event()
        threading.Thread(target=self._read, args=(self.proc, self.output, self.listening), daemon=True).start()

    @staticmethod
    def _read(proc, output: list[str], listening: threading.Event) -> None:
        for line in proc.stdout:  # drained to the end, so the router never blocks on a full pipe
            output.append(line)
            if line.startswith("router listening"):
                listening.set()

    def wait_serving(self, timeout: float = 90.0) -> None:
        """Until it printed its address and reports SERVING (it sees the decode node)."""
        deadline = time.monotonic() + timeout
        while not self.listening.wait(0.1):
            assert self.proc.poll() is None, "router exited:\n" + "".join(self.output)
            assert time.monotonic() < deadline, "router did not start:\n" + "".join(self.output)
        with pdserve.Client(self.address, timeout=5) as c:
            while not c.health():
                assert time.monotonic() < deadline, "router never saw the decode node"
                time.sleep(0.05)

    def kill(self) -> None:
        """A crash: SIGKILL, nothing drained; its ports close with the process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture
def decode_node(redis_url, chat_model):
    from engine.config import CacheConfig, EngineConfig
    from tests.clusters import start_node

    namespace = f"restart-{uuid.uuid4().hex[:6]}"
    node = start_node("decode", "decode-0", EngineConfig(model=str(chat_model), device="cpu", num_threads=1,
                                                         cache=CacheConfig(block_size=16, num_blocks=128)),
                      redis_url=redis_url, namespace=namespace, lease_s=2.0, heartbeat_s=0.2)
    yield namespace
    node.stop()


def wait_until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


MESSAGES = [{"role": "user", "content": "Say something about routers."}]


def test_sdk_and_openai_requests_sent_while_the_router_is_down_complete_after_it_restarts(
        chat_model, redis_server, decode_node):
    import openai

    from deploy.redis_server import free_port

    router = RouterProcess(chat_model, redis_server, decode_node, free_port(), free_port())
    router.start()
    try:
        router.wait_serving()
        # The reference answers, router up (greedy, fixed length: the restart must change nothing).
        with pdserve.Client(router.address, timeout=120) as c:
            want_sdk = c.complete(MESSAGES, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids
        sent: list = []  # every HTTP attempt the openai client makes
        # openai's own client class (httpx or httpx2, by release), with a hook that counts attempts
        http = openai.DefaultHttpxClient(event_hooks={"request": [sent.append]})
        # What users should set across a restart: max_retries covering the restart (its waits
        # grow 0.5, 1, 2, 4, 8, 8 ... s: 10 retries span about a minute) and a timeout.
        oai = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=10, timeout=60, http_client=http)

        def chat() -> list:
            resp = oai.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, temperature=0.0,
                                               extra_body={"ignore_eos": True})
            return [resp.choices[0].message.content, resp.choices[0].finish_reason, resp.usage.completion_tokens]

        want_oai = chat()
        sent.clear()

        router.kill()
        results: dict[str, object] = {}
        sdk = pdserve.Client(router.address, timeout=120)  # the default retry budget
        stream = sdk.generate(MESSAGES, max_tokens=8, temperature=0.0, ignore_eos=True)

        def run(name, fn):
            try:
                results[name] = fn()
            except Exception as e:  # reported by the assertion below
                results[name] = e

        threads = [threading.Thread(target=run, args=("sdk", lambda: [ch.token_ids for ch in stream])),
                   threading.Thread(target=run, args=("openai", chat))]
        for t in threads:
            t.start()
        # Both refused at least once (connection refused), and retrying, before the router is back.
        wait_until(lambda: stream.attempts >= 2 and len(sent) >= 2, "both clients to retry a refused connection")
        down_at = time.monotonic()
        router.start()
        router.wait_serving()
        print(f"router restarted in {time.monotonic() - down_at:.2f} s")
        for t in threads:
            t.join(150)
        assert not any(t.is_alive() for t in threads)
        got_sdk = results["sdk"]
        assert not isinstance(got_sdk, Exception), got_sdk
        assert tuple(t for ids in got_sdk for t in ids) == want_sdk
        assert stream.completion.finish_reason == "length"
        assert results["openai"] == want_oai
        assert len(sent) >= 3  # refused twice or more, then answered
        sdk.close()
        oai.close()
    finally:
        router.kill()
