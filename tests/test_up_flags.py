"""`pdserve up`'s router flags reach the RouterConfig the launcher starts the router with: the
CLI's own parser, ClusterConfig and ``deploy.launcher.router_config`` (the function bring-up
calls), no cluster needed. The flags match the router CLI's (`python -m frontend.server`)."""
from __future__ import annotations

import argparse

import pytest

from deploy.cli import add_up_arguments, cluster_config_from_args
from deploy.launcher import router_config

BRING_UP = dict(redis_url="redis://127.0.0.1:1/0", model_name="m", tokenizer_dir="/nonexistent", max_model_len=1024)


def parse_up(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_up_arguments(p)
    return p.parse_args(list(argv))


def test_router_fault_flags_reach_the_router_config():
    cfg = cluster_config_from_args(parse_up("--max-migrations", "0", "--straggler-factor", "5.5",
                                            "--short-prompt-tokens", "32", "--prefill-nodes", "0"))
    rc = router_config(cfg, **BRING_UP)
    assert (rc.max_migrations, rc.straggler_factor) == (0, 5.5)
    assert rc.short_prompt_tokens == 32 and rc.ready_min_prefill == 0 and rc.redis_url == BRING_UP["redis_url"]


def test_defaults_are_the_router_clis():
    from frontend.server import build_parser

    router_defaults = build_parser().parse_args(["--redis-url", "redis://x", "--tokenizer-dir", "/t", "--model-name", "m",
                                                 "--max-model-len", "64"])
    rc = router_config(cluster_config_from_args(parse_up()), **BRING_UP)
    assert rc.max_migrations == router_defaults.max_migrations == 2
    assert rc.straggler_factor == router_defaults.straggler_factor == 3.0
    assert rc.prefix_fetch is router_defaults.prefix_fetch is True


def test_no_prefix_fetch_reaches_the_router_config():
    from frontend.server import build_parser

    assert router_config(cluster_config_from_args(parse_up("--no-prefix-fetch")), **BRING_UP).prefix_fetch is False
    args = build_parser().parse_args(["--redis-url", "redis://x", "--tokenizer-dir", "/t", "--model-name", "m",
                                      "--max-model-len", "64", "--no-prefix-fetch"])
    assert args.prefix_fetch is False


@pytest.mark.parametrize("argv", [("--max-migrations", "-1"), ("--straggler-factor", "nan"),
                                  ("--straggler-factor", "inf"), ("--straggler-factor", "-2")])
def test_bad_values_stop_before_anything_starts(argv, capsys):
    from deploy.cli import cmd_up

    with pytest.raises(ValueError, match=argv[0].lstrip("-").replace("-", "_")):
        cluster_config_from_args(parse_up(*argv))
    assert cmd_up(parse_up(*argv)) == 2  # reported, nothing started
    assert "error:" in capsys.readouterr().err


def test_the_ready_line_says_where_the_dashboards_token_is(tmp_path):
    """Ray's token auth stays on, so the dashboard of the ready line asks for a token: the line
    names where it is (never the token), as Ray looks for it, after the fields scripts parse."""
    from types import SimpleNamespace

    from deploy.launcher import dashboard_login, ready_line

    home = tmp_path
    assert dashboard_login({"RAY_AUTH_MODE": "token"}, home) == str(home / ".ray" / "auth_token")
    assert dashboard_login({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/etc/t"}, home) == "/etc/t"
    assert dashboard_login({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "s3cret"}, home) == "$RAY_AUTH_TOKEN"
    assert dashboard_login({"RAY_AUTH_MODE": "disabled"}, home) is None and dashboard_login({}, home) is None

    cluster = SimpleNamespace(address="127.0.0.1:50051", http_address="127.0.0.1:8000",
                              dashboard_url="http://127.0.0.1:8265", tls=SimpleNamespace(ca_file="/tmp/x/ca.pem"))
    line = ready_line(cluster, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "s3cret"}, home)
    assert line.startswith("pdserve ready grpc=127.0.0.1:50051 http=127.0.0.1:8000 dashboard=http://127.0.0.1:8265 "
                           "tls_ca=/tmp/x/ca.pem")
    fields = dict(f.split("=", 1) for f in line.split()[2:])
    assert fields["dashboard_token"] == "$RAY_AUTH_TOKEN" and "s3cret" not in line
    assert "dashboard_token" not in ready_line(cluster, {"RAY_AUTH_MODE": "disabled"}, home)


def test_tensor_parallel_flags_reach_each_roles_node_config_and_ray_options():
    import argparse
    import dataclasses

    from deploy import nodes
    from deploy.nodes import NodeTemplate, tensor_parallel_sizes
    from engine.config import EngineConfig
    from kv_index.nodes import Role
    from node.config import NodeConfig, ray_actor_options

    cfg = cluster_config_from_args(parse_up("--tensor-parallel", "3", "--decode-tensor-parallel", "1"))
    assert (cfg.prefill_tensor_parallel, cfg.decode_tensor_parallel) == (3, 1)
    p = argparse.ArgumentParser()
    nodes.add_arguments(p)
    assert tensor_parallel_sizes(p.parse_args(["--prefill-tensor-parallel", "2"])) == (2, 1)
    with pytest.raises(ValueError, match="tensor_parallel"):
        cluster_config_from_args(parse_up("--tensor-parallel", "0"))
    template = NodeTemplate(engine=EngineConfig(model="m"), redis_url="redis://x", prefill_tensor_parallel=3)
    prefill, decode = template.config(Role.PREFILL, 0), template.config(Role.DECODE, 0)
    assert (prefill.tensor_parallel, decode.tensor_parallel) == (3, 1)
    # The prefill role's step budget: from `pdserve up` and `pdserve nodes` to every node's config
    # (whatever role it starts in: a node that switches to prefill takes it then).
    cfg = cluster_config_from_args(parse_up("--max-num-batched-tokens", "256", "--prefill-step-tokens", "1024"))
    assert cfg.prefill_step_tokens == 1024
    assert nodes.template_from_args(p.parse_args(["--redis-url", "redis://x", "--prefill-step-tokens", "768"]),
                                    EngineConfig(model="m"), {}).prefill_step_tokens == 768
    stepped = dataclasses.replace(template, prefill_step_tokens=1024,
                                  engine=cfg.engine)
    for role in Role:
        c = stepped.config(role, 0)
        assert c.prefill_step_tokens == 1024
        assert c.step_tokens(role) == (1024 if role is Role.PREFILL else 256)
        assert c.step_tokens(Role.DECODE) == 256  # the decode role keeps the engine's
    with pytest.raises(ValueError, match="prefill_step_tokens"):
        cluster_config_from_args(parse_up("--prefill-step-tokens", "0"))
    # One CPU (or GPU) per rank for a TP node's actor; a TP 1 node asks what it asked before.
    assert ray_actor_options(prefill, num_cpus=0)["num_cpus"] == 3
    assert ray_actor_options(prefill, gpu=True)["num_gpus"] == 3
    assert ray_actor_options(decode, num_cpus=0)["num_cpus"] == 0 and "num_gpus" not in ray_actor_options(decode)
    # Speculation (decode) and KV tiers are refused with TP > 1, naming the flag.
    spec = dataclasses.replace(decode.engine, speculative=dataclasses.replace(decode.engine.speculative, method="ngram"))
    with pytest.raises(ValueError, match="speculative decoding is not supported with tensor parallelism.*--spec-method off"):
        NodeConfig(node_id="d", role="decode", redis_url="redis://x", tensor_parallel=2, engine=spec)
    tiers = dataclasses.replace(decode.engine, cache=dataclasses.replace(decode.engine.cache, host_cache_mib=8))
    with pytest.raises(ValueError, match="KV tiers"):
        NodeConfig(node_id="d", role="decode", redis_url="redis://x", tensor_parallel=2, engine=tiers)
    with pytest.raises(ValueError, match="tensor_parallel must be >= 1"):
        NodeConfig(node_id="d", role="decode", redis_url="redis://x", tensor_parallel=0)
