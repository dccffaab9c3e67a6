"""The Helm chart, offline: lint and render every example values file with helm-python-sdk (the Helm
v4 SDK, no helm binary), validate built-in kinds with kubernetes-validate --strict and each
RayCluster against KubeRay's CRD schema (../shared/data/k8s/), then check what users rely on:
probes on real ports, the NetworkPolicy admitting the router, secrets only through secretKeyRef,
secure defaults (generated Secrets that no render changes, TLS and API keys on, read-only root
filesystems, no service-account tokens, GCS fault tolerance, a budget for the head), worker
groups whose requests match their values, a schema that refuses misspelt values, and every
value documented."""
from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "pdserve"
EXAMPLES = sorted((REPO / "helm" / "examples").glob("*.yaml"))
CRD = REPO.parent / "shared" / "data" / "k8s" / "ray.io_rayclusters.yaml"
K8S_VERSION = "1.33.0"
# Kinds of other operators: checked against their CRD where we have it (KubeRay), by hand otherwise.
CUSTOM_KINDS = {"RayCluster", "ServiceMonitor", "PodMonitor", "Issuer", "Certificate"}


def example_values(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@cache
def _render(values_json: str) -> tuple[dict, ...]:
    out = helm_python.Chart.load(str(CHART)).render(json.loads(values_json), name="pd", namespace="serving")
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return tuple(docs)


def render(values: dict | None = None) -> list[dict]:
    return list(_render(json.dumps(values or {}, sort_keys=True)))


def notes(values: dict | None = None) -> str:
    out = helm_python.Chart.load(str(CHART)).render(values or {}, name="pd", namespace="serving")
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"{kind} *{name_suffix}: {[d['metadata']['name'] for d in found]}"
    return found[0]


def containers(pod_spec: dict) -> list[dict]:
    return pod_spec.get("initContainers", []) + pod_spec["containers"]


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod template in the release, the RayCluster's included."""
    out = []
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            out.append((d["metadata"]["name"], d["spec"]["template"]["spec"]))
        elif d["kind"] == "RayCluster":
            out.append(("head", d["spec"]["headGroupSpec"]["template"]["spec"]))
            out += [(g["groupName"], g["template"]["spec"]) for g in d["spec"]["workerGroupSpecs"]]
    return out


def hook_args(docs: list[dict]):
    """The secrets hook Job's flags, read by its own parser (deploy/k8s_secrets.py); all None
    when the release renders no hook."""
    from deploy.k8s_secrets import build_parser

    jobs = [d for d in docs if d["kind"] == "Job"]
    if not jobs:
        return build_parser().parse_args([])
    (job,) = jobs
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["python", "-m", "deploy.k8s_secrets"]
    return build_parser().parse_args(c["args"])


def secret_refs(docs: list[dict]) -> dict[str, tuple[str, str]]:
    """{env var: (Secret, key)} of every secretKeyRef in the release's pods."""
    return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for _, spec in pod_specs(docs) for c in containers(spec) for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


# ---------------------------------------------------------------------- lint, render, validate
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_lints_clean(example):
    result = helm_python.lint(str(CHART), example_values(example), strict=True)
    assert result["errors"] == []
    assert [m for m in result["messages"] if m["severity"] > 1] == []  # info ("icon is recommended") only


def test_the_three_examples_exist():
    assert {p.stem for p in EXAMPLES} == {"cpu-toy", "gpu-single", "h100-4p4d"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_builtin_kinds_validate_strictly(example):
    docs = render(example_values(example))
    checked = 0
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 8


# Corners the examples do not reach: no secret at all, a download, no optional object.
CORNERS = {
    "bare": {"ray": {"auth": {"enabled": False}, "head": {"pdb": {"enabled": False}}},
             "networkPolicy": {"enabled": False}, "tls": {"enabled": False}, "apiKey": {"enabled": False},
             "redis": {"mode": "external", "external": {"url": "redis://cache:6379/0"}},
             "router": {"pdb": {"enabled": False}}, "prefill": {"replicas": 0}},
    "download": {"model": {"source": "download", "download": {"repo": "Org/Model"}}},
    "secured": {"tls": {"enabled": True, "secretName": "pd-tls"}, "apiKey": {"name": "pd-keys"}},
    "cert-manager": {"tls": {"provider": "certManager"}, "ray": {"gcsFaultTolerance": {"enabled": False}}},
}


@pytest.mark.parametrize("corner", sorted(CORNERS))
def test_corner_values_validate_strictly(corner):
    docs = render(CORNERS[corner])
    for doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    rc = one(docs, "RayCluster")
    validate_raycluster(rc)
    for where, spec in pod_specs([rc]):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": where}, "spec": spec},
                                     K8S_VERSION, strict=True)


def test_strict_validation_catches_a_misplaced_field():
    deployment = one(render(), "Deployment", "-router")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


@cache
def raycluster_schema() -> dict:
    crd = yaml.safe_load(CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


@cache
def _raycluster_validator():
    schema = raycluster_schema()
    cls = jsonschema.validators.validator_for(schema)  # what jsonschema.validate picks
    cls.check_schema(schema)  # once: jsonschema.validate does it on every call
    return cls(schema)


def validate_raycluster(rc: dict) -> None:
    """jsonschema.validate against KubeRay's CRD, its (large) schema checked once per run."""
    error = jsonschema.exceptions.best_match(_raycluster_validator().iter_errors(rc))
    if error is not None:
        raise error


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_raycluster_matches_kuberays_crd(example):
    rc = one(render(example_values(example)), "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    validate_raycluster(rc)
    # The CRD leaves unknown fields of embedded pod templates to the API server: check those
    # pod specs as built-in PodSpecs, strictly.
    for where, spec in pod_specs([rc]):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": where}, "spec": spec},
                                     K8S_VERSION, strict=True)


def test_the_crd_schema_catches_a_wrong_field():
    rc = one(render(), "RayCluster")
    rc["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_raycluster(rc)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_monitors_are_well_formed(example):
    docs = render(example_values(example))
    for kind, port_key in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints")):
        for m in (d for d in docs if d["kind"] == kind):
            assert m["apiVersion"] == "monitoring.coreos.com/v1"
            assert set(m["spec"]) == {"selector", port_key}
            assert all(set(e) <= {"port", "path", "interval", "scheme", "tlsConfig"} and e["path"] == "/metrics"
                       for e in m["spec"][port_key])


def test_the_router_is_scraped_over_https_under_tls():
    """The router's /metrics is HTTPS when tls.enabled: the ServiceMonitor says so and trusts
    the release's CA under the member name; the nodes' metrics ports stay plain HTTP
    (docs/security.md says why)."""
    values = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
    (plain,) = one(render({**values, "tls": {"enabled": False}}), "ServiceMonitor")["spec"]["endpoints"]
    assert "scheme" not in plain and "tlsConfig" not in plain
    (default,) = one(render(values), "ServiceMonitor")["spec"]["endpoints"]  # TLS on: the chart's own CA
    assert default["tlsConfig"]["ca"]["secret"] == {"name": "pd-pdserve-tls", "key": "ca.crt"}
    docs = render({**values, "tls": {"enabled": True, "secretName": "pd-tls", "serverName": "members.pd"}})
    (ep,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert ep["scheme"] == "https"
    assert ep["tlsConfig"] == {"ca": {"secret": {"name": "pd-tls", "key": "ca.crt"}}, "serverName": "members.pd"}
    assert all("scheme" not in e for e in one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"])


def test_what_each_example_renders():
    kinds = {p.stem: sorted(d["kind"] for d in render(example_values(p))) for p in EXAMPLES}
    base = ["Deployment", "NetworkPolicy", "NetworkPolicy", "PodDisruptionBudget", "PodDisruptionBudget",
            "PodDisruptionBudget", "PodDisruptionBudget", "RayCluster", "Service",
            "Job", "Role", "RoleBinding", "ServiceAccount"]  # the secrets hook (API key, TLS)
    builtin_redis = ["NetworkPolicy", "Service", "StatefulSet"]  # its password: the hook's too
    monitoring = ["ConfigMap", "PodMonitor", "ServiceMonitor"]
    assert kinds["cpu-toy"] == sorted(base + builtin_redis)
    assert kinds["gpu-single"] == sorted(base + builtin_redis + monitoring)
    assert kinds["h100-4p4d"] == sorted(base + monitoring + ["HorizontalPodAutoscaler"])


# ---------------------------------------------------------------------- probes and ports
def _port(container: dict, ref) -> int:
    if isinstance(ref, int):
        assert ref in {p["containerPort"] for p in container["ports"]}, f"{ref} is not a port of {container['name']}"
        return ref
    (p,) = [p for p in container["ports"] if p["name"] == ref]
    return p["containerPort"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_router_probes_point_at_its_ports(example):
    values = example_values(example)
    docs = render(values)
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]
    (c,) = router["containers"]
    args = c["args"]
    grpc_port = int(args[args.index("--port") + 1])
    http_port = int(args[args.index("--http-port") + 1])
    assert args[args.index("--host") + 1] == "0.0.0.0"
    if values.get("tls", {}).get("enabled", True):  # the kubelet's gRPC probe speaks no TLS: /ready
        assert c["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http", "scheme": "HTTPS"}
    else:
        assert _port(c, c["startupProbe"]["grpc"]["port"]) == grpc_port
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert _port(c, c["readinessProbe"]["httpGet"]["port"]) == http_port
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert _port(c, c["livenessProbe"]["httpGet"]["port"]) == http_port
    # The Service forwards to the same ports by name.
    svc = one(docs, "Service", "-router")
    assert {p["name"]: _port(c, p["targetPort"]) for p in svc["spec"]["ports"]} == {"grpc": grpc_port, "http": http_port}


def test_router_drains_before_it_is_killed():
    values = {"router": {"shutdown": {"drainSeconds": 45}}}
    router = one(render(values), "Deployment", "-router")["spec"]["template"]["spec"]
    (c,) = router["containers"]
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "45"]
    # the sleep, then the router's own stop (gRPC grace and uvicorn's wait) must fit the grace period
    assert router["terminationGracePeriodSeconds"] >= 45 + 15


@pytest.mark.parametrize("drain_s", [30, 42.5, 0])
def test_workers_drain_their_node_before_the_pod_stops(drain_s, capsys):
    """Kubernetes signals only a worker container's PID 1 (`ray start`), not the node actor:
    the preStop hook drains it (deploy/pod_drain.py, its own parser reads the rendered args),
    waiting at least the node's drain timeout, and the grace period outlasts the hook plus
    Ray's stop. The hook against a real node actor: tests/test_lifecycle.py."""
    from deploy.pod_drain import main as pod_drain

    rc = one(render({"nodes": {"drainSeconds": drain_s}}), "RayCluster")
    sup = next(c for c in rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"] if c["name"] == "pdserve-nodes")
    assert float(_cli_flags(sup["args"])["--drain-timeout"]) == drain_s
    for group in rc["spec"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        (worker,) = spec["containers"]
        cmd = worker["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[:3] == ["python", "-m", "deploy.pod_drain"]
        wait_s = float(_cli_flags(cmd)["--timeout-s"])
        assert wait_s >= drain_s + 10  # the drain, leaving the index, the actor's exit
        assert spec["terminationGracePeriodSeconds"] >= wait_s + 10  # then `ray start` stops
        assert pod_drain([*cmd[3:], "--under", "-1"]) == 0  # parses; no process below "pid -1" to drain
    assert "no node actor running here" in capsys.readouterr().out


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_nodes_serve_on_the_ports_the_chart_declares(example):
    rc = one(render(example_values(example)), "RayCluster")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    (sup,) = [c for c in head["containers"] if c["name"] == "pdserve-nodes"]
    args = sup["args"]
    assert sup["command"] == ["pdserve", "nodes"]
    grpc_port, metrics_port = int(args[args.index("--grpc-port") + 1]), int(args[args.index("--metrics-port") + 1])
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert metrics_port != 8080  # KubeRay's port for Ray's own metrics
    for group in rc["spec"]["workerGroupSpecs"]:
        (worker,) = group["template"]["spec"]["containers"]
        assert _port(worker, "node-grpc") == grpc_port and _port(worker, "node-metrics") == metrics_port
        env = {e["name"]: e for e in worker["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"  # what the node registers


def test_the_supervisor_reaches_the_head_it_runs_beside():
    rc = one(render(), "RayCluster")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    ray_head, sup = head["containers"]
    assert ray_head["name"] == "ray-head"  # KubeRay starts Ray in the first container
    gcs = _port(ray_head, "gcs-server")
    assert sup["args"][sup["args"].index("--ray-address") + 1] == f"127.0.0.1:{gcs}"
    shared = {m["name"] for m in ray_head["volumeMounts"] if m["mountPath"] == "/tmp/ray"}
    assert shared and shared == {m["name"] for m in sup["volumeMounts"] if m["mountPath"] == "/tmp/ray"}
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no node on the head


# ---------------------------------------------------------------------- worker groups
def _cli_flags(args: list[str]) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[a] = nxt if nxt is not None and not nxt.startswith("--") else True
    return out


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_worker_groups_match_their_values(example):
    values = example_values(example)
    rc = one(render(values), "RayCluster")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    flags = _cli_flags(next(c for c in head["containers"] if c["name"] == "pdserve-nodes")["args"])
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, g in groups.items():
        want = values.get(role, {})
        assert g["replicas"] == want.get("replicas", 1)
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        # one unit of the role's pool per pod: the supervisor's "auto" count is the pod count
        assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {f"{role}_pool": 1}
        assert flags[f"--{role}-nodes"] == "auto"
        (c,) = g["template"]["spec"]["containers"]
        res = c["resources"]
        for kind in ("requests", "limits"):
            expected = {k: str(v) for k, v in want.get("resources", {}).get(kind, {}).items()}
            got = {k: str(v) for k, v in res[kind].items()}
            gpu = want.get("gpu", {})
            if gpu.get("count", 0):
                assert got.pop(gpu["resourceName"]) == str(gpu["count"])
            if expected:
                assert got == expected
        gpu = want.get("gpu", {})
        assert flags.get(f"--{role}-gpu", False) is bool(gpu.get("count", 0))
        assert flags.get(f"--{role}-accelerator-type") == (gpu.get("type") or None)
        assert g["template"]["spec"].get("nodeSelector", {}) == want.get("nodeSelector", {})
        assert g["template"]["spec"].get("tolerations", []) == want.get("tolerations", [])
        assert g["template"]["spec"].get("affinity", {}) == want.get("affinity", {})


def test_pools_follow_the_planner_within_the_worker_groups_bounds():
    """pools.followTargets: the supervisor follows the planner's targets within each group's
    minReplicas..maxReplicas (its flags parsed by its own parser), KubeRay's in-tree autoscaler
    adds and removes the pods, and only then does the head mount a service-account token."""
    import argparse

    from deploy import nodes
    from deploy.cli import _add_engine_args
    from deploy.pool_runners import pool_bounds

    def supervisor_args(rc):
        head = rc["spec"]["headGroupSpec"]["template"]["spec"]
        p = argparse.ArgumentParser()
        _add_engine_args(p)
        nodes.add_arguments(p)
        return p.parse_args(next(c for c in head["containers"] if c["name"] == "pdserve-nodes")["args"])

    rc = one(render(), "RayCluster")
    assert "enableInTreeAutoscaling" not in rc["spec"] and "autoscalerOptions" not in rc["spec"]
    assert rc["spec"]["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert not supervisor_args(rc).follow_targets
    assert {g["groupName"]: (g["minReplicas"], g["maxReplicas"]) for g in rc["spec"]["workerGroupSpecs"]} == \
        {"prefill": (0, 16), "decode": (1, 16)}

    values = {"pools": {"followTargets": True, "cooldownSeconds": 45, "idleTimeoutSeconds": 120,
                        "startTimeoutSeconds": 600},
              "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4},
              "decode": {"replicas": 2, "minReplicas": 2, "maxReplicas": 6}}
    rc = one(render(values), "RayCluster")
    validate_raycluster(rc)  # KubeRay's CRD knows every field
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    assert rc["spec"]["autoscalerOptions"] == {"upscalingMode": "Default", "idleTimeoutSeconds": 120}
    assert rc["spec"]["headGroupSpec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert {g["groupName"]: (g["minReplicas"], g["replicas"], g["maxReplicas"])
            for g in rc["spec"]["workerGroupSpecs"]} == {"prefill": (1, 1, 4), "decode": (2, 2, 6)}
    a = supervisor_args(rc)
    assert (a.follow_targets, a.pool_cooldown_s, a.pool_start_timeout_s) == (True, 45.0, 600.0)
    assert (a.min_prefill_nodes, a.max_prefill_nodes, a.min_decode_nodes, a.max_decode_nodes) == (1, 4, 2, 6)
    assert (a.prefill_nodes, a.decode_nodes) == (None, None)  # "auto" (the pods there) until a target is set
    bounds = pool_bounds(a)  # the supervisor accepts them as they are
    assert [(bounds.low(r), bounds.high(r)) for r in ("prefill", "decode")] == [(1, 4), (2, 6)]

    # bounds that cannot hold are refused: by the schema, or by the template naming both values
    for bad in ({"decode": {"minReplicas": 0}}, {"prefill": {"minReplicas": -1}}, {"pools": {"followTargets": "yes"}},
                {"pools": {"idleTimeoutSeconds": -5}}):
        with pytest.raises(helm_python.HelmValuesError):
            helm_python.Chart.load(str(CHART)).render(bad, name="pd", namespace="serving")
    with pytest.raises(Exception, match=r"prefill.minReplicas \(5\) is above prefill.maxReplicas \(2\)"):
        helm_python.Chart.load(str(CHART)).render({"prefill": {"minReplicas": 5, "maxReplicas": 2}},
                                                  name="pd", namespace="serving")


def test_engine_values_map_onto_pdserve_nodes_flags():
    import argparse

    from deploy import nodes
    from deploy.cli import _add_engine_args, engine_config_from_args

    values = example_values(REPO / "helm" / "examples" / "h100-4p4d.yaml")
    rc = one(render(values), "RayCluster")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    args = next(c for c in head["containers"] if c["name"] == "pdserve-nodes")["args"]
    p = argparse.ArgumentParser()
    _add_engine_args(p)
    nodes.add_arguments(p)
    a = p.parse_args(args)  # every flag the chart passes exists
    engine = engine_config_from_args(a)
    assert engine.model == "/models/Meta-Llama-3.1-8B-Instruct"
    assert (engine.dtype, engine.cache.kv_cache_bytes, engine.scheduler.max_num_seqs) == ("bfloat16", 40960 << 20, 256)
    assert engine.speculative.method == "ngram"
    assert (a.prefill_nodes, a.decode_nodes, a.grpc_port, a.metrics_port) == (None, None, 50061, 9400)
    assert (a.prefill_gpu, a.prefill_accelerator_type, a.decode_gpu) == (True, "H100", True)
    # Node metrics carry the router's model name, not the model's path: their series join.
    router_args = one(render(values), "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert a.served_model_name == router_args[router_args.index("--model-name") + 1] == values["model"]["name"]


def test_kv_dist_value_reaches_the_nodes():
    import argparse

    from deploy import nodes
    from deploy.cli import _add_engine_args

    for on in (False, True):
        values = example_values(REPO / "helm" / "examples" / "h100-4p4d.yaml")
        values.setdefault("nodes", {})["kvDist"] = on
        head = one(render(values), "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
        args = next(c for c in head["containers"] if c["name"] == "pdserve-nodes")["args"]
        p = argparse.ArgumentParser()
        _add_engine_args(p)
        nodes.add_arguments(p)
        assert p.parse_args(args).kv_dist is on


def test_tensor_parallel_values_reach_the_nodes_and_size_the_gpu_pods():
    import argparse

    from deploy import nodes
    from deploy.cli import _add_engine_args

    values = example_values(REPO / "helm" / "examples" / "h100-4p4d.yaml")
    values["prefill"]["tensorParallel"], values.setdefault("decode", {})["tensorParallel"] = 4, 2
    values["prefill"]["stepTokens"] = 1024
    rc = one(render(values), "RayCluster")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    args = next(c for c in head["containers"] if c["name"] == "pdserve-nodes")["args"]
    p = argparse.ArgumentParser()
    _add_engine_args(p)
    nodes.add_arguments(p)
    assert nodes.tensor_parallel_sizes(p.parse_args(args)) == (4, 2)
    assert p.parse_args(args).prefill_step_tokens == 1024
    values["prefill"]["stepTokens"] = None  # unset: no flag, the engine's budget in every role
    head = one(render(values), "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    args = next(c for c in head["containers"] if c["name"] == "pdserve-nodes")["args"]
    assert "--prefill-step-tokens" not in args and p.parse_args(args).prefill_step_tokens is None
    for g in rc["spec"]["workerGroupSpecs"]:  # one GPU per rank
        gpu = values[g["groupName"]]["gpu"]
        (c,) = g["template"]["spec"]["containers"]
        want = str(gpu["count"] * values[g["groupName"]]["tensorParallel"])
        assert c["resources"]["limits"][gpu["resourceName"]] == c["resources"]["requests"][gpu["resourceName"]] == want


def test_kv_tier_values_reach_the_nodes_and_their_volume():
    """engine.hostCacheMiB and engine.diskCache become the tier flags of `pdserve nodes`, and the
    worker pods mount the disk tier's volume where --disk-cache-dir points (an emptyDir, or the
    named claim); without them, neither flags nor volume."""
    import argparse

    from deploy import nodes
    from deploy.cli import _add_engine_args, engine_config_from_args

    def nodes_cache(values):
        rc = one(render(values), "RayCluster")
        head = rc["spec"]["headGroupSpec"]["template"]["spec"]
        p = argparse.ArgumentParser()
        _add_engine_args(p)
        nodes.add_arguments(p)
        a = p.parse_args(next(c for c in head["containers"] if c["name"] == "pdserve-nodes")["args"])
        workers = [g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]]
        vols = [[v for v in w["volumes"] if v["name"] == "kv-cache"] for w in workers]
        mounts = [[m["mountPath"] for m in w["containers"][0]["volumeMounts"] if m["name"] == "kv-cache"]
                  for w in workers]
        return engine_config_from_args(a).cache, vols, mounts

    cache, vols, mounts = nodes_cache({})
    assert (cache.host_cache_mib, cache.disk_cache_dir) == (0, None) and vols == [[], []] and mounts == [[], []]
    cache, vols, mounts = nodes_cache({"engine": {"hostCacheMiB": 2048, "diskCache": {"mib": 10240}}})
    assert (cache.host_cache_mib, cache.disk_cache_dir, cache.disk_cache_mib) == (2048, "/kv-cache", 10240)
    assert vols == [[{"name": "kv-cache", "emptyDir": {"sizeLimit": "16Gi"}}]] * 2 and mounts == [["/kv-cache"]] * 2
    _, vols, _ = nodes_cache({"engine": {"hostCacheMiB": 512, "diskCache": {"mib": 100, "claimName": "kv"}}})
    assert vols[0] == [{"name": "kv-cache", "persistentVolumeClaim": {"claimName": "kv"}}]


def test_router_values_map_onto_router_server_flags():
    """Every flag the chart gives the router exists in ``python -m frontend.server`` (its own
    parser reads the rendered args), and the reliability values arrive: max_migrations and the
    straggler factor, default and set."""
    from frontend.server import build_parser

    def router_args(values: dict):
        args = one(render(values), "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]["args"]
        return build_parser().parse_args(args)

    a = router_args({})
    assert (a.max_migrations, a.straggler_factor, a.max_inflight, a.policy) == (2, 3.0, 256, "ttft")
    a = router_args({"router": {"maxMigrations": 0, "stragglerFactor": 2.5}})
    assert (a.max_migrations, a.straggler_factor) == (0, 2.5)
    assert router_args({"router": {"stragglerFactor": 0}}).straggler_factor == 0.0  # off
    assert a.prefix_fetch is True and router_args({"router": {"prefixFetch": False}}).prefix_fetch is False
    # The HTTP front's bounds: the body limit from the model's context unless set.
    assert (a.max_body_bytes, a.max_buffered_bytes, a.http_header_timeout_s, a.http_body_timeout_s) == \
        (None, 128 << 20, 20.0, 30.0)
    a = router_args({"router": {"maxBodyBytes": 4 << 20, "maxBufferedBytes": 1 << 30, "httpHeaderTimeoutSeconds": 5}})
    assert (a.max_body_bytes, a.max_buffered_bytes, a.http_header_timeout_s) == (4 << 20, 1 << 30, 5.0)
    a = router_args({"router": {"decodeProgress": {"factor": 5, "floorSeconds": 2, "ceilingSeconds": 20},
                                "prefillDeadline": {"factor": 3, "floorSeconds": 7}}})
    assert (a.decode_progress_factor, a.decode_progress_floor_s, a.decode_progress_ceiling_s,
            a.prefill_deadline_factor, a.prefill_deadline_floor_s) == (5, 2, 20, 3, 7)
    for example in EXAMPLES:
        router_args(example_values(example))


def test_pdbs_select_the_worker_groups_and_the_router():
    docs = render()
    rc = one(docs, "RayCluster")
    for role in ("prefill", "decode"):
        pdb = one(docs, "PodDisruptionBudget", f"-{role}")
        assert pdb["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": rc["metadata"]["name"], "ray.io/group": role}
    router_pdb = one(docs, "PodDisruptionBudget", "-router")
    router_pods = one(docs, "Deployment", "-router")["spec"]["template"]["metadata"]["labels"]
    assert router_pdb["spec"]["selector"]["matchLabels"].items() <= router_pods.items()
    assert not [d for d in render({"prefill": {"replicas": 0}}) if d["metadata"]["name"].endswith("-prefill")]


# ---------------------------------------------------------------------- network policy
def _admits(policy: dict, pod_labels: dict, port: int) -> bool:
    for rule in policy["spec"]["ingress"]:
        ports = rule.get("ports")
        if ports and port not in {p["port"] for p in ports}:
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            sel = peer.get("podSelector")
            if sel is not None and "namespaceSelector" not in peer and sel.get("matchLabels", {}).items() <= pod_labels.items():
                return True
    return False


def _selects(policy: dict, labels: dict) -> bool:
    return policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def test_network_policy_admits_the_router_and_keeps_ray_inside():
    docs = render()
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    rc = one(docs, "RayCluster")
    router_pod = one(docs, "Deployment", "-router")["spec"]["template"]["metadata"]["labels"]
    redis_pod = one(docs, "StatefulSet", "-redis")["spec"]["template"]["metadata"]["labels"]
    # KubeRay labels every Ray pod with its cluster (and group)
    ray_pod = {"ray.io/cluster": rc["metadata"]["name"], "ray.io/group": "decode"}
    outsider = {"app": "somebody-else"}
    ray_pol, = [p for p in policies if _selects(p, ray_pod)]
    redis_pol, = [p for p in policies if _selects(p, redis_pod)]
    router_pol, = [p for p in policies if _selects(p, router_pod)]

    assert _admits(ray_pol, router_pod, 50061)  # the router calls the nodes
    assert _admits(ray_pol, ray_pod, 50061)  # node-to-node KV transfer
    for port in (6379, 8265, 10001, 50061, 9400):  # GCS, dashboard, client, KV, metrics
        assert not _admits(ray_pol, outsider, port)
    assert not _admits(ray_pol, router_pod, 8265)  # the router has no business on the dashboard
    assert _admits(redis_pol, router_pod, 6379) and _admits(redis_pol, ray_pod, 6379)
    assert not _admits(redis_pol, outsider, 6379)
    assert _admits(router_pol, outsider, 8000) and _admits(router_pol, outsider, 50051)  # clients: anyone by default


def test_router_clients_narrow_who_reaches_the_router():
    clients = [{"podSelector": {"matchLabels": {"app": "gateway"}}}]
    docs = render({"networkPolicy": {"routerClients": clients}})
    router_pod = one(docs, "Deployment", "-router")["spec"]["template"]["metadata"]["labels"]
    (router_pol,) = [p for p in docs if p["kind"] == "NetworkPolicy" and _selects(p, router_pod)]
    assert _admits(router_pol, {"app": "gateway"}, 8000) and _admits(router_pol, {"app": "gateway"}, 50051)
    assert not _admits(router_pol, {"app": "somebody-else"}, 8000)
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


# ---------------------------------------------------------------------- secrets
SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|AUTH|API_KEY", re.I)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_secrets_reach_pods_only_through_secret_refs(example):
    docs = render(example_values(example))
    for where, spec in pod_specs(docs):
        for c in containers(spec):
            for e in c.get("env", []):
                if SECRET_NAME.search(e["name"]) and e["name"] != "RAY_AUTH_MODE":
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{where}/{c['name']}: {e['name']} is not from a Secret"
            text = " ".join(c.get("command", []) + c.get("args", []))
            assert not re.search(r"rediss?://[^/\s]*:[^/\s]*@", text), f"{where}/{c['name']}: a password in a URL"
            assert "--requirepass" not in text and "-a " not in text
    # the one generated password is in its Secret only: in no other object
    secrets = [d for d in docs if d["kind"] == "Secret"]
    others = json.dumps([d for d in docs if d["kind"] != "Secret"])
    for s in secrets:
        for value in s["data"].values():
            import base64
            assert base64.b64decode(value).decode() not in others


def test_values_hold_no_secret_only_references_to_secrets():
    """No value takes a password or token itself: the schema has no such property, and every
    property that names a secret is a Secret's name or key."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node, path):
        for key, sub in node.get("properties", {}).items():
            if re.fullmatch(r"(?i).*(password|token|apikey|credential)(secret)?", key):
                props = sub.get("properties", {})
                assert sub.get("type") == "object" and {"name", "key"} <= set(props) <= {"name", "key", "enabled"}, \
                    f"{path + key} must reference a Secret, not hold one"
                assert props.get("enabled", {"type": "boolean"}) == {"type": "boolean"}
            walk(sub, f"{path}{key}.")

    walk(schema, "")
    for example in EXAMPLES:
        text = example.read_text()
        assert not re.search(r"hf_[A-Za-z0-9]{10,}|password:\s*\S", text), example.name


def test_existing_secrets_are_used_as_named():
    docs = render({"redis": {"builtin": {"existingSecret": "my-redis"}}, "ray": {"auth": {"existingSecret": "my-ray"}}})
    assert not [d for d in docs if d["kind"] == "Secret"]
    rc = one(docs, "RayCluster")
    assert rc["spec"]["authOptions"] == {"mode": "token", "secretName": "my-ray"}
    refs = {(e["name"], e["valueFrom"]["secretKeyRef"]["name"])
            for _, spec in pod_specs(docs) for c in containers(spec) for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}
    assert ("PDSERVE_REDIS_PASSWORD", "my-redis") in refs and ("RAY_AUTH_TOKEN", "my-ray") in refs
    assert ("REDIS_PASSWORD", "my-redis") in refs


def test_tls_and_api_keys_come_from_secrets():
    """tls.enabled mounts one Secret at one path on the router and every Ray pod, and the
    router's and the supervisor's flags name files under it (a node reads them on the pod Ray
    places it on); the kubelet's probes, which speak no TLS over gRPC, use HTTPS; the API keys
    reach the router as a secretKeyRef. Both on by default; off, nothing of them is left."""
    plain = render({"tls": {"enabled": False}, "apiKey": {"enabled": False}})
    router = one(plain, "Deployment", "-router")["spec"]["template"]["spec"]
    assert "grpc" in router["containers"][0]["startupProbe"]
    assert not any(a.startswith("--tls") for _, s in pod_specs(plain) for c in containers(s) for a in c.get("args", []))
    assert "PDSERVE_API_KEY" not in {e["name"] for e in router["containers"][0]["env"]}
    assert not [d for d in plain if d["kind"] == "Job"] or hook_args(plain).tls_secret is None

    docs = render({"tls": {"enabled": True, "secretName": "pd-tls"}, "apiKey": {"name": "pd-keys", "key": "k"}})
    pods = dict(pod_specs(docs))
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]
    (rc,) = router["containers"]
    rc_flags = _cli_flags(rc["args"])
    supervisor = next(c for c in containers(one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"])
                      if c["name"] == "pdserve-nodes")
    sup_flags = _cli_flags(supervisor["args"])
    files = {flag: rc_flags[flag] for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-file")}
    assert all(sup_flags[flag] == path for flag, path in files.items())
    assert rc_flags["--tls-server-name"] == sup_flags["--tls-server-name"] == "pdserve-cluster"
    mounted = [where for where in pods if where.endswith(("router", "head", "prefill", "decode"))]
    assert len(mounted) == 4
    for where in mounted:
        vols = {v["name"]: v for v in pods[where]["volumes"]}
        assert vols["pdserve-tls"]["secret"]["secretName"] == "pd-tls", where
        mounts = [m for c in containers(pods[where]) for m in c.get("volumeMounts", []) if m["name"] == "pdserve-tls"]
        assert mounts, where
        for mount in mounts:  # the head: the supervisor and Ray's own container (GCS to a rediss:// Redis)
            assert mount["readOnly"] and all(p.startswith(mount["mountPath"] + "/") for p in files.values()), where
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert rc[probe]["httpGet"]["scheme"] == "HTTPS"
    env = {e["name"]: e for e in rc["env"]}
    assert env["PDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "pd-keys", "key": "k"}


def test_client_certificates_for_the_router(redis_server, tmp_path):
    """tls.clientAuth: the router asks clients for a certificate from the release's CA, and its
    probes, which the kubelet's httpGet could no longer pass, run in the pod presenting the
    pod's own. The rendered probe command runs here against a real router asking for client
    certificates, with a throwaway CA's files where the Secret would be mounted."""
    import shutil
    import subprocess
    import sys
    import uuid

    from engine.models.builtin import resolve_builtin
    from frontend.server import build_parser
    from security.ca import ThrowawayCA, private_dir
    from tests.clusters import start_router

    docs = render({"tls": {"enabled": True, "secretName": "pd-tls", "clientAuth": True}})
    (c,) = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"]
    assert build_parser().parse_args(c["args"]).tls_client_auth
    probes = {name: c[name]["exec"]["command"] for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert all(cmd[3] == "/etc/pdserve/tls" for cmd in probes.values())
    assert probes["livenessProbe"][4] == "https://127.0.0.1:8000/health"
    assert probes["readinessProbe"][4] == probes["startupProbe"][4] == "https://127.0.0.1:8000/ready"
    off = render({"tls": {"enabled": True, "secretName": "pd-tls"}})
    assert not build_parser().parse_args(one(off, "Deployment", "-router")["spec"]["template"]["spec"]
                                         ["containers"][0]["args"]).tls_client_auth

    ca_dir = private_dir()
    try:
        member = ThrowawayCA(ca_dir).issue("member")
        mounted = tmp_path / "tls"  # the Secret's keys, as the pod sees them
        mounted.mkdir()
        for src, key in ((member.ca_file, "ca.crt"), (member.cert_file, "tls.crt"), (member.key_file, "tls.key")):
            shutil.copy(src, mounted / key)
        router = start_router(redis_server.url, resolve_builtin("smollm2-135m"), namespace="ca-" + uuid.uuid4().hex,
                              max_model_len=64, http_port=0, tls_cert_file=member.cert_file,
                              tls_key_file=member.key_file, tls_ca_file=member.ca_file, tls_client_auth=True)
        try:
            def probe(cmd: list[str], cert_dir: Path) -> int:
                url = cmd[4].replace("127.0.0.1:8000", router.http_address)
                return subprocess.run([sys.executable, *cmd[1:3], str(cert_dir), url], capture_output=True,
                                      timeout=60).returncode

            assert probe(probes["livenessProbe"], mounted) == 0
            assert probe(probes["readinessProbe"], mounted) != 0  # 503: no decode node yet
            (ca_dir / "other").mkdir(mode=0o700)
            stranger = ThrowawayCA(ca_dir / "other").issue("member")  # same name, another CA: refused
            shutil.copy(stranger.cert_file, mounted / "tls.crt")
            shutil.copy(stranger.key_file, mounted / "tls.key")
            assert probe(probes["livenessProbe"], mounted) != 0
        finally:
            router.stop()
    finally:
        shutil.rmtree(ca_dir)


def test_ray_token_auth_is_on_by_default():
    rc = one(render(), "RayCluster")
    assert rc["spec"]["authOptions"]["mode"] == "token"
    assert rc["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"  # dashboard: inside the cluster


# ---------------------------------------------------------------------- model sources and Redis modes
def test_model_sources():
    def router_and_workers(values):
        docs = render(values)
        router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]
        rc = one(docs, "RayCluster")
        return router, [g["template"]["spec"] for g in rc["spec"]["workerGroupSpecs"]], rc

    router, workers, _ = router_and_workers({})
    (init,) = router["initContainers"]
    assert init["args"] == ["smollm2-135m", "/cache/tokenizer", "--tokenizer-only"]
    assert router["containers"][0]["args"][router["containers"][0]["args"].index("--tokenizer-dir") + 1] == "/cache/tokenizer"
    assert all("initContainers" not in w for w in workers)  # each node converts the builtin itself

    router, workers, rc = router_and_workers({"model": {"source": "download", "download": {
        "repo": "Org/Model", "revision": "v1", "tokenSecret": {"name": "hf", "key": "token"}}}})
    for spec, tokenizer_only in [(router, True)] + [(w, False) for w in workers]:
        (init,) = spec["initContainers"]
        assert init["args"][:4] == ["hf:Org/Model", "/models/model", "--revision", "v1"]
        assert ("--tokenizer-only" in init["args"]) is tokenizer_only
        env = {e["name"]: e for e in init["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
        assert env["HF_HUB_OFFLINE"]["value"] == "0"

    router, workers, rc = router_and_workers({"model": {"source": "pvc", "pvc": {"claimName": "models", "path": "llama"}}})
    assert "initContainers" not in router and all("initContainers" not in w for w in workers)
    for spec in [router] + workers:
        (vol,) = [v for v in spec["volumes"] if v["name"] == "model"]
        assert vol["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    sup = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]
    assert sup["args"][sup["args"].index("--model") + 1] == "/models/llama"


def test_redis_modes():
    docs = render()
    sts = one(docs, "StatefulSet", "-redis")
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert hook_args(docs).redis_password_secret == "pd-pdserve-redis"  # made by the hook, not rendered
    router_args = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    url = router_args[router_args.index("--redis-url") + 1]
    svc = one(docs, "Service", "-redis")
    assert url == f"redis://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}/0"

    docs = render({"redis": {"mode": "external", "external": {
        "url": "rediss://cache.example:6380/2", "passwordSecret": {"name": "ext", "key": "pw"}}}})
    assert not [d for d in docs if d["kind"] in ("StatefulSet", "Secret")]
    assert hook_args(docs).redis_password_secret is None
    router = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][router["args"].index("--redis-url") + 1] == "rediss://cache.example:6380/2"
    (pw,) = [e for e in router["env"] if e["name"] == "PDSERVE_REDIS_PASSWORD"]
    assert pw["valueFrom"]["secretKeyRef"] == {"name": "ext", "key": "pw"}


def test_an_external_redis_url_may_carry_redis_py_options():
    """rediss:// with a private CA: the CA file goes in the URL's query, which the schema admits
    (but no password in it), the pods receive as given, the password joins without touching it,
    and redis-py reads."""
    import redis

    from kv_index.redis_url import resolve_redis_url

    url = "rediss://cache.example:6380/2?ssl_ca_certs=/etc/pdserve/tls/ca.crt&ssl_cert_reqs=required"
    docs = render({"redis": {"mode": "external", "external": {"url": url, "passwordSecret": {"name": "ext"}}}})
    args = one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--redis-url") + 1] == url
    sup = next(c for c in one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
               if c["name"] == "pdserve-nodes")
    assert sup["args"][sup["args"].index("--redis-url") + 1] == url
    full = resolve_redis_url(url, {"PDSERVE_REDIS_PASSWORD": "s3cr/t"})
    assert full == "rediss://:s3cr%2Ft@cache.example:6380/2?ssl_ca_certs=/etc/pdserve/tls/ca.crt&ssl_cert_reqs=required"
    kw = redis.Redis.from_url(full).connection_pool.connection_kwargs  # parsed only: nothing connects
    assert (kw["ssl_ca_certs"], kw["password"], kw["db"]) == ("/etc/pdserve/tls/ca.crt", "s3cr/t", 2)


def test_optional_objects():
    docs = render({"router": {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 9}},
                   "metrics": {"grafanaDashboard": {"enabled": True}}})
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 9)
    assert "replicas" not in one(docs, "Deployment", "-router")["spec"]  # the HPA owns it
    dash = one(docs, "ConfigMap", "-grafana-dashboard")
    assert json.loads(dash["data"]["pdserve.json"]) == json.loads((REPO / "deploy/grafana/pdserve.json").read_text())
    assert "port-forward svc/pd-pdserve-router" in notes()


def test_the_charts_dashboard_is_the_repos():
    assert (CHART / "files" / "pdserve.json").read_bytes() == (REPO / "deploy" / "grafana" / "pdserve.json").read_bytes()


# ---------------------------------------------------------------------- values and schema
@pytest.mark.parametrize("bad", [
    {"prefil": {"replicas": 2}},  # a misspelt key at the top
    {"decode": {"gpu": {"cuont": 1}}},  # ... and deep down
    {"router": {"replicass": 3}},
    {"engine": {"dtype": "fp8"}},
    {"decode": {"replicas": 0}},
    {"prefill": {"gpu": {"count": 8}}},
    {"images": {"node": {"repository": "pdserve/node-cpu", "tag": "latest"}}},
    {"model": {"source": "pvc"}},  # a PVC source without its claim
    {"redis": {"mode": "external", "external": {"url": "redis://:hunter2@cache:6379/0"}}},  # a password in the URL
    {"redis": {"mode": "external", "external": {"url": "rediss://cache:6380/0?password=hunter2"}}},  # ... in its query
    {"redis": {"mode": "external", "external": {"url": "rediss://cache:6380/0?ssl_ca_certs=/a&password=x"}}},
    {"tls": {"enabled": True, "secretName": "t", "clientAuth": "yes"}},
    {"tls": {"provider": "letsencrypt"}},  # the chart makes its certificate one of two ways
    {"tls": {"validityDays": 0}},
    {"apiKey": {"enabled": "yes"}},
    {"ray": {"gcsFaultTolerance": {"enabled": 1}}},
    {"ray": {"head": {"pdb": {"maxUnavailabe": 1}}}},
    {"apiKey": "sk-inline"},  # a key itself instead of a reference to its Secret
    {"router": {"maxMigrations": -1}},
    {"router": {"maxMigrations": 1.5}},
    {"router": {"stragglerFactor": -3}},
    {"router": {"stragglerFactor": "3x"}},
], ids=lambda v: json.dumps(v))
def test_schema_rejects(bad):
    with pytest.raises(helm_python.HelmValuesError):
        helm_python.Chart.load(str(CHART)).render(bad, name="pd", namespace="serving")


def _value_paths(node, prefix=()) -> set[tuple[str, ...]]:
    out = set()
    for key, sub in node.items():
        out.add(prefix + (key,))
        if isinstance(sub, dict) and sub and not _free_form(prefix + (key,)):
            out |= _value_paths(sub, prefix + (key,))
    return out


def _free_form(path: tuple[str, ...]) -> bool:
    """Kubernetes objects passed through as they are (their keys are the API's, not ours)."""
    return path[-1] in {"resources", "supervisorResources", "nodeSelector", "affinity", "labels", "annotations"}


def _schema_paths(node, prefix=()) -> set[tuple[str, ...]]:
    out = set()
    for key, sub in node.get("properties", {}).items():
        out.add(prefix + (key,))
        if not _free_form(prefix + (key,)):
            out |= _schema_paths(sub, prefix + (key,))
    return out


def test_schema_and_values_list_the_same_keys():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert _value_paths(values) == _schema_paths(schema)


def test_every_value_is_documented():
    """Each key of values.yaml (outside pass-through Kubernetes objects) has a `# --` comment
    right above it, or its parent has (a key that groups others)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str]] = []
    documented: dict[tuple[str, ...], bool] = {}
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z0-9_]+):", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = tuple(k for _, k in stack) + (key,)
        stack.append((indent, key))
        if any(_free_form(path[:j]) for j in range(1, len(path))):
            continue
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1  # a comment's continuation lines
        documented[path] = j >= 0 and lines[j].strip().startswith("# --")
    groups = {p[:-1] for p in documented}
    missing = [".".join(p) for p, ok in documented.items() if not ok and p not in groups]
    assert not missing, "values without a `# --` comment: " + ", ".join(missing)
    assert len(documented) > 80


# ---------------------------------------------------------------------- secure by default
def _raw_render(values: dict, **kw) -> dict[str, str]:
    return helm_python.Chart.load(str(CHART)).render(values, name="pd", namespace="serving", **kw)


@pytest.mark.parametrize("values", [{}, {"tls": {"provider": "certManager"}}], ids=["generated", "cert-manager"])
def test_generated_secrets_are_the_same_on_every_render(values):
    """No render holds a generated value: two renders, an install and an upgrade render are
    byte for byte the same (`lookup` is empty offline, as under `helm template`, so a Secret
    the templates generated would differ), and no Secret object is rendered at all."""
    first = _raw_render(values)
    assert first == _raw_render(values) == _raw_render(values, is_upgrade=True)
    assert not [d for d in render(values) if d["kind"] == "Secret"]


def test_the_secrets_hook_makes_exactly_what_the_pods_use():
    """By default the pre-install/pre-upgrade hook creates the Redis password, the API key and
    the TLS Secret, under the names every pod, the RayCluster's GCS options and the ServiceMonitor
    read; its Role reads only those names; it alone gets a service-account token."""
    docs = render({"metrics": {"serviceMonitor": {"enabled": True}}})
    args = hook_args(docs)
    refs = secret_refs(docs)
    assert refs["PDSERVE_REDIS_PASSWORD"] == refs["REDIS_PASSWORD"] == (args.redis_password_secret, "password")
    assert refs["PDSERVE_API_KEY"] == (args.api_key_secret, args.api_key_key) == ("pd-pdserve-api-key", "api-key")
    rc = one(docs, "RayCluster")
    assert rc["spec"]["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]["secretKeyRef"] == {
        "name": args.redis_password_secret, "key": "password"}
    tls_volumes = {v["secret"]["secretName"] for _, spec in pod_specs(docs) for v in spec.get("volumes", [])
                   if v["name"] == "pdserve-tls"}
    assert tls_volumes == {args.tls_secret}
    (ep,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert ep["tlsConfig"]["ca"]["secret"]["name"] == args.tls_secret
    # The certificate names what members verify each other against and what clients dial.
    router_flags = _cli_flags(one(docs, "Deployment", "-router")["spec"]["template"]["spec"]["containers"][0]["args"])
    assert router_flags["--tls-server-name"] in args.tls_name
    assert {"pd-pdserve-router", "pd-pdserve-router.serving.svc", "localhost"} <= set(args.tls_name)
    assert args.tls_days == 365

    role = one(docs, "Role", "-secrets")
    get_rule, create_rule = role["rules"]
    assert set(get_rule["resourceNames"]) == {args.redis_password_secret, args.api_key_secret, args.tls_secret,
                                              args.cluster_token_secret}
    assert get_rule["verbs"] == ["get"] and create_rule["verbs"] == ["create"]
    for kind in ("ServiceAccount", "Role", "RoleBinding", "Job"):
        hook = one(docs, kind, "-secrets")["metadata"]["annotations"]
        assert hook["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert int(hook["helm.sh/hook-weight"]) <= 0 and "hook-succeeded" in hook["helm.sh/hook-delete-policy"]
    with_token = [where for where, spec in pod_specs(docs) if spec.get("automountServiceAccountToken") is not False]
    assert with_token == ["pd-pdserve-secrets"]


def test_an_operators_existing_secret_always_wins():
    docs = render({"redis": {"builtin": {"existingSecret": "my-redis"}}, "apiKey": {"name": "my-keys", "key": "k"},
                   "tls": {"secretName": "my-tls"}, "nodes": {"clusterToken": {"name": "my-token"}}})
    assert not [d for d in docs if d["kind"] in ("Job", "Role", "Secret", "Certificate")]  # nothing generated
    refs = secret_refs(docs)
    assert refs["PDSERVE_REDIS_PASSWORD"] == ("my-redis", "password") and refs["PDSERVE_API_KEY"] == ("my-keys", "k")
    assert {v["secret"]["secretName"] for _, spec in pod_specs(docs) for v in spec.get("volumes", [])
            if v["name"] == "pdserve-tls"} == {"my-tls"}
    # One of them given: the hook makes only the others.
    args = hook_args(render({"apiKey": {"name": "my-keys"}}))
    assert args.api_key_secret is None and args.redis_password_secret and args.tls_secret
    # cert-manager given its API, or asked for: no generated TLS, Certificates instead.
    assert hook_args(render({"tls": {"provider": "certManager"}})).tls_secret is None


def test_tls_from_cert_manager():
    """provider certManager: a self-signed issuer, the release's CA, its issuer, and the member
    certificate written into the Secret every pod mounts, for both usages and every name."""
    docs = render({"tls": {"provider": "certManager", "validityDays": 90}})
    issuers = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Issuer"}
    certs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    assert all(d["apiVersion"] == "cert-manager.io/v1" for d in docs if d["kind"] in ("Issuer", "Certificate"))
    ca, member = certs["pd-pdserve-ca"], certs["pd-pdserve-tls"]
    assert ca["isCA"] and issuers[ca["issuerRef"]["name"]] == {"selfSigned": {}}
    assert issuers[member["issuerRef"]["name"]] == {"ca": {"secretName": ca["secretName"]}}
    assert set(member["usages"]) >= {"server auth", "client auth"} and member["duration"] == "2160h"
    assert {"pdserve-cluster", "pd-pdserve-router", "localhost"} <= set(member["dnsNames"])
    assert {v["secret"]["secretName"] for _, spec in pod_specs(docs) for v in spec.get("volumes", [])
            if v["name"] == "pdserve-tls"} == {member["secretName"]}
    assert "--tls-ca-file" in _cli_flags(one(docs, "Deployment", "-router")["spec"]["template"]["spec"]
                                         ["containers"][0]["args"])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_container_has_a_read_only_root_and_scratch_where_it_writes(example):
    docs = render(example_values(example))
    for where, spec in pod_specs(docs):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in containers(spec):
            assert c["securityContext"]["readOnlyRootFilesystem"] is True, (where, c["name"])
            if c["name"] == "redis":
                continue  # writes /data (its volume) and /tmp
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            for path in ("/tmp", "/home/pdserve"):  # Ray's session, ~/.cache, ~/.ray, compilers
                assert "emptyDir" in volumes[mounts[path]], (where, c["name"], path)
    rc = one(docs, "RayCluster")
    for g in rc["spec"]["workerGroupSpecs"]:
        (worker,) = g["template"]["spec"]["containers"]
        assert {"/dev/shm", "/cache"} <= {m["mountPath"] for m in worker["volumeMounts"]}
    for spec in (rc["spec"]["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in
                                                                    rc["spec"]["workerGroupSpecs"])):
        assert spec["automountServiceAccountToken"] is False  # nothing in a Ray pod calls Kubernetes


def test_a_disruption_budget_keeps_the_head():
    docs = render()
    rc = one(docs, "RayCluster")
    pdb = one(docs, "PodDisruptionBudget", "-head")
    assert pdb["spec"]["maxUnavailable"] == 0
    # KubeRay's labels on the head pod: its cluster and node type.
    assert pdb["spec"]["selector"]["matchLabels"] == {"ray.io/cluster": rc["metadata"]["name"], "ray.io/node-type": "head"}
    assert not [d for d in render({"ray": {"head": {"pdb": {"enabled": False}}}}) if d["metadata"]["name"].endswith("-head")]


def test_gcs_fault_tolerance_uses_the_releases_redis():
    """KubeRay's gcsFaultToleranceOptions (checked against its CRD in the corner and example
    tests) point at the built-in Redis with its password, or at the external one, TLS and its
    private CA included; off, none."""
    rc = one(render(), "RayCluster")
    ft = rc["spec"]["gcsFaultToleranceOptions"]
    assert ft["redisAddress"] == "pd-pdserve-redis:6379"
    assert set(ft) == {"redisAddress", "redisPassword"}  # the storage namespace: KubeRay's default (the UID)

    url = "rediss://cache.example:6380/2?ssl_ca_certs=/etc/pdserve/tls/ca.crt"
    docs = render({"redis": {"mode": "external", "external": {"url": url, "passwordSecret": {"name": "ext"}}}})
    rc = one(docs, "RayCluster")
    validate_raycluster(rc)
    ft = rc["spec"]["gcsFaultToleranceOptions"]
    assert ft["redisAddress"] == "rediss://cache.example:6380"  # Ray's form: TLS by the scheme, no db
    assert ft["redisPassword"]["valueFrom"]["secretKeyRef"] == {"name": "ext", "key": "password"}
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    ray_head = head["containers"][0]
    assert {"name": "RAY_REDIS_CA_CERT", "value": "/etc/pdserve/tls/ca.crt"} in ray_head["env"]
    assert "/etc/pdserve/tls" in {m["mountPath"] for m in ray_head["volumeMounts"]}

    rc = one(render({"redis": {"mode": "external", "external": {"url": "redis://cache/0"}}}), "RayCluster")
    assert rc["spec"]["gcsFaultToleranceOptions"] == {"redisAddress": "cache:6379"}  # no port, no password
    assert "gcsFaultToleranceOptions" not in one(render({"ray": {"gcsFaultTolerance": {"enabled": False}}}),
                                                 "RayCluster")["spec"]


class _FakeApiServer:
    """Kubernetes' two Secret endpoints the hook calls, on loopback: GET by name, POST to create
    (a stand-in for the API server, which the test machines do not have)."""

    def __init__(self, namespace: str, token: str) -> None:
        import http.server
        import threading

        self.secrets: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _route(self) -> str | None:
                base = f"/api/v1/namespaces/{namespace}/secrets"
                if self.headers.get("Authorization") != f"Bearer {token}":
                    self.send_response(401)
                    self.end_headers()
                    return None
                server.calls.append((self.command, self.path))
                return self.path[len(base):] if self.path.startswith(base) else None

            def do_GET(self):
                name = (self._route() or "").lstrip("/")
                found = name in server.secrets
                self.send_response(200 if found else 404)
                self.end_headers()
                self.wfile.write(json.dumps(server.secrets.get(name, {})).encode())

            def do_POST(self):
                if self._route() != "":
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                kubernetes_validate.validate(body, K8S_VERSION, strict=True)
                name = body["metadata"]["name"]
                self.send_response(409 if name in server.secrets else 201)
                self.end_headers()
                server.secrets.setdefault(name, body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_secrets_hook_creates_only_what_is_missing_and_its_certificate_works(tmp_path, capsys):
    """The rendered hook's own args against the API calls it makes: the first run creates the
    three Secrets (valid Secret objects), a second run and an upgrade keep them untouched; the
    generated certificate passes a mutual TLS handshake on loopback under the member name."""
    import base64
    import socket
    import ssl
    import threading

    from deploy.k8s_secrets import KubeApi, main

    docs = render()
    (job,) = [d for d in docs if d["kind"] == "Job"]
    argv = job["spec"]["template"]["spec"]["containers"][0]["args"]
    api_server = _FakeApiServer("serving", "sa-token")
    try:
        api = KubeApi(api_server.url, "serving", "sa-token")
        assert main(argv, api=api) == 0
        first = {name: s["data"] for name, s in api_server.secrets.items()}
        assert set(first) == {"pd-pdserve-redis", "pd-pdserve-api-key", "pd-pdserve-tls", "pd-pdserve-cluster-token"}
        assert all(s["metadata"]["labels"]["app.kubernetes.io/instance"] == "pd" for s in api_server.secrets.values())
        posts = [c for c in api_server.calls if c[0] == "POST"]
        assert main(argv, api=api) == 0  # the next upgrade
        assert [c for c in api_server.calls if c[0] == "POST"] == posts  # nothing created again
        assert {name: s["data"] for name, s in api_server.secrets.items()} == first
        out = capsys.readouterr().out
        assert out.count("created") == 4 and out.count("kept") == 4
        assert all(base64.b64decode(v).decode(errors="ignore") not in out for d in first.values() for v in d.values())
    finally:
        api_server.close()
    password = base64.b64decode(first["pd-pdserve-redis"]["password"]).decode()
    assert len(password) == 32 and password.isalnum()
    assert len(base64.b64decode(first["pd-pdserve-api-key"]["api-key"])) > 32

    for key, data in first["pd-pdserve-tls"].items():
        (tmp_path / key).write_bytes(base64.b64decode(data))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    server_ctx.load_verify_locations(tmp_path / "ca.crt")
    server_ctx.verify_mode = ssl.CERT_REQUIRED  # mutual, as between members
    client_ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    client_ctx.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    listener = socket.create_server(("127.0.0.1", 0))
    peer: list[dict] = []

    def accept() -> None:
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as s:
            peer.append(s.getpeercert())
            s.sendall(b"ok")

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    with socket.create_connection(listener.getsockname(), timeout=10) as raw:
        with client_ctx.wrap_socket(raw, server_hostname="pdserve-cluster") as s:
            assert s.recv(2) == b"ok"
            names = {v for k, v in s.getpeercert()["subjectAltName"]}
    t.join(10)
    listener.close()
    assert peer and {"pdserve-cluster", "pd-pdserve-router.serving.svc", "localhost", "127.0.0.1"} <= names
