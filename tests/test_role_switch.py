"""Nodes change role live (node/role_switch.py, kv_index/roles.py).

- ``RoleStore`` against the real Redis; ``switch_refusal`` as pure logic.
- The live switch on real Ray node actors (tiny random model) under a router and a steady
  stream of concurrent greedy streams from the SDK: the prefill node turns decode and back
  through ``RoleStore.request`` (the planner's path) while they run. Every request completes
  once with the output of a run without switches, the node's cached blocks stay in the index,
  and its /metrics counted both switches.
- The fallback, driven by a real fault: the port the decode role must bind is held by a socket
  of the test, so the switch fails and the node serves its old role again over the same engine.
"""
from __future__ import annotations

import sys
import threading
import time
import urllib.request
import uuid

import pytest
import redis

from engine.config import EngineConfig, SpeculativeConfig
from kv_index.nodes import Role
from kv_index.roles import RoleStore, desired_key
from node.config import NodeConfig
from node.role_switch import switch_refusal
from tests.helpers import engine_config, prompt, wait_for

MAX_TOKENS = 16
THREADS = 16
DEADLINE_S = 60.0


# ---------------------------------------------------------------- RoleStore (real Redis)
def test_role_store_round_trip(redis_url):
    r = redis.Redis.from_url(redis_url)
    ns = f"roles-{uuid.uuid4().hex[:6]}"
    store = RoleStore(r, ns)
    assert store.desired("prefill-0") is None and store.all() == {}
    store.request("prefill-0", Role.DECODE, reason="decode queue 3x prefill")
    store.request("decode-1", "prefill")
    assert store.desired("prefill-0") is Role.DECODE
    assert store.reason("prefill-0") == "decode queue 3x prefill"
    assert store.all() == {"prefill-0": Role.DECODE, "decode-1": Role.PREFILL}
    assert RoleStore(r, "other-ns").all() == {}  # namespaced
    with pytest.raises(ValueError):
        store.request("decode-1", "both")  # refused, never stored
    r.hset(desired_key(ns), "decode-2", "both")  # a newer writer's role: ignored, not a crash
    assert store.desired("decode-2") is None and "decode-2" not in store.all()
    store.clear("prefill-0")
    assert store.desired("prefill-0") is None and store.reason("prefill-0") == ""
    r.close()


def test_switch_refusal_is_plain_config_logic():
    both = (Role.PREFILL, Role.DECODE)
    plain = dict(redis_url="redis://127.0.0.1:1", engine=EngineConfig(model="tiny"))
    cfg = NodeConfig(node_id="p", role="prefill", **plain)
    assert switch_refusal(cfg, Role.DECODE, both) is None
    assert "builds only prefill" in switch_refusal(cfg, Role.DECODE, (Role.PREFILL,))
    spec = NodeConfig(node_id="d", role="decode", redis_url="redis://127.0.0.1:1", engine=EngineConfig(
        model="tiny", speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2)))
    assert "speculative" in switch_refusal(spec, Role.PREFILL, both)
    if hasattr(NodeConfig, "tensor_parallel"):
        tp = NodeConfig(node_id="p", role="prefill", tensor_parallel=2, **plain)
        assert "tensor_parallel=2" in switch_refusal(tp, Role.DECODE, both)


