"""What the Helm chart needs from the code: `pdserve nodes` keeping node actors on an existing Ray
cluster (its plan, and a real run on a local Ray), nodes that bind every interface and register
the address peers can dial, a Redis password from the environment, and `pdserve prepare-model`."""
from __future__ import annotations

import argparse
import json
import subprocess
import uuid

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.nodes import NodeSupervisor, NodeTemplate, Plan, node_index, plan, pool_capacity
from deploy.redis_server import find_redis_server, free_port
from engine.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from kv_index.nodes import Role
from kv_index.reader import IndexReader
from kv_index.redis_url import PASSWORD_ENV, resolve_redis_url, with_password
from node.config import NodeConfig, host_port, is_wildcard_host, ray_actor_options
from tests.clusters import ray_pools
from tests.helpers import engine_config, wait_for


def small_engine_config(path) -> EngineConfig:
    """A smaller pool and batch than ``node_engine_config``'s: nothing here comes near either."""
    return engine_config(path, block_size=4, num_blocks=32,
                         scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4))


# ---------------------------------------------------------------------- the supervisor's plan
def test_plan_spawns_the_lowest_free_indexes():
    assert plan(Role.PREFILL, 3, {}) == Plan(("prefill-0", "prefill-1", "prefill-2"), ())
    assert plan(Role.PREFILL, 3, {"prefill-1": True}) == Plan(("prefill-0", "prefill-2"), ())
    # another role's actors and foreign names are not this role's
    assert plan(Role.DECODE, 1, {"prefill-0": True, "decode-x": True, "my-actor": False}) == Plan(("decode-0",), ())
    assert plan(Role.DECODE, 2, {"decode-0": True, "decode-1": False}) == Plan((), ())


def test_plan_stops_the_unanswering_first_then_the_highest():
    existing = {"decode-0": True, "decode-1": False, "decode-2": True, "decode-3": True}
    assert plan(Role.DECODE, 2, existing) == Plan((), ("decode-1", "decode-3"))
    assert plan(Role.DECODE, 0, existing) == Plan((), ("decode-1", "decode-3", "decode-2", "decode-0"))
    assert plan(Role.DECODE, 3, {"decode-0": True, "decode-7": True}) == Plan(("decode-1",), ())


def test_node_names_and_pool_capacity():
    assert node_index("prefill-12", Role.PREFILL) == 12
    assert node_index("prefill-12", Role.DECODE) is None
    assert node_index("prefill-", Role.PREFILL) is None
    assert pool_capacity({"prefill_pool": 3.0, "CPU": 8.0}, Role.PREFILL) == 3
    assert pool_capacity({"CPU": 8.0}, Role.DECODE) == 0


def test_template_gives_each_role_its_config():
    engine = EngineConfig(model="m", speculative=SpeculativeConfig(method="ngram"))
    t = NodeTemplate(engine=engine, redis_url="redis://r:6379/0", namespace="ns", host="0.0.0.0",
                     grpc_port=50061, metrics_port=9400, lease_s=2.0)
    p, d = t.config(Role.PREFILL, 3), t.config(Role.DECODE, 0)
    assert (p.node_id, p.role, d.node_id, d.role) == ("prefill-3", Role.PREFILL, "decode-0", Role.DECODE)
    assert p.engine.speculative.method == "off" and d.engine.speculative.method == "ngram"
    assert (p.load_tokenizer, d.load_tokenizer) == (True, True)  # a structured output's first token: on prefill
    assert (d.host, d.grpc_port, d.metrics_port, d.namespace, d.lease_s, d.heartbeat_s) == \
        ("0.0.0.0", 50061, 9400, "ns", 2.0, 0.5)
    assert t.config(Role.DECODE, 1, cpu_affinity=(1,)).cpu_affinity == (1,)


def test_detached_actor_options():
    cfg = NodeConfig(node_id="decode-2", role="decode", redis_url="redis://r")
    opts = ray_actor_options(cfg, gpu=True, accelerator_type="H100", num_cpus=0, detached=True)
    assert opts == {"name": "decode-2", "resources": {"decode_pool": 1}, "max_restarts": -1,
                    "max_task_retries": 3, "num_cpus": 0, "lifetime": "detached", "num_gpus": 1,
                    "accelerator_type": "H100"}
    assert "lifetime" not in ray_actor_options(cfg)


def test_a_pool_pinned_to_hosts_asks_for_a_sliver_of_their_resource():
    from deploy.nodes import RESOURCE_LABEL_UNITS, PoolResources, add_arguments

    cfg = NodeConfig(node_id="decode-2", role="decode", redis_url="redis://r")
    pinned = PoolResources(ray_resource="zone_b").extra_resources()
    assert pinned == {"zone_b": RESOURCE_LABEL_UNITS} and PoolResources().extra_resources() is None
    assert ray_actor_options(cfg, extra_resources=pinned)["resources"] == {"zone_b": 0.001, "decode_pool": 1}
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--decode-ray-resource", "zone_b"])
    assert (a.decode_ray_resource, a.prefill_ray_resource) == ("zone_b", None)


