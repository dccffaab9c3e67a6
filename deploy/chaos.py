"""`pdserve chaos --scenario NAME [--json]`: a fault injected into a live local cluster while a
batch of concurrent greedy streams runs, compared with the same batch run without the fault.

    pdserve chaos --scenario kill-decode --json
    {"scenario": "kill-decode", "requests": 8, "completed": 8, "lost": 0, "duplicated_tokens": 0,
     "outputs_identical": true, "recovery_s": 0.41, ...}

The cluster is `pdserve up`'s (deploy/launcher.py: Redis, local Ray, node actors, router),
started here and stopped at the end. Scenarios:

    kill-decode    the decode actor serving most streams is killed (ray.kill, restart allowed)
                   once every stream is under way: the router migrates its streams
    kill-prefill   the prefill actor is killed while it prefills: the requests are placed again
                   (prefilled on the decode node); Ray restarts the actor and it registers again
    corrupt-kv     every prefill node damages each KV transfer after its checksum (a fault hook
                   in the node's own process, prefill_node/faults.py): the decode nodes refuse
                   them, write nothing, and recompute the prompts
    redis-restart  Redis is stopped before the batch (placement by the last known load, no
                   index) and started again, empty, mid-way: the nodes register again and
                   rebuild the index from their snapshots
    slow-node      one decode node's steps become 10x slower while it streams: placement leaves
                   it out (router/placement.py without_stragglers) and the next requests go to
                   the other decode node
    restart-router the router stops while half the streams run and starts again on the same
                   port after the other half were sent: the SDK retries those (refused before
                   the first chunk) and they complete; the cut ones end in the retryable
                   StreamInterruptedError

Figures: ``lost`` = requests that ended in an error or short of the reference's tokens;
``duplicated_tokens`` = tokens received beyond the reference's; ``outputs_identical`` = every
stream's token ids equal the fault-free run's; ``recovery_s`` = the longest wait, from the
fault, for the next token of a stream still open at the fault (its first, if it had none).
Per scenario: ``killed`` and ``restart_s`` (from the kill until the restarted node registered
again; null if not within ``--restart-timeout-s``); ``transfers_refused``; ``reregistered_s``
(from Redis's restart until every node is registered), ``index_rebuilt_s`` (until the nodes'
block entries in the index are back to ``index_blocks_before``) and ``index_blocks_after``; and
``migrations``, the router's migration counters over the faulted run (not for restart-router).
slow-node: ``recovery_s`` = from the slowdown until placement leaves the node out (null: not
within the timeout), ``placed_on_slow_node`` = Decode calls it admitted from the requests sent
after that. restart-router: a stream that ended in a retryable error with the reference's tokens
so far was reported to its client: not lost, compared as a prefix (``interrupted`` counts them);
``retried_before_start``, ``router_down_s``.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

SCENARIOS = ("kill-decode", "kill-prefill", "corrupt-kv", "redis-restart", "slow-node", "restart-router")

# Chat questions of different lengths: with the chat template every prompt is longer than
# `pdserve up`'s short_prompt_tokens, so each takes the disaggregated path first.
QUESTIONS = (
    "What is the capital of France?",
    "Name three colors and one thing of each color.",
    "What is 12 times 12? Explain the steps.",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "What does a CPU do in a computer?",
    "Give me one tip for better sleep.",
    "Translate 'thank you very much' into German and French.",
    "What is the largest planet in the solar system, and how large is it?",
    "Why is the sky blue?",
    "List the first five prime numbers.",
    "What is a load balancer?",
    "Describe a cat in one sentence.",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", required=True, choices=SCENARIOS)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    p.add_argument("--requests", type=int, default=8, help="concurrent greedy streams")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per stream (EOS ignored)")
    p.add_argument("--prefill-nodes", type=int, default=1)
    p.add_argument("--decode-nodes", type=int, default=2)
    p.add_argument("--node-threads", type=int, default=1, help="torch threads per node")
    p.add_argument("--step-delay-s", type=float, default=0.0,
                   help="slow every engine step by this much in both runs, so that a fault lands mid-way "
                        "on a fast model (a tiny test model)")
    p.add_argument("--restart-timeout-s", type=float, default=120.0,
                   help="how long to wait for Ray to restart the killed node (0: do not wait)")


def run(args: argparse.Namespace, engine) -> int:
    """The CLI: bring a cluster up, run the scenario, print the result, tear it down."""
    from deploy.launcher import ClusterConfig, LocalCluster

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    config = ClusterConfig(engine=engine, prefill_nodes=args.prefill_nodes, decode_nodes=args.decode_nodes,
                           grpc_port=0, http_port=None, dashboard_port=0, node_threads=args.node_threads,
                           namespace=f"chaos-{int(time.time())}")
    with LocalCluster(config, progress) as cluster:
        result = run_scenario(cluster, args.scenario, requests=args.requests, max_tokens=args.max_tokens,
                              step_delay_s=args.step_delay_s, restart_timeout_s=args.restart_timeout_s,
                              progress=progress)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2), flush=True)
    return 0 if result["lost"] == 0 and result["duplicated_tokens"] == 0 and result["outputs_identical"] else 1


# ----------------------------------------------------------------------------- one batch
@dataclass(slots=True)
class StreamLog:
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # monotonic arrival of each chunk
    finish: str | None = None
    error: str | None = None
    retryable: bool = False  # the error was one the SDK marks retryable (StreamInterruptedError, ...)
    attempts: int = 0  # Generate attempts the SDK made (retries before the first chunk)


class Batch:
    """Concurrent streams through the router (one SDK stream per thread)."""

    def __init__(self, address: str, prompts: list[list[dict]], max_tokens: int, timeout_s: float = 300.0,
                 retries: int | None = 0) -> None:
        import pdserve

        self.logs = [StreamLog() for _ in prompts]
        self.streams: list = [None] * len(prompts)
        self._client = pdserve.Client(address, timeout=timeout_s, retries=retries, retry_budget_s=timeout_s)
        self._threads = [threading.Thread(target=self._run, args=(i, p, max_tokens), daemon=True)
                         for i, p in enumerate(prompts)]
        self.timeout_s = timeout_s
        for t in self._threads:
            t.start()

    def _run(self, i: int, messages: list[dict], max_tokens: int) -> None:
        log = self.logs[i]
        try:
            with self._client.generate(messages, max_tokens=max_tokens, temperature=0.0, ignore_eos=True) as stream:
                self.streams[i] = stream
                for chunk in stream:
                    if chunk.token_ids:
                        log.tokens.extend(chunk.token_ids)
                        log.times.append(time.monotonic())
                log.finish = stream.completion.finish_reason
        except Exception as e:  # counted as lost, unless retryable where the scenario allows it
            log.error = f"{type(e).__name__}: {e}"
            log.retryable = bool(getattr(e, "retryable", False))
        finally:
            if self.streams[i] is not None:
                log.attempts = self.streams[i].attempts

    def wait_until(self, cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos: timed out waiting for {what}")
            time.sleep(0.01)

    def under_way(self, min_tokens: int) -> bool:
        """Every stream has at least ``min_tokens`` tokens or has ended."""
        return all(len(s.tokens) >= min_tokens or s.finish or s.error for s in self.logs)

    def join(self) -> list[StreamLog]:
        for t in self._threads:
            t.join(self.timeout_s)
        self._client.close()
        return self.logs


def compare(reference: list[StreamLog], faulted: list[StreamLog], retryable_ok: bool = False) -> dict:
    """The scenario's figures (see the module docstring). ``retryable_ok`` (restart-router): a
    stream that ended in a retryable error (cut mid-way) with a prefix of the reference's
    tokens is reported to its client, so not lost; its output is compared as that prefix."""
    def reported(r: StreamLog, f: StreamLog) -> bool:
        return retryable_ok and f.error is not None and f.retryable and r.tokens[:len(f.tokens)] == f.tokens

    completed = sum(1 for f in faulted if f.error is None and f.finish is not None)
    lost = sum(1 for r, f in zip(reference, faulted)
               if not reported(r, f) and (f.error is not None or f.finish is None or len(f.tokens) < len(r.tokens)))
    duplicated = sum(max(0, len(f.tokens) - len(r.tokens)) for r, f in zip(reference, faulted))
    identical = all(r.tokens == f.tokens or reported(r, f) for r, f in zip(reference, faulted))
    return {"requests": len(faulted), "completed": completed, "lost": lost, "duplicated_tokens": duplicated,
            "outputs_identical": identical}


def recovery_s(logs: list[StreamLog], fault_at: float) -> float:
    """The longest wait from the fault to the next token of a stream still open at the fault
    (its first token, if it had none yet)."""
    waits = [next(t for t in s.times if t >= fault_at) - fault_at
             for s in logs if s.times and s.times[-1] >= fault_at]
    return round(max(waits, default=0.0), 3)


# ----------------------------------------------------------------------------- scenarios
def run_scenario(cluster, name: str, *, requests: int = 8, max_tokens: int = 48, step_delay_s: float = 0.0,
                 restart_timeout_s: float = 120.0, progress: Callable[[str], None] = lambda m: None) -> dict:
    """Run ``name`` on a started LocalCluster; returns the result dict."""
    import ray

    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    if name == "redis-restart" and cluster.redis is None:
        raise ValueError("redis-restart needs the cluster's own redis-server (not --redis-url)")
    prompts = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(requests)]
    # corrupt-kv damages transfers, and a prompt whose KV the decode node already caches (from
    # the reference run, or an earlier scenario) needs none: its faulted run goes first, on
    # prompts no node has seen.
    fault_first = name == "corrupt-kv"
    if fault_first:
        salt = uuid.uuid4().hex[:12]
        prompts = [[{"role": "system", "content": f"Chaos run {salt}: answer plainly."}, *p] for p in prompts]
    role = "decode" if name in ("kill-decode", "slow-node") else "prefill"
    actors = {nid: a for nid, a in cluster.actors.items() if nid.startswith(role)}
    if name != "redis-restart" and not actors:
        raise ValueError(f"scenario {name} needs at least one {role} node")
    if step_delay_s:
        ray.get([a.set_step_delay.remote(step_delay_s) for a in cluster.actors.values()])

    def reference_run() -> list:
        progress(f"reference run: {requests} streams x {max_tokens} tokens, no fault")
        ref = Batch(cluster.address, prompts, max_tokens).join()
        if any(s.error for s in ref):
            raise RuntimeError(f"the fault-free run failed: {[s.error for s in ref if s.error]}")
        return ref

    if not fault_first:
        reference = reference_run()
    progress(f"faulted run: {name}")
    migrations_before = _migrations(cluster)
    inject = {"kill-decode": _kill_decode, "kill-prefill": _kill_prefill, "corrupt-kv": _corrupt_kv,
              "redis-restart": _restart_redis, "slow-node": _slow_node, "restart-router": _restart_router}[name]
    router = cluster.router
    logs, fault_at, extra = inject(cluster, actors, prompts, max_tokens, step_delay_s, restart_timeout_s, progress)
    if fault_first:
        reference = reference_run()
    result = {"scenario": name, **compare(reference, logs, retryable_ok=name == "restart-router"),
              "recovery_s": recovery_s(logs, fault_at), **extra}
    if cluster.router is router:  # a restarted router counts from zero
        result["migrations"] = {k: v - migrations_before.get(k, 0.0) for k, v in _migrations(cluster).items()}
    errors = sorted({s.error for s in logs if s.error})
    if errors:
        result["errors"] = errors
    return result


def _kill(cluster, actors: dict, victim: str, batch: Batch, restart_timeout_s: float, progress):
    import ray

    old_address = _registered(cluster).get(victim)
    fault_at = time.monotonic()
    progress(f"killing {victim} (Ray restarts it)")
    ray.kill(actors[victim], no_restart=False)
    logs = batch.join()
    restart_s = _wait_reregistered(cluster, victim, old_address, fault_at, restart_timeout_s)
    return logs, fault_at, {"killed": victim, "restart_s": restart_s}


def _kill_decode(cluster, actors, prompts, max_tokens, step_delay_s, restart_timeout_s, progress):
    """Once every stream is under way, the decode actor serving most of them dies."""
    import ray

    batch = Batch(cluster.address, prompts, max_tokens)
    batch.wait_until(lambda: batch.under_way(2), "every stream to be under way")
    victim = max(actors, key=lambda nid: ray.get(actors[nid].stats.remote()).get("running", 0))
    return _kill(cluster, actors, victim, batch, restart_timeout_s, progress)


def _kill_prefill(cluster, actors, prompts, max_tokens, step_delay_s, restart_timeout_s, progress):
    """A prefill actor dies while it prefills (mid-prefill or mid-push)."""
    import ray

    if step_delay_s:  # the prefill must be in progress when the actor dies: make it last
        ray.get([a.set_step_delay.remote(max(1.0, 20 * step_delay_s)) for a in actors.values()])
    batch = Batch(cluster.address, prompts, max_tokens)

    def prefilling() -> str | None:
        busy = [nid for nid, a in actors.items() if ray.get(a.stats.remote()).get("prefills_in_progress", 0)]
        return busy[0] if busy else None

    batch.wait_until(lambda: prefilling() is not None, "a prefill in progress")
    victim = prefilling() or next(iter(actors))
    return _kill(cluster, actors, victim, batch, restart_timeout_s, progress)


def _corrupt_kv(cluster, actors, prompts, max_tokens, step_delay_s, restart_timeout_s, progress):
    """Every prefill node flips a byte in each KV transfer after its checksum (prefill_node/faults.py):
    the decode nodes refuse them and recompute the prompts."""
    import ray

    decoders = [a for nid, a in cluster.actors.items() if nid.startswith("decode")]

    def refused() -> int:
        return sum(ray.get(a.stats.remote()).get("transfer_failures", 0) for a in decoders)

    before = refused()
    ray.get([a.set_kv_fault.remote("flip") for a in actors.values()])
    fault_at = time.monotonic()
    try:
        logs = Batch(cluster.address, prompts, max_tokens).join()
    finally:
        ray.get([a.set_kv_fault.remote(None) for a in actors.values()])
    return logs, fault_at, {"transfers_refused": refused() - before}


def _restart_redis(cluster, actors, prompts, max_tokens, step_delay_s, restart_timeout_s, progress):
    """Redis dies before the batch starts (placement by the last known load, no index) and comes
    back empty mid-way: the nodes register again and rebuild the index from their snapshots."""
    from deploy.redis_server import RedisServer

    blocks_before = _index_blocks(cluster)
    old = cluster.redis
    progress("stopping redis-server")
    old.stop()
    fault_at = time.monotonic()
    batch = Batch(cluster.address, prompts, max_tokens)
    batch.wait_until(lambda: batch.under_way(2), "every stream to be under way without Redis")
    progress("starting redis-server again, empty")
    cluster.redis = RedisServer(port=old.port, host=old.host, password=old.password).start()
    back_at = time.monotonic()
    logs = batch.join()
    registered_s = _wait_for(lambda: set(_registered(cluster)) == set(cluster.actors), back_at, restart_timeout_s)
    # Each node resyncs its entries from its snapshot right after its first heartbeat finds
    # them gone; nothing was evicted meanwhile, so the rebuilt index holds at least as many.
    rebuilt_s = _wait_for(lambda: _index_blocks(cluster) >= blocks_before, back_at, restart_timeout_s)
    return logs, fault_at, {"reregistered_s": registered_s, "index_rebuilt_s": rebuilt_s,
                            "index_blocks_before": blocks_before, "index_blocks_after": _index_blocks(cluster)}


def _slow_node(cluster, actors, prompts, max_tokens, step_delay_s, restart_timeout_s, progress):
    """One decode node's steps become 10x slower while it streams: the router must leave it out
    of placement (router/placement.py without_stragglers, on the step times the nodes
    heartbeat) and place the next requests on the other decode node."""
    import ray

    from router.placement import SLOW_STEP_FACTOR, without_stragglers

    if len(actors) < 2:
        raise ValueError("slow-node needs at least two decode nodes")
    orch = cluster.router.orchestrator
    factor = getattr(orch.policy, "slow_step_factor", SLOW_STEP_FACTOR)

    def decoders() -> list:
        return [n for n in orch.refresher.view.nodes if n.node_id in actors]

    def running() -> int:
        return sum(n.running for n in decoders())

    # Wave 1, one stream at a time once the router sees the previous one running, so that
    # every decode node streams (and has a measured step time) when the fault comes.
    first = max(len(actors), len(prompts) // 2)
    wave1 = []
    for i in range(first):
        wave1.append(Batch(cluster.address, [prompts[i]], max_tokens))
        b = wave1[-1]
        b.wait_until(lambda: b.under_way(2) and (running() >= len(wave1) or b.logs[0].finish is not None),
                     "a stream to be seen running")
    # The victim is the node the load figures alone would pick next.
    victim = min(decoders(), key=lambda n: (n.running + n.waiting, n.kv_usage, n.node_id))
    base = step_delay_s or victim.step_s or 0.01
    progress(f"slowing {victim.node_id}: {base:.3f} -> {10 * base:.3f} s per step")
    fault_at = time.monotonic()
    # with a base delay the step is about that delay; else add 9 measured steps to each
    ray.get(actors[victim.node_id].set_step_delay.remote(10 * base if step_delay_s else 9 * base))
    # None if not within the timeout: the result then says so instead of hanging the run.
    avoided_s = _wait_for(lambda: all(n.node_id != victim.node_id for n in without_stragglers(decoders(), factor)),
                          fault_at, max(30.0, restart_timeout_s))
    before = ray.get(actors[victim.node_id].stats.remote()).get("decodes", 0)
    wave2 = Batch(cluster.address, prompts[first:], max_tokens)
    wave2.wait_until(lambda: wave2.under_way(1), "the second wave to be placed")
    placed_on_slow = ray.get(actors[victim.node_id].stats.remote()).get("decodes", 0) - before
    ray.get(actors[victim.node_id].set_step_delay.remote(step_delay_s))  # done: finish quickly
    logs = [log for b in wave1 for log in b.join()] + wave2.join()
    return logs, fault_at, {"slowed": victim.node_id, "recovery_s": avoided_s, "placed_on_slow_node": placed_on_slow,
                            "requests_after_recovery": len(prompts) - first}


def _restart_router(cluster, actors, prompts, max_tokens, step_delay_s, restart_timeout_s, progress):
    """The router stops while half the streams run and restarts on the same port after the other
    half were sent: those are retried by the SDK (connection refused is UNAVAILABLE before the
    first chunk) and complete; the cut ones end in the SDK's retryable StreamInterruptedError."""
    from dataclasses import replace

    from router.server import serve

    first = max(1, len(prompts) // 2)
    running = Batch(cluster.address, prompts[:first], max_tokens, retries=None)
    running.wait_until(lambda: running.under_way(2), "every stream to be under way")
    old = cluster.router
    port = int(old.address.rsplit(":", 1)[1])
    progress("stopping the router")
    fault_at = time.monotonic()
    old.stop()
    waiting = Batch(old.address, prompts[first:], max_tokens, retries=None)
    waiting.wait_until(lambda: all(s is not None and s.attempts >= 1 for s in waiting.streams),
                       "the new streams to be refused once")
    progress("starting the router again on the same port")
    cluster.router = serve(replace(old.config, port=port))
    back_at = time.monotonic()
    logs = running.join() + waiting.join()
    return logs, fault_at, {"router_down_s": round(back_at - fault_at, 3),
                            "interrupted": sum(1 for s in logs if s.error and s.retryable),
                            "retried_before_start": sum(1 for s in logs[first:] if s.attempts > 1 and not s.error)}


def _wait_for(cond: Callable[[], bool], since: float, timeout_s: float) -> float | None:
    """Seconds from ``since`` until ``cond()``; None if not within ``timeout_s``."""
    while not cond():
        if time.monotonic() > since + timeout_s:
            return None
        time.sleep(0.2)
    return round(time.monotonic() - since, 3)


def _index_blocks(cluster) -> int:
    """Block entries the nodes hold in the index (their published snapshots)."""
    import redis

    from kv_index.schema import node_blocks_key

    r = redis.Redis.from_url(cluster.redis_url)
    try:
        return sum(r.scard(node_blocks_key(cluster.config.namespace, nid)) for nid in cluster.actors)
    finally:
        r.close()


def _migrations(cluster) -> dict[str, float]:
    from telemetry.metrics import MIGRATIONS

    reg = cluster.router.orchestrator.metrics.registry
    model = cluster.router.orchestrator.config.model_name
    return {r: reg.get_sample_value("pdserve:request_migrations_total", {"model_name": model, "reason": r}) or 0.0
            for r in MIGRATIONS}


def _registered(cluster) -> dict[str, str]:
    import redis

    from kv_index.reader import IndexReader

    reader = IndexReader(redis.Redis.from_url(cluster.redis_url), cluster.config.namespace)
    return {nid: n.grpc_address for nid, n in reader.live_nodes().items()}


def _wait_reregistered(cluster, node_id: str, old_address: str | None, since: float, timeout_s: float) -> float | None:
    """Seconds from ``since`` until ``node_id`` is registered at a new address (its new life);
    None if not within ``timeout_s`` (0: do not wait)."""
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        address = _registered(cluster).get(node_id)
        if address is not None and address != old_address:
            return round(time.monotonic() - since, 3)
        time.sleep(0.2)
    return None

