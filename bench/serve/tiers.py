"""`pdserve bench serve --workload multiturn --compare tiers`: multi-turn chat on the same cluster
with the KV tiers and prefix fetch off, then on.

    pdserve bench serve --workload multiturn --compare tiers --json
    pdserve bench serve --workload multiturn --compare tiers --conversations 24 --turns 5 --json

The workload is conversations. Each turn's prompt is the conversation so far (a shared system
prompt, every earlier user message and every earlier answer, the answer as the model produced
it) plus a new user message; the next turn is sent a think time after the answer ended.
Conversations start at ``--conversation-rate`` per second (Poisson); within one the turns are
closed-loop, as a user's are. Greedy decoding with a fixed answer length, so both runs send
exactly the same token ids as long as their answers are the same (``outputs_identical``).

One layout (``pdserve up``'s: 1 prefill + 1 decode node, one core each), started once per run
with what ``--layouts`` turns on (bench/serve/tiers_layouts.py lists them):

    off   each node's device pool sized to hold ``--device-share`` (0.2) of the working set
          (every conversation's final context), no host or disk tier, no prefix fetch
    on    the same device pools, plus a host tier of ``--host-share`` and a disk tier of
          ``--disk-share`` of the working set per node, and prefix fetch (a prefill node brings
          the answer's KV from the decode node that produced it)

and the baselines at their best: ``off-local`` (a decode node prefills a follow-up turn it
holds all but the new message of, as Dynamo does by uncached length), ``off-big`` (the host
tier's RAM given to the device pool), and the 2 x 2 halves ``tiers`` and ``fetch``. With
``--abba`` each seed runs the layouts forward then backward; off's two runs are the A/A pair.

The SLO is the same for all: ``--slo-ttft-factor`` x the best run's median unloaded TTFT of a
first turn (sent alone, nothing to reuse), ``--slo-tpot-factor`` x its unloaded TPOT. Result::

    {"slo_attainment_ratio": on / off, "ttft_p50_ratio": off / on, "ttft_p99_ratio": off / on,
     "goodput_ratio_closed_loop", "aa": {the same ratios, off against off}, "layouts": {name:
     {figures, ratios, their range over seeds}}, "runs": [...], "outputs_identical", "off": {...},
     "on": {...}, "slo": {...}, "working_set_tokens", ...}

Goodput is not the headline: turns are closed-loop, so a faster layout's run is also shorter
and good requests per second count its win twice.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass

from bench.serve import tiers_layouts as tl
from bench.serve import workload as wl
from bench.serve.client import send_grpc
from bench.serve.metrics import Record, slo_from_unloaded, summarize

BLOCK_SIZE = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multiturn workload (--workload multiturn, --compare tiers)")
    g.add_argument("--conversations", type=int, default=16)
    g.add_argument("--turns", type=int, default=4, help="turns per conversation")
    g.add_argument("--system-tokens", type=int, default=128, help="the system prompt every conversation shares")
    g.add_argument("--user-tokens", type=int, default=64, help="tokens of each user message")
    g.add_argument("--answer-tokens", type=int, default=48, help="tokens of each answer (ignore_eos)")
    g.add_argument("--conversation-rate", type=float, default=0.25, help="conversations started per second")
    g.add_argument("--think-s", type=float, default=2.0, help="mean pause between an answer and the next turn")
    g.add_argument("--device-share", type=float, default=0.2,
                   help="each node's device KV as a share of the working set (both runs)")
    g.add_argument("--host-share", type=float, default=0.6, help="each node's host tier, share of the working set (on)")
    g.add_argument("--disk-share", type=float, default=1.0, help="each node's disk tier, share of the working set (on)")
    g.add_argument("--layouts", default="off,on", help="comma-separated: off, off-local (local prefill by uncached "
                   "length), off-big (device pool + the host tier's RAM), tiers, fetch, on (tiers and fetch); off is "
                   "always run, every ratio is against it")
    g.add_argument("--seeds", default=None, help="comma-separated workload seeds (default: --seed)")
    g.add_argument("--abba", action="store_true", help="per seed, run the layouts forward then backward (A B B A): "
                   "drift falls on all alike, and off's two runs are an A/A pair")


@dataclass(frozen=True, slots=True)
class Conversation:
    start_s: float
    user: tuple[tuple[int, ...], ...]  # one message per turn
    think_s: tuple[float, ...]  # pause after each turn's answer


def conversations(args, seed: int) -> tuple[tuple[int, ...], list[Conversation]]:
    """The shared system prompt and the conversations (start times Poisson at the rate)."""
    rng = random.Random(seed)
    system = wl.random_prompt(args.system_tokens, random.Random(seed - 1))
    out = []
    for t in wl.arrivals(args.conversations, args.conversation_rate, rng):
        user = tuple(wl.random_prompt(args.user_tokens, rng) for _ in range(args.turns))
        out.append(Conversation(t, user, tuple(rng.expovariate(1.0 / args.think_s) for _ in range(args.turns))))
    return system, out


def working_set_tokens(args) -> int:
    """Every conversation's final context: what all of them would keep cached."""
    final = args.system_tokens + args.turns * args.user_tokens + args.turns * args.answer_tokens
    return args.conversations * final