# ---------------------------------------------------------------------- bind vs advertise
def test_advertised_host():
    base = dict(node_id="decode-0", role="decode", redis_url="redis://r")
    assert NodeConfig(**base).advertised_host == "127.0.0.1"
    assert NodeConfig(**base, host="10.0.0.5").advertised_host == "10.0.0.5"
    assert NodeConfig(**base, host="0.0.0.0").advertised_host is None
    assert NodeConfig(**base, host="::", advertise_host="fd00::7").advertised_host == "fd00::7"
    with pytest.raises(ValueError, match="advertise_host"):
        NodeConfig(**base, advertise_host="0.0.0.0")
    assert [is_wildcard_host(h) for h in ("0.0.0.0", "::", "", "127.0.0.1")] == [True, True, True, False]
    assert (host_port("10.1.2.3", 5), host_port("fd00::7", 5)) == ("10.1.2.3:5", "[fd00::7]:5")


def test_an_actor_advertises_its_pod_or_ray_node_address():
    ray = pytest.importorskip("ray")  # noqa: F841  (node.actor imports it)
    from node.actor import with_advertised_host

    cfg = NodeConfig(node_id="decode-0", role="decode", redis_url="redis://r", host="0.0.0.0")
    assert with_advertised_host(cfg, {"POD_IP": "10.4.0.17"}, lambda: "10.9.9.9").advertise_host == "10.4.0.17"
    assert with_advertised_host(cfg, {}, lambda: "10.9.9.9").advertise_host == "10.9.9.9"
    pinned = NodeConfig(node_id="decode-0", role="decode", redis_url="redis://r", host="10.1.1.1")
    assert with_advertised_host(pinned, {"POD_IP": "10.4.0.17"}, lambda: "x") is pinned  # bound to one address


def test_a_node_bound_to_every_interface_registers_its_advertised_address(tiny_dir, redis_url):
    from tests.clusters import start_node

    ns = f"adv-{uuid.uuid4().hex[:6]}"
    server = start_node(Role.DECODE, "decode-0", small_engine_config(tiny_dir), redis_url=redis_url, namespace=ns,
                        host="0.0.0.0", advertise_host="127.0.0.1", lease_s=2.0, heartbeat_s=0.2)
    try:
        port = int(server.address.rsplit(":", 1)[1])
        assert server.address == f"127.0.0.1:{port}"
        info = IndexReader(redis.Redis.from_url(redis_url), ns=ns).live_nodes()["decode-0"]
        assert info.grpc_address == server.address
        assert info.metrics_address.startswith("127.0.0.1:")
        with grpc.insecure_channel(info.grpc_address) as ch:  # the registered address answers
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()


def test_a_node_bound_to_every_interface_needs_an_address_to_register(tiny_dir, redis_url):
    from decode_node.server import DecodeServer

    cfg = NodeConfig(node_id="decode-0", role="decode", redis_url=redis_url, host="0.0.0.0",
                     engine=small_engine_config(tiny_dir), load_tokenizer=False)
    server = DecodeServer(cfg)
    try:
        with pytest.raises(ValueError, match="advertise_host"):
            server.start()
    finally:
        server.stop(deregister=False)


# ---------------------------------------------------------------------- Redis password
def test_redis_url_gets_its_password_encoded():
    assert with_password("redis://cache:6379/0", "s3cr/t@:%") == "redis://:s3cr%2Ft%40%3A%25@cache:6379/0"
    assert with_password("rediss://cache:6380/2", "pw") == "rediss://:pw@cache:6380/2"
    assert with_password("redis://default@cache:6379", "pw") == "redis://default:pw@cache:6379"
    with pytest.raises(ValueError, match="already has a password"):
        with_password("redis://:old@cache:6379", "pw")
    with pytest.raises(ValueError, match="not a network Redis URL"):
        with_password("http://cache:6379", "pw")
    assert resolve_redis_url("redis://cache:6379/0", {}) == "redis://cache:6379/0"
    assert resolve_redis_url("redis://cache:6379/0", {PASSWORD_ENV: ""}) == "redis://cache:6379/0"
    # redis-py reads back exactly the password, TLS for rediss://
    for url, tls in (("redis://cache:6379/0", False), ("rediss://cache:6380/1", True)):
        client = redis.Redis.from_url(resolve_redis_url(url, {PASSWORD_ENV: "s3cr/t@:%#"}))
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["password"] == "s3cr/t@:%#" and kwargs["host"] == "cache"
        assert (client.connection_pool.connection_class is redis.SSLConnection) is tls


