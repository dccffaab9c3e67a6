"""What the node-failure tests share (tests/test_fault_migration.py, tests/test_gray_failures.py):
four requests, the answer a single engine gives them, a cluster of three in-process nodes and a
router, and the requests as concurrent client streams.

- ``requests``: the four requests (token ids, sampling fields).
- ``reference_run``: a single engine's tokens for a request, the answer without the fault.
- ``three_node_cluster``: prefill-0, decode-0, decode-1 and a router in a fresh namespace (a
  generator: a fixture yields from it).
- ``Streams``: the requests as client streams, one thread each; a module subclasses it with
  its ``requests`` and ``max_tokens``.
"""
from __future__ import annotations

import threading
import time
import uuid

import pdserve
from tests.clusters import start_node, start_router
from tests.helpers import engine_config, prompt, wait_for

DEADLINE_S = 60.0


def requests(**seeded) -> list[tuple[list[int], dict]]:
    """Two prompts take the disaggregated path (>= 32 tokens), two prefill on the decode node; one
    of each samples with a seed. ``seeded``: more sampling fields for the long seeded request."""
    return [
        (prompt(1, 80), {"temperature": 0.0}),
        (prompt(2, 20), {"temperature": 0.0}),
        (prompt(3, 64), {"temperature": 0.9, "top_p": 0.9, "seed": 11, **seeded}),
        (prompt(4, 24), {"temperature": 0.8, "seed": 5}),
    ]


def reference_run(model: str, max_tokens: int):
    """``run(ids, **sampling)``: the tokens one engine on ``model`` (CPU, no fault) generates for
    a request, ``max_tokens`` of them (EOS ignored); each request computed once."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from tokens.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=model, device="cpu", num_threads=1), load_tokenizer=False)
    memo: dict = {}

    def run(ids, **sampling) -> list[int]:
        key = (tuple(ids), tuple(sorted(sampling.items())))
        if key not in memo:
            out = engine.generate([ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))
            memo[key] = list(out[0].outputs[0].token_ids)
        return memo[key]

    return run


def three_node_cluster(redis_url: str, tok_dir: str, model: str, *, prefix: str, **router_fields):
    """prefill-0, decode-0 and decode-1 (node servers in this process, short leases) and a router
    over them in a fresh namespace ``prefix-…``; yields ``(router, nodes)`` once the router is
    healthy, then stops them all (nodes a test crashed are already stopped). ``router_fields``:
    RouterConfig fields over these (a 512-token window, prompts of 32 tokens and more
    disaggregated)."""
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    eng = engine_config(model, num_blocks=256)
    nodes = {nid: start_node(role, nid, eng, redis_url=redis_url, namespace=ns, lease_s=1.5, heartbeat_s=0.2,
                             grpc_workers=8)
             for nid, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"))}
    router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=512, short_prompt_tokens=32,
                          vocab_size=512, **router_fields)
    with pdserve.Client(router.address) as c:
        wait_for(c.health, timeout=20, every=0.1)
    yield router, nodes
    for s in nodes.values():  # a slowed or wedged engine stops at once
        if s.aengine is not None:
            s.aengine.step_delay_s = 0.0
    router.stop()
    for s in nodes.values():
        if s.aengine is not None and s.aengine.alive:
            s.stop(grace_s=0)


class Streams:
    """The requests as concurrent client streams (one thread each), token ids as they arrive.
    A subclass sets ``requests`` and ``max_tokens``; ``which``: the indices sent (default all).
    ``tokens`` and ``finish`` are indexed like ``requests``."""

    requests: list[tuple[list[int], dict]] = []
    max_tokens: int = 0

    def __init__(self, address: str, which: range | None = None) -> None:
        self.which = list(range(len(self.requests)) if which is None else which)
        self.tokens: list[list[int]] = [[] for _ in self.requests]
        self.finish: list[str | None] = [None] * len(self.requests)
        self.errors: list[BaseException] = []
        self._client = pdserve.Client(address, timeout=DEADLINE_S, retries=0)
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in self.which]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        ids, sampling = self.requests[i]
        try:
            with self._client.generate(token_ids=ids, max_tokens=self.max_tokens, ignore_eos=True,
                                       **sampling) as stream:
                for chunk in stream:
                    self.tokens[i].extend(chunk.token_ids)
                self.finish[i] = stream.completion.finish_reason
        except BaseException as e:  # reported by the test
            self.errors.append(e)

    def wait_until(self, cond, what: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; tokens so far {self.tokens}"
            time.sleep(0.01)

    def wait_tokens(self, n: int) -> None:
        """Until every stream sent has ``n`` tokens."""
        assert wait_for(lambda: all(len(self.tokens[i]) >= n for i in self.which), timeout=DEADLINE_S), self.tokens

    def join(self) -> float:
        """Wait for every stream to end; the seconds that took."""
        t0 = time.monotonic()
        for t in self._threads:
            t.join(DEADLINE_S)
        self._client.close()
        return time.monotonic() - t0

    def assert_exact(self, reference, *, finish: str | None = None) -> None:
        """No error, and each stream's tokens equal ``reference``'s (no token lost, none twice,
        the same sampling draws); each ended for ``finish`` if given."""
        assert not self.errors, self.errors
        for i in self.which:
            ids, sampling = self.requests[i]
            assert self.tokens[i] == reference(ids, **sampling), i
            if finish is not None:
                assert self.finish[i] == finish, i