async def _run(target: str, system: tuple[int, ...], convs: list[Conversation], answer_tokens: int,
               progress) -> tuple[list[Record], dict[tuple[int, int], list[int]]]:
    """Every conversation on its own task; returns one Record per turn and each turn's tokens."""
    import pdserve

    loop = asyncio.get_running_loop()
    clock = loop.time
    client = pdserve.AsyncClient(target, retries=0)
    records: list[Record] = []
    outputs: dict[tuple[int, int], list[int]] = {}
    start = clock()

    async def one(i: int, conv: Conversation) -> None:
        await asyncio.sleep(max(0.0, start + conv.start_s - clock()))
        history = list(system)
        for k, message in enumerate(conv.user):
            prompt = history + list(message)
            rec = Record(len(records), f"turn{min(k, 1)}", len(prompt), answer_tokens, clock() - start)
            records.append(rec)
            rec.sent_s = clock() - start
            tokens: list[int] = []
            try:
                await send_grpc(client, wl.LoadRequest(0.0, tuple(prompt), answer_tokens), rec, clock, tokens)
            except Exception as e:  # a failed turn ends its conversation: the next would differ
                rec.error, rec.end_s = f"{type(e).__name__}: {str(e)[:200]}", clock()
            for name in ("first_token_s", "end_s"):
                if getattr(rec, name) is not None:
                    setattr(rec, name, getattr(rec, name) - start)
            outputs[i, k] = tokens
            if rec.error is not None:
                return
            history = prompt + tokens
            await asyncio.sleep(conv.think_s[k])
        progress(f"conversation {i} done ({sum(r.error is not None for r in records)} failed turns so far)")

    try:
        await asyncio.gather(*(one(i, c) for i, c in enumerate(convs)))
    finally:
        await client.close()
    return records, outputs


def _engine(args, layout: tl.TiersLayout, tmp: str):
    from engine.config import CacheConfig, EngineConfig

    block_bytes = _block_bytes(args.model)
    ws_blocks = math.ceil(working_set_tokens(args) / BLOCK_SIZE)
    longest = math.ceil((working_set_tokens(args) / args.conversations + args.answer_tokens) / BLOCK_SIZE)
    device = max(math.ceil(args.device_share * ws_blocks), 2 * longest)  # room for two of the longest turns
    if layout.device_plus_host:  # the same RAM as the host tier, as device blocks (a device block is a host block)
        device += math.ceil(args.host_share * ws_blocks)
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=device)
    if layout.tiers:
        cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=device,
                            host_cache_mib=args.host_share * ws_blocks * block_bytes / 2**20,
                            disk_cache_dir=os.path.join(tmp, "disk") if args.disk_share > 0 else None,
                            disk_cache_mib=args.disk_share * ws_blocks * (block_bytes + 4096) / 2**20)
    return EngineConfig(model=args.model, dtype="float32", cache=cache), device, ws_blocks


def _block_bytes(model: str) -> int:
    """KV bytes of one 16-token block of ``model`` in float32, from its config.json (no weights)."""
    import json
    from pathlib import Path

    from engine.models.builtin import BUILTIN_MODELS, resolve_builtin
    from engine.models.config import ModelConfig

    path = resolve_builtin(model) if model in BUILTIN_MODELS else Path(model)
    mc = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    return 2 * mc.num_layers * BLOCK_SIZE * mc.num_kv_heads * mc.head_dim * 4


def _start(args, layout: tl.TiersLayout, tmp: str, report):
    from deploy.launcher import ClusterConfig, LocalCluster

    engine, device, ws_blocks = _engine(args, layout, tmp)
    # A follow-up turn's uncached part on the node that decoded the last answer: the new user
    # message and the partial blocks at either end of it.
    local = args.user_tokens + 2 * BLOCK_SIZE if layout.local_uncached else 0
    cfg = ClusterConfig(engine=engine, prefill_nodes=1, decode_nodes=1, grpc_port=0, http_port=0, dashboard_port=0,
                        node_threads=1, pin_cores=True, short_prompt_tokens=16, prefix_fetch=layout.fetch,
                        local_prefill_uncached_tokens=local,
                        namespace=f"bench-tiers-{layout.name}-{os.getpid()}")
    c = engine.cache
    report.progress(f"{layout.name}: device {device} blocks per node ({device / ws_blocks:.0%} of the "
                    f"{ws_blocks}-block working set), host {c.host_cache_mib:.0f} MiB, disk "
                    f"{c.disk_cache_mib:.0f} MiB, prefix fetch {'on' if layout.fetch else 'off'}, local prefill "
                    f"below {local} uncached tokens")
    return LocalCluster(cfg, report.progress).start()


def _unloaded(target: str, args, seed: int, report) -> list[Record]:
    """First turns sent one at a time (fresh tokens, nothing to reuse): the SLO's base."""
    system, convs = conversations(args, seed)
    recs = []
    for conv in convs[:3]:
        recs += asyncio.run(_run(target, system, [Conversation(0.0, conv.user[:1], (0.0,))], args.answer_tokens,
                                 lambda m: None))[0]
    return recs


