"""`pdserve` command line: generate, up, status, bench; nodes and prepare-model for clusters
that already run Ray (the Helm chart, `ray up`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from deploy.spinner import Spinner


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags: one per field of engine/config.py's configs that declares one."""
    from engine.config import ENGINE_CONFIGS
    from settings.flags import add_arguments

    for cls in ENGINE_CONFIGS:
        add_arguments(p, cls)


def engine_config_from_args(a: argparse.Namespace):
    """The EngineConfig of parsed ``_add_engine_args`` flags: each sub-config from its flags."""
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from settings.flags import from_args

    return from_args(EngineConfig, a, cache=from_args(CacheConfig, a), scheduler=from_args(SchedulerConfig, a),
                     speculative=from_args(SpeculativeConfig, a))


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params_from_args(a: argparse.Namespace):
    from tokens.sampling_params import SamplingParams

    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                          top_k=a.top_k, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                          seed=a.seed, stop=tuple(a.stop))


def _client_tls(a: argparse.Namespace):
    """The SDK's TLS settings from `pdserve generate`'s flags; against the running
    `pdserve up --tls` (same address) its throwaway CA is trusted without a flag."""
    import pdserve

    ca = a.tls_ca_file
    if ca is None:
        from deploy.launcher import state_file

        try:
            state = json.loads(state_file().read_text())
        except (OSError, ValueError):
            state = {}
        if state.get("tls_ca") and state.get("grpc") == a.url:
            ca = state["tls_ca"]
    if ca is None and a.tls_cert_file is None and not a.tls:
        return None
    return pdserve.TLS(root_certificates=ca, certificate_chain=a.tls_cert_file, private_key=a.tls_key_file,
                       server_name_override=a.tls_server_name)