def test_a_password_protected_redis_takes_the_resolved_url():
    port = free_port()
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--requirepass", "s3cr/t@ x"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://127.0.0.1:{port}/0"
        plain = redis.Redis.from_url(url, socket_timeout=2)
        assert wait_for(lambda: _answers(plain), 10, every=0.1)
        with pytest.raises(redis.AuthenticationError):
            plain.ping()
        assert redis.Redis.from_url(resolve_redis_url(url, {PASSWORD_ENV: "s3cr/t@ x"})).ping()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _answers(client: redis.Redis) -> bool:
    try:
        client.ping()
    except redis.AuthenticationError:
        return True
    except redis.ConnectionError:
        return False
    return True


# ---------------------------------------------------------------------- prepare-model
def with_tokenizer(model_dir, dest):
    """A copy of the tiny model with a tokenizer beside it, as a Hugging Face directory has."""
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    shutil.copytree(model_dir, dest)
    Tokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"eos_token": "a"}))
    return dest


@pytest.fixture
def hf_dir(tiny_dir, tmp_path):
    return with_tokenizer(tiny_dir, tmp_path / "src")


def test_prepare_model_copies_a_model_or_its_tokenizer(hf_dir, tmp_path):
    from deploy.model_files import prepare

    full = prepare(str(hf_dir), tmp_path / "vol" / "model")
    assert sorted(p.name for p in full.iterdir()) == sorted(p.name for p in hf_dir.iterdir())
    tok = prepare(str(hf_dir), tmp_path / "vol" / "tokenizer", tokenizer_only=True)
    assert sorted(p.name for p in tok.iterdir()) == ["config.json", "generation_config.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert [p.name for p in (tmp_path / "vol").iterdir() if p.name.startswith(".")] == []  # no staging left

    # a prepared directory is kept (a restarted pod does not fetch again); a partial one is redone
    stamp = (full / "config.json").stat().st_mtime_ns
    (hf_dir / "config.json").write_text("{}")
    assert (prepare(str(hf_dir), full) / "config.json").stat().st_mtime_ns == stamp
    (tok / "tokenizer.json").unlink()
    assert (prepare(str(hf_dir), tok, tokenizer_only=True) / "tokenizer.json").is_file()


def test_prepare_model_refuses_a_directory_without_a_tokenizer(tiny_dir, tmp_path):
    from deploy.model_files import prepare

    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        prepare(str(tiny_dir), tmp_path / "model", tokenizer_only=True)
    assert not (tmp_path / "model").exists()


def test_cli_has_the_cluster_subcommands(capsys):
    from deploy.cli import main

    for cmd in ("nodes", "prepare-model"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
    assert "--prefill-nodes" in capsys.readouterr().out


# ---------------------------------------------------------------------- on a real Ray
@pytest.fixture(scope="module")
def pool_ray():
    """A local Ray with room for two prefill nodes and one decode node."""
    pytest.importorskip("ray")
    yield from ray_pools(2, 1, prefix="nodes")


def test_supervisor_keeps_the_pools_filled(tiny_dir, redis_url, pool_ray, tmp_path):
    ray = pool_ray
    ns = f"sup-{uuid.uuid4().hex[:6]}"
    engine = small_engine_config(with_tokenizer(tiny_dir, tmp_path / "model"))  # decode nodes load a tokenizer
    # Bound to every interface like a pod's node: each registers the Ray node's address.
    template = NodeTemplate(engine=engine, redis_url=redis_url, namespace=ns, host="0.0.0.0", lease_s=2.0)
    reader = IndexReader(redis.Redis.from_url(redis_url), ns=ns)

    sup = NodeSupervisor(template, {Role.PREFILL: None, Role.DECODE: None})
    assert sup.step() == {Role.PREFILL: Plan(("prefill-0", "prefill-1"), ()), Role.DECODE: Plan(("decode-0",), ())}
    assert wait_for(lambda: set(reader.live_nodes()) == {"prefill-0", "prefill-1", "decode-0"}, 90, every=0.1)
    node_ip = ray.util.get_node_ip_address()
    assert all(i.grpc_address.startswith(f"{node_ip}:") for i in reader.live_nodes().values())

    # A supervisor that restarts adopts the running actors instead of starting more.
    again = NodeSupervisor(template, {Role.PREFILL: None, Role.DECODE: None})
    assert again.step() == {Role.PREFILL: Plan((), ()), Role.DECODE: Plan((), ())}

    # Fewer wanted: the surplus leaves the index and dies for good.
    fewer = NodeSupervisor(template, {Role.PREFILL: 1, Role.DECODE: None})
    assert fewer.step()[Role.PREFILL] == Plan((), ("prefill-1",))
    assert set(reader.live_nodes()) == {"prefill-0", "decode-0"}
    assert "prefill-1" not in ray.util.list_named_actors()

    for name in ("prefill-0", "decode-0"):
        actor = ray.get_actor(name)
        ray.get(actor.stop.remote(), timeout=30)
        ray.kill(actor, no_restart=True)