def _fetch_counts(cluster) -> dict[str, float]:
    """kv_fetch_total by outcome, summed over the cluster's nodes (their /metrics)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from deploy.status import metrics_url
    from kv_index.client import redis_client
    from kv_index.reader import IndexReader

    out: dict[str, float] = {}
    for node in IndexReader(redis_client(cluster.redis_url), cluster.config.namespace).live_nodes().values():
        with urllib.request.urlopen(metrics_url(node.metrics_address), timeout=5) as resp:
            text = resp.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "pdserve:kv_fetch_total":
                    out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
    return out


def compare_tiers(args, report) -> dict:
    if args.compare != "tiers" or args.workload != "multiturn":
        raise SystemExit("--compare tiers runs the multiturn workload, and the multiturn workload needs "
                         "--compare tiers: give both")
    layouts = {lay.name: lay for lay in tl.parse_layouts(args.layouts)}
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    order = tl.schedule(list(layouts), seeds, args.abba)
    report.progress(f"{len(order)} runs: " + " ".join(f"{n}/{s}" for n, s in order))
    runs, unloaded = [], []
    for i, (name, seed) in enumerate(order):
        report.progress(f"run {i + 1}/{len(order)}: {name}, seed {seed}")
        runs.append({"layout": name, "seed": seed, **_one_run(args, layouts[name], seed, report)})
        unloaded.append(runs[-1].pop("unloaded"))
    slo = slo_from_unloaded(unloaded, args.slo_ttft_factor, args.slo_tpot_factor)
    slo = type(slo)(slo.ttft_s, slo.tpot_s)  # one TTFT bound for every turn: a follow-up is no slower to wait for
    for r in runs:
        r["summary"] = summarize(r.pop("records"), slo)
        r["summary"]["fetches"] = r.pop("fetches")
        r["figures"] = tl.figures(r["summary"])
    identical = all(r["outputs"] == next(q["outputs"] for q in runs if q["seed"] == r["seed"])
                    and all(r["outputs"].values()) for r in runs)
    cmp = tl.compare([{k: r[k] for k in ("layout", "seed", "figures")} for r in runs])
    first = {r["layout"]: r["summary"] for r in reversed(runs) if r["seed"] == seeds[0]}  # each layout's first run
    on = cmp["layouts"].get("on", {})
    out = {
        "headline": "slo_attainment_ratio and ttft_p50/p99_ratio of on against off (goodput_ratio_closed_loop "
                    "counts a faster run twice: its turns also end sooner)",
        "slo_attainment_ratio": on.get("slo_attainment_ratio"),
        "ttft_p50_ratio": on.get("ttft_p50_ratio"), "ttft_p99_ratio": on.get("ttft_p99_ratio"),
        "goodput_ratio_closed_loop": on.get("goodput_rps_ratio"),
        "cached_token_fraction_on": first.get("on", {}).get("cached_token_fraction"),
        "cached_token_fraction_off": first["off"]["cached_token_fraction"],
        "outputs_identical": identical, "aa": cmp["aa"], "layouts": cmp["layouts"],
        "runs": [{k: r[k] for k in ("layout", "seed", "figures")} for r in runs],
        **{name: first[name] for name in first}, "slo": slo.as_json(), "order": [list(o) for o in order],
        "working_set_tokens": working_set_tokens(args), "conversations": args.conversations, "turns": args.turns,
        "cores": len(os.sched_getaffinity(0)), "seeds": seeds, "model": args.model,
    }
    report.table(["layout", "runs", "SLO met", "x off", "TTFT p50 s", "x off", "TTFT p99 s", "x off", "cached"],
                 [[n, e["runs"], e["figures"]["slo_attainment"], e.get("slo_attainment_ratio"),
                   e["figures"]["ttft_p50"], e.get("ttft_p50_ratio"), e["figures"]["ttft_p99"],
                   e.get("ttft_p99_ratio"), e["figures"]["cached_token_fraction"]]
                  for n, e in cmp["layouts"].items()])
    if cmp["aa"]:
        report.progress("A/A (off against off, same seed): " + ", ".join(
            f"{k} {v:.3f}" for k, v in cmp["aa"].items() if k != "seed" and v is not None))
    return out


def _one_run(args, layout: tl.TiersLayout, seed: int, report) -> dict:
    """One layout's cluster, its unloaded first turns, then the conversations of ``seed``."""
    system, convs = conversations(args, seed)
    tmp = tempfile.mkdtemp(prefix="pdserve-tiers-")
    cluster = _start(args, layout, tmp, report)
    try:
        unloaded = _unloaded(cluster.address, args, seed + 100, report)
        report.progress(f"{layout.name}: {args.conversations} conversations x {args.turns} turns")
        t0 = time.monotonic()
        records, outputs = asyncio.run(_run(cluster.address, system, convs, args.answer_tokens, report.progress))
        report.progress(f"{layout.name}: done in {time.monotonic() - t0:.0f} s")
        fetches = _fetch_counts(cluster)
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"unloaded": unloaded, "records": records, "outputs": outputs, "fetches": fetches}