def test_poll_switches_on_a_new_wish_and_does_not_retry_a_refused_one(redis_url):
    """``RoleSwitcher.poll`` over a real RoleStore, with a stand-in server whose factory builds
    one role only: the switch is refused once, counted once, and not retried every heartbeat."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from node.role_switch import RoleSwitcher
    from telemetry.role_switch_metrics import RoleSwitchMetrics

    r = redis.Redis.from_url(redis_url)
    store = RoleStore(r, f"poll-{uuid.uuid4().hex[:6]}")
    cfg = NodeConfig(node_id="p0", role="prefill", redis_url=redis_url, engine=EngineConfig(model="tiny"))
    server = SimpleNamespace(role=Role.PREFILL, config=cfg, address="127.0.0.1:1",
                             metrics=SimpleNamespace(registry=CollectorRegistry()))
    metrics = RoleSwitchMetrics("m", "p0")
    switcher = RoleSwitcher(server, lambda config, engine=None: None, metrics)

    def refused() -> float:
        return metrics.registry.get_sample_value("pdserve:role_switches_total", {
            "model_name": "m", "node_id": "p0", "from_role": "prefill", "to_role": "decode",
            "outcome": "refused"}) or 0.0

    switcher.poll(store)  # no wish: nothing
    assert refused() == 0
    store.request("p0", Role.DECODE)
    switcher.poll(store)
    assert wait_for(lambda: refused() == 1, 5)
    for _ in range(5):  # heartbeats go on: the same wish is not tried again
        switcher.poll(store)
    assert wait_for(lambda: not switcher.lock.locked(), 5) and refused() == 1
    assert switcher.server is server and switcher.switching is None
    store.clear("p0")
    r.close()


def test_status_marks_a_node_whose_desired_role_differs():
    import time

    from deploy.status import build_report, mark_switching, render
    from kv_index.nodes import NodeInfo

    nodes = {nid: NodeInfo(node_id=nid, role=role, grpc_address="127.0.0.1:1", fingerprint="f", block_size=16,
                           num_blocks=100, updated_at=time.time())
             for nid, role in (("p0", "prefill"), ("d0", "decode"))}
    report = build_report(nodes, {"p0": "no metrics", "d0": "no metrics"}, now=time.time())
    mark_switching(report, {"p0": Role.DECODE, "d0": Role.DECODE})
    rows = {r["node_id"]: r for rows in report["pools"].values() for r in rows}
    assert (rows["p0"]["switching"], rows["p0"]["desired_role"]) == (True, "decode")
    assert (rows["d0"]["switching"], rows["d0"]["desired_role"]) == (False, "decode")
    assert "switching prefill -> decode" in render(report)


# ---------------------------------------------------------------- live switch on Ray
class Load:
    """THREADS client threads, each streaming requests one after another (prompt ``i`` once,
    greedy) until ``stop``; what each request streamed, and every error."""

    def __init__(self, address: str) -> None:
        import pdserve

        self.tokens: dict[int, list[int]] = {}
        self.finish: dict[int, str] = {}
        self.errors: list[BaseException] = []
        self._next = iter(range(10**6))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._client = pdserve.Client(address, timeout=DEADLINE_S, retries=0)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(THREADS)]
        for t in self._threads:
            t.start()

    @staticmethod
    def prompt_of(i: int) -> list[int]:
        return prompt(i, 40 + (i * 13) % 41)  # 40..80 tokens: over short_prompt_tokens, disaggregated

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                i = next(self._next)
            got: list[int] = []
            try:
                with self._client.generate(token_ids=self.prompt_of(i), max_tokens=MAX_TOKENS, ignore_eos=True,
                                           temperature=0.0, request_id=f"req-{i}") as stream:
                    for chunk in stream:
                        got.extend(chunk.token_ids)
                    with self._lock:
                        assert i not in self.finish  # completed once
                        self.tokens[i], self.finish[i] = got, stream.completion.finish_reason
            except BaseException as e:  # reported by the test
                self.errors.append(e)

    @property
    def done(self) -> int:
        return len(self.finish)

    def stop(self) -> int:
        """Stop submitting; wait for the requests in flight; returns how many were submitted."""
        self._stop.set()
        for t in self._threads:
            t.join(DEADLINE_S)
        self._client.close()
        return next(self._next)


def serves(reader, node_id: str, role: Role) -> bool:
    n = reader.live_nodes().get(node_id)
    return n is not None and n.role == role and not n.draining


def switch_metrics(metrics_address: str) -> dict[tuple[str, str, str], float]:
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve:role_switches_total{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1: line.index("}")].split(","))
            key = tuple(labels[k].strip('"') for k in ("from_role", "to_role", "outcome"))
            out[key] = float(line.rsplit(" ", 1)[1])
        if line.startswith("pdserve:role_switch_seconds_sum{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1: line.index("}")].split(","))
            out[(labels["from_role"].strip('"'), labels["to_role"].strip('"'), "seconds")] = \
                float(line.rsplit(" ", 1)[1])
    return out


def test_prefill_node_turns_decode_and_back_under_live_streams(tiny_dir, tok_dir, redis_url, local_ray):
    import ray

    from engine.engine import LLMEngine
    from kv_index.reader import IndexReader
    from tests.clusters import spawn_actor, start_router
    from tokens.block_hash import hash_prompt_blocks
    from tokens.sampling_params import SamplingParams

    ns = f"switch-{uuid.uuid4().hex[:6]}"
    eng = engine_config(tiny_dir, num_blocks=2048)  # nothing cached is evicted during the test
    # The default lease (3 s): nothing here waits on a lease running out, and a CI run saw the
    # router refuse requests with "no live decode node" once, which only a lapsed decode-0 lease
    # explains; its index counters are in the failure message below if it happens again.
    # The prefill role's own step budget (NodeConfig.prefill_step_tokens): 384 tokens a step while
    # prefill-0 prefills, the engine's 512 while it decodes.
    common = dict(redis_url=redis_url, namespace=ns, lease_s=3.0, heartbeat_s=0.1, load_tokenizer=False,
                  engine=eng, grpc_workers=THREADS + 8, drain_timeout_s=20.0, prefill_step_tokens=384)
    budget = {Role.PREFILL: 384, Role.DECODE: eng.scheduler.max_num_batched_tokens}
    assert budget[Role.DECODE] != 384

    def step_tokens(nid: str) -> int | None:
        return ray.get(actors[nid].stats.remote(), timeout=30).get("step_tokens")

    actors = {nid: spawn_actor(role, nid, **common) for nid, role in (("prefill-0", "prefill"), ("decode-0", "decode"))}
    r = redis.Redis.from_url(redis_url)
    reader, roles = IndexReader(r, ns=ns), RoleStore(r, ns)
    router = None
    try:
        assert ray.get([a.ready.remote() for a in actors.values()], timeout=60) == [True, True]
        router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=512, short_prompt_tokens=32,
                              vocab_size=512)
        load = Load(router.address)
        assert wait_for(lambda: load.done >= THREADS, DEADLINE_S), load.errors
        # What prefill-0 cached by now stays listed through both switches (same engine, same pool).
        fp = reader.live_nodes()["prefill-0"].fingerprint.encode()
        hashes = {i: hash_prompt_blocks(Load.prompt_of(i), eng.cache.block_size, fp) for i in range(THREADS)}
        held = {i: reader.match(h, ["prefill-0"])["prefill-0"].blocks for i, h in hashes.items()}
        assert sum(held.values()) > 0
        old_address = ray.get(actors["prefill-0"].address.remote(), timeout=30)
        assert (step_tokens("prefill-0"), step_tokens("decode-0")) == (budget[Role.PREFILL], budget[Role.DECODE])

        metrics_address = reader.live_nodes()["prefill-0"].metrics_address  # kept across switches
        took = []  # (switch, seconds from the wish to the registry's new role, the node's own figure)
        for to_role in (Role.DECODE, Role.PREFILL):
            before, t0 = load.done, time.monotonic()
            roles.request("prefill-0", to_role, reason="test")  # the planner's path
            assert wait_for(lambda: serves(reader, "prefill-0", to_role), DEADLINE_S, every=0.01), load.errors
            frm = "decode" if to_role is Role.PREFILL else "prefill"
            seconds = time.monotonic() - t0
            # The node writes its new role in the new server's first heartbeat and counts the
            # switch once switch_role returns, a moment later: wait for the count.
            key = (frm, str(to_role), "seconds")
            assert wait_for(lambda: key in switch_metrics(metrics_address), DEADLINE_S, every=0.05)
            took.append((f"{frm}->{to_role}", seconds, switch_metrics(metrics_address)[key]))
            assert wait_for(lambda: load.done >= before + THREADS, DEADLINE_S), load.errors  # served on
            assert step_tokens("prefill-0") == budget[to_role]
            assert {i: reader.match(h, ["prefill-0"])["prefill-0"].blocks for i, h in hashes.items()} == held
        new_address = ray.get(actors["prefill-0"].address.remote(), timeout=30)
        assert new_address != old_address and reader.live_nodes()["prefill-0"].grpc_address == new_address

        # The drain's bound, driven: as a decode node with slow steps, prefill-0 is told to turn
        # prefill with 0.2 s to drain; its streams still running fail over (router/migration.py).
        p0 = actors["prefill-0"]
        roles.clear("prefill-0")  # direct use from here on: the poll must not switch it back
        assert ray.get(p0.switch_role.remote("decode", 10.0), timeout=30)["outcome"] == "ok"
        ray.get(p0.set_step_delay.remote(0.05), timeout=30)
        assert wait_for(lambda: ray.get(p0.stats.remote(), timeout=30).get("running", 0) >= 2, DEADLINE_S)
        timed_out = ray.get(p0.switch_role.remote("prefill", 0.2), timeout=30)
        ray.get(p0.set_step_delay.remote(0.0), timeout=30)
        assert timed_out["outcome"] == "timeout" and timed_out["failed_over"] >= 1, timed_out
        before = load.done
        assert wait_for(lambda: load.done >= before + THREADS, DEADLINE_S), load.errors
        submitted = load.stop()

        if load.errors:  # what the nodes' index links went through, for the next reader
            links = {nid: {k: v for k, v in ray.get(a.stats.remote(), timeout=30).items() if k.startswith("index_")}
                     for nid, a in actors.items()}
            raise AssertionError(f"{len(load.errors)} errors, first {load.errors[:3]}; index links: {links}")
        assert sorted(load.finish) == list(range(submitted))  # every request once, none lost
        ref = LLMEngine(eng, load_tokenizer=False)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = ref.generate([Load.prompt_of(i) for i in range(submitted)], params)
        for i, out in enumerate(outs):
            assert load.tokens[i] == list(out.outputs[0].token_ids), f"request {i}"
            assert load.finish[i] == "length"

        metrics = switch_metrics(metrics_address)
        assert metrics[("prefill", "decode", "ok")] == 2 and metrics[("decode", "prefill", "ok")] == 1
        assert metrics[("decode", "prefill", "timeout")] == 1
        moved = router.orchestrator.metrics.registry.get_sample_value(
            "pdserve:request_migrations_total", {"model_name": "m", "reason": "decode_failed"})
        assert moved >= timed_out["failed_over"]
        # Direct use: already prefill (nothing to do).
        assert ray.get(actors["prefill-0"].switch_role.remote("prefill", 5.0), timeout=30)["outcome"] == "unchanged"
        print(f"\nrole switch: {submitted} requests, {moved:.0f} moved on the timed-out switch; "
              + ", ".join(f"{what} {wish:.2f} s from the wish ({own:.3f} s on the node)" for what, wish, own in took))
    finally:
        stop_cluster(router, actors, r)


def stop_cluster(router, actors: dict, r) -> None:
    """The live tests' teardown: the router, then every node actor (drained, then killed), then
    the Redis client."""
    import ray

    if router is not None:
        router.stop()
    try:
        ray.get([a.stop.remote(drain_timeout_s=5.0) for a in actors.values()], timeout=60)
    finally:
        for a in actors.values():
            ray.kill(a, no_restart=True)
        r.close()


# ---------------------------------------------------------------- a new role that cannot start
class DecodeOnTakenPort:
    """The node actor's server factory (deploy/node_servers.py build_any_role), except that its decode
    role is deployed with a KV data port another process holds: that role's server fails to
    bind it (EADDRINUSE) when the node switches to it. The prefill role keeps a free port.
    Both roles share every configured port, so only a role-specific setting like this one
    leaves the old role able to start again (a port taken from both would fail both)."""

    roles = (Role.PREFILL, Role.DECODE)

    def __init__(self, port: int) -> None:
        self.port = port

    def __call__(self, config: NodeConfig, engine=None):
        from dataclasses import replace

        from deploy.node_servers import build_any_role

        if config.role is Role.DECODE:
            config = replace(config, kv_data_port=self.port)
        return build_any_role(config, engine)


def _generate(client, ids: list[int]) -> list[int]:
    got: list[int] = []
    with client.generate(token_ids=ids, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0) as stream:
        for chunk in stream:
            got.extend(chunk.token_ids)
        assert stream.completion.finish_reason == "length"
    return got


def test_a_new_role_that_cannot_start_gives_the_node_its_old_role_back_on_the_same_engine(
        tiny_dir, tok_dir, redis_url, local_ray):
    """The real fault: the port the decode role must bind is held by a listening socket of this
    test. prefill-0 is told to turn decode: the switch answers "failed", the node serves as
    prefill again (registry role, a new address, requests prefilled there and token-identical)
    in the same process over the same engine (its cache and counters kept), and its /metrics
    counted the failure."""
    import socket

    import ray
    from ray import cloudpickle

    import pdserve
    from engine.engine import LLMEngine
    from kv_index.reader import IndexReader
    from tests.clusters import spawn_actor, start_router
    from tokens.block_hash import hash_prompt_blocks
    from tokens.sampling_params import SamplingParams

    # The factory travels to the actor by value: pytest imports this file under a name the
    # actor's process cannot import.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    held = socket.create_server(("127.0.0.1", 0))  # listening: nothing else may bind it
    ns = f"switchfail-{uuid.uuid4().hex[:6]}"
    eng = engine_config(tiny_dir, num_blocks=512)
    # The default lease (3 s): nothing here waits on a lease running out, and a CI run saw the
    # router refuse requests with "no live decode node" once, which only a lapsed decode-0 lease
    # explains; its index counters are in the failure message below if it happens again.
    common = dict(redis_url=redis_url, namespace=ns, lease_s=3.0, heartbeat_s=0.1, load_tokenizer=False,
                  engine=eng, grpc_workers=8, drain_timeout_s=10.0)
    actors = {"prefill-0": spawn_actor("prefill", "prefill-0", build=DecodeOnTakenPort(held.getsockname()[1]),
                                       **common),
              "decode-0": spawn_actor("decode", "decode-0", **common)}
    p0 = actors["prefill-0"]
    r = redis.Redis.from_url(redis_url)
    reader = IndexReader(r, ns=ns)
    router = client = None
    try:
        assert ray.get([a.ready.remote() for a in actors.values()], timeout=60) == [True, True]
        router = start_router(redis_url, tok_dir, namespace=ns, max_model_len=512, short_prompt_tokens=32,
                              vocab_size=512)
        client = pdserve.Client(router.address, timeout=DEADLINE_S, retries=0)

        def routed_to(address: str) -> bool:
            return any(n.node_id == "prefill-0" and n.grpc_address == address
                       for n in router.orchestrator.refresher.view.nodes)

        old_address = ray.get(p0.address.remote(), timeout=30)
        assert wait_for(lambda: routed_to(old_address) and serves(reader, "decode-0", Role.DECODE), 20, every=0.05)
        ref_engine = LLMEngine(eng, load_tokenizer=False)

        def expected(ids: list[int]) -> list[int]:
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            return list(ref_engine.generate([ids], params)[0].outputs[0].token_ids)

        ids = prompt(7, 60)
        assert _generate(client, ids) == expected(ids)
        before = ray.get(p0.stats.remote(), timeout=30)
        assert before["prefills"] == 1
        fp = reader.live_nodes()["prefill-0"].fingerprint.encode()
        hashes = hash_prompt_blocks(ids, eng.cache.block_size, fp)
        cached = reader.match(hashes, ["prefill-0"])["prefill-0"].blocks
        assert cached > 0
        metrics_address = reader.live_nodes()["prefill-0"].metrics_address

        result = ray.get(p0.switch_role.remote("decode", 5.0), timeout=60)
        assert result["outcome"] == "failed", result
        assert "decode server failed to start" in result["reason"] and "Address already in use" in result["reason"]
        new_address = result["address"]
        assert new_address and new_address != old_address  # the old role on a fresh gRPC port
        assert ray.get(p0.address.remote(), timeout=30) == new_address

        # The registry: the old role at the new address, not draining; its blocks still listed.
        assert wait_for(lambda: serves(reader, "prefill-0", Role.PREFILL)
                        and reader.live_nodes()["prefill-0"].grpc_address == new_address, 10, every=0.05)
        assert reader.match(hashes, ["prefill-0"])["prefill-0"].blocks == cached
        # Served as prefill again, over the same engine: the same process (no restart), the
        # engine's cumulative counters go on, and the prompt it prefilled before is a cache hit.
        assert wait_for(lambda: routed_to(new_address), 10, every=0.05)
        assert _generate(client, ids) == expected(ids)
        after = ray.get(p0.stats.remote(), timeout=30)
        assert after["role"] == "prefill" and after["pid"] == before["pid"] and after["healthy"]
        assert after["prefills"] == 1  # this server's first: the router placed it here again
        assert after["prefix_cache_query_tokens"] > before["prefix_cache_query_tokens"]
        assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
        other = prompt(8, 50)  # and a prompt it never saw
        assert _generate(client, other) == expected(other)
        assert ray.get(p0.stats.remote(), timeout=30)["prefills"] == 2

        metrics = switch_metrics(metrics_address)  # the same endpoint, the fallback server's registry
        assert metrics[("prefill", "decode", "failed")] == 1
        assert metrics.get(("prefill", "decode", "ok"), 0) == 0
    finally:
        held.close()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        if client is not None:
            client.close()
        stop_cluster(router, actors, r)