def cmd_generate_remote(a: argparse.Namespace) -> int:
    """`pdserve generate --url HOST:PORT`: stream through the cluster with the client SDK."""
    import pdserve

    kwargs = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                  min_p=a.min_p, repetition_penalty=a.repetition_penalty, seed=a.seed, stop=a.stop or None)
    prompt = a.prompt if a.no_chat else (
        ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": a.prompt}])
    t0 = time.perf_counter()
    t_first = None
    n = 0
    try:
        with pdserve.Client(a.url, tls=_client_tls(a), api_key=a.api_key) as client:
            stream = client.generate(prompt, **{k: v for k, v in kwargs.items() if v is not None})
            for chunk in stream:
                if t_first is None:
                    t_first = time.perf_counter()
                n += len(chunk.token_ids)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            done = stream.completion
    except pdserve.PdServeError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    print()
    usage = f", prompt {done.usage.prompt_tokens} tokens ({done.usage.cached_prompt_tokens} cached)" if done else ""
    print(f"[{n} tokens in {dt:.2f}s: {n / dt:.1f} tok/s, first token "
          f"{((t_first or t0) - t0) * 1000:.0f} ms{usage}, finish={done.finish_reason if done else None}]",
          file=sys.stderr)
    return 0


def cluster_config_from_args(a: argparse.Namespace):
    from deploy.launcher import ClusterConfig
    from deploy.nodes import tensor_parallel_sizes
    from security.api_keys import keys_from
    from settings.flags import from_args

    return from_args(
        ClusterConfig, a, engine=engine_config_from_args(a), host="127.0.0.1",
        api_keys=keys_from(a.api_keys, os.environ), prefill_step_tokens=a.prefill_step_tokens,
        **dict(zip(("prefill_tensor_parallel", "decode_tensor_parallel"), tensor_parallel_sizes(a))),
    )


def cmd_up(a: argparse.Namespace) -> int:
    from deploy.launcher import run_up

    spinner_free = lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        cfg = cluster_config_from_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_up(cfg, spinner_free, demo_prompt=a.demo)


def cmd_status(a: argparse.Namespace) -> int:
    """Nodes per pool with their load, cache and transfer figures, the index's size, freshness
    and accuracy: the registry in Redis plus each node's (and the router's) /metrics
    (deploy/status.py). ``--json``: one JSON object per refresh; ``--watch``: redraw until Ctrl-C."""
    import redis

    from deploy.launcher import state_file
    from deploy.status import gather, metrics_url, prometheus_targets, render
    from kv_index.client import redis_client
    from kv_index.redis_url import redact

    def write_targets(path: str, targets: list) -> None:
        tmp = f"{path}.tmp"  # Prometheus re-reads the file on change: never let it see half of one
        with open(tmp, "w") as f:
            json.dump(targets, f, indent=1)
        os.replace(tmp, path)

    url, ns = a.redis_url, a.namespace
    state = {}
    if url is None and state_file().exists():
        state = json.loads(state_file().read_text())
        url, ns = state.get("redis_url"), state.get("namespace", ns)
    if url is None:
        print("error: no running `pdserve up` found; pass --redis-url", file=sys.stderr)
        return 2
    if state.get("tls_ca"):  # `pdserve up --tls`: the router's HTTP side is HTTPS under its own CA
        import ssl
        import urllib.request

        context = ssl.create_default_context(cafile=state["tls_ca"])
        urllib.request.install_opener(urllib.request.build_opener(urllib.request.HTTPSHandler(context=context)))
    scheme = "https://" if state.get("tls_ca") else ""
    router = a.router_metrics or (metrics_url(scheme + state["http"]) if state.get("http") else None)
    # The URL may carry the Redis password: what is shown never does.
    cluster = {"grpc": state.get("grpc"), "http": state.get("http"), "dashboard": state.get("dashboard"),
               "redis_url": redact(url), "namespace": ns}
    r = redis_client(url)
    prev = None
    tty = sys.stdout.isatty()
    try:
        while True:
            try:
                report, prev = gather(r, ns, router_metrics=router, prev=prev, cluster=cluster)
            except redis.RedisError as e:
                print(f"error: cannot read {redact(url)}: {e}", file=sys.stderr)
                return 2
            if a.prometheus_sd:
                write_targets(a.prometheus_sd, prometheus_targets(report, state.get("http")))
            if a.json:
                print(json.dumps(report), flush=True)
            else:
                print(("\033[H\033[J" if tty and a.watch else "") + render(report), flush=True)
            if a.watch is None:
                return 0
            time.sleep(a.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        r.close()


def cmd_generate(a: argparse.Namespace) -> int:
    if a.url:
        return cmd_generate_remote(a)
    from engine.engine import LLMEngine
    from engine.errors import InvalidRequestError
    from engine.models.loader import ModelLoadError

    try:
        with Spinner() as sp:
            sp.update(f"loading {a.model}")
            cfg = engine_config_from_args(a)
            if cfg.backend != "pdserve":  # in-process is pdserve's engine; vLLM runs behind a node
                raise InvalidRequestError("--engine vllm is for `pdserve up` and `pdserve nodes` (or `--url` of such "
                                          "a cluster); in-process generate runs pdserve's own engine")
            factory = None
            if cfg.speculative.enabled:  # in-process: this engine plays the decode role
                from engine.speculative.proposers import build_proposer as factory
            eng = LLMEngine(cfg, progress=sp.update, proposer_factory=factory)
            sp.update("tokenizing")
            ids = eng.encode(a.prompt, chat=not a.no_chat, system=a.system)
        params = sampling_params_from_args(a)
        t0 = time.perf_counter()
        n_tokens = 0
        t_first = None
        out = None
        for out in eng.stream(ids, params):
            for c in out.outputs:
                n_tokens += len(c.new_token_ids)
                sys.stdout.write(c.text_delta)
                sys.stdout.flush()
            if t_first is None and n_tokens:
                t_first = time.perf_counter()
    except (InvalidRequestError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    reason = out.outputs[0].finish_reason if out and out.outputs else None
    print()
    decode_rate = (n_tokens - 1) / (time.perf_counter() - t_first) if t_first and n_tokens > 1 else 0.0
    print(
        f"[{n_tokens} tokens in {dt:.2f}s: {n_tokens / dt:.1f} tok/s overall, "
        f"{decode_rate:.1f} tok/s decode, first token {((t_first or t0) - t0) * 1000:.0f} ms, "
        f"prompt {len(ids)} tokens, finish={reason}]",
        file=sys.stderr,
    )
    return 0


def cmd_bench(a: argparse.Namespace, rest: list[str]) -> int:
    from bench import Reporter, benchmark_module

    mod = benchmark_module(a.name)
    p = argparse.ArgumentParser(prog=f"pdserve bench {a.name}")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    mod.add_arguments(p)
    args = p.parse_args(rest)
    result = mod.run(args, Reporter(sys.stderr if args.json else sys.stdout))
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    failed = failed_checks(result)
    if failed:
        print(f"pdserve bench {a.name}: failed ({', '.join(f'{k} is false' for k in failed)})", file=sys.stderr)
        return 1
    return 0


def failed_checks(result: dict) -> list[str]:
    """The verdict fields of a bench result that are false. A check that failed is the run's
    verdict, not a figure: a script (or CI) sees it in the exit code. A target missed is a
    figure (its ``met`` field) and exits 0."""
    return [k for k in ("passed", "bit_exact") if result.get(k) is False]


def add_up_arguments(u: argparse.ArgumentParser) -> None:
    """`pdserve up`'s flags: the engine's, one per ClusterConfig field that declares one (the
    router's, planner's and nodes' settings it hands down among them), the per-role ones."""
    from deploy.cluster_config import ClusterConfig
    from deploy.nodes import add_per_role_arguments
    from settings.flags import add_arguments

    _add_engine_args(u)
    add_arguments(u, ClusterConfig)
    add_per_role_arguments(u)
    u.add_argument("--demo", default=None, metavar="PROMPT",
                   help="once ready, stream an answer to PROMPT through the cluster, then keep serving")


def main(argv: list[str] | None = None) -> int:
    from deploy.forking import disable_grpc_fork_support

    disable_grpc_fork_support()  # before any gRPC use: `pdserve up` and some benches start Ray
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = argparse.ArgumentParser(prog="pdserve", description="disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="stream an answer to a prompt")
    g.add_argument("prompt")
    g.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--url", default=None, help="a running cluster's router (HOST:PORT); default: in-process")
    g.add_argument("--api-key", default=None, help="the router's API key (default: $PDSERVE_API_KEY)")
    g.add_argument("--tls", action="store_true", help="TLS to --url, trusting the system's CAs")
    g.add_argument("--tls-ca-file", default=None,
                   help="TLS to --url, trusting this CA (default: the running `pdserve up --tls`'s)")
    g.add_argument("--tls-cert-file", default=None, help="client certificate, where the router asks for one")
    g.add_argument("--tls-key-file", default=None, help="the client certificate's key")
    g.add_argument("--tls-server-name", default=None, help="verify the router's certificate against this name")
    _add_engine_args(g)
    _add_sampling_args(g)

    add_up_arguments(sub.add_parser("up", help="run the whole cluster on this machine"))

    st = sub.add_parser("status", help="nodes, load, caches, transfers and the index of a running cluster")
    st.add_argument("--redis-url", default=None, help="default: the running `pdserve up`'s")
    st.add_argument("--namespace", default="pdserve")
    st.add_argument("--router-metrics", default=None, metavar="URL",
                    help="the router's /metrics (host:port or URL) for index accuracy; "
                         "default: the running `pdserve up`'s HTTP address")
    st.add_argument("--json", action="store_true", help="one JSON object per refresh instead of the table")
    st.add_argument("--prometheus-sd", default=None, metavar="FILE",
                    help="write Prometheus file_sd targets (router and every node's /metrics) to FILE "
                         "on each refresh")
    st.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 2) until Ctrl-C; transfer rates need two refreshes")

    from deploy import model_files, nodes

    n = sub.add_parser("nodes", help="spawn and keep the node actors on an existing Ray cluster (deploy/nodes.py)")
    _add_engine_args(n)
    nodes.add_arguments(n)

    pm = sub.add_parser("prepare-model", help="put a model (or its tokenizer) into a directory, for pods")
    model_files.add_arguments(pm)

    import chaos

    ch = sub.add_parser("chaos", help="faults injected into a local cluster under load, judged against a fault-free "
                                      "run; exit 1 if any check failed (chaos/)")
    _add_engine_args(ch)
    chaos.add_arguments(ch)

    b = sub.add_parser("bench", help="benchmarks (pdserve bench NAME --help)", add_help=False)
    b.add_argument("name")

    args, rest = parser.parse_known_args(argv)
    if args.cmd == "bench":
        return cmd_bench(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "up":
        return cmd_up(args)
    if args.cmd == "status":
        return cmd_status(args)
    if args.cmd == "nodes":
        return nodes.run(args, engine_config_from_args(args))
    if args.cmd == "chaos":
        return chaos.run(args, engine_config_from_args(args))
    if args.cmd == "prepare-model":
        return model_files.run(args, lambda m: print(m, file=sys.stderr, flush=True))
    return cmd_generate(args)


if __name__ == "__main__":
    sys.exit(main())
